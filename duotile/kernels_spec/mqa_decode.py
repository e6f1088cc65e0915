"""Decode attention with split KV: one query token per sequence, H heads sharing one K = V row
per position (V4's MQA: 64 heads, 512 wide), O = softmax(q K^T / sqrt(D)) K.

With a handful of sequences a grid of one block per sequence leaves most SMs idle. ``SPLIT``
cuts the R rows into that many contiguous ranges: phase 0 runs a block per (sequence, range),
an online softmax over its rows, and writes the range's normalised output and its log-sum-exp
(base 2) into workspaces; phase 1 combines the ranges of a sequence in range order, ``BD``
output columns a block, weighting each by ``2^(lse_s - max lse)``. The order is fixed, so a
sequence's output never depends on the batch around it. A range with no rows (more ranges than
row blocks) writes zeros and an LSE of -inf, which weighs nothing. ``SPLIT = 1`` is one phase.

Model shape (model.md 5.4): 64 heads x 512; rows per query 128 (window), 640 (CSA) or up to
8,320 (HCA at 1M tokens). Rows here are dense per sequence (the gather by index and the sink
are not part of this kernel yet).
"""

from __future__ import annotations

import math

import torch

from .. import dsl
from . import model_shapes as shapes
from .column_groups import column_groups
from .registry import Dim, OneOf, Spec, register

LOG2E = 1.4426950408889634


def _attend(q, kv, b, lo, hi, BN, STAGES, DG=1):
    """Online softmax of the heads of sequence b over row blocks lo .. hi-1: (accs, row_max,
    row_sum), the output not yet divided by row_sum (a tile a column group of ``DG``, see
    ``column_groups``), in base-2 units."""
    H, D, R = q.H, q.D, kv.R
    groups = column_groups(D, DG) or ((0, D),)
    q_tiles = [dsl.load(q[b, 0, first], (H, width), role="operand") for first, width in groups]
    accs = [dsl.zeros((H, width), dsl.f32, role="accumulator") for _, width in groups]
    row_max = dsl.full((H,), float("-inf"), dsl.f32)
    row_sum = dsl.zeros((H,), dsl.f32)
    scale = LOG2E * D ** -0.5
    for n in dsl.pipelined(hi, stages=STAGES, start=lo):
        kv_tiles = [dsl.load(kv[b, n * BN, first], (BN, width), role="operand") for first, width in groups]
        scores = dsl.zeros((H, BN), dsl.f32, role="accumulator")
        for q_tile, kv_tile in zip(q_tiles, kv_tiles):
            dsl.gemm(q_tile, kv_tile, scores, transpose_b=True)
        masked = dsl.where(n * BN + dsl.arange(BN)[None, :] < R, scores, float("-inf"))
        new_max = dsl.maximum(row_max, masked.max(axis=1) * scale)
        p = dsl.exp2(masked * scale - new_max[:, None])
        rescale = dsl.exp2(row_max - new_max)
        row_sum[:] = row_sum * rescale + p.sum(axis=1)
        for acc in accs:
            acc[:] = acc * rescale[:, None]
        row_max[:] = new_max
        p16 = p.to(dsl.bf16)
        for acc, kv_tile in zip(accs, kv_tiles):
            dsl.gemm(p16, kv_tile, acc)
    return list(zip(groups, accs)), row_max, row_sum


# SPLIT defaults to 16, the two-phase form, for the tuning cache key (see gemm_splitk.py)
@dsl.kernel(batch_dim="B", dynamic=("B", "R"))
def mqa_decode(q: dsl.Tensor["B", "H", "D", dsl.bf16], kv: dsl.Tensor["B", "R", "D", dsl.bf16],
               o: dsl.Tensor["B", "H", "D", dsl.bf16], *,
               BN: dsl.Tunable = dsl.choice(64, 32, 128),
               STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
               SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32),
               BD: dsl.Tunable = dsl.choice(128, 64, 256),
               DG: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    blocks = dsl.cdiv(kv.R, BN)
    if SPLIT == 1:
        for b in dsl.grid(q.B):
            accs, _, row_sum = _attend(q, kv, b, 0, blocks, BN, STAGES, DG)
            for (first, _), acc in accs:
                dsl.store(o[b, 0, first], (acc * (1.0 / row_sum)[:, None]).to(dsl.bf16))
        return
    part_o = dsl.workspace("part_o", (SPLIT, q.B, q.H, q.D), dsl.f32)
    part_lse = dsl.workspace("part_lse", (SPLIT, q.B, q.H), dsl.f32)
    for b, s in dsl.grid(q.B, SPLIT):
        accs, row_max, row_sum = _attend(q, kv, b, s * blocks // SPLIT, (s + 1) * blocks // SPLIT, BN, STAGES, DG)
        seen = row_sum > 0.0  # false only for a range without rows
        inv = dsl.where(seen, 1.0 / row_sum, 0.0)
        for (first, _), acc in accs:
            dsl.store(part_o[s, b, 0, first], acc * inv[:, None])
        dsl.store(part_lse[s, b, 0], dsl.where(seen, row_max + dsl.log2(row_sum), float("-inf")))
    for b, j in dsl.grid(q.B, dsl.cdiv(q.D, BD)):  # BD output columns a block
        top = dsl.full((q.H,), float("-inf"), dsl.f32)
        for s in dsl.range(SPLIT):
            top[:] = dsl.maximum(top, dsl.load(part_lse[s, b, 0], (q.H,)))
        total = dsl.zeros((q.H,), dsl.f32)
        out = dsl.zeros((q.H, BD), dsl.f32)
        for s in dsl.range(SPLIT):  # in range order: the same sum at every batch size
            w = dsl.exp2(dsl.load(part_lse[s, b, 0], (q.H,)) - top)
            total[:] = total + w
            out[:] = out + dsl.load(part_o[s, b, 0, j * BD], (q.H, BD)) * w[:, None]
        dsl.store(o[b, 0, j * BD], (out * (1.0 / total)[:, None]).to(dsl.bf16))


def mqa_decode_reference(q, kv) -> dict:
    """Softmax attention of each head over its sequence's rows, K = V, in fp32."""
    s = torch.einsum("bhd,brd->bhr", q.float(), kv.float()) / math.sqrt(q.shape[-1])
    return {"o": torch.einsum("bhr,brd->bhd", torch.softmax(s, dim=-1), kv.float()).to(torch.bfloat16)}


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, r, d = case["B"], case["H"], case["R"], case["D"]
    return {"q": torch.randn(b, h, d, generator=g).to(torch.bfloat16).to(device),
            "kv": torch.randn(b, r, d, generator=g).to(torch.bfloat16).to(device),
            "o": torch.empty(b, h, d, dtype=torch.bfloat16, device=device)}


SMALL = {"BN": 32, "STAGES": 1}  # small row blocks: several ranges even at a few hundred rows
SPEC = register(Spec(
    kernel=mqa_decode,
    reference=mqa_decode_reference,
    make_inputs=_inputs,
    outputs=("o",),
    cases={
        "split4": {"B": 3, "H": 64, "R": 200, "D": 128, "config": {**SMALL, "SPLIT": 4}},
        # 2 row blocks in 8 ranges: six ranges are empty and must weigh nothing
        "empty_ranges": {"B": 2, "H": 64, "R": 40, "D": 128, "config": {**SMALL, "SPLIT": 8}},
        "one_phase": {"B": 2, "H": 64, "R": 96, "D": 128, "config": {**SMALL, "SPLIT": 1}},
        # 10 row blocks over 16 ranges: 6 empty ranges among the others, unevenly (an empty range
        # that ran a block anyway weighs that block twice; with every block duplicated alike, as
        # in empty_ranges, the softmax cannot tell)
        "uneven_ranges": {"B": 2, "H": 64, "R": 320, "D": 128, "config": {**SMALL, "SPLIT": 16}},
        # the output's columns in DG groups (sparse_mqa_decode.column_groups), each its own accumulator
        "groups4_split4": {"B": 3, "H": 64, "R": 200, "D": 128, "config": {**SMALL, "SPLIT": 4, "DG": 4}},
        "groups2_one_phase": {"B": 2, "H": 64, "R": 96, "D": 128, "config": {**SMALL, "SPLIT": 1, "DG": 2}},
    },
    build_cases={"hca_1m": {"B": 4, "H": 64, "R": 8320, "D": 512}},
    tolerance=lambda case, out: (2e-2, 2e-2),
    flops=lambda c: 4.0 * c["B"] * c["H"] * c["R"] * c["D"],
    bytes_moved=lambda c: 2.0 * c["B"] * (c["R"] * c["D"] + 2 * c["H"] * c["D"]),
    model_shapes=shapes.for_models(shapes.mqa_decode_shapes),
    # the model's 64 heads; rows from one to several hundred blocks, ranges empty or full
    sweep={"B": Dim(1, 5, large=64), "H": 64, "R": Dim(1, 300, large=9000), "D": OneOf(64, 128),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BN": OneOf(32, 64)}},
))
