"""The cache formats' round trip of KV and index rows, FP32 out (model.md 2.5.2, 2.5.5, 2.10, 2.13,
3.1, 3.4, 4.1): each block of a row quantised to its codes and scale and decoded back, the values
the runtime's ``kv_round`` op keeps (``runtime/layers/common.round_rows``). One kernel for the four
formats, ``FORMAT`` with ``BLOCK`` (and ``FLOOR`` for FP8):

* ``"fp8"``, ``BLOCK`` 64: V4's window and compressed KV rows (the 448 nope channels); ``BLOCK`` 32:
  V4.1's window rows (all 512 channels). e4m3 values, a UE8M0 scale per block.
* ``"nvfp4"`` (``BLOCK`` 16): V4.1's compressed KV rows. e2m1 values, an E4M3 scale per 16.
* ``"mxfp4"`` (``BLOCK`` 32): the index queries and keys of both models. e2m1, UE8M0 per 32.

Per token and block of ``BLOCK`` channels (a last block cut short by D holds the channels that
exist, the rest counting as zeros), in f32:

    fp8:    amax = max(max |x|, FLOOR)   r = amax / 448 (the f32 quotient)   s = 2^ceil(log2 r)
            out  = e4m3(clamp(x / s, -448, 448)) x s                         (e4m3: nearest, ties even)
    mxfp4:  amax = max(max |x|, 6 x 2^-126)   s = 2^ceil(log2(amax / 6))
            out  = e2m1(x / s) x s                                           (e2m1: clamp 6, ties even)
    nvfp4:  amax = max(max |x|, 6 x 2^-9)     s = e4m3(min(amax / 6, 448))
            out  = e2m1(x / s) x s

FLOOR is 0 for the cache rows (the runtime's); any FLOOR in [0, 448] is taken. With FLOOR 0 the
FP8 scale reaches below f32's normals: ``amax / 448`` under 2^-126 is the IEEE quotient, rounded
onto the subnormal grid (multiples of 2^-149), s the smallest power of two at or above that
quotient, and a block whose quotient is 0 (all zeros, or amax at most 448 x 2^-150) keeps s = 1,
log2 having no value there: its values are zeros in e4m3 whatever s is. Signs: e4m3 keeps the
sign of a value that rounds to zero (-0 stays -0); e2m1 writes such a value as code 0, +0 (as the
runtime's ``quant.fp4_codes`` and ``quantize_fp4.py``). A product past f32's range is +-Inf (an
FP8 / MXFP4 block near the f32 maximum can round up to 2^128).

Non-finite input, as the formulas give it: a block holding a NaN is NaN throughout (amax is NaN);
a block holding an Inf is NaN throughout in the UE8M0 formats (s = 2^ceil(log2 Inf) is Inf, and
every value x / s x s is NaN) but not in NVFP4, whose scale clamps to 448: an Inf there is +-6 x
448 = +-2688 and the block's finite values round at s = 448 (the runtime's ``quant.nvfp4_round``
does the same; the activation quantiser ``quantize_fp4.py``, which emits codes, marks that block
with the scale's NaN instead). The other blocks of the row are unaffected.

The kernel, from bits, the same on every target (no log2, no exp2; a target built with ftz flushes
subnormal float operands and results, so none is used as one):

* the block's amax is a float max of magnitude bits (``ue8m0.magnitude_bits``; NaN reads as Inf).
  With a FLOOR below 2^-126 a block of subnormals has a subnormal amax, which a flushing max
  reads as 0: the max is then taken over the normal magnitudes and, apart, over the subnormals'
  mantissas as integers (normal floats), and put together on bits;
* UE8M0 scales: ``ue8m0.pow2_code`` from amax's exponent and mantissa bits, exact wherever
  ``amax / qmax`` is above 2^-126 (always but for FP8 blocks of amax under 448 x 2^-125, which
  only a FLOOR below that lets through). Below, the
  quotient's subnormal-grid count ``n = round(amax / 2^-149 / 448)`` (ties even) is an integer
  division of amax's mantissa, and s = 2^(ceil(log2 n) - 149), or 1 where n = 0;
* FP8 values: x / s moves x's exponent bits (a subnormal x is rebuilt from its mantissa, as
  ``quantize_fp4._scaled_by_code`` does for MXFP4), clamped to 448, rounded to its e4m3 byte
  (``kv_insert._e4m3_bytes``) and decoded from that byte's exponent and mantissa;
* MXFP4 / NVFP4: the e2m1 codes of ``quantize_fp4`` (``_e2m1``, ``_scaled_by_code``; NVFP4's
  scale is the e4m3 byte of ``min(amax / 6, 448)``, amax / 6 and x / s IEEE divisions as torch's);
* the decoded value times a power of two is built on its bits (an exponent added, or below 2^-126
  the subnormal's mantissa count, exact as every such product of a round trip is a multiple of
  2^-149; +Inf past the range); NVFP4's product (>= 2^-10) is a plain f32 multiply.

Tunables: ``ROWS`` rows and ``BLOCKS`` blocks a program; they change no bit.

Decode path: each row is rounded on its own (batch dimension T, dynamic).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .kv_insert import _e4m3_bytes
from .quantize import FP8_MAX, INF_BITS, MAGNITUDE, f32_bits
from .quantize import _values as _fp8_activation_values
from .quantize_fp4 import FLOORS as FP4_FLOORS
from .quantize_fp4 import FORMATS as FP4_BLOCKS
from .quantize_fp4 import _e2m1, _scaled_by_code
from .quantize_fp4 import _values as _fp4_activation_values
from .registry import Dim, OneOf, Spec, register
from .ue8m0 import MANTISSA, inverse_pow2, magnitude_bits, pow2_code

FORMATS = ("fp8", "nvfp4", "mxfp4")
FP8_BLOCKS = (32, 64)
FP4_MAX = 6.0
NAN_BITS = 0x7FC00000  # the quiet NaN a non-finite block's values are
MIN_NORMAL_BITS = 0x00800000  # 2^-126
E2M1_HALF_BITS = f32_bits(0.5)
UE8M0_NAN = 255
FLOOR_ALL_NORMAL = 2.0**-126  # a FLOOR at or above it: no subnormal amax, a plain float max
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between e2m1 magnitudes; a tie goes to the even code
TIE_UP = (False, True, False, True, False, True, False)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
REFERENCE_FLOORS = {"mxfp4": 6.0 * 2.0**-126, "nvfp4": 6.0 * 2.0**-9}  # model.md 2.10, 2.13


def _block_of(fmt: str, block) -> int:
    if fmt == "fp8":
        if block not in FP8_BLOCKS:
            raise dsl.DslError(f"BLOCK {block!r}: FORMAT 'fp8' takes {' or '.join(map(str, FP8_BLOCKS))} channels "
                               "a scale")
        return block
    if block not in (0, FP4_BLOCKS[fmt]):
        raise dsl.DslError(f"BLOCK {block!r}: FORMAT {fmt!r} has {FP4_BLOCKS[fmt]} channels a scale (give that or 0)")
    return FP4_BLOCKS[fmt]


def _pow2(p):
    """2^p (an f32 tile) for integer tiles p in [-126, 127], built from bits."""
    return ((p + 127) * (1 << 23)).bitcast(dsl.f32)


def _pow2_int(p):
    """2^p as an i32 tile, for p in [0, 30]."""
    return _pow2(p).to(dsl.i32)


def _amax_bits(x, floor: float):
    """max(max |x|, floor) of each row of ``x`` (rows x block, f32) as f32 bits (i32), Inf's for
    a row with a NaN or an Inf. Below 2^-126 the float max of a target built with ftz reads
    subnormals as 0, so with such a floor the subnormals' mantissas are maxed apart, as integers."""
    mag = magnitude_bits(x)
    amax = dsl.maximum(mag.max(axis=1).bitcast(dsl.i32), f32_bits(floor))
    if floor >= FLOOR_ALL_NORMAL:
        return amax
    bits = mag.bitcast(dsl.i32)
    sub = dsl.where(bits < MIN_NORMAL_BITS, bits, 0).to(dsl.f32).max(axis=1).to(dsl.i32)  # < 2^23: exact
    return dsl.where(amax >= MIN_NORMAL_BITS, amax, dsl.maximum(sub, f32_bits(floor)))


def _fp8_scale_exponent(amax):
    """k of the FP8 scale s = 2^k of f32 bits ``amax`` (i32 tile of finite values, at least 0):
    ``pow2_code`` where amax / 448 > 2^-126 (codes 2 and up), else from the quotient's count
    n = round(amax / 448 / 2^-149) on f32's subnormal grid, ties to even: amax = m x 2^(e' - 150)
    (m with its leading bit, e' = max(e, 1)), so n = round(m x 2^(e' - 7) / 7), an integer division
    (e' <= 9 there); k = ceil(log2 n) - 149, and 0 (s = 1) where n = 0."""
    code = pow2_code(amax, FP8_MAX)
    e = amax >> 23
    m = (amax & MANTISSA) | ((e > 0).to(dsl.i32) << 23)
    sh = dsl.minimum(dsl.maximum(e, 1) - 7, 2)  # -6 .. 2 where the count is used
    num = m * _pow2_int(dsl.maximum(sh, 0))
    den = 7 * _pow2_int(dsl.maximum(-sh, 0))
    q, r = num // den, num % den
    n = q + ((2 * r > den) | ((2 * r).eq(den) & (q & 1).eq(1))).to(dsl.i32)
    nb = n.to(dsl.f32).bitcast(dsl.i32)  # n <= 2^23: exact
    k = (nb >> 23) - 127 + ((nb & MANTISSA) > 0).to(dsl.i32) - 149
    return dsl.where(code >= 2, code - 127, dsl.where(n.eq(0), 0, k))


def _div_pow2(bits, k):
    """|x| / 2^k (f32 magnitudes) of f32 bits ``bits`` for exponents k in [-149, 127]: exact where
    the quotient is at least 2^-126, else some value below 2^-100, which e4m3 rounds to 0. A
    normal |x| has its exponent bits moved; a subnormal one is its mantissa times 2^(-149 - k)."""
    mag = bits & MAGNITUDE
    e = mag >> 23
    moved = dsl.where(e - k >= 1, mag - k * (1 << 23), 0).bitcast(dsl.f32)
    rebuilt = (mag & MANTISSA).to(dsl.f32) * _pow2(dsl.minimum(dsl.maximum(-149 - k, -126), 0))
    return dsl.where(e.eq(0), rebuilt, moved)


def _e4m3_value(code):
    """The magnitude (f32) of e4m3 bytes ``code`` without their sign bit (0 .. 126)."""
    e, m = code >> 3, code & 7
    return dsl.where(e > 0, (((e + 120) << 23) | (m << 20)).bitcast(dsl.f32), m.to(dsl.f32) * 2.0**-9)


def _e2m1_value(code):
    """The magnitude (f32) of e2m1 codes ``code`` without their sign bit (0 .. 7): 0.5 x the code
    below 2, else (1 + mantissa / 2) x 2^(exponent - 1)."""
    e, m = code >> 1, code & 1
    bits = dsl.where(e > 0, ((e + 126) << 23) | (m << 22), m * E2M1_HALF_BITS)
    return bits.bitcast(dsl.f32)


def _times_pow2(v, k):
    """The f32 bits (i32) of v x 2^k for magnitudes v (f32 tile, each 0 or normal) and exponents
    k: an exponent added; below 2^-126 the subnormal's bits, its count of 2^-149 (exact where the
    product is a multiple of 2^-149, as a round trip's is); +Inf past f32's range."""
    mag = v.bitcast(dsl.i32)
    e = (mag >> 23) + k
    count = (((mag & MANTISSA) | (1 << 23)).to(dsl.f32) * _pow2(dsl.minimum(dsl.maximum(e - 1, -126), 127)))
    normal = dsl.where(e >= 255, INF_BITS, mag + k * (1 << 23))
    return dsl.where(mag.eq(0), 0, dsl.where(e >= 1, normal, count.to(dsl.i32)))


def _sign(bits):
    """The sign bit of f32 bits, in place (0 or -2^31)."""
    return (bits >> 31) << 31


def _fp8_block(xt, block_floor: float):
    bits = xt.bitcast(dsl.i32)
    amax = _amax_bits(xt, block_floor)
    bad = amax >= INF_BITS
    k = dsl.where(bad, 0, _fp8_scale_exponent(amax))[:, None]
    y = dsl.minimum(_div_pow2(bits, k), FP8_MAX)
    out = _times_pow2(_e4m3_value(_e4m3_bytes(y)), k) | _sign(bits)
    return dsl.where(bad[:, None], NAN_BITS, out)


def _mxfp4_block(xt):
    bits = xt.bitcast(dsl.i32)
    mag = magnitude_bits(xt)
    amax = _amax_bits(xt, FP4_FLOORS["mxfp4"])
    bad = amax >= INF_BITS
    code = dsl.where(bad, UE8M0_NAN, pow2_code(amax, FP4_MAX))
    c = _e2m1(_scaled_by_code(mag, bits, code, inverse_pow2(code, bad)), bits < 0, bad)
    out = _times_pow2(_e2m1_value(c & 7), dsl.where(bad, 0, code - 127)[:, None]) | ((c >> 3) << 31)
    return dsl.where(bad[:, None], NAN_BITS, out)


def _nvfp4_block(xt):
    bits = xt.bitcast(dsl.i32)
    mag = magnitude_bits(xt)
    amax = _amax_bits(xt, FP4_FLOORS["nvfp4"])
    nan = dsl.where((bits & MAGNITUDE) > INF_BITS, 1.0, 0.0).max(axis=1) > 0.0  # an Inf alone clamps to 448
    s = _e4m3_value(_e4m3_bytes(dsl.minimum(amax.bitcast(dsl.f32) / FP4_MAX, FP8_MAX)))[:, None]
    c = _e2m1(mag / s, bits < 0, nan)
    out = (_e2m1_value(c & 7) * s).bitcast(dsl.i32) | ((c >> 3) << 31)  # >= 2^-10: normal, exact
    return dsl.where(nan[:, None], NAN_BITS, out)


@dsl.kernel(batch_dim="T", dynamic=("T",))
def kv_round(x: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], out: dsl.Tensor["T", "D", dsl.f32], *,
             FORMAT: dsl.Const = "fp8", BLOCK: dsl.Const = 64, FLOOR: dsl.Const = 0.0,
             ROWS: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16), BLOCKS: dsl.Tunable = dsl.choice(2, 1, 4, 8)):
    if FORMAT not in FORMATS:
        raise dsl.DslError(f"FORMAT {FORMAT!r}: expected one of {', '.join(FORMATS)}")
    block = _block_of(FORMAT, BLOCK)
    if FORMAT == "fp8" and not 0.0 <= FLOOR <= FP8_MAX:
        raise dsl.DslError(f"FLOOR {FLOOR} out of range: an FP8 floor lies in [0, 448]")
    if FORMAT != "fp8" and FLOOR != 0.0:
        raise dsl.DslError(f"FLOOR {FLOOR}: FORMAT {FORMAT!r} has its own floor ({FP4_FLOORS[FORMAT]:.6g})")
    for t, n in dsl.grid(dsl.cdiv(x.T, ROWS), dsl.cdiv(x.D, block * BLOCKS)):
        for g in dsl.range(BLOCKS):
            col = (n * BLOCKS + g) * block
            xt = dsl.load(x[t * ROWS, col], (ROWS, block)).to(dsl.f32)  # past D: zeros
            if FORMAT == "fp8":
                got = _fp8_block(xt, float(FLOOR))
            elif FORMAT == "mxfp4":
                got = _mxfp4_block(xt)
            else:
                got = _nvfp4_block(xt)
            dsl.store(out[t * ROWS, col], got.bitcast(dsl.f32))


# -- reference -----------------------------------------------------------------------------------

def _ceil_pow2(r: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at or above each positive finite f32 ``r``, from its bits (a
    subnormal's too), as f32; 1 where r is 0 (log2 has no value there)."""
    bits = r.contiguous().view(torch.int32)
    e, m = bits >> 23, bits & 0x7FFFFF
    k_normal = e - 127 + (m > 0).to(torch.int32)
    k_sub = -149 + sum((m > (1 << j)).to(torch.int32) for j in range(23))  # ceil(log2 m) for 1 <= m < 2^23
    k = torch.where(e > 0, k_normal, k_sub)
    return torch.where(r > 0, torch.pow(2.0, k.double()).float(), 1.0)


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """y rounded onto e2m1's magnitudes (clamped to 6; to nearest, a tie to the even code), the
    sign kept but for a zero (+0)."""
    m = y.abs().clamp(max=FP4_MAX)
    idx = sum(((m > mid) | ((m == mid) & up)).long() for mid, up in zip(MIDPOINTS, TIE_UP))
    mag = torch.tensor(E2M1_GRID, device=y.device)[idx]
    return torch.where((y < 0) & (idx > 0), -mag, mag)


def kv_round_reference(x: torch.Tensor, FORMAT: str = "fp8", BLOCK: int = 64, FLOOR: float = 0.0) -> dict:
    """model.md 2.10 and 4.1 in f32 (the module docstring's formulas), with torch's e4m3 cast for
    e4m3's rounding; a short last block padded with zeros."""
    block = FP4_BLOCKS.get(FORMAT, BLOCK)
    t, d = x.shape
    nb = -(-d // block)
    padded = torch.zeros(t, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :d] = x.float()
    b = padded.view(t, nb, block)
    nan = b.isnan().any(-1, keepdim=True)
    amax = torch.where(nan, 0.0, b.abs()).amax(-1, keepdim=True)  # an Inf stays (NVFP4 clamps it)
    if FORMAT == "fp8":
        s = _ceil_pow2(torch.where(amax.isinf(), 1.0, amax.clamp(min=FLOOR) / FP8_MAX))
        values = (b / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        bad = nan | amax.isinf()
    elif FORMAT == "mxfp4":
        s = _ceil_pow2(torch.where(amax.isinf(), 1.0, amax.clamp(min=REFERENCE_FLOORS[FORMAT]) / FP4_MAX))
        values = _e2m1_round(b / s) * s
        bad = nan | amax.isinf()
    else:
        s = (amax.clamp(min=REFERENCE_FLOORS[FORMAT]) / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
        values = _e2m1_round(b / s) * s
        bad = nan
    out = torch.where(bad, float("nan"), values)
    return {"out": out.flatten(1)[:, :d].contiguous()}


# -- cases ---------------------------------------------------------------------------------------

def _format(case) -> str:
    return case.get("FORMAT", "fp8")


def _block(case) -> int:
    fmt = _format(case)
    return case.get("BLOCK", 64) if fmt == "fp8" else FP4_BLOCKS[fmt]


def _constants(case) -> dict:
    fmt = _format(case)
    if fmt == "fp8":
        return {"FORMAT": fmt, "BLOCK": _block(case), "FLOOR": float(case.get("FLOOR", 0.0))}
    return {"FORMAT": fmt, "BLOCK": _block(case)}


E4M3_GRID = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def _fp8_values(kind: str, t: int, d: int, block: int, g: torch.Generator) -> torch.Tensor:
    """FP8 rows of one kind (f32):

    * ``scales``: each block's max at 448 x 2^k (an exact scale; k from -149, where amax / 448
      is an f32 subnormal, to 119), one f32 ulp above or below it, or at 2^k; the others below;
    * ``ties``: each block's max 448 x s for an exact scale s, the others e4m3 values, the midpoints
      between neighbours (ties of e4m3 rounding) and their f32 neighbours, times s;
    * ``spread``: magnitudes over 2^-20 .. 1 of a block's max (e4m3 subnormals, values that round
      to zero, -0 and +0 among them);
    * ``huge``: up to BF16's largest value, which f32 holds too, where a block's quotient rounds up
      to 256 at s = 2^120: products past f32's range;
    * ``tiny``: quantize.py's rows down to f32 subnormals (with FLOOR 0, scales below 2^-126);
    * ``zeros``, ``pow2``, ``normal``: quantize.py's;
    * ``nonfinite``: NaN, +Inf and -Inf in some blocks (quantize_fp4.py's)."""
    nb = -(-d // block)
    sign = torch.where(torch.rand(t, d, generator=g) < 0.5, -1.0, 1.0)
    if kind == "scales":
        k = torch.randint(-149, 120, (t, nb), generator=g).float()
        base = FP8_MAX * torch.exp2(k)  # exact down to 448 x 2^-149
        nudge = torch.randint(-1, 2, (t, nb), generator=g)
        top = torch.where(nudge > 0, torch.nextafter(base, torch.tensor(float("inf"))),
                          torch.where(nudge < 0, torch.nextafter(base, torch.tensor(0.0)), base))
        top = torch.where(torch.rand(t, nb, generator=g) < 0.2, torch.exp2(k.clamp(min=-149)), top)
        amax = top.repeat_interleave(block, 1)[:, :d]
        x = (torch.rand(t, d, generator=g) * 2 - 1) * amax
        first = (torch.arange(nb) * block).clamp(max=d - 1)
        x[:, first] = amax[:, first] * sign[:, first]
        return x
    if kind == "ties":
        s = torch.exp2(torch.randint(-126, 110, (t, nb), generator=g).float()).repeat_interleave(block, 1)[:, :d]
        mids = (E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2
        pool = torch.cat([E4M3_GRID, mids, torch.nextafter(mids, torch.tensor(0.0)),
                          torch.nextafter(mids, torch.tensor(1e9))])
        x = pool[torch.randint(0, len(pool), (t, d), generator=g)] * sign * s
        x[:, ::block] = FP8_MAX * s[:, ::block] * sign[:, ::block]
        return x
    if kind == "spread":
        scale = torch.exp2(torch.randint(-30, 30, (t, 1), generator=g).float())
        x = sign * scale * torch.exp2(-20 * torch.rand(t, d, generator=g))
        x[:, ::block] = scale * sign[:, ::block]
        return torch.where(torch.rand(t, d, generator=g) < 0.05, 0.0 * sign, x)
    if kind == "huge":
        return torch.randn(t, d, generator=g).clamp(-2.0, 2.0) * (torch.finfo(torch.bfloat16).max / 2)
    if kind == "nonfinite":
        return _fp4_activation_values(kind, "mxfp4", t, d, g)
    return _fp8_activation_values(kind, t, d, g)


def _spread_fp4(t: int, d: int, block: int, g: torch.Generator) -> torch.Tensor:
    """FP4 rows whose blocks span 2^-10 .. 1 of their max: most values round to 0 in e2m1."""
    sign = torch.where(torch.rand(t, d, generator=g) < 0.5, -1.0, 1.0)
    scale = torch.exp2(torch.randint(-30, 30, (t, 1), generator=g).float())
    x = sign * scale * torch.exp2(-10 * torch.rand(t, d, generator=g))
    x[:, ::block] = scale * sign[:, ::block]
    return x


def _values(case, g: torch.Generator) -> torch.Tensor:
    t, d, fmt, kind = case["T"], case["D"], _format(case), case.get("values", "normal")
    if fmt == "fp8":
        return _fp8_values(kind, t, d, _block(case), g)
    if kind == "spread":
        return _spread_fp4(t, d, _block(case), g)
    return _fp4_activation_values(kind, fmt, t, d, g)


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    if device.type == "meta":  # shapes and dtypes only
        x = torch.empty(t, d, dtype=dtype, device=device)
    else:
        x = _values(case, torch.Generator().manual_seed(seed)).to(dtype).to(device)
    return {"x": x, "out": torch.full((t, d), -7.0, dtype=torch.float32, device=device)}


def kv_round_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The rows the runtime rounds (runtime/layers/attention_v4.py, attention_v41.py), a call's rows
    each (one sequence's compressed rows and index keys, the batch's window rows and index
    queries, the queries' heads as rows of 128), at the decode batches ``decode_t`` and a prefill
    chunk of ``PREFILL_CHUNK`` tokens:

    * window KV rows, a row a token: V4's nope channels (448, FP8 per 64), V4.1's whole row (512,
      FP8 per 32); BF16;
    * compressed KV rows of one sequence, ``chunk / ratio`` a prefill chunk and at most one a
      decode step: V4's nope channels (FP8 per 64; ratios 4 and 128), V4.1's NVFP4 rows (512;
      ratios 2 and 1); BF16;
    * index keys of one sequence (MXFP4, 128): V4's CSA layers (ratio 4), V4.1's KV sources
      (ratios 2 and 1);
    * index queries (MXFP4, 128), ``index_heads`` rows a token.
    V4's index rows are FP32 (its Hadamard product), the others BF16."""
    chunk = shapes.PREFILL_CHUNK
    v41 = m.name == shapes.V41_FLASH.name
    nope = m.head_dim - m.rope_dim
    index_ratios = m.compress_ratios if v41 else tuple(r for r in m.compress_ratios if r != 128)
    index_dtype = {} if v41 else {"dtype": "f32"}
    window = ({"FORMAT": "fp8", "BLOCK": 32, "D": m.head_dim} if v41 else {"FORMAT": "fp8", "BLOCK": 64, "D": nope})
    comp = {"FORMAT": "nvfp4", "D": m.head_dim} if v41 else {"FORMAT": "fp8", "BLOCK": 64, "D": nope}
    out: dict[str, shapes.Case] = {}

    def add(what, case, rows):
        for phase, t in rows:
            out[f"{m.short}/{what}/{phase}"] = {"T": t, **case, "model": m.name}

    tokens = [(f"decode{b}", b) for b in decode_t] + [(f"prefill{chunk}", chunk)]
    per_seq = lambda ratios: [("decode1", 1)] + [(f"prefill{chunk}_r{r}", chunk // r) for r in ratios]  # noqa: E731
    fmt_name = lambda c: c["FORMAT"] + (f"_{c['BLOCK']}" if "BLOCK" in c else "")  # noqa: E731
    add(f"window_{fmt_name(window)}_d{window['D']}", window, tokens)
    add(f"comp_{fmt_name(comp)}_d{comp['D']}", comp, per_seq(m.compress_ratios))
    add(f"index_k_mxfp4_d{m.index_head_dim}", {"FORMAT": "mxfp4", "D": m.index_head_dim, **index_dtype},
        per_seq(index_ratios))
    add(f"index_q_mxfp4_h{m.index_heads}_d{m.index_head_dim}",
        {"FORMAT": "mxfp4", "D": m.index_head_dim, **index_dtype}, [(p, t * m.index_heads) for p, t in tokens])
    return out


def _case(t, d, fmt="fp8", values="normal", **more):
    return {"T": t, "D": d, "FORMAT": fmt, "values": values, **more}


# NaN outputs (the nonfinite cases) compare as equal to the reference's NaNs; -0 against +0 is
# checked bit for bit by tests/kernels_spec/test_kv_round.py
CASES = {
    "fp8_b64_t3_d448": _case(3, 448, BLOCK=64),
    "fp8_b32_t5_d512_f32": _case(5, 512, BLOCK=32, dtype="f32"),
    "fp8_b64_zeros": _case(6, 256, BLOCK=64, values="zeros"),
    "fp8_b32_pow2": _case(7, 256, BLOCK=32, values="pow2"),
    "fp8_b64_scales_f32": _case(16, 512, BLOCK=64, values="scales", dtype="f32"),
    "fp8_b32_scales_bf16": _case(9, 384, BLOCK=32, values="scales"),
    "fp8_b32_ties_f32": _case(8, 256, BLOCK=32, values="ties", dtype="f32"),
    "fp8_b64_spread_f32": _case(6, 384, BLOCK=64, values="spread", dtype="f32"),
    "fp8_b64_tiny_f32": _case(12, 128, BLOCK=64, values="tiny", dtype="f32"),
    "fp8_b32_tiny_floor": _case(9, 128, BLOCK=32, values="tiny", dtype="f32", FLOOR=1e-4),
    "fp8_b64_huge_f32": _case(3, 256, BLOCK=64, values="huge", dtype="f32"),
    "fp8_b32_huge_bf16": _case(2, 384, BLOCK=32, values="huge"),
    "fp8_b32_nonfinite_f32": _case(7, 256, BLOCK=32, values="nonfinite", dtype="f32"),
    "fp8_b64_ragged_t17_d200": _case(17, 200, BLOCK=64, config={"ROWS": 8, "BLOCKS": 2}),  # a last block of 8
    "fp8_b32_ragged_t13_d37": _case(13, 37, BLOCK=32, values="spread"),
}
for _fmt in FP4_BLOCKS:
    CASES.update({
        f"{_fmt}_t3_d512": _case(3, 512, _fmt),
        f"{_fmt}_zeros": _case(6, 256, _fmt, "zeros"),
        f"{_fmt}_scales_f32": _case(16, 512, _fmt, "scales", dtype="f32"),
        f"{_fmt}_scales_bf16": _case(9, 384, _fmt, "scales"),
        f"{_fmt}_ties_f32": _case(8, 256, _fmt, "ties", dtype="f32"),
        f"{_fmt}_nibbles": _case(4, 96, _fmt, "nibbles"),
        f"{_fmt}_spread_f32": _case(5, 256, _fmt, "spread", dtype="f32"),
        f"{_fmt}_huge_f32": _case(3, 128, _fmt, "huge", dtype="f32"),
        f"{_fmt}_tiny_f32": _case(9, 64, _fmt, "tiny", dtype="f32"),
        f"{_fmt}_nonfinite_f32": _case(7, 256, _fmt, "nonfinite", dtype="f32"),
        f"{_fmt}_nonfinite_bf16": _case(5, 160, _fmt, "nonfinite"),
        f"{_fmt}_ragged_t17_d37": _case(17, 37, _fmt),
        f"{_fmt}_ragged_t13_d200": _case(13, 200, _fmt, "scales", config={"ROWS": 8, "BLOCKS": 4}),
    })

SPEC = register(Spec(
    kernel=kv_round,
    reference=kv_round_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases=CASES,
    build_cases={"v4_window_kv448": _case(4096, 448, BLOCK=64), "v41_nvfp4_kv512": _case(2048, 512, "nvfp4")},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    constants_of=_constants,
    bytes_moved=lambda c: c["T"] * c["D"] * ((4 if c.get("dtype") == "f32" else 2) + 4),
    model_shapes=shapes.for_models(kv_round_shapes),
    # finite values only (a GPU sweep compares with torch.equal, where NaN is never equal)
    sweep={"T": Dim(1, 40, large=4099), "D": Dim(1, 400, large=16384), "FORMAT": OneOf(*FORMATS),
           "BLOCK": OneOf(*FP8_BLOCKS), "FLOOR": OneOf(0.0, 1e-4), "dtype": OneOf("bf16", "f32"),
           "values": OneOf("normal", "zeros", "scales", "ties", "spread", "tiny", "huge"),
           "config": {"ROWS": OneOf(1, 2, 4, 8, 16), "BLOCKS": OneOf(1, 2, 4)}},
))
