"""Device helpers (codegen/tilelang_cuda/device_helpers.py) compiled for the host: their PTX
instructions replaced by C emulations, so a test can run them over every input on a CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

STUBS = r"""
#include <cstdio>
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static float bf16_to_float(unsigned h) { unsigned u = (h & 0xFFFFu) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static unsigned float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  unsigned u; std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
static unsigned host_mul_bf16x2(unsigned a, unsigned b) {  // mul.rn.bf16x2: the exact product, rounded once
  unsigned lo = float_to_bf16(bf16_to_float(a) * bf16_to_float(b));
  unsigned hi = float_to_bf16(bf16_to_float(a >> 16) * bf16_to_float(b >> 16));
  return (lo & 0xFFFFu) | (hi << 16);
}
static float e4m3_to_float(unsigned b) {  // e4m3fn: bias 7, no infinities, magnitude 0x7F NaN
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  float v = (b & 0x7Fu) == 0x7Fu ? NAN : (e ? std::ldexp(1.0f + m / 8.0f, (int)e - 7) : std::ldexp(m / 8.0f, -6));
  return (b & 0x80u) ? -v : v;
}
static unsigned float_to_f16(float f) {  // for values an f16 holds exactly (every e4m3 one), NaN
  unsigned sign = std::signbit(f) ? 0x8000u : 0u;
  if (std::isnan(f)) return 0x7FFFu;
  f = std::fabs(f);
  if (f == 0.0f) return sign;
  int e;
  float m = std::frexp(f, &e);  // f = m 2^e, m in [0.5, 1)
  if (e - 1 < -14) return sign | (unsigned)std::ldexp(f, 24);  // an f16 subnormal
  return sign | ((unsigned)(e - 1 + 15) << 10) | ((unsigned)std::ldexp(m * 2.0f - 1.0f, 10));
}
static float f16_to_float(unsigned h) {
  const unsigned e = (h >> 10) & 31u, m = h & 1023u;
  float v = e == 31 ? (m ? NAN : INFINITY)
                    : (e ? std::ldexp(1.0f + m / 1024.0f, (int)e - 15) : std::ldexp(m / 1024.0f, -14));
  return (h & 0x8000u) ? -v : v;
}
static unsigned host_prmt(unsigned a, unsigned b, unsigned sel) {  // prmt.b32, default mode
  unsigned d = 0;
  for (int i = 0; i < 4; ++i) {
    unsigned s = (sel >> (4 * i)) & 0xFu, pick = s & 7u;
    unsigned byte = ((pick < 4 ? a >> (8 * pick) : b >> (8 * (pick - 4))) & 0xFFu);
    if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * i);
  }
  return d;
}
"""

EMULATED = {
    'asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));': "d = host_mul_bf16x2(a, b);",
    'asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));': "d = host_prmt(a, b, selector);",
    'asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<unsigned short>(two)));':
        "h = float_to_f16(e4m3_to_float(two & 0xFFu)) | float_to_f16(e4m3_to_float((two >> 8) & 0xFFu)) << 16;",
    'asm("{.reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi) : "r"(h));':
        "lo = f16_to_float(h & 0xFFFFu); hi = f16_to_float(h >> 16);",
    'asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));':
        "d = (float_to_bf16(lo) & 0xFFFFu) | (float_to_bf16(hi) << 16);",
}


def run_on_host(helpers: str, main: str, workdir: Path) -> list[str]:
    """Compile ``helpers`` (device source) with every PTX instruction emulated, and ``main``;
    run it and return its output lines."""
    body = helpers
    for asm, host in EMULATED.items():
        body = body.replace(asm, host)
    assert "asm(" not in body, "a PTX instruction of the helper has no host emulation"
    src = workdir / "helper.cpp"
    src.write_text(STUBS + body + main)
    subprocess.run(["g++", "-O1", "-o", str(workdir / "helper"), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(workdir / "helper")], check=True, capture_output=True, text=True).stdout
    return [line for line in out.split("\n") if line]
