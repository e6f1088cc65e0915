"""Bit-level helpers the quantisers share: an f32's bits, the |x| bits whose float max is exact on
every target, and the UE8M0 power-of-two scale of a block from its amax's bits (model.md 2.10,
4.1), computed from exponent and mantissa bits, never with log2.

The smallest power of two s = 2^(code - 127) with amax / s <= QMAX, for QMAX = (1 + f) x 2^e and a
normal amax of biased exponent E and mantissa m: code = E - e, plus one where m > f (the mantissa
bits of QMAX). For e4m3 (448 = 1.75 x 2^8) that is E - 8 or E - 7; for e2m1 (6 = 1.5 x 2^2) E - 2
or E - 1.
"""

from __future__ import annotations

import struct

from .. import dsl

INF_BITS = 0x7F800000  # an f32's magnitude bits at +Inf; NaNs lie above
MAGNITUDE = 0x7FFFFFFF  # every bit but the sign
MANTISSA = 0x7FFFFF


def f32_bits(value: float) -> int:
    """The bits of ``value`` rounded to f32, as a signed 32-bit integer."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def magnitude_bits(x):
    """|x| of an f32 tile, as an f32 tile whose NaNs became +Inf: a float max of these is exact
    and NaN-safe on every target (the NaNs' magnitude bits sort above Inf's)."""
    return dsl.minimum(x.bitcast(dsl.i32) & MAGNITUDE, INF_BITS).bitcast(dsl.f32)


def pow2_code(amax, qmax: float):
    """The UE8M0 code (i32 tile) of the smallest power of two s with amax / s <= ``qmax``, from
    ``amax``'s f32 bits (an i32 tile of normal, finite values; the caller decides NaN blocks)."""
    bits = f32_bits(qmax)
    e, f = ((bits >> 23) & 0xFF) - 127, bits & MANTISSA
    biased = amax >> 23
    return dsl.where((amax & MANTISSA) > f, biased - (e - 1), biased - e)


def inverse_pow2(code, bad):
    """1 / s = 2^(127 - code) for UE8M0 codes 1..253, from bits; 0 where ``bad``."""
    return dsl.where(bad, 0.0, ((254 - code) << 23).bitcast(dsl.f32))


def fp8_block_code(y, floor: int, nan_code: int):
    """A row block's e4m3 scale: (UE8M0 codes, 1 / s, which rows hold a NaN or an Inf) of ``y``
    (rows x block, f32), amax floored at the f32 bits ``floor``; a bad row gets ``nan_code``."""
    amax = dsl.maximum(magnitude_bits(y).max(axis=1).bitcast(dsl.i32), floor)
    bad = amax >= INF_BITS
    code = dsl.where(bad, nan_code, pow2_code(amax, 448.0))
    return code, inverse_pow2(code, bad), bad
