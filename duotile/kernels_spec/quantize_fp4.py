"""The FP4 (e2m1) activation quantisers of the indexer and the compressed KV rows (model.md 2.5.5,
2.10, 2.13, 4.1, 4.3, 5.7), one kernel for both formats (``FORMAT``):

* ``"mxfp4"``: one UE8M0 scale per 32 consecutive channels. V4's indexer queries and keys (after
  their Hadamard transform), V4.1's index queries and index keys.
* ``"nvfp4"``: one E4M3 scale per 16 channels, no global scale: V4.1's main compressed KV rows.

Per token and per block of ``BLOCK`` channels (32 or 16):

    amax  = max(max |x|, FLOOR)                  FLOOR = 6 x 2^-126 (mxfp4), 6 x 2^-9 (nvfp4)
    mxfp4: s = the smallest power of two with amax / s <= 6      (UE8M0 code = 127 + log2 s)
    nvfp4: s = e4m3(min(amax / 6, 448))                           (round to nearest, ties to even)
    q     = e2m1(x / s)                           (round to nearest, ties to the even code, |q| <= 6)

Outputs, all bytes (``uint8``):

* ``q`` (T x ceil(D / 2)): two e2m1 codes a byte (bit 3 sign, bits 0-2 the magnitude's index in
  {0, .5, 1, 1.5, 2, 3, 4, 6}), the **low nibble holding channel 2k and the high nibble channel
  2k + 1** (model.md 4.1, torch's ``float4_e2m1fn_x2``; the runtime's ``quant.pack_fp4``). A value
  that rounds to zero is code 0 (+0), never 8 (-0), as the runtime's ``quant.fp4_codes`` writes.
* ``scale`` (T x ceil(D / BLOCK)): the scale's bits, UE8M0 codes (``2^(code - 127)``, torch's
  ``float8_e8m0fnu``) or E4M3 bytes (torch's ``float8_e4m3fn``): view them as those dtypes.

A short last block (D not a multiple of BLOCK) holds the channels that exist, the rest counting as
zeros; an odd D leaves the last byte's high nibble 0.

Both scales are exact, built from bits. UE8M0: amax = 1.m x 2^e needs s = 2^(e - 2) when
1.m <= 1.5 (6 = 1.5 x 2^2) and 2^(e - 1) above, so the code is ``E - 2`` or ``E - 1`` for amax's
biased exponent E (1 at the floor, 253 at the f32 maximum), and q multiplies by 1 / s, a power of
two built from bits (exact, like the division it stands for). E4M3: y = min(amax / 6, 448) (an IEEE
f32 division, as torch's) is rounded to 3 mantissa bits on its bits where y >= 2^-6 (e4m3's
normals), and where it is below by adding 2^14, whose f32 spacing is e4m3's subnormal step 2^-9;
q then divides by the scale in f32 (the division torch's round trip does, so ties in e2m1 fall
alike). The e2m1 code counts the midpoints |q| passes: above 0.25, 1.25, 2.5 and 5 (a tie goes down
to the even code), at or above 0.75, 1.75 and 3.5 (a tie goes up).

Subnormal inputs: below the UE8M0 floor the scale is 2^-126, so a subnormal x can have a nonzero
code (2^-127 is 0.5). A target built with ftz flushes subnormal float operands to zero, so such
an x is rebuilt from its mantissa bits (``_scaled_by_code``) rather than multiplied; every other
float operation either sees normal operands or yields a result whose code is 0 either way. With
E4M3 (s >= 2^-9) a subnormal x always has code 0.

Non-finite input (decided as the FP8 quantiser decides, ``quantize.py``): a block holding a NaN or
an Inf gets the scale's NaN (UE8M0 code 255, E4M3 byte 0x7F) and every code of the block is 0, so
dequantising gives NaN across the block (NaN x 0) and a bad activation is never silently clipped.
e2m1 has no NaN or Inf, so the codes cannot carry it as the FP8 values do. The block test reads
bits (a NaN's magnitude bits sort above Inf's), so it does not rest on a target's NaN rules. The
other blocks of the row are unaffected.

Pairing: the even and the odd channels of a block are read as two tiles, gathers along the channel
axis (``x[row, col + 2 * arange(BLOCK // 2)]`` and ``+ 1``), so the two nibbles of a byte sit at
the same place of two tiles and a byte is ``even | odd << 4``.

Decode path: each row is quantised on its own (batch dimension T, dynamic and bucketed: each
power-of-two bucket of T gets its own config and build, larger tiles for a prefill chunk than for a
decode step; only max reductions, so no bit depends on the config, which check_batch_invariance
enforces).
"""

from __future__ import annotations

import torch

from .. import dsl
from ..runtime import quant
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register
from .ue8m0 import INF_BITS, f32_bits, inverse_pow2, magnitude_bits, pow2_code

FORMATS = {"mxfp4": 32, "nvfp4": 16}  # format -> channels a scale covers
FLOORS = {"mxfp4": quant.FP4_FLOOR, "nvfp4": quant.NVFP4_FLOOR}
NAN_CODE = {"mxfp4": 255, "nvfp4": 0x7F}  # the scale of a block with a NaN or an Inf
E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6 as f32 bits
E4M3_SUBNORMAL_ADD = 16384.0  # 2^14: f32 values near it lie 2^-9 apart, e4m3's subnormal step
E4M3_BIAS_SHIFT = (127 - 7) << 3  # f32 exponent bias minus e4m3's, in units of e4m3's 3-bit mantissa
# e2m1 midpoints, in order: a value above the odd-numbered ones (or at least the even-numbered
# ones) passes them; ties go to the even code (model.md 4.1)
MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1(m, neg, bad):
    """e2m1 codes (int32) of magnitudes ``m`` already divided by their scale, the sign bit set
    where ``neg`` and the code is not 0; 0 where ``bad``."""
    idx = None
    for mid, tie_up in MIDPOINTS:
        step = (m >= mid if tie_up else m > mid).to(dsl.i32)
        idx = step if idx is None else idx + step
    code = idx | ((neg & (idx > 0)).to(dsl.i32) << 3)
    return dsl.where(bad[:, None], 0, code)


def _scaled_by_code(mag, bits, code, inv):
    """|x| / 2^(code - 127) for UE8M0 codes 1..253. A normal |x| is multiplied by ``inv``; a
    subnormal one (a target may flush it to zero as an operand) is rebuilt from its mantissa bits
    m as m x 2^-22 x 2^-code (= m x 2^-149 x 2^(127 - code)); for codes above 104 that is below
    e2m1's 0.25 anyway, so 2^-code needs codes up to 126 only."""
    subnormal = (bits & INF_BITS).eq(0)
    low = dsl.minimum(code, 126)
    rebuilt = (bits & 0x7FFFFF).to(dsl.f32) * 2.0 ** -22 * ((127 - low[:, None]) << 23).bitcast(dsl.f32)
    return dsl.where(subnormal, rebuilt, mag * inv[:, None])


@dsl.kernel(batch_dim="T", bucketed=("T",))
def quantize_fp4(x: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], q: dsl.Tensor["T", "DQ", dsl.u8],
                 scale: dsl.Tensor["T", "NB", dsl.u8], *,
                 FORMAT: dsl.Const = "mxfp4",
                 ROWS: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16), BLOCKS: dsl.Tunable = dsl.choice(2, 1, 4, 8)):
    if FORMAT not in FORMATS:
        raise dsl.DslError(f"FORMAT {FORMAT!r}: expected one of {', '.join(FORMATS)}")
    block = FORMATS[FORMAT]
    half = block // 2
    floor = f32_bits(FLOORS[FORMAT])
    for t, n in dsl.grid(dsl.cdiv(x.T, ROWS), dsl.cdiv(x.D, block * BLOCKS)):
        for g in dsl.range(BLOCKS):
            col = (n * BLOCKS + g) * block
            even = col + 2 * dsl.arange(half)  # the channels of the low nibbles
            xe = dsl.load(x[t * ROWS, even], (ROWS, half)).to(dsl.f32)
            xo = dsl.load(x[t * ROWS, even + 1], (ROWS, half)).to(dsl.f32)
            be, bo = xe.bitcast(dsl.i32), xo.bitcast(dsl.i32)
            me, mo = magnitude_bits(xe), magnitude_bits(xo)
            amax = dsl.maximum(dsl.maximum(me.max(axis=1), mo.max(axis=1)).bitcast(dsl.i32), floor)
            bad = amax >= INF_BITS
            if FORMAT == "mxfp4":
                code = dsl.where(bad, NAN_CODE[FORMAT], pow2_code(amax, 6.0))
                inv = inverse_pow2(code, bad)
                qe, qo = _scaled_by_code(me, be, code, inv), _scaled_by_code(mo, bo, code, inv)
            else:
                y = dsl.minimum(amax.bitcast(dsl.f32) / 6.0, 448.0)
                yb = y.bitcast(dsl.i32)
                normal = yb >= E4M3_MIN_NORMAL_BITS
                rounded = (yb + (0x7FFFF + ((yb >> 20) & 1))) >> 20  # f32 exponent and 3 mantissa bits
                sub = (y + E4M3_SUBNORMAL_ADD).bitcast(dsl.i32) - f32_bits(E4M3_SUBNORMAL_ADD)  # y / 2^-9
                code = dsl.where(bad, NAN_CODE[FORMAT], dsl.where(normal, rounded - E4M3_BIAS_SHIFT, sub))
                s = dsl.where(normal, (rounded << 20).bitcast(dsl.f32), sub.to(dsl.f32) * 2.0 ** -9)
                qe, qo = me / s[:, None], mo / s[:, None]  # s >= 2^-9: a subnormal |x| gives code 0
            packed = _e2m1(qe, be < 0, bad) | (_e2m1(qo, bo < 0, bad) << 4)
            dsl.store(q[t * ROWS, col // 2], packed.to(dsl.u8))
            dsl.store(scale[t * ROWS, n * BLOCKS + g], code[:, None].to(dsl.u8))


def quantize_fp4_reference(x: torch.Tensor, FORMAT: str = "mxfp4") -> dict:
    """From model.md's formulas, with the runtime's rounding and packing (runtime/quant.py)."""
    block = FORMATS[FORMAT]
    t, d = x.shape
    nb = -(-d // block)
    padded = torch.zeros(t, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :d] = x.float()
    blocks = padded.view(t, nb, block)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    amax = torch.where(finite, blocks.abs().amax(-1, keepdim=True), 1.0).clamp(min=FLOORS[FORMAT])
    if FORMAT == "mxfp4":
        s = quant.ue8m0_scale(amax, quant.FP4_MAX)
        bits = s.to(torch.float8_e8m0fnu).view(torch.uint8)
    else:
        s = quant.nvfp4_scale(amax)
        bits = s.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite, quant.fp4_codes(blocks / s), 0)
    bits = torch.where(finite, bits, NAN_CODE[FORMAT])
    return {"q": quant.pack_fp4(codes.flatten(1))[:, : -(-d // 2)], "scale": bits.squeeze(-1)}


def fp4_quant_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """Where each format quantises activations, at the decode batches ``decode_t`` (``T`` = the
    batch: a row a sequence, the most a step emits; 1, 16 and 64 sample 1..64, which one build
    a power-of-two bucket of T serves) and at one prefill chunk (``PREFILL_CHUNK`` tokens, which emit
    ``chunk / ratio`` compressed rows):

    * MXFP4 index queries, ``index_heads x index_head_dim`` wide (V4: 64 x 128, V4.1: 32 x 128);
    * MXFP4 index keys, ``index_head_dim`` (128) wide: one a compressed row, for each ratio with
      an indexer (V4: the CSA layers, ratio 4; V4.1: the KV-source layers, ratios 2 and 1);
    * V4.1's NVFP4 main compressed KV rows, ``head_dim`` (512) wide, for ratios 2 and 1.
    V4 has no NVFP4 tensor; its compressed KV rows are FP8 (model.md 2.10)."""
    chunk = shapes.PREFILL_CHUNK
    v41 = m.name == shapes.V41_FLASH.name
    key_ratios = m.compress_ratios if v41 else tuple(r for r in m.compress_ratios if r != 128)
    widths = [("mxfp4", f"index_q{m.index_heads * m.index_head_dim}", m.index_heads * m.index_head_dim, (1,)),
              ("mxfp4", f"index_k{m.index_head_dim}", m.index_head_dim, key_ratios)]
    if v41:
        widths.append(("nvfp4", f"kv{m.head_dim}", m.head_dim, m.compress_ratios))
    out: dict[str, shapes.Case] = {}
    for fmt, what, d, ratios in widths:
        rows = [(f"decode{b}", b) for b in decode_t]
        rows += [(f"prefill{chunk}" + (f"_r{r}" if r > 1 else ""), chunk // r) for r in ratios]
        for phase, t in rows:
            out[f"{m.short}/{fmt}_{what}/{phase}"] = {"T": t, "D": d, "FORMAT": fmt, "model": m.name}
    return out


def _format(case) -> str:
    return case.get("FORMAT", "mxfp4")


def _block(case) -> int:
    return FORMATS[_format(case)]


E4M3_VALUES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # +0 < ... <= 448


def _edge_amax(fmt: str, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` block maxima at the scale's edges: for UE8M0, 6 x 2^k and its f32 neighbours, the
    floor and below it, the f32 maximum; for E4M3, 6 x each e4m3 value and 6 x each midpoint
    between neighbours (ties of the scale's rounding), the subnormal range, the 448 clamp, the
    floor and below it."""
    if fmt == "mxfp4":
        k = torch.randint(-126, 126, (n,), generator=g).float()
        base = 6.0 * torch.exp2(k)
        nudge = torch.randint(-1, 2, (n,), generator=g)
        edge = torch.where(nudge > 0, torch.nextafter(base, torch.tensor(float("inf"))),
                           torch.where(nudge < 0, torch.nextafter(base, torch.tensor(0.0)), base))
        special = torch.tensor([quant.FP4_FLOOR, quant.FP4_FLOOR / 3, 2.0**-140, torch.finfo(torch.float32).max,
                                6.0, 6.0 * 2.0**126, 2.0**-126])
    else:
        grid = E4M3_VALUES
        mids = (grid[:-1] + grid[1:]) / 2
        pool = torch.cat([grid, mids]) * 6.0
        edge = pool[torch.randint(0, len(pool), (n,), generator=g)]
        special = torch.tensor([quant.NVFP4_FLOOR, quant.NVFP4_FLOOR / 2, 6 * 448.0, 6 * 480.0, 1e30, 6 * 2.0**-6,
                                6 * (2.0**-6 - 2.0**-10), 6 * 1.5 * 2.0**-9])
    pick = torch.rand(n, generator=g) < 0.2
    return torch.where(pick, special[torch.randint(0, len(special), (n,), generator=g)], edge)


def _values(kind: str, fmt: str, t: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Activations of one kind (f32; the case's dtype rounds them):

    * ``normal``: a magnitude of 2^-20..2^20 per row;
    * ``zeros``: every other row zero, the rest -0 in half the channels (blocks at the floor);
    * ``scales``: each block's max at the scale's edges (``_edge_amax``), the others below it;
    * ``ties``: each block's max 6 x s for an exact scale s, the others e2m1 grid points and the
      midpoints between them times s (ties of e2m1 rounding), and their f32 neighbours;
    * ``nibbles``: every e2m1 magnitude, both signs, at even and odd channels (the nibble order);
    * ``huge`` / ``tiny``: up to the f32 and bf16 maxima / down to f32 subnormals;
    * ``nonfinite``: NaN, +Inf and -Inf in some blocks, finite blocks beside them."""
    block = FORMATS[fmt]
    nb = -(-d // block)
    x = torch.randn(t, d, generator=g)
    sign = torch.where(torch.rand(t, d, generator=g) < 0.5, -1.0, 1.0)
    if kind == "normal":
        return x * torch.exp2(torch.randint(-20, 21, (t, 1), generator=g).float())
    if kind == "zeros":
        x[::2] = 0.0
        x[1::2, : d // 2] = -0.0
        return x
    if kind == "scales":
        amax = _edge_amax(fmt, t * nb, g).view(t, nb).repeat_interleave(block, 1)[:, :d]
        x = (torch.rand(t, d, generator=g) * 2 - 1) * amax
        top = torch.randint(0, block, (t, nb), generator=g) + torch.arange(nb) * block
        top = top.clamp(max=d - 1)
        return x.scatter(1, top, amax.gather(1, top) * sign.gather(1, top))
    if kind == "ties":
        if fmt == "mxfp4":
            s = torch.exp2(torch.randint(-100, 100, (t, nb), generator=g).float())
        else:  # an e4m3 scale with any mantissa: amax / 6 is that scale exactly
            s = E4M3_VALUES[torch.randint(0, len(E4M3_VALUES), (t, nb), generator=g)]
        s = s.repeat_interleave(block, 1)[:, :d]
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        pool = torch.cat([quant.FP4_GRID, mids, torch.nextafter(mids, torch.tensor(0.0)),
                          torch.nextafter(mids, torch.tensor(10.0))])
        x = pool[torch.randint(0, len(pool), (t, d), generator=g)] * sign * s
        x[:, ::block] = 6.0 * s[:, ::block] * sign[:, ::block]
        return x
    if kind == "nibbles":
        k = (torch.arange(d) + torch.arange(t)[:, None]) % 16
        x = quant.FP4_GRID[k % 8] * torch.where(k >= 8, -1.0, 1.0)
        x[:, ::block] = 6.0  # every block's scale is 1
        return x
    if kind == "huge":
        return x.clamp(-2.0, 2.0) * 1.5e38  # up to 3e38: finite in f32 and bf16
    if kind == "tiny":
        return x * torch.exp2(torch.randint(-149, -12, (t, 1), generator=g).float())
    if kind == "nonfinite":
        r = torch.rand(t, d, generator=g)
        bad = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.randint(0, 3, (t, d), generator=g)]
        return torch.where(r < 0.02, bad, x * 10)
    raise ValueError(f"unknown value kind {kind!r}")


def _inputs(case, device, seed):
    t, d, fmt = case["T"], case["D"], _format(case)
    nb = case.get("NB", -(-d // _block(case)))
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    if device.type == "meta":  # shapes and dtypes only
        x = torch.empty(t, d, dtype=dtype, device=device)
    else:
        x = _values(case.get("values", "normal"), fmt, t, d, torch.Generator().manual_seed(seed)).to(dtype)
    return {"x": x.to(device), "q": torch.full((t, -(-d // 2)), 0xEE, dtype=torch.uint8, device=device),
            "scale": torch.full((t, nb), 0xEE, dtype=torch.uint8, device=device)}


def _case(t, d, fmt="mxfp4", values="normal", **more):
    return {"T": t, "D": d, "FORMAT": fmt, "values": values, **more}


CASES = {}
for _fmt in FORMATS:
    CASES.update({
        f"{_fmt}_t3_d512": _case(3, 512, _fmt),
        f"{_fmt}_zeros": _case(6, 256, _fmt, "zeros"),
        f"{_fmt}_scales_f32": _case(16, 512, _fmt, "scales", dtype="f32"),
        f"{_fmt}_scales_bf16": _case(9, 384, _fmt, "scales"),
        f"{_fmt}_ties_f32": _case(8, 256, _fmt, "ties", dtype="f32"),
        f"{_fmt}_ties_bf16": _case(5, 320, _fmt, "ties"),
        f"{_fmt}_nibbles": _case(4, 96, _fmt, "nibbles"),
        f"{_fmt}_huge_f32": _case(3, 128, _fmt, "huge", dtype="f32"),
        f"{_fmt}_tiny_f32": _case(9, 64, _fmt, "tiny", dtype="f32"),
        f"{_fmt}_nonfinite_f32": _case(7, 256, _fmt, "nonfinite", dtype="f32"),
        f"{_fmt}_nonfinite_bf16": _case(5, 160, _fmt, "nonfinite"),
        f"{_fmt}_ragged_t17_d37": _case(17, 37, _fmt),  # an odd width: a last byte with one nibble
        f"{_fmt}_ragged_t13_d200": _case(13, 200, _fmt, "scales", config={"ROWS": 8, "BLOCKS": 4}),
    })

SPEC = register(Spec(
    kernel=quantize_fp4,
    reference=quantize_fp4_reference,
    make_inputs=_inputs,
    outputs=("q", "scale"),
    cases=CASES,
    build_cases={"v4_mxfp4_index_q": _case(4096, 8192), "v41_nvfp4_kv": _case(2048, 512, "nvfp4")},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    constants_of=lambda case: {"FORMAT": _format(case)},
    bytes_moved=lambda c: (c["T"] * c["D"] * (4 if c.get("dtype") == "f32" else 2) + c["T"] * -(-c["D"] // 2)
                           + c["T"] * -(-c["D"] // _block(c))),
    model_shapes=shapes.for_models(fp4_quant_shapes),
    sweep={"T": Dim(1, 40, large=4099), "D": Dim(1, 400, large=16384), "FORMAT": OneOf(*FORMATS),
           "dtype": OneOf("bf16", "f32"),
           "values": OneOf("normal", "zeros", "scales", "ties", "nibbles", "huge", "tiny", "nonfinite"),
           "config": {"ROWS": OneOf(1, 2, 4, 8, 16), "BLOCKS": OneOf(1, 2, 4)}},
))
