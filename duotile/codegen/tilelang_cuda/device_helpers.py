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

# mul.rn.bf16x2: both halves' exact products, each rounded once. BF16 multiplies keep subnormals
# (PTX has no .ftz for bf16), whatever the kernel's fp32 ftz setting.
MUL_BF16X2 = r"""
__device__ __forceinline__ unsigned duotile_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
"""

# A UE8M0 scale code as a bf16 pair (both halves 2^(code - 127)): bits code << 7; code 0 is
# 2^-127, the subnormal 0x0040; code 255 is NaN.
UE8M0_BF16X2 = r"""
__device__ __forceinline__ unsigned duotile_ue8m0_bf16x2(int code) {
  const unsigned s = code == 255 ? 0x7FC0u : (code == 0 ? 0x0040u : static_cast<unsigned>(code) << 7);
  return s | s << 16;
}
"""

# Eight e2m1 codes (a 32-bit word, element 2j in the low nibble of byte j) times a bf16 pair ``s``
# (both halves the block's scale), as eight bf16 values written as 16 bytes. Each byte's two codes
# become a bf16 pair by bit operations: one prmt puts the low code in byte 0 and the high code in
# byte 2 (a selector nibble with its top bit set copies the sign of a byte whose top bit is clear:
# zero), and one multiply by 0x1040 (p << 6 | p << 12, no bits overlapping) and one mask move each
# code's three magnitude bits to bits 6-8 and its sign to bit 15 of its half, which reads as the
# e2m1 value times 2^-126 (a bf16 subnormal for codes 0 and 1); one mul.rn.bf16x2 by 2^126 makes it
# the value exactly, a second by ``s`` applies the scale: an e2m1 value (two significant bits)
# times a scale of at most four (UE8M0's one, E4M3's four) is exact wherever it is a bf16 number,
# and +-Inf beyond. About four instructions a value (about six with the per-byte shifts and masks
# nvcc made of the plain form; 2026-12-04, sass_loop.py). Needs PRMT and MUL_BF16X2.
FP4_X8 = r"""
__device__ __forceinline__ void duotile_fp4x8_bf16(unsigned w, void* out, unsigned s) {
  const unsigned lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;  // each byte's low and high code
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

# dsl.mxfp4_values (ops.py): eight e2m1 codes (four bytes) times the block's 2^(code - 127).
# Needs PRMT, MUL_BF16X2, UE8M0_BF16X2 and FP4_X8.
MXFP4_X8 = r"""
__device__ __forceinline__ void duotile_mxfp4x8_bf16(const void* packed, void* out, int code) {
  duotile_fp4x8_bf16(*reinterpret_cast<const unsigned*>(packed), out, duotile_ue8m0_bf16x2(code));
}
"""

# dsl.nvfp4_values (ops.py): eight e2m1 codes (four bytes) times their block's E4M3 scale, read as
# a byte. The scale's seven magnitude bits shifted left by four read as a bf16 that is the E4M3
# value times 2^-120 (E4M3's bias is 7, bf16's 127; an E4M3 subnormal lands on a bf16 subnormal
# with the same mantissa), and one mul.rn.bf16x2 by 2^120 makes it the value exactly; magnitude
# 0x7F is NaN. Every E4M3 value is a bf16 number, and an e2m1 value times it is one too (six
# significant bits at most, from 2^-10 to 2,688): exact. Needs PRMT, MUL_BF16X2 and FP4_X8.
NVFP4_X8 = r"""
__device__ __forceinline__ void duotile_nvfp4x8_bf16(const void* packed, void* out, const void* scale) {
  const unsigned b = *reinterpret_cast<const unsigned char*>(scale), mag = b & 0x7Fu;
  const unsigned t = ((b & 0x80u) << 8) | (mag << 4);  // the scale times 2^-120
  unsigned s = duotile_mul_bf16x2(t | t << 16, 0x7B807B80u);  // times 2^120 in both halves
  if (mag == 0x7Fu) s = 0x7FC07FC0u;
  duotile_fp4x8_bf16(*reinterpret_cast<const unsigned*>(packed), out, s);
}
"""

# dsl.mxfp8_values (ops.py): eight e4m3 values (eight bytes) times the block's 2^(code - 127), as
# eight bf16 values written as 16 bytes. Two bytes at a time: one cvt to an f16 pair (exact, NaN
# kept), two cvts to fp32, one cvt.rn.bf16x2 (exact: every e4m3 value is a bf16 number), one
# mul.rn.bf16x2 by the scale pair, which rounds the exact product once, as the reference's fp32
# product rounded to bf16 does. Needs MUL_BF16X2 and UE8M0_BF16X2.
MXFP8_X8 = r"""
__device__ __forceinline__ unsigned duotile_e4m3x2_bf16x2(unsigned two) {
  unsigned h, d;
  float lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<unsigned short>(two)));
  asm("{.reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi) : "r"(h));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ void duotile_mxfp8x8_bf16(const void* values, void* out, int code) {
  const uint2 w = *reinterpret_cast<const uint2*>(values);
  const unsigned s = duotile_ue8m0_bf16x2(code);
  uint4 o;
  o.x = duotile_mul_bf16x2(duotile_e4m3x2_bf16x2(w.x), s);
  o.y = duotile_mul_bf16x2(duotile_e4m3x2_bf16x2(w.x >> 16), s);
  o.z = duotile_mul_bf16x2(duotile_e4m3x2_bf16x2(w.y), s);
  o.w = duotile_mul_bf16x2(duotile_e4m3x2_bf16x2(w.y >> 16), s);
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

# Which helpers each one calls, in the order they must come before it.
_NEEDS = {"MXFP4_X8": ("PRMT", "MUL_BF16X2", "UE8M0_BF16X2", "FP4_X8"),
          "NVFP4_X8": ("PRMT", "MUL_BF16X2", "FP4_X8"),
          "MXFP8_X8": ("MUL_BF16X2", "UE8M0_BF16X2"),
          "MXFP4_E4M3_X16": ("PRMT",)}


def with_needs(name: str) -> list[tuple[str, str]]:
    """(name, source) of helper ``name`` and of every helper it calls, callees first."""
    return [(n, globals()[n]) for n in (*_NEEDS.get(name, ()), name)]
