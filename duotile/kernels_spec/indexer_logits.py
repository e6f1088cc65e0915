"""The lightning indexer's logits at decode (model.md 2.5.5, 2.13, 5.4): one query token per
sequence, ``H`` index heads of width ``D`` against the sequence's own ``L`` index-key rows,

    s_j = sum_h w_h * relu(q_h . k_j)    for j < (P + 1) // RATIO,    -inf otherwise

where ``P`` is the query's 0-based position (``pos``, one per sequence) and ``RATIO`` the layer's
compress ratio (a compressed row is visible once its window is complete). V4-Flash: 64 heads,
ratio 4 (CSA layers). V4.1-Flash: 32 heads, ratio 2 (layers 2, 8, 14) or 1 (layer 20 and the
Reindex layers, which score layer 20's keys). Both: D = 128; ``w`` carries the weights already
scaled by ``D^-0.5 * H^-0.5`` (the runtime's ``wts``). The keys are the cache's rows, ``L`` a
sequence (the batch's longest: rows past a sequence's visible count are scored -inf whatever
they hold). Output: ``logits`` (B, L) f32, -inf for every invisible row, so a sequence with no
visible row (P + 1 < RATIO) gets a row of -inf.

Keys are bf16 rows, or FP8 rows (model.md 3.1's FP8 index key: 128 e4m3 values and an f32 scale
a row, ``k_scale``): the e4m3 tile is widened to bf16 (exactly) for the same bf16 gemm, and each
row's dots are multiplied by its scale before the ReLU. Or MXFP4 rows as the cache stores them
(model.md 3.4's index key, u8 ``k``, rows of R >= D / 2 + D / 32 bytes: D e2m1 codes two a byte,
then a UE8M0 code per 32; 68 bytes at D = 128), decoded by ``dsl.mxfp4_values`` into the same bf16
operand, exactly. The prefill form (a chunk of queries of one sequence) is not written.

A block scores ``NB`` consecutive tiles of ``BN`` rows of one sequence: one gemm
``k_tile @ q^T`` (BN x H, f32) a tile, ReLU, times ``w`` per head, summed over the heads (the
row reduction of the tile), then the mask. The query tile and ``w`` are loaded once a block.
``pos`` is read as a one-element tile, broadcast against the tile's row indices in the mask.
Every row's sum runs over its own heads inside one block, so a sequence's logits do not depend
on the batch (``B`` is the batch dimension) and one build serves every ``B`` and ``L``.

Tolerance (``_error_bound``): the reference runs in float64. The kernel's bf16 products are
exact in f32; the D-term dot and the H-term sum round in f32 in whatever order a target sums
them, so |error| <= gamma * sum_h |w_h| sum_d |q_hd k_jd| with gamma = 2 (D + H + 3) 2^-24
(twice the textbook (n) u bound, for tensor cores that truncate instead of rounding; one more
rounding for an FP8 row's scale; k the dequantised keys), plus
2^-24 relative for the f32 output and an absolute 1e-30 for flushed subnormal products. ReLU is
1-Lipschitz, so a dot that lands on the other side of 0 stays inside the same bound. Logits of
small-integer inputs ("ints", the ties cases) are exact on every target: every partial sum is an
integer below 2^24.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.ops import MXFP4_BLOCK
from . import model_shapes as shapes
from .moe_gemm_mxfp4 import fp4_values
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")


MIN_HEADS = 16  # the least width of the dots tile (the heads, padded)


@dsl.kernel(batch_dim="B", dynamic=("B", "L"))
def indexer_logits(q: dsl.Tensor["B", "H", "D", dsl.bf16], w: dsl.Tensor["B", "H", dsl.f32],
                   k: dsl.Tensor["B", "L", "R", dsl.bf16 | dsl.f8e4m3 | dsl.u8], pos: dsl.Tensor["B", dsl.i32],
                   logits: dsl.Tensor["B", "L", dsl.f32],
                   k_scale: dsl.OptionalTensor["B", "L", dsl.f32] = None, *,
                   RATIO: dsl.Const = 4,
                   BN: dsl.Tunable = dsl.choice(64, 32, 128),
                   NB: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16),
                   STAGES: dsl.Tunable = dsl.int_range(1, 3, default=2)):
    if not (isinstance(RATIO, int) and RATIO >= 1):
        raise dsl.DslError(f"RATIO {RATIO!r} must be a positive int (a compress ratio)")
    # fewer heads than MIN_HEADS (a small model's 2) are padded with zero queries of weight 0,
    # which add exact zeros: the dots tile keeps a width the tensor cores' instructions take
    H, D = dsl.maximum(q.H, MIN_HEADS), q.D
    packed = k.dtype == dsl.u8  # MXFP4 rows as stored
    require_key_rows(k, D)
    for b, g in dsl.grid(q.B, dsl.cdiv(dsl.cdiv(k.L, BN), NB)):
        q_tile = dsl.load(q[b, 0, 0], (H, D), role="operand")
        wts = dsl.load(w[b, 0], (H,))
        visible = (dsl.load(pos[b], (1,)) + 1) // RATIO  # rows of this sequence's window count
        for i in dsl.pipelined(NB, stages=STAGES):
            row = (g * NB + i) * BN
            if packed:
                k_tile = dsl.mxfp4_values(dsl.load(k[b, row, 0], (BN, D // 2), role="operand"),
                                          dsl.load(k[b, row, D // 2], (BN, D // MXFP4_BLOCK), role="operand"))
            elif k_scale is None:
                k_tile = dsl.load(k[b, row, 0], (BN, D), role="operand")
            else:  # FP8 rows: e4m3 values are exact in bf16 (a bf16 gemm), the scale comes after it
                k_tile = dsl.load(k[b, row, 0], (BN, D)).to(dsl.bf16)
            dots = dsl.zeros((BN, H), dsl.f32, role="accumulator")
            dsl.gemm(k_tile, q_tile, dots, transpose_b=True)
            if k_scale is not None:
                dots = dots * dsl.load(k_scale[b, row], (BN,))[:, None]
            s = (dsl.maximum(dots, 0.0) * wts[None, :]).sum(axis=1)
            dsl.store(logits[b, row], dsl.where(row + dsl.arange(BN) < visible, s, NEG_INF))


def require_key_rows(k, D) -> None:
    """``k``'s rows (R wide) hold D values: bf16 rows of exactly D, or MXFP4 rows as stored (u8) of
    at least D / 2 bytes of e2m1 pairs and their D / 32 codes (a shorter row would read zeros)."""
    if k.dtype == dsl.u8:
        dsl.require(k.R >= D // 2 + D // MXFP4_BLOCK,
                    "k's MXFP4 rows (R bytes) are short of D / 2 bytes of e2m1 pairs and their D / 32 codes")
    else:  # (sizes compare as symbols: == would be False before binding)
        for cond in (k.R >= D, k.R <= D):
            dsl.require(cond, "k's rows must hold D values, as the queries' rows do")


def _keys(k: torch.Tensor, k_scale: torch.Tensor | None, lo: int, hi: int, d: int) -> torch.Tensor:
    """Rows lo .. hi-1 of the keys in float64: FP8 rows times their scale (model.md 3.1), MXFP4 rows
    (u8) decoded (3.4)."""
    if k.dtype == torch.uint8:
        return mxfp4_key_values(k[:, lo:hi], d)
    rows = k[:, lo:hi].double()
    return rows if k_scale is None else rows * k_scale[:, lo:hi].double()[:, :, None]


def mxfp4_key_values(rows: torch.Tensor, d: int) -> torch.Tensor:
    """MXFP4 key rows as stored (u8 [..., >= d / 2 + d / 32]) in float64: each e2m1 value (the even
    element in a byte's low nibble) times 2^(code - 127) of its 32 (NaN at code 255)."""
    codes = rows[..., d // 2 : d // 2 + d // MXFP4_BLOCK]
    scale = torch.where(codes == 255, torch.nan, torch.exp2(codes.double() - 127))
    return fp4_values(rows[..., : d // 2]) * scale.repeat_interleave(MXFP4_BLOCK, -1)


def indexer_logits_reference(q, w, k, pos, k_scale=None, RATIO: int = 4) -> dict:
    """model.md 2.5.5 in float64, rounded once to f32: per sequence b and row j,
    sum_h w[b, h] * relu(q[b, h] . k[b, j]) where j < (pos[b] + 1) // RATIO, else -inf; FP8 keys
    are dequantised first (value times the row's scale). Rows are taken in chunks so that a
    model-sized call (64 sequences of 262,144 rows) fits a GPU."""
    b, h, _ = q.shape
    rows = k.shape[1]
    q64, w64 = q.double(), w.double()
    out = torch.empty(b, rows, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, b * h))
    for lo in range(0, rows, chunk):
        dots = torch.einsum("bhd,bld->bhl", q64, _keys(k, k_scale, lo, lo + chunk, q.shape[-1]))
        out[:, lo:lo + chunk] = (dots.clamp(min=0) * w64[:, :, None]).sum(1).float()
    visible = torch.div(pos.long() + 1, RATIO, rounding_mode="floor")
    cols = torch.arange(rows, device=q.device)
    return {"logits": out.masked_fill(cols[None, :] >= visible[:, None].to(q.device), NEG_INF)}


def _error_bound(case, output, inputs) -> torch.Tensor:
    """gamma * sum_h |w_h| sum_d |q_hd| |k_jd| (the module docstring), as |k| times the per-sequence
    vector sum_h |w_h| |q_h| (cheap at every size)."""
    q, w, k, k_scale = inputs["q"], inputs["w"], inputs["k"], inputs.get("k_scale")
    gamma = 2.0 * (q.shape[2] + q.shape[1] + 3) * 2.0 ** -24  # (+1: an FP8 row's scale multiply)
    v = (w.double().abs()[:, :, None] * q.double().abs()).sum(1)  # (B, D)
    bound = torch.empty(k.shape[:2], dtype=torch.float64, device=k.device)
    chunk = max(1, (1 << 24) // max(1, k.shape[0] * q.shape[2]))
    for lo in range(0, k.shape[1], chunk):
        bound[:, lo:lo + chunk] = torch.einsum("bld,bd->bl", _keys(k, k_scale, lo, lo + chunk, q.shape[2]).abs(), v)
    return (gamma * bound).float()


def _positions(case, b: int, g: torch.Generator) -> torch.Tensor:
    """Each sequence's position. ``visible`` "mixed" cycles through: no visible row
    (P = RATIO - 2, or P = 0 at ratio 1: one row), a single visible row, a random count, every
    row, and a position past the rows (more visible than the L the cache holds); "all": every row
    visible; an int: that many rows visible in every sequence."""
    ratio, rows, kind = case.get("RATIO", 4), case["L"], case.get("visible", "mixed")
    if isinstance(kind, int):  # the last position that sees `kind` rows (ratio 1 sees at least one)
        return torch.full((b,), max(0, (kind + 1) * ratio - 2), dtype=torch.int32)
    if kind == "all":
        return torch.full((b,), rows * ratio + ratio - 1, dtype=torch.int32)
    pos = []
    for i in range(b):
        pick = i % 5
        if pick == 0:
            p = max(0, ratio - 2)
        elif pick == 1:
            p = max(0, 2 * ratio - 2)  # one row
        elif pick == 2:
            p = int(torch.randint(0, rows * ratio + ratio, (1,), generator=g))
        elif pick == 3:
            p = rows * ratio + ratio - 1
        else:
            p = (rows + 7) * ratio + 3
        pos.append(p)
    return torch.tensor(pos, dtype=torch.int32)


def _inputs(case, device, seed):
    b, h, rows, d = case["B"], case["H"], case["L"], case["D"]
    out = {"logits": torch.full((b, rows), float("nan"), dtype=torch.float32, device=device)}
    fp8, mxfp4 = case.get("dtype") == "f8e4m3", case.get("dtype") == "mxfp4"
    if fp8:
        out["k_scale"] = torch.empty(b, rows, dtype=torch.float32, device=device)
    if device.type == "meta":
        k_dtype = torch.float8_e4m3fn if fp8 else (torch.uint8 if mxfp4 else torch.bfloat16)
        width = d // 2 + d // MXFP4_BLOCK if mxfp4 else d
        return {"q": torch.empty(b, h, d, dtype=torch.bfloat16, device=device),
                "w": torch.empty(b, h, dtype=torch.float32, device=device),
                "k": torch.empty(b, rows, width, dtype=k_dtype, device=device),
                "pos": torch.empty(b, dtype=torch.int32, device=device), **out}
    # model-sized keys (up to 4 GiB) are drawn where they are used: a CUDA generator on a GPU
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gen_device).manual_seed(seed)
    g_cpu = torch.Generator().manual_seed(seed)
    if case.get("values", "normal") == "ints":  # small integers and powers of two: exact sums, ties
        q = torch.randint(-1, 2, (b, h, d), generator=g, device=gen_device).to(torch.bfloat16)
        k = torch.randint(-2, 3, (b, rows, d), generator=g, device=gen_device).to(torch.bfloat16)
        w = torch.exp2(torch.randint(-3, 2, (b, h), generator=g, device=gen_device).float())
        w = w * (torch.rand(b, h, generator=g, device=gen_device) < 0.8)  # some heads weigh 0
        if rows > 3:
            k[:, 3] = k[:, 1]  # an exact tie between two rows
    else:
        q = torch.randn(b, h, d, generator=g, device=gen_device, dtype=torch.bfloat16)
        k = torch.randn(b, rows, d, generator=g, device=gen_device, dtype=torch.bfloat16)
        # the model's weights are (x @ weights_proj^T) * D^-0.5 * H^-0.5, either sign
        w = torch.randn(b, h, generator=g, device=gen_device) * (d * h) ** -0.5
    if fp8:  # model.md 3.1's FP8 index-key row: 128 e4m3 values and an f32 scale, amax / 448
        scale = (k.abs().amax(-1).float() / 448.0).clamp(min=2.0 ** -120)
        out["k_scale"] = scale.to(device)
        k8 = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device=k.device)
        step = 1 << 16  # rows at a time: no f32 copy of 1M-row keys
        for lo in range(0, rows, step):
            k8[:, lo:lo + step] = (k[:, lo:lo + step].float() / scale[:, lo:lo + step, None]).to(k8.dtype)
        k = k8
    if mxfp4:  # model.md 3.4's index-key row as the cache stores it: e2m1 pairs, then UE8M0 codes
        from .quantize_fp4 import quantize_fp4_reference

        enc = quantize_fp4_reference(k.reshape(b * rows, d), "mxfp4")
        k = torch.cat([enc["q"], enc["scale"]], -1).reshape(b, rows, -1)
    return {"q": q.to(device), "w": w.to(device), "k": k.to(device),
            "pos": _positions(case, b, g_cpu).to(device), **out}


def indexer_shapes(m: shapes.ModelDims) -> dict[str, dict]:
    """Decode scoring at the compressed rows the indexed layers see: every index ratio of the model
    (V4: 4; V4.1: 2 and 1) at contexts of 4K, 64K and 1M tokens (L = context / ratio), for the
    decode batches 1, 4, 16 and 64, leaving out calls whose bf16 keys pass 4 GiB (2^24 rows of
    128: a GPU test holds several calls at once); and FP8 keys at 1M context for 1 and 16
    sequences."""
    ratios = (4,) if m.name == "v4-flash" else (2, 1)
    out: dict[str, dict] = {}
    for ratio in ratios:
        for context in (4096, 1 << 16, shapes.CONTEXT):
            rows = context // ratio
            for b in (1, 4, 16, 64):
                if b * rows > 1 << 24:
                    continue
                label = f"{context >> 20}m" if context >= 1 << 20 else f"{context >> 10}k"
                out[f"{m.short}/r{ratio}_ctx{label}/decode{b}"] = {
                    "B": b, "H": m.index_heads, "L": rows, "D": m.index_head_dim, "RATIO": ratio,
                    "model": m.name}
        for b in (1, 16):  # FP8 keys with a row scale (model.md 3.1), and MXFP4 keys as stored, at 1M context
            for kind in ("fp8", "mxfp4"):
                out[f"{m.short}/r{ratio}_ctx1m_{kind}/decode{b}"] = {
                    "B": b, "H": m.index_heads, "L": shapes.CONTEXT // ratio, "D": m.index_head_dim, "RATIO": ratio,
                    "dtype": "f8e4m3" if kind == "fp8" else "mxfp4", "model": m.name}
    return out


SMALL = {"BN": 32, "NB": 2, "STAGES": 1}


def _key_bytes(c) -> float:
    """A key row's bytes: bf16, FP8 with its f32 scale, or MXFP4 as stored."""
    d = c["D"]
    return {"f8e4m3": d + 4.0, "mxfp4": d / 2 + d / MXFP4_BLOCK}.get(c.get("dtype"), 2.0 * d)
SPEC = register(Spec(
    kernel=indexer_logits,
    reference=indexer_logits_reference,
    make_inputs=_inputs,
    outputs=("logits",),
    cases={
        # five sequences: no visible row, one, a random count, all, past the end (V4: 64 heads)
        "v4_mixed": {"B": 5, "H": 64, "L": 150, "D": 128, "RATIO": 4, "config": SMALL},
        # V4.1's 32 heads, ratio 2 and 1, a ragged last tile
        "v41_r2_ragged": {"B": 3, "H": 32, "L": 77, "D": 128, "RATIO": 2, "config": SMALL},
        # a small model's 2 heads: padded to MIN_HEADS with zero queries of weight 0
        "few_heads": {"B": 3, "H": 2, "L": 70, "D": 64, "RATIO": 2, "config": SMALL},
        "v41_r1": {"B": 4, "H": 32, "L": 64, "D": 128, "RATIO": 1, "visible": "all"},
        # every sequence sees exactly 0 (all -inf) / 5 rows
        "none_visible": {"B": 2, "H": 64, "L": 40, "D": 128, "RATIO": 4, "visible": 0, "config": SMALL},
        "few_visible": {"B": 3, "H": 32, "L": 100, "D": 128, "RATIO": 2, "visible": 5, "config": SMALL},
        # small integers: exact logits, tied rows (row 3 repeats row 1), heads of weight 0
        "ties_ints": {"B": 3, "H": 64, "L": 50, "D": 128, "RATIO": 4, "values": "ints", "visible": "all",
                      "config": {**SMALL, "NB": 1}},
        # one row, a block of one tile, more tiles a block than the rows need
        "one_row": {"B": 2, "H": 32, "L": 1, "D": 128, "RATIO": 1, "visible": "all"},
        # FP8 index keys with a scale per row (model.md 3.1's alternative to MXFP4)
        "fp8_keys_v4": {"B": 5, "H": 64, "L": 90, "D": 128, "RATIO": 4, "dtype": "f8e4m3", "config": SMALL},
        "fp8_keys_v41": {"B": 2, "H": 32, "L": 130, "D": 128, "RATIO": 1, "dtype": "f8e4m3", "visible": "all"},
        # MXFP4 index keys as the cache stores them (model.md 3.4: 68-byte rows at D = 128)
        "mxfp4_keys_v41": {"B": 3, "H": 32, "L": 100, "D": 128, "RATIO": 2, "dtype": "mxfp4", "config": SMALL},
        "mxfp4_keys_few_heads": {"B": 2, "H": 2, "L": 70, "D": 64, "RATIO": 1, "dtype": "mxfp4", "visible": "all",
                                 "config": SMALL},
    },
    build_cases={"v4_1m_decode16": {"B": 16, "H": 64, "L": 262144, "D": 128, "RATIO": 4},
                 "v41_r1_1m_decode4": {"B": 4, "H": 32, "L": 1 << 20, "D": 128, "RATIO": 1}},
    tolerance=lambda case, out: (1e-30, 2.0 ** -24),
    extra_error=_error_bound,
    constants_of=lambda case: {"RATIO": case.get("RATIO", 4)},
    flops=lambda c: 2.0 * c["B"] * c["H"] * c["L"] * c["D"],
    bytes_moved=lambda c: c["B"] * (_key_bytes(c) * c["L"] + 4.0 * c["L"] + 2.0 * c["H"] * c["D"] + 4.0 * c["H"]),
    model_shapes=shapes.for_models(indexer_shapes),
    sweep={"B": Dim(1, 6, large=64), "H": OneOf(32, 64, 2), "L": Dim(1, 300, large=70000), "D": OneOf(64, 128),
           "RATIO": OneOf(1, 2, 4), "values": OneOf("normal", "normal", "ints"),
           "dtype": OneOf("bf16", "f8e4m3", "mxfp4"),
           "config": {"BN": OneOf(32, 64), "NB": OneOf(1, 2, 4), "STAGES": OneOf(1, 2)}},
))
