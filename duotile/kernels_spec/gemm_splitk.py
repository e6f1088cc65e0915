"""Decode GEMM with a split reduction: C = A @ B^T for a few rows (the batch), bf16 in and out.

At decode M is the batch, so an output of 4096 columns makes 32 tiles of 64x128: a quarter of
the H200's 132 SMs. ``SPLIT`` cuts K into that many contiguous ranges; phase 0 runs a block per
(tile, range) and writes its fp32 partial sum into a workspace; phase 1 adds the ``SPLIT``
partials of each tile in range order, so the result is the same at every batch size and on every
run (no atomics). ``SPLIT = 1`` is the plain one-phase GEMM.

Model shape (model.md): ``attn.wo_b`` 8192 -> 4096, at decode ``T = B`` rows.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .gemm import _k_range, _tolerance, gemm_reference, k_ranges, sum_ranges
from .registry import Dim, OneOf, Spec, register


# SPLIT defaults to 4: the tuning cache keys a kernel by its trace at the default config, which
# must then be the two-phase form, so that an edit to either phase changes the key
@dsl.kernel(batch_dim="M", dynamic=("M",))
def gemm_splitk(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16],
                c: dsl.Tensor["M", "N", dsl.bf16], *,
                BM: dsl.Tunable = dsl.choice(64, 128, 16),
                BN: dsl.Tunable = dsl.choice(128, 64, 256),
                BK: dsl.Tunable = dsl.choice(64, 128),
                STAGES: dsl.Tunable = dsl.int_range(2, 4, default=3),
                SPLIT: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16)):
    k_blocks = dsl.cdiv(a.K, BK)
    tiles = (dsl.cdiv(a.M, BM), dsl.cdiv(b.N, BN))
    if SPLIT == 1:
        for m, n in dsl.grid(*tiles):
            acc = _k_range(a, b, m, n, 0, k_blocks, BM, BN, BK, STAGES)
            dsl.store(c[m * BM, n * BN], acc.to(dsl.bf16))
        return
    partial = dsl.workspace("partial", (SPLIT, a.M, b.N), dsl.f32)
    for m, n, s in dsl.grid(*tiles, SPLIT):
        acc = _k_range(a, b, m, n, *k_ranges(k_blocks, SPLIT, s), BM, BN, BK, STAGES)
        dsl.store(partial[s, m * BM, n * BN], acc)
    for m, n in dsl.grid(*tiles):
        dsl.store(c[m * BM, n * BN], sum_ranges(partial, (m * BM, n * BN), (BM, BN), SPLIT).to(dsl.bf16))


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    m, n, k = case["M"], case["N"], case["K"]
    return {"a": torch.randn(m, k, generator=g).to(torch.bfloat16).to(device),
            "b": torch.randn(n, k, generator=g).to(torch.bfloat16).to(device),
            "c": torch.empty(m, n, dtype=torch.bfloat16, device=device)}


SPEC = register(Spec(
    kernel=gemm_splitk,
    reference=gemm_reference,
    make_inputs=_inputs,
    outputs=("c",),
    cases={
        "split4": {"M": 5, "N": 96, "K": 256, "config": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 4}},
        # 7 K blocks in ranges of 1, 2, 2 and 2; ragged M, N and K
        "ragged": {"M": 3, "N": 80, "K": 200, "config": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 4}},
        "one_phase": {"M": 4, "N": 64, "K": 128, "config": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 1}},
    },
    build_cases={"wo_b_decode": {"M": 16, "N": 4096, "K": 8192}},
    tolerance=_tolerance,
    flops=lambda c: 2.0 * c["M"] * c["N"] * c["K"],
    # compulsory bytes (A, B, C in bf16); the partial sums' round trip is the split's own cost
    bytes_moved=lambda c: 2.0 * (c["M"] * c["K"] + c["N"] * c["K"] + c["M"] * c["N"]),
    model_shapes=shapes.for_models(shapes.gemm_shapes, decode_m=shapes.SPLITK_M, prefill=False, dtype="bf16"),
    # decode rows; ranges of K from one block each to more ranges than blocks (empty ranges)
    sweep={"M": Dim(1, 20, large=64), "N": Dim(8, 264, multiple=8, large=8200),
           "K": Dim(8, 520, multiple=8, large=8200),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BK": OneOf(64, 128), "BM": OneOf(16, 64)}},
))
