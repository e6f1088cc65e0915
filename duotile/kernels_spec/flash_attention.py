"""Attention forward, O = softmax(Q K^T / sqrt(D) [causal]) V, with the log-sum-exp per row.

Layout [B, H, S, D] (query and key/value share S). The online softmax runs in base 2:
scores are scaled by log2(e) / sqrt(D), so exp2 replaces exp; LSE is returned in natural
log units. Model shapes: head dim 512 (V4 attention, 448 nope + 64 rope) and 128 (the
indexer's and the common benchmark's).
"""

from __future__ import annotations

import math

import torch

from .. import dsl
from . import model_shapes as shapes
from .column_groups import column_groups
from .registry import Dim, OneOf, Spec, register

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# d512 holds a 64x512 fp32 accumulator per block: the smallest tiles (the test cases)
D512_CONFIG = {"BM": 64, "BN": 64, "STAGES": 1}

@dsl.kernel
def flash_attention(q: dsl.Tensor["B", "H", "S", "D", dsl.bf16], k: dsl.Tensor["B", "H", "S", "D", dsl.bf16],
                    v: dsl.Tensor["B", "H", "S", "D", dsl.bf16], o: dsl.Tensor["B", "H", "S", "D", dsl.bf16],
                    lse: dsl.Tensor["B", "H", "S", dsl.f32], *,
                    CAUSAL: dsl.Const = False,
                    BM: dsl.Tunable = dsl.choice(128, 64),
                    BN: dsl.Tunable = dsl.choice(128, 64, 32, 176, 192),
                    STAGES: dsl.Tunable = dsl.int_range(1, 3, default=2),
                    DG: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    S, D = q.S, q.D
    groups = column_groups(D, DG) or ((0, D),)  # the output's columns, an accumulator a group
    for b, h, m in dsl.grid(q.B, q.H, dsl.cdiv(S, BM)):
        q_tiles = [dsl.load(q[b, h, m * BM, first], (BM, width), role="operand") for first, width in groups]
        accs = [dsl.zeros((BM, width), dsl.f32, role="accumulator") for _, width in groups]
        row_max = dsl.full((BM,), float("-inf"), dsl.f32)
        row_sum = dsl.zeros((BM,), dsl.f32)
        rows = m * BM + dsl.arange(BM)[:, None]
        n_blocks = dsl.minimum(dsl.cdiv((m + 1) * BM, BN), dsl.cdiv(S, BN)) if CAUSAL else dsl.cdiv(S, BN)
        for n in dsl.pipelined(n_blocks, stages=STAGES):
            k_tiles = [dsl.load(k[b, h, n * BN, first], (BN, width), role="operand") for first, width in groups]
            v_tiles = [dsl.load(v[b, h, n * BN, first], (BN, width), role="operand") for first, width in groups]
            scores = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
            for q_tile, k_tile in zip(q_tiles, k_tiles):
                dsl.gemm(q_tile, k_tile, scores, transpose_b=True)
            cols = n * BN + dsl.arange(BN)[None, :]
            keep = (cols <= rows) & (cols < S) if CAUSAL else cols < S
            masked = dsl.where(keep, scores, float("-inf"))
            scale = LOG2E * D ** -0.5  # positive, so max(s * scale) = max(s) * scale
            new_max = dsl.maximum(row_max, masked.max(axis=1) * scale)
            p = dsl.exp2(masked * scale - new_max[:, None])  # one fused multiply-add per score
            rescale = dsl.exp2(row_max - new_max)
            row_sum[:] = row_sum * rescale + p.sum(axis=1)
            for acc in accs:
                acc[:] = acc * rescale[:, None]
            row_max[:] = new_max
            p16 = p.to(dsl.bf16)
            for acc, v_tile in zip(accs, v_tiles):
                dsl.gemm(p16, v_tile, acc)
        inv_sum = 1.0 / row_sum  # one division per row, then a multiply per element
        for (first, _), acc in zip(groups, accs):
            dsl.store(o[b, h, m * BM, first], (acc * inv_sum[:, None]).to(dsl.bf16))
        dsl.store(lse[b, h, m * BM], (row_max + dsl.log2(row_sum)) * LN2)


QUERY_CHUNK_ELEMENTS = 1 << 28  # fp32 scores held at once by the reference (1 GiB)


def attention_reference(q, k, v, causal: bool = False) -> dict:
    """Plain softmax attention in fp32, written from the definition; queries in chunks, so the
    scores of a long sequence (16,384^2 x 64 heads is 64 GiB) never exist all at once."""
    b, h, n, d = q.shape
    rows = max(1, QUERY_CHUNK_ELEMENTS // max(1, b * h * k.shape[2]))
    o = torch.empty(b, h, n, v.shape[-1], dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, start:stop].float(), kf) / math.sqrt(d)
        if causal:
            cols = torch.arange(k.shape[2], device=q.device)
            visible = cols[None, :] <= torch.arange(start, stop, device=q.device)[:, None]
            s = s.masked_fill(~visible, float("-inf"))
        part = torch.logsumexp(s, dim=-1)
        o[:, :, start:stop] = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - part[..., None]), vf).to(torch.bfloat16)
        lse[:, :, start:stop] = part
    return {"o": o, "lse": lse}


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = case["B"], case["H"], case["S"], case["D"]
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(3))
    return {"q": q.to(device), "k": k.to(device), "v": v.to(device),
            "o": torch.empty(b, h, s, d, dtype=torch.bfloat16, device=device),
            "lse": torch.empty(b, h, s, dtype=torch.float32, device=device)}


def _flops(case):
    full = 4.0 * case["B"] * case["H"] * case["S"] * case["S"] * case["D"]
    return full / 2 if case.get("causal") else full


SPEC = register(Spec(
    kernel=flash_attention,
    reference=lambda q, k, v, CAUSAL=False: attention_reference(q, k, v, CAUSAL),
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        "d128": {"B": 1, "H": 2, "S": 256, "D": 128},
        "d128_causal": {"B": 2, "H": 1, "S": 192, "D": 128, "causal": True},
        "d128_ragged": {"B": 1, "H": 2, "S": 200, "D": 128, "causal": True},
        "d128_tail": {"B": 1, "H": 1, "S": 200, "D": 128},  # a ragged last key block, no diagonal
        "d512": {"B": 1, "H": 1, "S": 160, "D": 512, "config": D512_CONFIG},
        "d512_causal": {"B": 1, "H": 2, "S": 130, "D": 512, "causal": True, "config": D512_CONFIG},
        # the output's columns in DG groups (column_groups.py), each its own accumulator
        "d512_causal_groups2": {"B": 1, "H": 1, "S": 130, "D": 512, "causal": True,
                                "config": {**D512_CONFIG, "DG": 2}},
        "d128_groups4_tail": {"B": 1, "H": 2, "S": 200, "D": 128, "config": {"DG": 4}},
    },
    build_cases={"d128": {"B": 4, "H": 32, "S": 4096, "D": 128},
                 "d128_causal": {"B": 4, "H": 32, "S": 4096, "D": 128, "causal": True},
                 "d512": {"B": 1, "H": 64, "S": 4096, "D": 512, "causal": True}},
    tolerance=lambda case, out: (2e-2, 2e-2) if out == "o" else (1e-3, 1e-4),
    constants_of=lambda case: {"CAUSAL": bool(case.get("causal"))},
    flops=_flops,
    model_shapes=shapes.for_models(shapes.attention_shapes),
    reference_parts=("B", "H"),  # B x H x S x S fp32 scores: 64 GiB at 64 heads of 16K
    sweep={"B": Dim(1, 2, large=4), "H": Dim(1, 3, large=8), "S": Dim(1, 200, large=4100),
           "D": OneOf(64, 128), "causal": OneOf(False, True)},
))
