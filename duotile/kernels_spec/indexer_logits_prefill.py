"""The lightning indexer's logits over a prefill chunk (model.md 2.5.5, 2.13, 5.4): ``T`` query tokens
of one sequence, ``H`` index heads of width ``D`` each, against the sequence's ``N`` index-key rows,
which every query of the chunk reads:

    logits[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])    for j < (pos[t] + 1) // RATIO,  -inf otherwise

``pos[t]`` is query t's 0-based position (i32, one a query: consecutive in a chunk, but any values are
allowed, repeats included) and ``RATIO`` the layer's compress ratio. V4-Flash: 64 heads, ratio 4;
V4.1-Flash: 32 heads, ratio 2 or 1. Both: D = 128, ``w`` already scaled by ``D^-0.5 * H^-0.5``. Keys
are bf16 rows or MXFP4 rows as the cache stores them (u8, rows of R >= D / 2 + D / 32 bytes: e2m1
pairs, then a UE8M0 code per 32 values; 68 bytes at D = 128), decoded by ``dsl.mxfp4_values`` into
the same bf16 operand, exactly. The decode form is ``indexer_logits.py`` (each query its own keys).

A block takes ``BM`` queries and ``NB`` consecutive tiles of ``BN`` key rows. Its queries' tiles
(H x D each) and weights are loaded once; each key tile is loaded (and decoded) once for the BM
queries, and every query runs the decode form's arithmetic on it: one gemm ``k_tile @ q_t^T``
(BN x H, f32), ReLU, times ``w_t`` per head, summed over the heads (the row reduction of the tile),
then the mask. A query's logits are therefore those of the decode form at the same ``BN``, bit for
bit on any target that runs both, whatever ``BM``, ``T`` or the chunk around it (batch dim ``T``).
The queries share the key tile but not the gemm: the head sum of a flattened (BM x H)-wide gemm
(DeepGEMM's ``fp8_mqa_logits``, TileLang's DeepSeek-V3.2 indexer) needs a reshape of the
accumulator the DSL has no op for.

Causal skipping: a block computes only its key tiles some query of the block sees, ``steps`` of its
NB (``max_t (pos[t] + 1) // RATIO`` read from data, a loop ``stop``); the tiles after those are
written -inf without a gemm (a second loop, its first tile an index read from data). A chunk of T
consecutive positions ending at the keys' end skips about ``T^2 / (2 RATIO)`` of its ``T N`` scores
(half of them for a sequence's first chunk, little at long context); ``skipped_fraction`` counts it.

Tolerance: the decode form's (``indexer_logits._error_bound``, per query): f32 sums of exact bf16
products, |error| <= 2 (D + H + 3) 2^-24 sum_h |w_th| sum_d |q_thd k_jd|, plus 2^-24 relative and
1e-30 absolute; small-integer inputs ("ints") are exact.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.ops import MXFP4_BLOCK
from . import model_shapes as shapes
from .indexer_logits import MIN_HEADS, NEG_INF, mxfp4_key_values, require_key_rows
from .quantize_fp4 import quantize_fp4_reference
from .registry import Dim, OneOf, Spec, register


def _key_tile(k, row, rows, d):
    """``rows`` key rows from ``row`` on as the bf16 gemm operand: bf16 values as they are, MXFP4 rows
    as stored (u8) decoded exactly by ``dsl.mxfp4_values``."""
    if k.dtype == dsl.u8:
        return dsl.mxfp4_values(dsl.load(k[row, 0], (rows, d // 2), role="operand"),
                                dsl.load(k[row, d // 2], (rows, d // MXFP4_BLOCK), role="operand"))
    return dsl.load(k[row, 0], (rows, d), role="operand")


@dsl.kernel(batch_dim="T", dynamic=("T", "N"))
def indexer_logits_prefill(q: dsl.Tensor["T", "H", "D", dsl.bf16], w: dsl.Tensor["T", "H", dsl.f32],
                           k: dsl.Tensor["N", "R", dsl.bf16 | dsl.u8], pos: dsl.Tensor["T", dsl.i32],
                           logits: dsl.Tensor["T", "N", dsl.f32], *,
                           RATIO: dsl.Const = 4,
                           BM: dsl.Tunable = dsl.choice(4, 1, 2, 8),
                           BN: dsl.Tunable = dsl.choice(64, 32, 128),
                           NB: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16),
                           STAGES: dsl.Tunable = dsl.int_range(1, 3, default=2)):
    if not (isinstance(RATIO, int) and RATIO >= 1):
        raise dsl.DslError(f"RATIO {RATIO!r} must be a positive int (a compress ratio)")
    H, D = dsl.maximum(q.H, MIN_HEADS), q.D  # fewer heads are padded with zero queries of weight 0
    require_key_rows(k, D)
    for m, g in dsl.grid(dsl.cdiv(q.T, BM), dsl.cdiv(dsl.cdiv(k.N, BN), NB)):
        first = g * NB * BN  # the block's first key row
        queries = [m * BM + i for i in range(BM)]
        q_tiles = [dsl.load(q[t, 0, 0], (H, D), role="operand") for t in queries]
        wts = [dsl.load(w[t, 0], (H,)) for t in queries]
        # rows each query sees (a query past T reads pos -1: none)
        visible = [(dsl.load(pos[t], (1,), other=-1.0) + 1) // RATIO for t in queries]
        seen = visible[0]
        for v in visible[1:]:
            seen = dsl.maximum(seen, v)
        # the block's tiles some query sees: the first `steps` of its NB
        steps = dsl.minimum(dsl.maximum((seen - first + (BN - 1)) // BN, 0), NB)
        for i in dsl.pipelined(NB, stages=STAGES, stop=steps):
            row = first + i * BN
            k_tile = _key_tile(k, row, BN, D)
            for t, q_tile, wt, vis in zip(queries, q_tiles, wts, visible):
                dots = dsl.zeros((BN, H), dsl.f32, role="accumulator")
                dsl.gemm(k_tile, q_tile, dots, transpose_b=True)
                s = (dsl.maximum(dots, 0.0) * wt[None, :]).sum(axis=1)
                dsl.store(logits[t, row], dsl.where(row + dsl.arange(BN) < vis, s, NEG_INF))
        # the tiles no query of the block sees (steps .. NB - 1): no gemm, the same mask (every row
        # -inf; as a map of the row index, which CUDA stores element by element in bounds, where a
        # copy of a filled buffer into the dynamic-width row fails in TileLang 0.1.15)
        unseen = first + dsl.scalar(steps) * BN
        for j in dsl.range(NB, stop=NB - steps):
            row = unseen + j * BN
            for t, vis in zip(queries, visible):
                dsl.store(logits[t, row], dsl.where(row + dsl.arange(BN) < vis, 0.0, NEG_INF))


def _keys(k: torch.Tensor, lo: int, hi: int, d: int) -> torch.Tensor:
    """Key rows lo .. hi-1 in float64: bf16 values, or MXFP4 rows (u8) decoded (model.md 3.4)."""
    return mxfp4_key_values(k[lo:hi], d) if k.dtype == torch.uint8 else k[lo:hi].double()


KEY_RANGE = 1 << 16  # key rows the reference decodes at once
PRODUCTS = 1 << 24  # float64 products the reference holds at once


def _ranges(t: int, n: int, per: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Row ranges (j0, j1) of at most ``KEY_RANGE`` key rows, each with the query ranges (t0, t1)
    whose float64 products (``per`` a query and row) stay within ``PRODUCTS``: a key range is read
    (and decoded) once for every query."""
    cols = max(1, min(n, KEY_RANGE))
    rows = max(1, PRODUCTS // max(1, per * cols))
    return [(j0, min(n, j0 + cols), [(t0, min(t, t0 + rows)) for t0 in range(0, t, rows)])
            for j0 in range(0, n, cols)]


def indexer_logits_prefill_reference(q, w, k, pos, RATIO: int = 4) -> dict:
    """model.md 2.5.5 in float64, rounded once to f32: for query t and key row j,
    sum_h w[t, h] * relu(q[t, h] . k[j]) where j < (pos[t] + 1) // RATIO, else -inf. Queries and
    rows are taken in ranges (``_ranges``): a chunk of 4,096 queries over 262,144 rows fits a GPU,
    and each range of rows is decoded once."""
    t, h, d = q.shape
    n = k.shape[0]
    q64, w64 = q.double(), w.double()
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    for j0, j1, queries in _ranges(t, n, h):
        keys = _keys(k, j0, j1, d)
        for t0, t1 in queries:
            dots = torch.einsum("thd,nd->thn", q64[t0:t1], keys)
            out[t0:t1, j0:j1] = (dots.clamp(min=0) * w64[t0:t1, :, None]).sum(1).float()
    visible = torch.div(pos.long() + 1, RATIO, rounding_mode="floor").to(q.device)
    cols = torch.arange(n, device=q.device)
    return {"logits": out.masked_fill(cols[None, :] >= visible[:, None], NEG_INF)}


def _error_bound(case, output, inputs) -> torch.Tensor:
    """The decode form's bound a query at a time: gamma * sum_h |w_th| sum_d |q_thd| |k_jd|, as
    |k| times the per-query vector sum_h |w_th| |q_th|."""
    q, w, k = inputs["q"], inputs["w"], inputs["k"]
    t, h, d = q.shape
    gamma = 2.0 * (d + h + 3) * 2.0 ** -24
    v = (w.double().abs()[:, :, None] * q.double().abs()).sum(1)  # (T, D)
    bound = torch.empty(t, k.shape[0], dtype=torch.float64, device=k.device)
    for j0, j1, queries in _ranges(t, k.shape[0], 1):
        keys = _keys(k, j0, j1, d).abs().T
        for t0, t1 in queries:
            bound[t0:t1, j0:j1] = v[t0:t1] @ keys
    return (gamma * bound).float()


def skipped_fraction(pos: torch.Tensor, n: int, ratio: int, bm: int, bn: int, nb: int) -> float:
    """The share of a call's (query, key) scores in tiles the kernel skips (no gemm): the block's
    tiles past every one of its queries' visible rows, counted as the kernel counts them."""
    vis = torch.div(pos.long() + 1, ratio, rounding_mode="floor")
    t = pos.shape[0]
    pad = -(-t // bm) * bm - t
    seen = torch.cat([vis, vis.new_full((pad,), 0)]).view(-1, bm).amax(1)  # (blocks,)
    span = nb * bn
    groups = -(-n // span)
    firsts = torch.arange(groups) * span
    steps = ((seen[:, None] - firsts[None, :] + bn - 1) // bn).clamp(0, nb)
    computed = (steps * bn).clamp(max=(n - firsts)[None, :].clamp(min=0))  # rows a block scores
    per_block_queries = torch.full((seen.shape[0],), bm)
    per_block_queries[-1] = bm - pad
    return 1.0 - float((computed * per_block_queries[:, None]).sum()) / max(1, t * n)


def _positions(case, g: torch.Generator) -> torch.Tensor:
    """Each query's position. ``positions``: "chunk" (default) consecutive from ``start``, whose
    default ends the chunk at the keys' end (the last query sees every row, the model's prefill);
    "repeat": each position twice; "mixed" cycles through no visible row, one, a random count,
    every row, and a position past the rows (more visible than the N held), as the decode form's
    sequences do."""
    t, n, ratio = case["T"], case["N"], case.get("RATIO", 4)
    kind = case.get("positions", "chunk")
    start = case.get("start", max(0, (n + 1) * ratio - 1 - t))
    if kind == "chunk":
        return torch.arange(start, start + t, dtype=torch.int32)
    if kind == "repeat":
        return (start + torch.arange(t) // 2).to(torch.int32)
    picks = (max(0, ratio - 2), max(0, 2 * ratio - 2), None, (n + 1) * ratio - 1, (n + 7) * ratio + 3)
    rand = torch.randint(0, (n + 1) * ratio, (t,), generator=g).tolist()
    return torch.tensor([rand[i] if picks[i % 5] is None else picks[i % 5] for i in range(t)], dtype=torch.int32)


EDGE_CODES = (0, 1, 64, 126, 127, 128, 190, 227)  # UE8M0: the smallest scale, 1, and large ones short
# of overflowing an f32 dot (6 x 2^100 x 128 terms); 255 (NaN) left out


def _mxfp4_rows(k: torch.Tensor, codes: str, g: torch.Generator) -> torch.Tensor:
    """bf16 rows as the cache stores them (model.md 3.4); ``codes`` "edges" then sets each row's
    UE8M0 codes from ``EDGE_CODES`` (a row of zero nibbles, a row of -0, among them)."""
    n, d = k.shape
    enc = quantize_fp4_reference(k, "mxfp4")
    rows = torch.cat([enc["q"], enc["scale"]], -1)
    if codes == "edges" and n:
        pick = torch.randint(0, len(EDGE_CODES), (n, d // MXFP4_BLOCK), generator=g)
        rows[:, d // 2:] = torch.tensor(EDGE_CODES, dtype=torch.uint8)[pick]
        rows[0, d // 2:] = torch.tensor(EDGE_CODES[:d // MXFP4_BLOCK], dtype=torch.uint8)  # both ends
        rows[n // 2, : d // 2] = 0  # +0 values
        rows[-1, : d // 2] = 0x88  # -0 values
    return rows


def _inputs(case, device, seed):
    t, h, n, d = case["T"], case["H"], case["N"], case["D"]
    mxfp4 = case.get("dtype") == "mxfp4"
    out = {"logits": torch.full((t, n), float("nan"), dtype=torch.float32, device=device)}
    if device.type == "meta":
        k_meta = torch.empty(n, d // 2 + d // MXFP4_BLOCK, dtype=torch.uint8) if mxfp4 else \
            torch.empty(n, d, dtype=torch.bfloat16)
        return {"q": torch.empty(t, h, d, dtype=torch.bfloat16, device=device),
                "w": torch.empty(t, h, dtype=torch.float32, device=device), "k": k_meta.to(device),
                "pos": torch.empty(t, dtype=torch.int32, device=device), **out}
    g = torch.Generator().manual_seed(seed)
    if case.get("values", "normal") == "ints":  # small integers and powers of two: exact sums, ties
        q = torch.randint(-1, 2, (t, h, d), generator=g).to(torch.bfloat16)
        k = torch.randint(-2, 3, (n, d), generator=g).to(torch.bfloat16)
        w = torch.exp2(torch.randint(-3, 2, (t, h), generator=g).float())
        w = w * (torch.rand(t, h, generator=g) < 0.8)  # some heads weigh 0
        if n > 3:
            k[3] = k[1]  # an exact tie between two rows
    else:
        q = torch.randn(t, h, d, generator=g, dtype=torch.bfloat16)
        k = torch.randn(n, d, generator=g, dtype=torch.bfloat16)
        w = torch.randn(t, h, generator=g) * (d * h) ** -0.5  # (x @ weights_proj^T) * D^-0.5 * H^-0.5
    if mxfp4:
        k = _mxfp4_rows(k, case.get("codes", "data"), g)
    return {"q": q.to(device), "w": w.to(device), "k": k.to(device), "pos": _positions(case, g).to(device), **out}


MAX_LOGITS = 1 << 30  # f32 logits a model shape writes at most (4 GiB: a GPU test holds several)


def prefill_shapes(m: shapes.ModelDims) -> dict[str, dict]:
    """A prefill chunk scoring the compressed rows of each index ratio of the model (V4: 4; V4.1: 2
    and 1) at the chunk that ends a 4K, 64K and 1M-token context (N = context / ratio; the inputs'
    default positions end the chunk where its last query sees every row): bf16 keys at each, MXFP4
    rows as stored at 64K and 1M. The chunk is ``PREFILL_CHUNK`` tokens, or where its logits would
    pass ``MAX_LOGITS`` (V4.1 at 1M) the largest power of two that fits."""
    out: dict[str, dict] = {}
    for ratio in ((4,) if m.name == "v4-flash" else (2, 1)):
        for context in (4096, 1 << 16, shapes.CONTEXT):
            rows = context // ratio
            t = shapes.PREFILL_CHUNK
            while t * rows > MAX_LOGITS:
                t //= 2
            label = f"{context >> 20}m" if context >= 1 << 20 else f"{context >> 10}k"
            for kind in ("bf16", "mxfp4") if context > 4096 else ("bf16",):
                case = {"T": t, "H": m.index_heads, "N": rows, "D": m.index_head_dim, "RATIO": ratio,
                        "model": m.name}
                if kind == "mxfp4":
                    case["dtype"] = "mxfp4"
                suffix = "" if kind == "bf16" else "_mxfp4"
                out[f"{m.short}/r{ratio}_ctx{label}{suffix}/prefill{t}"] = case
    return out


def _key_bytes(c) -> float:
    d = c["D"]
    return d / 2 + d / MXFP4_BLOCK if c.get("dtype") == "mxfp4" else 2.0 * d


def _visible_pairs(c) -> float:
    """(query, row) pairs a case's default chunk scores: query t at start + t sees
    min(N, (start + t + 1) // RATIO) rows (the mixed and repeated positions are counted as a chunk)."""
    t, n, ratio = c["T"], c["N"], c.get("RATIO", 4)
    start = c.get("start", max(0, (n + 1) * ratio - 1 - t))
    vis = torch.div(torch.arange(start, start + t) + 1, ratio, rounding_mode="floor").clamp(max=n)
    return float(vis.sum())


SMALL = {"BM": 2, "BN": 32, "NB": 2, "STAGES": 1}
SPEC = register(Spec(
    kernel=indexer_logits_prefill,
    reference=indexer_logits_prefill_reference,
    make_inputs=_inputs,
    outputs=("logits",),
    cases={
        # a sequence's first chunk at V4's ratio: queries 0 .. 2 see no row, skipped blocks
        "v4_first_chunk": {"T": 37, "H": 64, "N": 9, "D": 128, "RATIO": 4, "start": 0, "config": SMALL},
        # a chunk ending at the keys' end, N a ragged number of tiles, T not a multiple of BM
        "v4_chunk_end": {"T": 29, "H": 64, "N": 150, "D": 128, "RATIO": 4, "config": {**SMALL, "BM": 4}},
        "v41_r2": {"T": 21, "H": 32, "N": 77, "D": 128, "RATIO": 2, "config": SMALL},
        "v41_r1": {"T": 19, "H": 32, "N": 100, "D": 128, "RATIO": 1, "start": 81},
        "one_query": {"T": 1, "H": 64, "N": 70, "D": 128, "RATIO": 4, "config": SMALL},
        "one_query_sees_none": {"T": 1, "H": 32, "N": 40, "D": 128, "RATIO": 2, "start": 0, "config": SMALL},
        "repeated_positions": {"T": 14, "H": 32, "N": 64, "D": 128, "RATIO": 2, "positions": "repeat",
                               "start": 101, "config": SMALL},
        # random positions: none, some, all and past N visible, in any order within a block
        "mixed_positions": {"T": 13, "H": 64, "N": 90, "D": 128, "RATIO": 4, "positions": "mixed",
                            "config": {**SMALL, "BM": 4}},
        # a small model's 2 heads: padded to MIN_HEADS with zero queries of weight 0
        "few_heads": {"T": 9, "H": 2, "N": 70, "D": 64, "RATIO": 2, "config": SMALL},
        # small integers: exact logits, tied rows (row 3 repeats row 1), heads of weight 0
        "ties_ints": {"T": 7, "H": 64, "N": 50, "D": 128, "RATIO": 4, "values": "ints", "start": 196,
                      "config": {**SMALL, "NB": 1}},
        # MXFP4 rows as stored (68 bytes at D = 128); codes from data, and at the format's edges
        "mxfp4_keys_v41": {"T": 11, "H": 32, "N": 100, "D": 128, "RATIO": 2, "dtype": "mxfp4", "config": SMALL},
        "mxfp4_edge_codes": {"T": 6, "H": 64, "N": 64, "D": 128, "RATIO": 4, "dtype": "mxfp4", "codes": "edges",
                             "config": SMALL},
        "mxfp4_few_heads": {"T": 5, "H": 2, "N": 70, "D": 64, "RATIO": 1, "dtype": "mxfp4", "start": 3,
                            "config": SMALL},
    },
    build_cases={"v4_ctx64k_prefill": {"T": 4096, "H": 64, "N": 16384, "D": 128, "RATIO": 4},
                 "v41_r1_ctx64k_mxfp4": {"T": 4096, "H": 32, "N": 65536, "D": 128, "RATIO": 1, "dtype": "mxfp4"}},
    tolerance=lambda case, out: (1e-30, 2.0 ** -24),
    extra_error=_error_bound,
    constants_of=lambda case: {"RATIO": case.get("RATIO", 4)},
    flops=lambda c: 2.0 * c["H"] * c["D"] * _visible_pairs(c),
    bytes_moved=lambda c: _key_bytes(c) * c["N"] + 4.0 * c["T"] * c["N"]
    + c["T"] * (2.0 * c["H"] * c["D"] + 4.0 * c["H"] + 4.0),
    model_shapes=shapes.for_models(prefill_shapes),
    sweep={"T": Dim(1, 40, large=600), "H": OneOf(32, 64, 2), "N": Dim(1, 200, large=3000), "D": OneOf(64, 128),
           "RATIO": OneOf(1, 2, 4), "values": OneOf("normal", "normal", "ints"),
           "positions": OneOf("chunk", "chunk", "repeat", "mixed"), "dtype": OneOf("bf16", "mxfp4"),
           "codes": OneOf("data", "edges"),
           "config": {"BM": OneOf(1, 2, 4), "BN": OneOf(32, 64), "NB": OneOf(1, 2, 4), "STAGES": OneOf(1, 2)}},
))
