"""Device helpers (codegen/tilelang_cuda/device_helpers.py) compiled for the host: their PTX
instructions replaced by C emulations, so a test can run them over every input on a CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

STUBS = r"""
#include <cstdio>
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
