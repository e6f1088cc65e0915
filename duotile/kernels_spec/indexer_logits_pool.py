"""The lightning indexer restricted to a candidate pool (model.md 2.13 "hierarchical selection",
5.7): V4.1's Reindex layers (24, 28, 32, 36) score only the positions of the pool that the
candidate source (layer 20) keeps, 2,048 blocks of 8 compressed positions a query, where the decode
form (``indexer_logits``) scores every visible row (up to 1M of them).

Per query b (one token a sequence), ``KB`` block ids ``blocks[b]`` (``candidate_pool``'s output:
ascending, -1 in the empty slots) and ``BLOCK`` positions a block, column ``c`` of the output
stands for position ``p = blocks[b, c // BLOCK] * BLOCK + c % BLOCK``:

    logits[b, c] = sum_h w_h * relu(q_h . k[b, p])   if blocks[b, c // BLOCK] >= 0,
                                                      p < (P + 1) // RATIO and p < L,
                   -inf                               otherwise

``P`` the query's 0-based position (``pos``), ``L`` the key rows the cache holds (a position past
them has no key: -inf, as the decode form leaves it unwritten). Output ``logits`` (B, KB * BLOCK)
f32 in candidate order: a sorted block list gives ascending positions, so the top-k over these
columns with ties to the lowest column is the top-k of the full row masked by the pool with ties
to the lowest position (``tests/kernels_spec/test_indexer_logits_pool.py``). The kernel itself
does not need the list sorted. Keys as the decode form takes them: bf16 rows, or MXFP4 rows as the
cache stores them (u8, D / 2 bytes of e2m1 pairs then D / 32 UE8M0 codes), decoded exactly into
the same bf16 operand by ``dsl.mxfp4_values``. V4.1: 32 heads x 128, ratio 1, KB 2048, BLOCK 8.

A block scores ``NB`` tiles of ``BN`` columns of one query. Each tile reads the block ids of its
columns (a gather of ``blocks``, column // BLOCK), makes the positions a row-index tile (-1 for a
dead column, which gathers a zero row: no invisible row is needed) and gathers those key rows, then runs
``indexer_logits``' arithmetic unchanged: one gemm ``k_tile @ q^T`` (BN x H, f32, H padded to
``MIN_HEADS`` with zero queries of weight 0), ReLU, times ``w``, the row sum over the heads, the
mask. A row's logit is the same function of its key row, its query and the config in both forms,
so at one config each finite logit is the decode form's logit of that position bit for bit on the
interpreter (tested); on a GPU the tensor cores' order inside one dot is fixed by the MMA shape,
which both forms share at one BN. ``B`` and ``L`` are dynamic (one build for every batch and
context at a given KB).

Tolerance: ``indexer_logits``' bound (gamma = 2 (D + H + 3) 2^-24 times sum_h |w_h| sum_d
|q_hd k_pd|, 2^-24 relative, 1e-30 absolute) at the gathered rows; "ints" values are exact.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.ops import MXFP4_BLOCK
from . import model_shapes as shapes
from .indexer_logits import MIN_HEADS, mxfp4_key_values, require_key_rows
from .indexer_logits import _inputs as _decode_inputs
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")


@dsl.kernel(batch_dim="B", dynamic=("B", "L", "KS"))
def indexer_logits_pool(q: dsl.Tensor["B", "H", "D", dsl.bf16], w: dsl.Tensor["B", "H", dsl.f32],
                        k: dsl.Tensor["KS", "L", "R", dsl.bf16 | dsl.u8], pos: dsl.Tensor["B", dsl.i32],
                        blocks: dsl.Tensor["B", "KB", dsl.i32], logits: dsl.Tensor["B", "C", dsl.f32], *,
                        RATIO: dsl.Const = 1, BLOCK: dsl.Const = 8, SHARED: dsl.Const = False,
                        BN: dsl.Tunable = dsl.choice(64, 32, 128),
                        NB: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16),
                        STAGES: dsl.Tunable = dsl.int_range(1, 3, default=2)):
    for name, v in (("RATIO", RATIO), ("BLOCK", BLOCK)):
        if not (isinstance(v, int) and v >= 1):
            raise dsl.DslError(f"{name} {v!r} must be a positive int (RATIO a compress ratio, BLOCK the "
                               f"positions of a pool block)")
    H, D = dsl.maximum(q.H, MIN_HEADS), q.D  # padded heads: zero queries of weight 0 (indexer_logits)
    packed = k.dtype == dsl.u8  # MXFP4 rows as stored
    require_key_rows(k, D)
    for cond in (logits.C >= blocks.KB * BLOCK, logits.C <= blocks.KB * BLOCK):
        dsl.require(cond, "logits must have KB * BLOCK columns: one a position of each listed block")
    rows_of = _key_stack(k, q, SHARED)
    for b, g in dsl.grid(q.B, dsl.cdiv(dsl.cdiv(logits.C, BN), NB)):
        q_tile = dsl.load(q[b, 0, 0], (H, D), role="operand")
        wts = dsl.load(w[b, 0], (H,))
        visible = (dsl.load(pos[b], (1,)) + 1) // RATIO  # positions of this query's window count
        for i in dsl.pipelined(NB, stages=STAGES):
            col = (g * NB + i) * BN + dsl.arange(BN)
            blk = dsl.load(blocks[b, col // BLOCK], (BN,), other=-1)  # columns past KB: no block
            p = blk * BLOCK + col % BLOCK
            live = (blk >= 0) & (p < visible) & (p < k.L)
            rows = dsl.where(live, p, -1)  # a dead column gathers a zero row
            if packed:
                k_tile = dsl.mxfp4_values(dsl.load(k[rows_of(b), rows, 0], (BN, D // 2), role="operand"),
                                          dsl.load(k[rows_of(b), rows, D // 2], (BN, D // MXFP4_BLOCK),
                                                   role="operand"))
            else:
                k_tile = dsl.load(k[rows_of(b), rows, 0], (BN, D), role="operand")
            dots = dsl.zeros((BN, H), dsl.f32, role="accumulator")
            dsl.gemm(k_tile, q_tile, dots, transpose_b=True)
            s = (dsl.maximum(dots, 0.0) * wts[None, :]).sum(axis=1)
            dsl.store(logits[b, (g * NB + i) * BN], dsl.where(live, s, NEG_INF))


def _key_stack(k, q, shared):
    """Which key stack query b reads: its own (``k`` B x L x R, a decode step's sequences) or, with
    ``SHARED``, the one every query reads (``k`` 1 x L x R: a prefill chunk of one sequence)."""
    if not isinstance(shared, bool):
        raise dsl.DslError(f"SHARED {shared!r} must be a bool: True where every query reads one key stack")
    if shared:
        dsl.require(k.KS <= 1, "SHARED: k must hold one key stack (1 x L x R) that every query reads")
        return lambda b: 0
    dsl.require(k.KS >= q.B, "k must hold a key stack a query (B x L x R), or give SHARED for one that all read")
    return lambda b: b


def pool_positions(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Each column's position (B, KB * block), int64: ``blocks[b, c // block] * block + c % block``,
    -1 where the block slot is empty (< 0)."""
    ids = blocks.long().repeat_interleave(block, 1)
    offs = torch.arange(ids.shape[1], device=blocks.device) % block
    return torch.where(ids >= 0, ids * block + offs, torch.full_like(ids, -1))


def _gathered_keys(k: torch.Tensor, rows: torch.Tensor, d: int) -> torch.Tensor:
    """The key rows named by ``rows`` (B, C; valid indices) in float64, MXFP4 rows decoded."""
    got = k.gather(1, rows[:, :, None].expand(-1, -1, k.shape[2]))
    return mxfp4_key_values(got, d) if k.dtype == torch.uint8 else got.double()


def _live_rows(k, pos, blocks, RATIO, BLOCK):
    """Each column's position clamped to a valid row, and whether it is live (a listed block's
    position below the visible count and the cache's rows)."""
    p = pool_positions(blocks, BLOCK)
    visible = torch.div(pos.long() + 1, RATIO, rounding_mode="floor").to(p.device)
    live = (p >= 0) & (p < visible[:, None]) & (p < k.shape[1])
    return torch.where(live, p, torch.zeros_like(p)), live


def _own_stacks(k: torch.Tensor, b: int) -> torch.Tensor:
    """A key stack a query: ``k`` itself, or the one stack (1 x L x R, ``SHARED``) seen by each."""
    return k.expand(b, -1, -1) if k.shape[0] == 1 else k


def indexer_logits_pool_reference(q, w, k, pos, blocks, RATIO: int = 1, BLOCK: int = 8, SHARED: bool = False) -> dict:
    """model.md 2.13 in float64, rounded once to f32: column c of query b is position
    p = blocks[b, c // BLOCK] * BLOCK + c % BLOCK, scored sum_h w[b, h] relu(q[b, h] . k[b, p])
    where the block slot holds a block and p < (pos[b] + 1) // RATIO (and p < L), else -inf
    (``SHARED``: k[0] for every b). Columns in chunks, so that a model-sized call fits a GPU."""
    k = _own_stacks(k, q.shape[0]) if SHARED else k
    rows, live = _live_rows(k, pos, blocks, RATIO, BLOCK)
    q64, w64 = q.double(), w.double()
    out = torch.empty(rows.shape, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 22) // max(1, q.shape[0] * q.shape[1]))
    for lo in range(0, rows.shape[1], chunk):
        keys = _gathered_keys(k, rows[:, lo:lo + chunk], q.shape[2])
        dots = torch.einsum("bhd,bld->bhl", q64, keys)
        out[:, lo:lo + chunk] = (dots.clamp(min=0) * w64[:, :, None]).sum(1).float()
    return {"logits": out.masked_fill(~live, NEG_INF)}


def _error_bound(case, output, inputs) -> torch.Tensor:
    """``indexer_logits``' bound at the gathered rows: gamma * sum_h |w_h| sum_d |q_hd| |k_pd|."""
    q, w = inputs["q"], inputs["w"]
    k = _own_stacks(inputs["k"], q.shape[0])
    rows, _ = _live_rows(k, inputs["pos"], inputs["blocks"], case.get("RATIO", 1), case.get("BLOCK", 8))
    gamma = 2.0 * (q.shape[2] + q.shape[1] + 3) * 2.0 ** -24
    v = (w.double().abs()[:, :, None] * q.double().abs()).sum(1)  # (B, D)
    bound = torch.empty(rows.shape, dtype=torch.float64, device=q.device)
    chunk = max(1, (1 << 22) // max(1, q.shape[0] * q.shape[2]))
    for lo in range(0, rows.shape[1], chunk):
        keys = _gathered_keys(k, rows[:, lo:lo + chunk], q.shape[2]).abs()
        bound[:, lo:lo + chunk] = torch.einsum("bld,bd->bl", keys, v)
    return (gamma * bound).float()


def _block_row(kind: str, visible: int, rows: int, kb: int, block: int, g: torch.Generator) -> list[int]:
    """One query's block list of a kind, sorted ascending, -1 padded to ``kb``:

    * ``pool``: what ``candidate_pool`` gives: up to kb blocks holding a visible position, the
      newest (straddling the visible count where it is not a multiple of BLOCK) always among them;
    * ``wild``: any blocks up to two past the cache's rows (past the visible count too, which the
      kernel scores -inf), the newest visible one among them;
    * ``none``: every slot empty; ``all``: every visible block (fewer than kb where they are)."""
    if kind == "none":
        return [-1] * kb
    seen = -(-min(visible, rows) // block)  # blocks holding a visible row
    newest = seen - 1
    if kind == "all":
        ids = list(range(min(seen, kb)))
    else:
        span = seen if kind == "pool" else -(-rows // block) + 2
        order = torch.randperm(span, generator=g).tolist()
        take = min(span, kb, max(1, int(torch.randint(0, kb + 1, (1,), generator=g))))
        ids = order[:take]
        if newest >= 0 and newest not in ids:  # the forced newest block
            ids = [newest] + ids[: kb - 1]
    ids = sorted(ids)
    return ids + [-1] * (kb - len(ids))


def _chunk_inputs(case, device, seed) -> dict:
    """``SHARED``: a prefill chunk of B queries of one sequence over its one key stack (1 x L x R),
    at consecutive positions ending where every row is visible (the chunk's first queries see
    fewer rows, or none, where the chunk is longer than the rows)."""
    ratio, b = case.get("RATIO", 1), case["B"]
    out = _decode_inputs({**case, "L": 1, "RATIO": ratio}, device, seed)  # queries and weights
    out["k"] = _decode_inputs({**case, "B": 1, "RATIO": ratio}, device, seed + 3)["k"]
    last = case["L"] * ratio + ratio - 1
    out["pos"] = (last - b + 1 + torch.arange(b)).clamp(min=0).to(torch.int32).to(device)
    return out


def _inputs(case, device, seed):
    b, kb, block = case["B"], case.get("KB", 2048), case.get("BLOCK", 8)
    if case.get("SHARED"):
        decode = _chunk_inputs(case, device, seed)
    else:
        decode = _decode_inputs({**case, "RATIO": case.get("RATIO", 1)}, device, seed)
    decode.pop("logits")
    out = {"logits": torch.full((b, kb * block), float("nan"), dtype=torch.float32, device=device)}
    if device.type == "meta":
        return {**decode, "blocks": torch.empty(b, kb, dtype=torch.int32, device=device), **out}
    g = torch.Generator().manual_seed(seed + 1)
    visible = torch.div(decode["pos"].long().cpu() + 1, case.get("RATIO", 1), rounding_mode="floor")
    kinds = {"mixed": ("pool", "wild", "all", "none", "pool")}.get(case.get("pool", "mixed"), (case.get("pool"),))
    rows = [_block_row(kinds[i % len(kinds)], int(visible[i]), case["L"], kb, block, g) for i in range(b)]
    return {**decode, "blocks": torch.tensor(rows, dtype=torch.int32).to(device), **out}


def pool_indexer_shapes(m: shapes.ModelDims) -> dict[str, dict]:
    """V4.1's Reindex scoring (V4-Flash has no pool): the pool's KB blocks of BLOCK positions over
    layer 20's ratio-1 keys at contexts of 64K and 1M (L = context), at decode batches 1, 16 and 64
    (one build serves every B): MXFP4 keys as the cache stores them, and bf16 keys where they stay
    within 4 GiB (B x L <= 2^24 rows of 128); and a prefill chunk's queries over their sequence's
    MXFP4 keys (``SHARED``)."""
    if not m.candidate_topk_blocks:
        return {}
    out: dict[str, dict] = {}
    for context in (1 << 16, shapes.CONTEXT):
        label = f"{context >> 20}m" if context >= 1 << 20 else f"{context >> 10}k"
        for kind in ("bf16", "mxfp4"):
            for b in shapes.DECODE_SAMPLE:
                if kind == "bf16" and b * context > 1 << 24:
                    continue
                tag = "" if kind == "bf16" else "_mxfp4"
                out[f"{m.short}/r1_ctx{label}{tag}/decode{b}"] = {
                    "B": b, "H": m.index_heads, "L": context, "D": m.index_head_dim, "KB": m.candidate_topk_blocks,
                    "RATIO": 1, "BLOCK": m.candidate_block, "dtype": kind, "model": m.name}
        # a prefill chunk ending the context, its queries over the sequence's one key stack
        out[f"{m.short}/r1_ctx{label}_mxfp4/prefill{shapes.PREFILL_CHUNK}"] = {
            "B": shapes.PREFILL_CHUNK, "H": m.index_heads, "L": context, "D": m.index_head_dim,
            "KB": m.candidate_topk_blocks, "RATIO": 1, "BLOCK": m.candidate_block, "dtype": "mxfp4",
            "SHARED": True, "model": m.name}
    return out


def _key_bytes(c) -> float:
    """A key row's bytes: bf16, or MXFP4 as stored."""
    d = c["D"]
    return d / 2 + d / MXFP4_BLOCK if c.get("dtype") == "mxfp4" else 2.0 * d


def _columns(c) -> int:
    return c.get("KB", 2048) * c.get("BLOCK", 8)


SMALL = {"BN": 32, "NB": 2, "STAGES": 1}
SPEC = register(Spec(
    kernel=indexer_logits_pool,
    reference=indexer_logits_pool_reference,
    make_inputs=_inputs,
    outputs=("logits",),
    # a decode step's queries each read their own key stack (k's KS axis goes with the batch);
    # with SHARED one stack serves every query
    batched_with=lambda case: {} if case.get("SHARED") else {"k": 0},
    cases={
        # five queries: a candidate pool, wild blocks (past the visible count and the cache), every
        # visible block (fewer than KB), no block, a pool; positions from none visible to past the rows
        "v41_mixed": {"B": 5, "H": 32, "L": 150, "D": 128, "KB": 12, "config": SMALL},
        # a visible count inside a block: the newest block straddles it
        "straddle": {"B": 3, "H": 32, "L": 100, "D": 128, "KB": 6, "visible": 43, "pool": "pool",
                     "config": SMALL},
        "wild_blocks": {"B": 4, "H": 32, "L": 90, "D": 128, "KB": 9, "visible": 61, "pool": "wild",
                        "config": SMALL},
        "no_blocks": {"B": 2, "H": 32, "L": 40, "D": 128, "KB": 4, "pool": "none", "config": SMALL},
        "fewer_blocks_than_kb": {"B": 2, "H": 32, "L": 50, "D": 128, "KB": 16, "visible": "all", "pool": "all"},
        # a small model's 2 heads, 4-position blocks, ratio 2
        "few_heads": {"B": 3, "H": 2, "L": 70, "D": 64, "KB": 5, "BLOCK": 4, "RATIO": 2, "config": SMALL},
        # small integers: exact logits, tied rows (row 3 repeats row 1), heads of weight 0
        "ties_ints": {"B": 3, "H": 32, "L": 50, "D": 128, "KB": 7, "values": "ints", "visible": "all",
                      "pool": "all", "config": {**SMALL, "NB": 1}},
        # MXFP4 index keys as the cache stores them (model.md 3.4: 68-byte rows at D = 128)
        "mxfp4_keys": {"B": 5, "H": 32, "L": 120, "D": 128, "KB": 10, "dtype": "mxfp4", "config": SMALL},
        "mxfp4_few_heads": {"B": 2, "H": 2, "L": 70, "D": 64, "KB": 4, "dtype": "mxfp4", "visible": "all",
                            "config": SMALL},
        # one block of one position; the default config's tiles over a wider pool
        "one_position": {"B": 2, "H": 32, "L": 1, "D": 128, "KB": 1, "BLOCK": 1, "visible": "all", "pool": "all"},
        "model_block": {"B": 2, "H": 32, "L": 3000, "D": 128, "KB": 64, "visible": "all", "pool": "pool"},
        # a prefill chunk: every query reads one key stack, causal (the first queries see fewer rows)
        "shared_chunk": {"B": 7, "H": 32, "L": 60, "D": 128, "KB": 5, "SHARED": True, "config": SMALL},
        "shared_chunk_mxfp4": {"B": 9, "H": 2, "L": 40, "D": 64, "KB": 4, "BLOCK": 4, "RATIO": 2, "SHARED": True,
                               "dtype": "mxfp4", "pool": "pool"},
        "shared_longer_than_rows": {"B": 12, "H": 32, "L": 5, "D": 128, "KB": 3, "BLOCK": 2, "SHARED": True,
                                    "pool": "all", "config": SMALL},
    },
    build_cases={"v41_ctx1m_mxfp4_decode16": {"B": 16, "H": 32, "L": 1 << 20, "D": 128, "KB": 2048,
                                              "dtype": "mxfp4"}},
    tolerance=lambda case, out: (1e-30, 2.0 ** -24),
    extra_error=_error_bound,
    constants_of=lambda case: {"RATIO": case.get("RATIO", 1), "BLOCK": case.get("BLOCK", 8),
                               "SHARED": bool(case.get("SHARED", False))},
    flops=lambda c: 2.0 * c["B"] * c["H"] * _columns(c) * c["D"],
    # key rows at the pool's positions, the logits, the block list, the queries and weights
    bytes_moved=lambda c: c["B"] * ((_key_bytes(c) + 4.0) * _columns(c) + 4.0 * c.get("KB", 2048)
                                    + 2.0 * c["H"] * c["D"] + 4.0 * c["H"]),
    model_shapes=shapes.for_models(pool_indexer_shapes),
    sweep={"B": Dim(1, 6, large=64), "H": OneOf(32, 2, 64), "L": Dim(1, 300, large=70000), "D": OneOf(64, 128),
           "KB": OneOf(1, 3, 8, 17, 64), "BLOCK": OneOf(8, 8, 4, 1), "RATIO": OneOf(1, 1, 2),
           "values": OneOf("normal", "normal", "ints"), "dtype": OneOf("bf16", "mxfp4"),
           "pool": OneOf("mixed", "pool", "wild", "all"), "SHARED": OneOf(False, False, True),
           "config": {"BN": OneOf(32, 64), "NB": OneOf(1, 2, 4), "STAGES": OneOf(1, 2)}},
))
