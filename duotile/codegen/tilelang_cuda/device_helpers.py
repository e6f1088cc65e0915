"""Small hand-written CUDA device functions the generated TileLang source imports
(``T.import_source``), each for one op whose element-by-element lowering would cost many times its
instructions. Kept in a Python module so that an edit changes ``build.compiler_digest``."""

from __future__ import annotations

# prmt.b32: four bytes picked from the eight of (a, b), one a selector nibble (its top bit set: the
# picked byte's sign bit repeated). The helpers below import it (``Source.helper``: once a kernel).
PRMT = r"""
__device__ __forceinline__ unsigned duotile_prmt(unsigned a, unsigned b, unsigned selector) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}
"""

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

# dsl.mxfp4_values feeding a block-scaled MMA (block_scaled.py): sixteen e2m1 codes (eight bytes,
# element i in nibble i) to their e4m3 bytes, unscaled (the MMA applies the block's code), written
# as 16 bytes. Every e2m1 value is an e4m3 number, so this is exact: one prmt looks the four
# magnitudes of a half word up in the eight e4m3 bytes of {0, .5, 1, 1.5, 2, 3, 4, 6} (a selector
# nibble is a code's low three bits), a second prmt doubles the half word's two bytes ([b0, b0,
# b1, b1]) so that each code's sign bit sits at bit 3 or 7 of its own output byte, and a shift and
# a mask move it to bit 7. About eight instructions a four values.
MXFP4_E4M3_X16 = r"""
__device__ __forceinline__ void duotile_mxfp4x16_e4m3(const void* packed, void* out) {
  const uint2 w = *reinterpret_cast<const uint2*>(packed);
  const unsigned table_lo = 0x3C383000u, table_hi = 0x4C484440u;  // e4m3 of 0, .5, 1, 1.5 | 2, 3, 4, 6
  uint4 o;
  unsigned* r = reinterpret_cast<unsigned*>(&o);
#pragma unroll
  for (unsigned h = 0; h < 4; ++h) {
    const unsigned word = h < 2 ? w.x : w.y;
    const unsigned half = (h & 1u) ? word >> 16 : word;  // four codes in the low 16 bits
    const unsigned mag = duotile_prmt(table_lo, table_hi, half & 0x7777u);
    const unsigned twice = duotile_prmt(half, 0u, 0x1100u);  // bytes [b0, b0, b1, b1]
    r[h] = mag | ((twice << 4) & 0x00800080u) | (twice & 0x80008000u);
  }
  *reinterpret_cast<uint4*>(out) = o;
}
"""

# dsl.cumsum (ops.py) of an i32 row in shared memory, by every consumer thread in two calls with a
# barrier between them: each thread sums its contiguous segment of n values, the warps scan those
# sums with shuffles (``duotile_scan_sums``: each thread's inclusive warp prefix and each warp's
# total into shared memory); then each thread adds the totals of the warps before it and the
# prefix of its own warp, and writes its segment's prefixes (``duotile_scan_write``). A whole row
# in about 2n + 40 instructions a thread, where TileLang's own scan (T.cumsum) walks the row with
# one warp, 32 values a step.
SCAN = r"""
__device__ __forceinline__ void duotile_scan_sums(const int* x, int* part, int* warps, int t, int n, int w) {
  int s = 0;
  for (int i = t * n; i < t * n + n && i < w; ++i) s += x[i];
  const int lane = t & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, s, o);
    if (lane >= o) s += v;
  }
  part[t] = s;
  if (lane == 31) warps[t >> 5] = s;
}

__device__ __forceinline__ void duotile_scan_write(const int* x, const int* part, const int* warps, int* out, int t,
                                                   int n, int w, int exclusive) {
  int run = 0;
  for (int j = 0; j < (t >> 5); ++j) run += warps[j];
  int seg = 0;
  for (int i = t * n; i < t * n + n && i < w; ++i) seg += x[i];
  run += part[t] - seg;
  for (int i = t * n; i < t * n + n && i < w; ++i) {
    const int v = x[i];
    out[i] = exclusive ? run : run + v;
    run += v;
  }
}
"""
