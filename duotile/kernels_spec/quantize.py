"""The FP8 activation quantiser in front of every FP8 / FP4-weight GEMM (model.md 2.7, 2.10, 4.1).

Per token and per ``BLOCK`` consecutive channels (128 in V4, 32 in V4.1):

    amax  = max(max |x|, 1e-4)
    s     = the smallest power of two with amax / s <= 448     (UE8M0: s = 2^(code - 127))
    q     = e4m3(clamp(x / s, -448, 448))                       (round to nearest, ties to even)

Outputs: ``q`` (T x D, e4m3) and ``scale`` (T x ceil(D / BLOCK), uint8): the UE8M0 exponent
*codes* (``2^(code - 127)``, torch's ``float8_e8m0fnu`` bits), not f32 scales. A last block cut
short by D holds the channels that exist (the rest count as zeros).

The scale is exact: it is computed from amax's exponent and mantissa bits, never with log2.
amax = 1.m x 2^e needs s = 2^(e - 8) when 1.m <= 1.75 (448 = 1.75 x 2^8) and 2^(e - 7) above, so
the code is ``E - 8`` or ``E - 7`` for amax's biased exponent E. q multiplies by 1 / s, itself
built from bits, a power of two (exact, like the division it stands for). Since amax / s <= 448,
the clamp never binds on a finite block.

Non-finite input (decided here, the same on every target): a block holding a NaN or an Inf has
scale code 255 (UE8M0's NaN) and q = x * 0: +-0 for its finite values, NaN for its NaN and +-Inf
ones; dequantising gives NaN across the block, so a bad activation is never silently clipped. The
block test reads bits (a NaN's magnitude bits sort above Inf's), so it does not rest on a target's
NaN rules for max or comparisons. The other blocks of the row are unaffected.

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
from .ue8m0 import INF_BITS, MAGNITUDE, f32_bits, fp8_block_code

__all__ = ["INF_BITS", "MAGNITUDE", "f32_bits", "quantize", "quantize_reference"]  # kv_insert reads these

FP8_MAX = 448.0
NAN_CODE = 255  # UE8M0 code of a block with a NaN or an Inf


@dsl.kernel(batch_dim="T", bucketed=("T",))
def quantize(x: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], q: dsl.Tensor["T", "D", dsl.f8e4m3],
             scale: dsl.Tensor["T", "NB", dsl.u8], *,
             BLOCK: dsl.Const = 128, FLOOR: dsl.Const = 1e-4,
             ROWS: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16), BLOCKS: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    if not 2.0 ** -118 <= FLOOR <= FP8_MAX:
        raise dsl.DslError(f"FLOOR {FLOOR} out of range: the scale codes assume 2^-118 <= FLOOR <= 448")
    floor = f32_bits(FLOOR)
    for t, n in dsl.grid(dsl.cdiv(x.T, ROWS), dsl.cdiv(x.D, BLOCK * BLOCKS)):
        for g in dsl.range(BLOCKS):
            col = (n * BLOCKS + g) * BLOCK
            xt = dsl.load(x[t * ROWS, col], (ROWS, BLOCK)).to(dsl.f32)
            code, inv, _ = fp8_block_code(xt, floor, NAN_CODE)
            dsl.store(q[t * ROWS, col], (xt * inv[:, None]).to(dsl.f8e4m3))
            dsl.store(scale[t * ROWS, n * BLOCKS + g], code[:, None].to(dsl.u8))


def quantize_reference(x: torch.Tensor, BLOCK: int = 128, FLOOR: float = 1e-4) -> dict:
    """From model.md's formulas, with the runtime's UE8M0 and e4m3 rounding (runtime/quant.py)."""
    t, d = x.shape
    nb = -(-d // BLOCK)
    padded = torch.zeros(t, nb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :d] = x.float()
    blocks = padded.view(t, nb, BLOCK)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    amax = torch.where(finite, blocks.abs().amax(-1, keepdim=True), 1.0).clamp(min=FLOOR)
    s = quant.ue8m0_scale(amax, FP8_MAX)
    values = torch.where(finite, quant.fp8_round(blocks / s), blocks * 0.0)  # non-finite block: x * 0
    codes = torch.where(finite, s.to(torch.float8_e8m0fnu).view(torch.uint8), NAN_CODE)
    return {"q": values.flatten(1)[:, :d].to(torch.float8_e4m3fn), "scale": codes.squeeze(-1)}


def _block(case) -> int:
    return case.get("BLOCK", case["D"] // case["NB"] if "NB" in case else 128)


def _values(kind: str, t: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Activations of one kind: ``normal`` (a magnitude of 2^-20..2^20 per row), ``zeros`` (every
    other row zero: all-zero blocks hit the floor), ``pow2`` (powers of two and 448 x 2^k, where a
    scale must not round up), ``huge`` (up to the f32 and bf16 maxima), ``tiny`` (down to f32
    subnormals: under the floor)."""
    x = torch.randn(t, d, generator=g)
    if kind == "normal":
        return x * torch.exp2(torch.randint(-20, 21, (t, 1), generator=g).float())
    if kind == "zeros":
        x[::2] = 0.0
        x[1::2, : d // 2] = -0.0
        return x
    if kind == "pow2":
        k = torch.randint(-30, 30, (t, d), generator=g).float()
        base = torch.where(torch.rand(t, d, generator=g) < 0.5, 1.0, FP8_MAX)
        return torch.where(x < 0, -1.0, 1.0) * base * torch.exp2(k)
    if kind == "huge":
        return x.clamp(-2.0, 2.0) * 1.5e38  # up to 3e38: finite in f32 and bf16
    if kind == "tiny":
        return x * torch.exp2(torch.randint(-149, -12, (t, 1), generator=g).float())
    raise ValueError(f"unknown value kind {kind!r}")


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    t, d = case["T"], case["D"]
    nb = case.get("NB", -(-d // _block(case)))
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    x = _values(case.get("values", "normal"), t, d, g).to(dtype)
    return {"x": x.to(device), "q": torch.empty(t, d, dtype=torch.float8_e4m3fn, device=device),
            "scale": torch.empty(t, nb, dtype=torch.uint8, device=device)}


SPEC = register(Spec(
    kernel=quantize,
    reference=quantize_reference,
    make_inputs=_inputs,
    outputs=("q", "scale"),
    cases={"t3_d4096": {"T": 3, "D": 4096}, "t5_d1024_b32": {"T": 5, "D": 1024, "BLOCK": 32},
           "zeros": {"T": 6, "D": 512, "values": "zeros"}, "pow2": {"T": 7, "D": 256, "values": "pow2"},
           "pow2_b32": {"T": 4, "D": 320, "BLOCK": 32, "values": "pow2"},
           "huge_f32": {"T": 3, "D": 256, "dtype": "f32", "values": "huge"},
           "huge_bf16": {"T": 2, "D": 384, "values": "huge"},
           "tiny_f32": {"T": 9, "D": 128, "dtype": "f32", "values": "tiny"},
           "ragged_t17_d200": {"T": 17, "D": 200, "BLOCK": 32},  # a last block of 8 channels
           "ragged_t13_d300": {"T": 13, "D": 300, "config": {"ROWS": 8, "BLOCKS": 2}}},
    build_cases={"v4_hidden": {"T": 4096, "D": 4096}, "v41_hidden": {"T": 4096, "D": 5120, "BLOCK": 32}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    constants_of=lambda case: {"BLOCK": _block(case)},
    bytes_moved=lambda c: c["T"] * c["D"] * (3 if c.get("dtype") != "f32" else 5) + c["T"] * -(-c["D"] // _block(c)),
    model_shapes=shapes.for_models(shapes.act_quant_shapes),
    sweep={"T": Dim(1, 67, large=4099), "D": Dim(1, 700, large=16384), "BLOCK": OneOf(32, 128),
           "dtype": OneOf("bf16", "f32"), "values": OneOf("normal", "zeros", "pow2", "huge", "tiny"),
           "config": {"ROWS": OneOf(1, 2, 4, 8, 16), "BLOCKS": OneOf(1, 2, 4)}},
))
