"""RMSNorm fused with the FP8 activation quantiser: the norm in front of an FP8 GEMM (model.md 2.2,
2.6, 2.7, 2.10, 4.1; V4.1's 32-wide blocks in 1.7, 2.13, 4.3). The FFN site's ``ffn_norm`` feeds
the routed experts' and the shared expert's FP8 / FP4-weight GEMMs with one quantised row, and its
BF16 router with the row itself; the attention site's ``attn_norm`` feeds ``wq_a`` and ``wkv``
(FP8) and the BF16 compressor and indexer projections alike.

Per token (row) of ``x`` (T x D) and weight ``w`` (D)::

    y     = rnd(x * rsqrt(sum(x^2) / D + EPS) * w)        f32 math, rnd = round to x's dtype
    per block of BLOCK channels (128 in V4, 32 in V4.1):
    amax  = max(max |y|, FLOOR)                            FLOOR = 1e-4
    s     = the smallest power of two with amax / s <= 448 (UE8M0 code = log2(s) + 127)
    q     = e4m3(y / s)                                    round to nearest, ties to even

``rnd`` is model.md 2.2's rounding point: the norm's output is a BF16 activation (the runtime's
``ctx.act``) before the quantiser reads it; with f32 activations there is none. The quantisation
is ``quantize.py``'s, bit for bit: the scale from amax's exponent and mantissa bits (model.md
2.10's exact power-of-two test, so amax = 448 x 2^k gives 2^k, not 2^(k + 1)), ``q`` multiplied
by 1 / s built from bits; a block holding a NaN or an Inf gets code 255 (UE8M0's NaN) and
``q = y * 0`` (+-0, NaN where y is NaN or Inf); a last block cut short by D quantises the
channels that exist. Outputs: ``q`` (T x D, e4m3) and ``scale`` (T x ceil(D / BLOCK), uint8
codes, ``2^(code - 127)``), and where the call passes it ``y`` (T x D): the rounded norm itself,
what the BF16 consumers of the same norm read (``rmsnorm``'s output). ``EPS`` is the model's
``rms_norm_eps``: 1e-6 in V4, 1e-20 in V4.1.

Non-finite rows follow from f32 arithmetic, as in ``rmsnorm.py``'s reference: a NaN anywhere in a
row makes every block of it NaN (code 255); an Inf, or finite values whose squares sum past the
f32 range, make the rsqrt 0, so the row's finite channels quantise to zeros at the floor's code
and an Inf channel's block is NaN.

Each program normalises ``ROWS`` rows: it reads the whole row once for the sum of squares (one
tile, the row padded with zeros to a power of two) and then quantises its share of the row's
blocks, re-reading them; ``SPLIT`` programs share a row's blocks (each sums the row itself, in
the same order), so a decode step of few tokens still spreads over ``SPLIT`` programs. Neither
tunable changes a bit of the result.

Exactness: on the interpreter the outputs are the reference's bit for bit, as the tests check byte
by byte. The reference is model.md 2.2's norm as ``rmsnorm.py``'s reference computes it, its sum of
squares taken over the same zero-padded row as the kernel's tile (the same additions; at a
power-of-two width the same bits as ``rmsnorm_reference``), then ``quantize_reference``. Elsewhere
a target's rsqrt and its f32 sum order move ``y`` by an ulp or two, which can move its rounding
(``y``'s tolerance, one bf16 ulp as ``rmsnorm``'s) and so a value by one e4m3 step (``q``'s); scale
codes are exact unless a block's amax lies within that distance of 448 x 2^k, which the bf16
rounding point makes rare (f32 rows that land exactly on such a maximum, rows of +-1 at EPS 1e-20,
are left out of the sweep). CUDA builds flush subnormals (their ``y`` quantise to zero anyway: the
scale floor leaves them below e4m3's smallest step).

Decode path: rows are tokens, each normalised and quantised on its own: batch dimension T,
dynamic (one build serves every token count).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .quantize import FP8_MAX, NAN_CODE, f32_bits, quantize_reference
from .registry import Dim, OneOf, Spec, register
from .ue8m0 import fp8_block_code

RMS_EPS = {"v4-flash": 1e-6, "v41-flash": 1e-20}  # rms_norm_eps (model.md 1.1, 1.7)
E4M3_STEP = 2.0 ** -9  # e4m3's smallest subnormal: its spacing below 2^-6


def check_quant_constants(BLOCK, FLOOR) -> int:
    """The quantiser's constants, checked where a kernel is traced; FLOOR's f32 bits."""
    if not (isinstance(BLOCK, int) and not isinstance(BLOCK, bool) and BLOCK >= 1):
        raise dsl.DslError(f"BLOCK {BLOCK!r} must be a positive int: the channels one scale covers")
    if not 2.0 ** -118 <= FLOOR <= FP8_MAX:
        raise dsl.DslError(f"FLOOR {FLOOR} out of range: the scale codes assume 2^-118 <= FLOOR <= 448")
    return f32_bits(FLOOR)


def quantize_block(q, scale, row, col, blk, y, floor: int):
    """``quantize.py``'s quantisation of one block ``y`` (rows x BLOCK, f32): the e4m3 values at
    ``q[row, col]``, the UE8M0 codes at ``scale[row, blk]``; ``floor`` is FLOOR's f32 bits."""
    code, inv, _ = fp8_block_code(y, floor, NAN_CODE)
    dsl.store(q[row, col], (y * inv[:, None]).to(dsl.f8e4m3))
    dsl.store(scale[row, blk], code[:, None].to(dsl.u8))


@dsl.kernel(batch_dim="T", dynamic=("T",))
def rmsnorm_quant(x: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], weight: dsl.Tensor["D", dsl.bf16 | dsl.f32],
                  q: dsl.Tensor["T", "D", dsl.f8e4m3], scale: dsl.Tensor["T", "NB", dsl.u8],
                  y: dsl.OptionalTensor["T", "D", dsl.bf16 | dsl.f32] = None, *,
                  EPS: dsl.Const = 1e-6, BLOCK: dsl.Const = 128, FLOOR: dsl.Const = 1e-4,
                  ROWS: dsl.Tunable = dsl.choice(4, 1, 2, 8), SPLIT: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    floor = check_quant_constants(BLOCK, FLOOR)
    width = dsl.next_pow2(x.D)  # one tile covers the row; the padding reads zeros
    per = dsl.cdiv(dsl.cdiv(x.D, BLOCK), SPLIT)  # blocks a program quantises
    for t, s in dsl.grid(dsl.cdiv(x.T, ROWS), SPLIT):
        xt = dsl.load(x[t * ROWS, 0], (ROWS, width)).to(dsl.f32)
        r = dsl.rsqrt((xt * xt).sum(axis=1) / x.D + EPS)
        for g in dsl.range(per):
            blk = s * per + g
            xb = dsl.load(x[t * ROWS, blk * BLOCK], (ROWS, BLOCK)).to(dsl.f32)
            wb = dsl.load(weight[blk * BLOCK], (BLOCK,)).to(dsl.f32)
            yb = (xb * r[:, None] * wb[None, :]).to(x.dtype)  # model.md 2.2's rounding point
            if y is not None:
                dsl.store(y[t * ROWS, blk * BLOCK], yb.to(y.dtype))
            quantize_block(q, scale, t * ROWS, blk * BLOCK, blk, yb.to(dsl.f32), floor)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.md 2.2: ``w * x * rsqrt(mean(x^2) + eps)`` in f32, rounded to x's dtype; the sum of
    squares over the row padded with zeros to a power of two (zeros change no sum, only the order
    torch adds it in, which is then the kernel's tile's)."""
    t, d = x.shape
    xf = torch.zeros(t, 1 << max(d - 1, 0).bit_length(), dtype=torch.float32, device=x.device)
    xf[:, :d] = x.float()
    inv = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / d + eps)
    return (xf[:, :d] * inv * weight.float()).to(x.dtype)


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, EPS: float = 1e-6, BLOCK: int = 128,
                            FLOOR: float = 1e-4) -> dict:
    """The RMSNorm (model.md 2.2), then the FP8 activation quantiser's reference (model.md 2.7,
    2.10, 4.1: ``quantize_reference``); ``y`` the norm."""
    y = rms_norm_rows(x, weight, EPS)
    return {**quantize_reference(y, BLOCK, FLOOR), "y": y}


def _block(case) -> int:
    return case.get("BLOCK", 128)


def _rows(kind: str, t: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, weight) of one kind:

    * ``normal``: rows of magnitude 2^-20 .. 2^20, weights near 1;
    * ``zeros``: every other row zero, the others -0 in their first half;
    * ``floor``: rows of +-1 and weights whose magnitude per 32 channels is 0, 2^-20, a bf16 value
      either side of 1e-4, 448 x 2^-22 (the largest amax the floor's code covers) or the next bf16
      value above it: blocks at and just past the scale floor;
    * ``boundary``: rows of +-1 and weights +-2^k or +-448 x 2^k: block maxima where a code steps;
    * ``huge``: rows of magnitude 2^40 .. 2^126: the sum of squares overflows in most (rsqrt 0, the
      row quantises to zeros), not in the others;
    * ``tiny``: rows of magnitude 2^-149 .. 2^-70: the squares underflow, EPS alone is left.
    """
    x = torch.randn(t, d, generator=g)
    w = 1 + 0.1 * torch.randn(d, generator=g)
    sign = torch.where(torch.rand(t, d, generator=g) < 0.5, -1.0, 1.0)
    if kind == "normal":
        return x * torch.exp2(torch.randint(-20, 21, (t, 1), generator=g).float()), w
    if kind == "zeros":
        x[::2] = 0.0
        x[1::2, : d // 2] = -0.0
        return x, w
    if kind == "floor":
        levels = torch.tensor([0.0, 2.0 ** -20, 1.6328125 * 2.0 ** -14, 1.640625 * 2.0 ** -14,
                               1.75 * 2.0 ** -14, 1.7578125 * 2.0 ** -14])
        pick = torch.randint(0, len(levels), (-(-d // 32),), generator=g).repeat_interleave(32)[:d]
        return sign, levels[pick] * torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    if kind == "boundary":
        k = torch.randint(-20, 20, (d,), generator=g).float()
        base = torch.where(torch.rand(d, generator=g) < 0.5, FP8_MAX, 1.0)
        return sign, base * torch.exp2(k) * torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    if kind == "huge":
        return x.clamp(-1.5, 1.5) * torch.exp2(torch.randint(40, 127, (t, 1), generator=g).float()), w
    if kind == "tiny":
        return x * torch.exp2(torch.randint(-149, -69, (t, 1), generator=g).float()), w
    raise ValueError(f"unknown row kind {kind!r}")


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    nb = case.get("NB", -(-d // _block(case)))
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    out = {"q": torch.empty(t, d, dtype=torch.float8_e4m3fn, device=device),
           "scale": torch.empty(t, nb, dtype=torch.uint8, device=device),
           "y": torch.empty(t, d, dtype=dtype, device=device)}
    if device.type == "meta":
        return {"x": torch.empty(t, d, dtype=dtype, device=device),
                "weight": torch.empty(d, dtype=torch.bfloat16, device=device), **out}
    x, w = _rows(case.get("values", "normal"), t, d, torch.Generator().manual_seed(seed))
    return {"x": x.to(dtype).to(device), "weight": w.to(torch.bfloat16).to(device), **out}


def _tolerance(case, out):
    """The interpreter is exact (the module docstring); a GPU's rsqrt and sum order may move ``y``
    by one ulp (``rmsnorm``'s tolerance) and so a value by one e4m3 step (at most 1/8 of it, or
    2^-9 among subnormals); codes are exact."""
    if out == "y":
        return (1e-5, 1e-5) if case.get("dtype") == "f32" else (1.6e-2, 1.6e-2)
    return (E4M3_STEP, 0.125) if out == "q" else (0.0, 0.0)


def norm_quant_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The hidden-width norms that feed FP8 GEMMs (``ffn_norm`` before the experts, ``attn_norm``
    before ``wq_a`` / ``wkv``) at the decode token counts ``decode_t`` and a prefill chunk: D = the
    hidden size (4096 in V4, 5120 in V4.1), one code per ``fp8_block`` channels, the model's eps."""
    out: dict[str, shapes.Case] = {}
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        out[f"{m.short}/hidden/{phase}"] = {"T": t, "D": m.hidden, "NB": m.hidden // m.fp8_block,
                                            "BLOCK": m.fp8_block, "EPS": RMS_EPS[m.name], "model": m.name}
    return out


CASES = {
    "v4_t3_d4096": {"T": 3, "D": 4096},
    "v41_t2_d5120_b32": {"T": 2, "D": 5120, "BLOCK": 32, "EPS": 1e-20},
    "ragged_t17_d200_b32": {"T": 17, "D": 200, "BLOCK": 32},  # a last block of 8 channels
    "ragged_t13_d300": {"T": 13, "D": 300, "config": {"ROWS": 8, "SPLIT": 2}},  # 44 channels
    "zeros_t6_d512": {"T": 6, "D": 512, "values": "zeros"},
    "floor_t4_d384_b32": {"T": 4, "D": 384, "BLOCK": 32, "values": "floor"},
    "floor_t3_d512": {"T": 3, "D": 512, "values": "floor", "EPS": 1e-20},
    "boundary_t5_d256": {"T": 5, "D": 256, "values": "boundary"},
    "boundary_f32_t3_d96_b32": {"T": 3, "D": 96, "BLOCK": 32, "dtype": "f32", "values": "boundary"},
    "huge_t8_d256": {"T": 8, "D": 256, "values": "huge", "config": {"ROWS": 2, "SPLIT": 4}},
    "tiny_f32_t5_d160_b32": {"T": 5, "D": 160, "BLOCK": 32, "dtype": "f32", "values": "tiny"},
    "f32_t7_d96": {"T": 7, "D": 96, "dtype": "f32", "config": {"ROWS": 1, "SPLIT": 8}},
}

SPEC = register(Spec(
    kernel=rmsnorm_quant,
    reference=rmsnorm_quant_reference,
    make_inputs=_inputs,
    outputs=("q", "scale", "y"),
    cases=CASES,
    build_cases={"v4_hidden": {"T": 4096, "D": 4096},
                 "v41_hidden": {"T": 4096, "D": 5120, "BLOCK": 32, "EPS": 1e-20}},
    tolerance=_tolerance,
    constants_of=lambda case: {"BLOCK": _block(case), "EPS": case.get("EPS", 1e-6)},
    flops=lambda c: 6.0 * c["T"] * c["D"],
    bytes_moved=lambda c: c["T"] * c["D"] * (3 * (2 if c.get("dtype") != "f32" else 4) + 1)
    + c["T"] * -(-c["D"] // _block(c)) + 2 * c["D"],
    model_shapes=shapes.for_models(norm_quant_shapes),
    sweep={"T": Dim(1, 33, large=4099), "D": Dim(1, 450, large=8192), "BLOCK": OneOf(32, 128),
           "dtype": OneOf("bf16", "f32"), "EPS": OneOf(1e-6, 1e-20),
           "values": OneOf("normal", "zeros", "floor", "boundary", "huge", "tiny"),
           "config": {"ROWS": OneOf(1, 2, 4, 8), "SPLIT": OneOf(1, 2, 4, 8)}},
    # f32 rows of +-1 at EPS 1e-20 normalise to exactly 1: a maximum at 448 x 2^k, a knife edge for
    # a GPU's rsqrt (bf16 rows, and EPS 1e-6 with its rsqrt below 1, are not)
    sweep_valid=lambda c: not (c["dtype"] == "f32" and c["EPS"] < 1e-10 and c["values"] in ("floor", "boundary")),
))
