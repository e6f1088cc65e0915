"""Small hand-written CUDA device functions the generated TileLang source imports
(``T.import_source``), each for one op whose element-by-element lowering would cost many times its
instructions. Kept in a Python module so that an edit changes ``build.compiler_digest``."""

from __future__ import annotations

# dsl.mxfp4_values (ops.py): eight e2m1 codes (a 32-bit word, element 2j in the low nibble of byte
# j) to eight bf16 values times the block's 2^(code - 127), written as 16 bytes. Each byte's two
# codes become a bf16 pair by bit operations: one prmt puts the low code in byte 0 and the high
# code in byte 2 (a selector nibble with its top bit set copies the sign of a byte whose top bit is
# clear: zero), and one multiply by 0x1040 (p << 6 | p << 12, no bits overlapping) and one mask
# move each code's three magnitude bits to bits 6-8 and its sign to bit 15 of its half, which reads
# as the e2m1 value times 2^-126 (a bf16 subnormal for codes 0 and 1); one mul.rn.bf16x2 by 2^126
# makes it the value exactly, a second by the scale (bf16 bits code << 7; code 0 is 2^-127, the
# subnormal 0x0040; code 255 is NaN) applies the block's power of two: the product is exact
# wherever it is a bf16 number and +-Inf beyond. BF16 multiplies keep subnormals (PTX has no .ftz
# for bf16), whatever the kernel's fp32 ftz setting. About four instructions a value (about six
# with the per-byte shifts and masks nvcc made of the plain form; 2026-12-04, sass_loop.py).
MXFP4_X8 = r"""
__device__ __forceinline__ unsigned duotile_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ unsigned duotile_prmt(unsigned a, unsigned b, unsigned selector) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ void duotile_mxfp4x8_bf16(const void* packed, void* out, int code) {
  const unsigned w = *reinterpret_cast<const unsigned*>(packed);
  const unsigned lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;  // each byte's low and high code
  unsigned s = code == 255 ? 0x7FC0u : (code == 0 ? 0x0040u : static_cast<unsigned>(code) << 7);
  s |= s << 16;
  const unsigned lift = 0x7E807E80u;  // 2^126 in both halves
  uint4 o;
  unsigned* r = reinterpret_cast<unsigned*>(&o);
#pragma unroll
  for (unsigned k = 0; k < 4; ++k) {
    const unsigned pair = duotile_prmt(lo, hi, k | 0x80u | ((4u + k) << 8) | 0x8000u);  // [lo_k, 0, hi_k, 0]
    const unsigned bits = (pair * 0x1040u) & 0x81C081C0u;
    r[k] = duotile_mul_bf16x2(duotile_mul_bf16x2(bits, lift), s);
  }
  *reinterpret_cast<uint4*>(out) = o;
}
"""
