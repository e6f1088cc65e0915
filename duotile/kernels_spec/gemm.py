"""C = A @ B^T with fp32 accumulation and a bf16 (or fp32) result; bf16 or fp8-e4m3 inputs, with
optional per-row (A) and per-column (B) fp32 scales applied to the accumulator. An fp32 ``c``
keeps the accumulator as it is (the runtime's FP32 projections: gates, compressor scores, the LM
head's logits); the reference's bf16 result is within the tolerance of it.

Model shapes (model.md 5.1): the dense projections of V4.1-Flash, e.g. wq_b 1024 -> 32768,
wo_b 8192 -> 4096, and the shared expert 4096 -> 2048, at decode rows (1 to 64) and a prefill
chunk (4,096).

At decode the output has few tiles (a 64 x 128 tile grid of 4096 columns is 32 blocks on 132 SMs)
and a block streams its whole K range alone: ``SPLIT`` cuts K into that many contiguous ranges
(phase 0, fp32 partial sums in a workspace) and phase 1 adds them in range order and applies the
scales, so a result never depends on the split's timing (no atomics). ``SPLIT = 1`` is one phase.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

FP8_MAX = 448.0


def _scaled(acc, a_scale, b_scale, m, n, BM, BN):
    """The accumulator times the optional per-row (A) and per-column (B) scales."""
    out = acc
    if a_scale is not None:
        out = out * dsl.load(a_scale[m * BM], (BM,))[:, None]
    if b_scale is not None:
        out = out * dsl.load(b_scale[n * BN], (BN,))[None, :]
    return out


def _k_range(a, b, m, n, k_start, k_stop, BM, BN, BK, STAGES):
    """acc = A[m tile, K blocks k_start .. k_stop-1] @ B[n tile, same]^T, in fp32."""
    acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
    for k in dsl.pipelined(k_stop, stages=STAGES, start=k_start):
        a_tile = dsl.load(a[m * BM, k * BK], (BM, BK), role="operand")
        b_tile = dsl.load(b[n * BN, k * BK], (BN, BK), role="operand")
        dsl.gemm(a_tile, b_tile, acc, transpose_b=True)
    return acc


def k_ranges(k_blocks, SPLIT, s):
    """The K blocks of range s of SPLIT contiguous ranges: floor(s * k_blocks / SPLIT) ..
    floor((s + 1) * k_blocks / SPLIT) - 1 (empty where there are more ranges than blocks)."""
    return s * k_blocks // SPLIT, (s + 1) * k_blocks // SPLIT


def sum_ranges(partial, corner, shape, SPLIT):
    """The SPLIT partial tiles ``partial[s, *corner]`` added in range order: a fixed order with no
    atomics, so a row's sum is the same at every batch size and on every run."""
    total = dsl.zeros(shape, dsl.f32)
    for s in dsl.range(SPLIT):
        total[:] = total + dsl.load(partial[(s, *corner)], shape)
    return total


@dsl.kernel(bucketed=("M",))
def gemm(a: dsl.Tensor["M", "K", dsl.bf16 | dsl.f8e4m3], b: dsl.Tensor["N", "K", dsl.bf16 | dsl.f8e4m3],
         c: dsl.Tensor["M", "N", dsl.bf16 | dsl.f32],
         a_scale: dsl.OptionalTensor["M", dsl.f32] = None, b_scale: dsl.OptionalTensor["N", dsl.f32] = None,
         *,
         BM: dsl.Tunable = dsl.choice(128, 64, 256),
         BN: dsl.Tunable = dsl.choice(256, 128, 64, 192, 32),
         BK: dsl.Tunable = dsl.choice(64, 128, 32),
         STAGES: dsl.Tunable = dsl.int_range(2, 5, default=3),
         SPLIT: dsl.Tunable = dsl.choice(1, 2, 4, 8, 16, 32)):
    k_blocks = dsl.cdiv(a.K, BK)
    tiles = (dsl.cdiv(a.M, BM), dsl.cdiv(b.N, BN))
    if SPLIT == 1:
        for m, n in dsl.grid(*tiles):
            acc = _k_range(a, b, m, n, 0, k_blocks, BM, BN, BK, STAGES)
            dsl.store(c[m * BM, n * BN], _scaled(acc, a_scale, b_scale, m, n, BM, BN).to(c.dtype))
        return
    # a few rows (decode): SPLIT contiguous ranges of K blocks fill the SMs that the few output
    # tiles would leave idle; the partial sums are added in range order (no atomics), then scaled
    partial = dsl.workspace("partial", (SPLIT, a.M, b.N), dsl.f32)
    for m, n, s in dsl.grid(*tiles, SPLIT):
        acc = _k_range(a, b, m, n, *k_ranges(k_blocks, SPLIT, s), BM, BN, BK, STAGES)
        dsl.store(partial[s, m * BM, n * BN], acc)
    for m, n in dsl.grid(*tiles):
        total = sum_ranges(partial, (m * BM, n * BN), (BM, BN), SPLIT)
        dsl.store(c[m * BM, n * BN], _scaled(total, a_scale, b_scale, m, n, BM, BN).to(c.dtype))


def gemm_reference(a, b, a_scale=None, b_scale=None) -> dict:
    out = a.float() @ b.float().t()
    if a_scale is not None:
        out = out * a_scale.float()[:, None]
    if b_scale is not None:
        out = out * b_scale.float()[None, :]
    return {"c": out.to(torch.bfloat16)}


def _quantise_rows(x: torch.Tensor):
    """Per-row fp8 e4m3 with an fp32 scale: x ~= q * scale."""
    scale = x.abs().amax(dim=1).clamp(min=1e-4) / FP8_MAX
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale.float()


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    m, n, k = case["M"], case["N"], case["K"]
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g)
    out = {"c": torch.empty(m, n, dtype=torch.float32 if case.get("out") == "f32" else torch.bfloat16)}
    if case.get("dtype", "bf16") == "f8e4m3":
        out["a"], sa = _quantise_rows(a)
        out["b"], sb = _quantise_rows(b)
        if case.get("scales", True):
            out["a_scale"], out["b_scale"] = sa, sb
    else:
        out["a"], out["b"] = a.to(torch.bfloat16), b.to(torch.bfloat16)
        if case.get("scales", False):
            out["a_scale"] = torch.rand(m, generator=g) + 0.5
            out["b_scale"] = torch.rand(n, generator=g) + 0.5
    return {k: v.to(device) for k, v in out.items()}


def _fp8_accumulation_error(case, output, inputs):
    """Hopper's fp8 tensor cores add products with a mantissa narrower than fp32 (about 13 bits
    within one instruction chain), so an element's error scales with sum_k |a_ik b_jk|, not with
    the result: cancelling sums keep an absolute error that a relative tolerance would reject."""
    if case.get("dtype", "bf16") != "f8e4m3":
        return torch.zeros(())
    mag = inputs["a"].float().abs() @ inputs["b"].float().abs().t()
    if "a_scale" in inputs:
        mag = mag * inputs["a_scale"].float()[:, None]
    if "b_scale" in inputs:
        mag = mag * inputs["b_scale"].float()[None, :]
    return mag * 2.0 ** -11


def _tolerance(case, output):
    # fp32 accumulation of K products; the result is rounded once to bf16 (rel 2^-8).
    # Products of fp8 inputs are exact in fp32, so the error is the bf16 rounding plus
    # summation-order differences of order K * eps32 * |terms|.
    scale = 1.0 if case.get("dtype", "bf16") == "bf16" else 8.0
    return (1e-2 * scale * (case["K"] / 64) ** 0.5, 1e-2)


SPEC = register(Spec(
    kernel=gemm,
    reference=gemm_reference,
    make_inputs=_inputs,
    outputs=("c",),
    cases={
        "bf16_128": {"M": 128, "N": 128, "K": 128},
        "bf16_ragged": {"M": 200, "N": 136, "K": 200},
        "bf16_scaled": {"M": 96, "N": 160, "K": 64, "scales": True},
        "fp8_scaled": {"M": 130, "N": 256, "K": 256, "dtype": "f8e4m3"},
        "fp8_plain": {"M": 64, "N": 64, "K": 128, "dtype": "f8e4m3", "scales": False},
        # decode rows with K split in ranges of 1 and 2 blocks (7 blocks in 4 ranges), scaled after the sum
        "fp8_split4": {"M": 3, "N": 96, "K": 224, "dtype": "f8e4m3",
                       "config": {"BM": 64, "BN": 32, "BK": 32, "SPLIT": 4}},
        "bf16_split8_scaled": {"M": 1, "N": 40, "K": 200, "scales": True,
                               "config": {"BM": 64, "BN": 32, "BK": 32, "SPLIT": 8}},
        "bf16_f32out": {"M": 70, "N": 96, "K": 160, "out": "f32"},
        "bf16_f32out_split4": {"M": 2, "N": 64, "K": 256, "out": "f32",
                               "config": {"BM": 64, "BN": 32, "BK": 32, "SPLIT": 4}},
    },
    build_cases={"bf16_8192": {"M": 8192, "N": 8192, "K": 8192},
                 "fp8_8192": {"M": 8192, "N": 8192, "K": 8192, "dtype": "f8e4m3"}},
    tolerance=_tolerance,
    extra_error=_fp8_accumulation_error,
    flops=lambda c: 2.0 * c["M"] * c["N"] * c["K"],
    model_shapes=shapes.for_models(shapes.gemm_shapes),
    # rows are free; a row of A, B (K) or C (N) is a whole number of 16 bytes, as TMA needs
    sweep={"M": Dim(1, 300, large=4100), "N": Dim(8, 320, multiple=8, large=4104),
           "K": Dim(16, 336, multiple=16, large=4112), "dtype": OneOf("bf16", "f8e4m3"), "scales": OneOf(False, True),
           "config": {"SPLIT": OneOf(1, 2, 4, 8), "BK": OneOf(32, 64)}},
))
