"""The window KV row of each decode token, fused (model.md 2.4, 2.5.2, 2.13, 3.1, 3.4, 4.1): the
kv norm, RoPE at the token's position, quantisation into the cache row's bytes, and the write into
the sequence's ring slot ``P mod WINDOW`` of its window cache (WINDOW = 128 rows in both models;
the cache is B x WINDOW x row bytes, and a ring slot past a shorter cache is dropped).

Per token b (sequence b, one token each), with ``x = kv[b]`` (the ``wkv`` projection, D = 512)::

    y     = bf16(x / sqrt(sum(x^2) / D + EPS) * weight)             RMSNorm_kv, f32 math
    pair i of the last ROPE channels (a, b) = (y[n + 2i], y[n + 2i + 1]),  n = D - ROPE:
    a'    = a cos - b sin,   b' = a sin + b cos                      cos / sin = table row P, pair i
    y     = bf16(y with the rotated pairs)
    cache[b, P mod WINDOW, :] = the row's bytes (FORMAT); the other rows are not written

The bf16 roundings are the reference's (the runtime stores the normed and the rotated rows in the
activation dtype). ``cos`` / ``sin`` are the layer's tables (P_max x ROPE / 2, f32: ratio-0 layers
base 10000, compressed layers base 160000 with YaRN), read at row P (``positions[b]``); a position
outside the table reads zeros there. Row formats (``FORMAT``), bytes of a ``cache`` row:

* ``"fp8"`` (V4.1, 528 bytes): all D channels e4m3 (``[0, D)``), then D / 32 UE8M0 scale codes,
  one per 32 channels (``[D, D + D / 32)``).
* ``"fp8_nope"`` (V4, 584 bytes): the D - ROPE nope channels e4m3 (``[0, n)``), the ROPE rope
  channels bf16, little-endian (``[n, n + 2 ROPE)``), then (D - ROPE) / 64 UE8M0 codes, one per
  64 nope channels, padded to a multiple of 8 bytes (vLLM's padding byte at 584), not written.

Quantisation of a block (32 or 64 channels), as the FP8 activation quantiser (``quantize.py``):
``amax = max(max |y|, FLOOR)``, the scale the smallest power of two with ``amax / s <= 448`` (code
``E - 8`` or ``E - 7`` of amax's biased exponent), value byte ``e4m3(y / s)`` (round to nearest,
ties to even; the sign bit kept, so -0 is 0x80). FLOOR = 1e-4 (model.md 2.10; the runtime's
window rows round with no floor, the same where a block's amax is at least 1e-4). The e4m3 byte
is computed from y / s's bits, as the NVFP4 scale is in ``quantize_fp4.py``: above 2^-6 its
exponent and 3 mantissa bits rounded on the f32 bits, below by adding 2^14 (whose f32 spacing
is e4m3's subnormal step 2^-9). A block holding a NaN or an Inf gets scale code 255 and value
bytes 0x7F (e4m3's NaN).

RoPE: the DSL reads a pair's partner channel as a column gather (``kv[b, c ^ 1]``, normed alike,
so its bits are those of y[c ^ 1]) and a channel's cos / sin as a column gather of the table's row
P (``dsl.scalar``: the row read from data) at the channel's pair (a one-hot max over the row's
pairs, as before, took about seven times the instructions in ``rope.py``, 2026-12-04); each
channel is computed where it is stored, in order, so the e4m3 bytes (V4.1) and the bf16 bytes (V4,
each channel's value read at its two byte columns) are stored at a corner. The ring slot is a
scatter store (``cache[b, slot, col]`` with ``slot`` a one-element tile). Even channels take
``a cos - b sin``, odd ones ``b cos + a sin``: the same f32 operations as the reference's, so the
interpreter is bit-exact.

Tolerances: exact on the interpreter (the tests check bytes); elsewhere a target's rsqrt, its
f32 sum order and fused multiply-adds can move a bf16 rounding, so a value byte may move by one
e4m3 step, a bf16 rope channel's high byte by one and its low byte anywhere; scale codes are
exact unless a block's amax lies within one bf16 ulp of 448 x 2^k.

Decode path: one token a sequence (B = T, dynamic, the batch dimension). D - ROPE must be a
multiple of the block; cos / sin have ROPE / 2 columns.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..runtime import quant
from . import model_shapes as shapes
from .quantize import FP8_MAX, MAGNITUDE, NAN_CODE, f32_bits
from .registry import Dim, OneOf, Spec, register
from .ue8m0 import fp8_block_code

FORMATS = {"fp8": 32, "fp8_nope": 64}  # format -> channels a UE8M0 scale covers
E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6 as f32 bits
E4M3_SUBNORMAL_ADD = 16384.0  # 2^14: f32 values near it lie 2^-9 apart, e4m3's subnormal step
E4M3_BIAS_SHIFT = (127 - 7) << 3  # f32 exponent bias minus e4m3's, in units of e4m3's 3-bit mantissa
E4M3_NAN = 0x7F


def _e4m3_bytes(y):
    """The e4m3 bytes (int32, 0..255) of ``y`` (f32, |y| <= 448): sign bit, then the magnitude
    rounded to nearest even on its bits (the module docstring)."""
    bits = y.bitcast(dsl.i32)
    mag = bits & MAGNITUDE
    v = mag.bitcast(dsl.f32)
    normal = (mag + (0x7FFFF + ((mag >> 20) & 1))) >> 20
    sub = (v + E4M3_SUBNORMAL_ADD).bitcast(dsl.i32) - f32_bits(E4M3_SUBNORMAL_ADD)
    code = dsl.where(mag >= E4M3_MIN_NORMAL_BITS, normal - E4M3_BIAS_SHIFT, sub)
    return code | ((bits >> 24) & 0x80)


def _put_block(cache, b, slot, y, col, scale_col, floor: int):
    """Quantise one row block ``y`` (1 x n, f32) and store its value bytes at ``col`` and its
    UE8M0 code at ``scale_col`` of the token's ring row."""
    code, inv, bad = fp8_block_code(y, floor, NAN_CODE)
    q = dsl.where(bad[:, None], E4M3_NAN, _e4m3_bytes(y * inv[:, None]))
    dsl.store(cache[b, slot, col], q.to(dsl.u8))
    dsl.store(cache[b, slot, scale_col], code[:, None].to(dsl.u8))


@dsl.kernel(batch_dim="B", dynamic=("B",))
def kv_insert(kv: dsl.Tensor["B", "D", dsl.bf16 | dsl.f32], weight: dsl.Tensor["D", dsl.bf16 | dsl.f32],
              positions: dsl.Tensor["B", dsl.i32 | dsl.i64],
              cos: dsl.Tensor["P", "H", dsl.f32], sin: dsl.Tensor["P", "H", dsl.f32],
              cache: dsl.Tensor["B", "W", "R", dsl.u8], *,
              FORMAT: dsl.Const = "fp8", WINDOW: dsl.Const = 128, ROPE: dsl.Const = 64, EPS: dsl.Const = 1e-6,
              FLOOR: dsl.Const = 1e-4):
    if FORMAT not in FORMATS:
        raise dsl.DslError(f"FORMAT {FORMAT!r}: expected one of {', '.join(FORMATS)}")
    block = FORMATS[FORMAT]
    if not (isinstance(ROPE, int) and ROPE > 0 and ROPE % block == 0):
        raise dsl.DslError(f"ROPE {ROPE!r} must be a positive multiple of the {block}-channel block")
    if not 2.0 ** -118 <= FLOOR <= FP8_MAX:
        raise dsl.DslError(f"FLOOR {FLOOR} out of range: the scale codes assume 2^-118 <= FLOOR <= 448")
    floor, d = f32_bits(FLOOR), kv.D
    nope = d - ROPE
    scales = d if FORMAT == "fp8" else nope + 2 * ROPE  # the row's first scale byte
    for b in dsl.grid(kv.B):
        p = dsl.load(positions[b], (1,))
        slot = p % WINDOW
        x = dsl.load(kv[b, 0], (1, dsl.next_pow2(d))).to(dsl.f32)  # the padding reads zeros
        r = dsl.rsqrt((x * x).sum(axis=1) / d + EPS)

        def normed(cols, n, b=b, r=r):  # channels ``cols`` (a corner or an index tile) of y, bf16-rounded
            xs = dsl.load(kv[b, cols], (1, n)).to(dsl.f32)
            ws = dsl.load(weight[cols], (n,)).to(dsl.f32)
            return (xs * r[:, None] * ws[None, :]).to(dsl.bf16).to(dsl.f32)

        def rotated(k, n, row=dsl.scalar(p)):  # rope channels ``k`` (an index tile, 0 .. ROPE - 1) of the rotated row
            y, partner = normed(nope + k, n), normed(nope + (k ^ 1), n)
            c = dsl.load(cos[row, k >> 1], (1, n))  # the channel's pair in the table's row P
            s = dsl.load(sin[row, k >> 1], (1, n))
            even = (k & 1).eq(0)[None, :]
            return dsl.where(even, y * c - partner * s, y * c + partner * s).to(dsl.bf16).to(dsl.f32)

        for g in dsl.range(dsl.cdiv(nope, block)):
            _put_block(cache, b, slot, normed(g * block, block), g * block, scales + g, floor)
        if FORMAT == "fp8":
            for j in range(ROPE // block):  # unrolled: the rope channels' blocks
                y = rotated(j * block + dsl.arange(block), block)
                _put_block(cache, b, slot, y, nope + j * block, scales + dsl.cdiv(nope, block) + j, floor)
        else:  # each rope channel's bf16 bits, low byte first, at its two byte columns
            byte = dsl.arange(2 * ROPE)
            bits = rotated(byte >> 1, 2 * ROPE).bitcast(dsl.i32)
            low = (byte & 1).eq(0)[None, :]
            dsl.store(cache[b, slot, nope], dsl.where(low, (bits >> 16) & 0xFF, (bits >> 24) & 0xFF).to(dsl.u8))


def _fp8_blocks(y: torch.Tensor, block: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Value bytes and UE8M0 codes of rows ``y`` (f32) in blocks of ``block`` channels (model.md
    2.10, 4.1; the runtime's UE8M0 and e4m3 rounding); a non-finite block: 0x7F values, code 255."""
    t, n = y.shape
    blocks = y.view(t, n // block, block)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    amax = torch.where(finite, blocks.abs().amax(-1, keepdim=True), 1.0).clamp(min=floor)
    s = quant.ue8m0_scale(amax, FP8_MAX)
    values = quant.fp8_round(torch.where(finite, blocks, 0.0) / s).to(torch.float8_e4m3fn).view(torch.uint8)
    values = torch.where(finite, values, E4M3_NAN)
    codes = torch.where(finite, s.to(torch.float8_e8m0fnu).view(torch.uint8), NAN_CODE)
    return values.flatten(1), codes.flatten(1)


def kv_insert_reference(kv, weight, positions, cos, sin, FORMAT: str = "fp8", WINDOW: int = 128, ROPE: int = 64,
                        EPS: float = 1e-6, FLOOR: float = 1e-4) -> dict:
    """From model.md 2.5.2 / 2.13 (norm, rope, FP8 round trip), 2.4 (interleaved pairs), 3.1 / 3.4
    (row bytes) and 4.1 (UE8M0, e4m3); the norm's sum over the row padded with zeros to a power of
    two, as the kernel's tile holds it (zeros change no sum, only the order it is taken in). The
    rows not written hold ``SENTINEL``, as ``make_inputs`` fills the cache."""
    bsz, d = kv.shape
    nope, block = d - ROPE, FORMATS[FORMAT]
    x = torch.zeros(bsz, 1 << max(d - 1, 0).bit_length(), dtype=torch.float32, device=kv.device)
    x[:, :d] = kv.float()
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) / d + EPS)
    y = (x[:, :d] * r * weight.float()).to(torch.bfloat16).float()
    pos = positions.long()
    inside = ((pos >= 0) & (pos < cos.shape[0]))[:, None]
    c = torch.where(inside, cos[pos.clamp(0, cos.shape[0] - 1)].float(), 0.0)
    s = torch.where(inside, sin[pos.clamp(0, sin.shape[0] - 1)].float(), 0.0)
    a, b = y[:, nope::2], y[:, nope + 1::2]
    rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(1)
    y = torch.cat([y[:, :nope], rot], 1).to(torch.bfloat16).float()
    if FORMAT == "fp8":
        values, codes = _fp8_blocks(y, block, FLOOR)
        row = torch.cat([values, codes], 1)
    else:
        values, codes = _fp8_blocks(y[:, :nope].contiguous(), block, FLOOR)
        rope = y[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        row = torch.cat([values, rope, codes], 1)
    out = torch.full((bsz, WINDOW, row_bytes(d, FORMAT, ROPE)), SENTINEL, dtype=torch.uint8, device=kv.device)
    out[torch.arange(bsz, device=kv.device), pos % WINDOW, : row.shape[1]] = row
    return {"cache": out}


def row_bytes(d: int, fmt: str, rope: int = 64) -> int:
    """A cache row's bytes: V4.1's 512 + 16; V4's 448 + 128 + its 7 scale bytes padded to 8 (the
    scale bytes padded to a multiple of 8 at any width: rows of whole 8-byte words)."""
    if fmt == "fp8":
        return d + d // FORMATS[fmt]
    return (d - rope) + 2 * rope + -(-(d - rope) // FORMATS[fmt] // 8) * 8


def rope_tables(n: int, base: float = 10000.0, rope: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of positions 0 .. n - 1 at pair frequencies base^(-2i / rope) (model.md 2.4; the
    YaRN tables of compressed layers differ only in their frequencies)."""
    freqs = base ** (-2.0 * torch.arange(rope // 2, dtype=torch.float64) / rope)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cos(angle).float(), torch.sin(angle).float()


def _positions(kind: str, b: int, n: int, window: int, g: torch.Generator) -> torch.Tensor:
    """``random`` (anywhere in the table), ``wrap`` (around ring boundaries: k W - 1, k W, k W + 1),
    ``zero`` (P = 0 for every sequence), ``end`` (the table's last rows)."""
    if kind == "random":
        return torch.randint(0, n, (b,), generator=g)
    if kind == "wrap":
        k = torch.randint(0, max(n // window, 1), (b,), generator=g) * window
        return (k + torch.tensor([-1, 0, 1])[torch.arange(b) % 3]).clamp(0, n - 1)
    if kind == "zero":
        return torch.zeros(b, dtype=torch.int64)
    if kind == "end":
        return (n - 1 - torch.arange(b) % 3).clamp(min=0)
    raise ValueError(f"unknown position kind {kind!r}")


def _rows(kind: str, b: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, weight) of one kind: ``normal`` (a magnitude of 2^-20..2^20 a row, weights near 1),
    ``zeros`` (every other row zero, the rest -0 in half the channels), ``extreme`` (rows of
    magnitude 2^-60..2^60, where the sum of squares underflows into eps or overflows to inf; weights
    2^-40..2^40 a channel), ``boundary`` (rows of +-1 and weights +-448 x 2^k or +-2^k: block maxima
    exactly where a scale code steps)."""
    x = torch.randn(b, d, generator=g)
    w = 1 + 0.1 * torch.randn(d, generator=g)
    if kind == "normal":
        return x * torch.exp2(torch.randint(-20, 21, (b, 1), generator=g).float()), w
    if kind == "zeros":
        x[::2] = 0.0
        x[1::2, : d // 2] = -0.0
        return x, w
    if kind == "extreme":
        k = torch.randint(-60, 61, (b, 1), generator=g).float()
        return x * torch.exp2(k), w * torch.exp2(torch.randint(-40, 41, (d,), generator=g).float())
    if kind == "boundary":
        sign = torch.where(torch.rand(b, d, generator=g) < 0.5, -1.0, 1.0)
        k = torch.randint(-20, 20, (d,), generator=g).float()
        base = torch.where(torch.rand(d, generator=g) < 0.5, FP8_MAX, 1.0)
        return sign, base * torch.exp2(k) * torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    raise ValueError(f"unknown row kind {kind!r}")


SENTINEL = 0xEE  # what a cache byte holds before the call: rows not written keep it


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    b, d, fmt, n, window = case["B"], case["D"], case.get("FORMAT", "fp8"), case["P"], case.get("W", 128)
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    index = torch.int64 if case.get("index") == "i64" else torch.int32
    cache = torch.full((b, window, row_bytes(d, fmt)), SENTINEL, dtype=torch.uint8, device=device)
    if device.type == "meta":  # shapes and dtypes only (a 1M-position table costs seconds)
        return {"kv": torch.empty(b, d, dtype=dtype, device=device),
                "weight": torch.empty(d, dtype=torch.bfloat16, device=device),
                "positions": torch.empty(b, dtype=index, device=device),
                "cos": torch.empty(n, 32, device=device), "sin": torch.empty(n, 32, device=device), "cache": cache}
    kv, weight = _rows(case.get("values", "normal"), b, d, g)
    cos, sin = rope_tables(n, case.get("base", 10000.0))
    pos = _positions(case.get("positions", "random"), b, n, window, g)
    return {"kv": kv.to(dtype).to(device), "weight": weight.to(torch.bfloat16).to(device),
            "positions": pos.to(index).to(device), "cos": cos.to(device), "sin": sin.to(device), "cache": cache}


def _extra_error(case, out, inputs):
    """Per byte of a row, what a GPU's rounding may move (the module docstring): one e4m3 step of a
    value byte, one in a bf16 channel's high byte, anything in its low byte, nothing in a scale."""
    d, fmt = case["D"], case.get("FORMAT", "fp8")
    nope = d - 64
    per_byte = torch.zeros(row_bytes(d, fmt))
    if fmt == "fp8":
        per_byte[:d] = 1.0
    else:
        per_byte[:nope] = 1.0
        per_byte[nope: nope + 128: 2] = 255.0
        per_byte[nope + 1: nope + 128: 2] = 1.0
    return per_byte.expand(inputs["cache"].shape)


def window_kv_shapes(m: shapes.ModelDims, decode_b=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """Each decode batch ``decode_b`` (one build serves every B) writing its rows into a window of
    ``m.window`` rows, the tables covering the 1M-token context: V4's 584-byte rows, V4.1's 528."""
    fmt = "fp8" if m.name == shapes.V41_FLASH.name else "fp8_nope"
    out: dict[str, shapes.Case] = {}
    for b in decode_b:
        out[f"{m.short}/window_kv{row_bytes(m.head_dim, fmt)}/decode{b}"] = {
            "B": b, "D": m.head_dim, "W": m.window, "P": shapes.CONTEXT, "FORMAT": fmt, "model": m.name}
    return out


def _case(b, fmt="fp8", values="normal", positions="random", n=300, **more):
    return {"B": b, "D": 512, "P": n, "FORMAT": fmt, "values": values, "positions": positions, **more}


CASES = {}
for _fmt in FORMATS:
    CASES.update({
        f"{_fmt}_b5": _case(5, _fmt),
        f"{_fmt}_wrap_b6": _case(6, _fmt, positions="wrap", n=1000),
        f"{_fmt}_p0_b3": _case(3, _fmt, positions="zero"),
        f"{_fmt}_table_end_b4": _case(4, _fmt, positions="end", n=4099, index="i64"),
        f"{_fmt}_zeros_b4": _case(4, _fmt, values="zeros"),
        f"{_fmt}_extreme_b8": _case(8, _fmt, values="extreme", base=160000.0),
        f"{_fmt}_boundary_b5": _case(5, _fmt, values="boundary", positions="wrap"),
        f"{_fmt}_f32_b3": _case(3, _fmt, dtype="f32"),
    })
CASES["fp8_small_window_b7"] = _case(7, "fp8", positions="wrap", n=64, W=16)

SPEC = register(Spec(
    kernel=kv_insert,
    reference=kv_insert_reference,
    make_inputs=_inputs,
    outputs=("cache",),
    cases=CASES,
    build_cases={"v41_decode64": _case(64, "fp8", n=shapes.CONTEXT),
                 "v4_decode64": _case(64, "fp8_nope", n=shapes.CONTEXT)},
    tolerance=lambda case, out: (0.0, 0.0),
    extra_error=_extra_error,
    constants_of=lambda case: {"FORMAT": case.get("FORMAT", "fp8"), "WINDOW": case.get("W", 128)},
    flops=lambda c: 8.0 * c["B"] * c["D"],
    bytes_moved=lambda c: c["B"] * (c["D"] * (4 if c.get("dtype") == "f32" else 2) + 256
                                    + row_bytes(c["D"], c.get("FORMAT", "fp8"))) + 2 * c["D"],
    model_shapes=shapes.for_models(window_kv_shapes),
    sweep={"B": Dim(1, 40, large=4099), "D": OneOf(128, 192, 512), "P": Dim(1, 600, large=1 << 20),
           "W": OneOf(1, 16, 128), "FORMAT": OneOf(*FORMATS), "dtype": OneOf("bf16", "f32"),
           "values": OneOf("normal", "zeros", "extreme", "boundary"),
           "positions": OneOf("random", "wrap", "zero", "end"), "index": OneOf("i32", "i64"),
           "base": OneOf(10000.0, 160000.0)},
    # the nope channels fill whole blocks (D - 64 a multiple of 64 in V4's format)
    sweep_valid=lambda c: (c["D"] - 64) % FORMATS[c["FORMAT"]] == 0,
))
