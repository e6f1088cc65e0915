"""C = A @ B^T in FP32 on BF16 tensor cores: each FP32 operand split into three BF16 parts.

    p0 = x.to(bf16)      p1 = (x - p0).to(bf16)      p2 = (x - p0 - p1).to(bf16)      x = p0 + p1 + p2 + r
    C ~= sum of A_i B_j^T over the parts with i + j <= 2                  (one FP32 accumulator)

The runtime's FP32 projections (model op ``linear`` where an operand is not a BF16 value): V4.1's
compressor ``wkv`` / ``wgate`` [512, 5120] (FP32 weights, model.md 2.13) and V4's indexer
Hadamard-128 (entries +-2^-3.5, model.md 2.5.5), both against BF16 activations, and every
projection of a model run with FP32 activations. ``a`` and ``b`` are each FP32 or BF16: a BF16
operand is its own only part, so a BF16 activation against an FP32 weight takes three gemms a K
step (six with both split), and reads half the activation bytes. Both BF16 is one gemm (``gemm``'s
FP32 result, which the runtime calls for that).

Three parts, not two: with two (``hi + lo``, three gemms for two FP32 operands) the split leaves
2^-16 of each product where the reference's FP32 matmul leaves 2^-24, and in the tiny models
(``duotile/runtime/presets.py``) that alone moved the logits by 0.28 where reordering the FP32
sums moves them by 0.03 (2026-12-02, the interpreter). Three parts leave what FP32 itself does.

**The error** (every bound relative to ``S = |A| @ |B|^T``, the sum of the products' magnitudes):

* The split. With ``u = 2^-8`` (BF16 keeps 8 significant bits, rounded to nearest), each part
  rounds what the earlier ones leave: ``|e_i| <= u^i |x|`` for the remainder after i parts, so
  ``|p_0| <= (1 + u) |x|``, ``|p_i| <= u^i (1 + u) |x|`` and ``|r| <= u^3 |x|``. Each BF16 x BF16
  product is exact in FP32. The terms left out of ``a b`` are the part products with i + j > 2
  (``a_1 b_2``, ``a_2 b_1``, ``a_2 b_2``) and ``(a - a_r) b_r + a_r b``: about ``4 x 2^-24`` of
  ``|a||b|`` with both operands split, ``2^-24`` where one is BF16 (only the other's ``r`` is
  left), zero where both are (``split_error``). A BF16 GEMM of the operands rounded to BF16 leaves
  up to ``2^-8 (2 + 2^-8)`` of ``|a||b|``.
* The FP32 sums. The kernel adds ``n`` products (``K`` for each gemm a K step runs) into one
  FP32 accumulator in an order the target picks; each add rounds by at most an ulp, 2^-23 of the
  partial sum (round to nearest gives half that; tensor cores' adders may truncate), and the
  products' magnitudes add to at most ``(1 + u)^2 (1 + 2u) S < (1 + 2^-5) S``:
  ``n 2^-23 (1 + 2^-5) S``. The reference
  is an FP32 matmul, ``K`` products rounded to nearest and summed: ``K 2^-24 S``. The bound is the
  sum of the two, since both are compared with the exact product.
* The bottom of the range. A part or a product below 2^-126 is an FP32 subnormal, which a
  target may flush to zero: at most 2^-126 an element of each lower part (times the other
  operand) and a product; ``2^-124 (sum_k |a_ik| + sum_k |b_jk| + 4 K)`` covers them (the lowest
  part of values near 2^-110 and below; every case's values are far from it but ``tiny``'s).
  ``|x|`` must stay below the largest BF16 (``p_0`` would be infinite): about 3.39e38.

Model shapes: V4.1's compressor projection (N 512 = head dim, K 5120 = hidden; ``wkv`` and
``wgate`` are the same GEMM) at decode rows 1, 16, 64 and a prefill chunk; V4's Hadamard-128 on
the index queries (64 heads a token: 64 x the decode batch, 64 x a prefill chunk) and the index
keys (a decode step's one compressed row, a prefill chunk's 4096 / 4). ``SPLIT`` cuts K into
contiguous ranges added in range order, as ``gemm`` does at decode.

An FP32 tile is a vector load (its split is vector work, which reads vector tiles on every target);
its parts are the gemms' operands. A BF16 tile is loaded as an operand.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .gemm import k_ranges, sum_ranges
from .registry import Dim, OneOf, Spec, register

U_BF16 = 2.0 ** -8  # unit roundoff of BF16 (8 significant bits)
ULP_ADD = 2.0 ** -23  # an FP32 add: at most an ulp of the partial sum (truncated or rounded)
U_F32 = 2.0 ** -24  # the reference's FP32 matmul: round to nearest
TINY = 2.0 ** -126  # the smallest normal FP32 (and BF16): below it a target may flush to zero
INDEX_RATIO = 4  # V4's indexer compressor: one index key per 4 tokens (model.md 2.5.5)


PARTS = 3  # BF16 parts of an FP32 operand


def bf16_parts(tile, n: int = PARTS) -> list:
    """An FP32 tile as ``n`` BF16 tiles, largest first: its BF16 rounding, then the BF16 rounding of
    what each leaves (vector work). Their sum keeps 8 n significant bits (the module docstring's
    bound); a gemm over each part, the small ones first, takes the tile at that precision."""
    rest, parts = tile, []
    for i in range(n):
        parts.append(rest.to(dsl.bf16))
        if i < n - 1:
            rest = rest - parts[-1].to(dsl.f32)
    return parts


def _parts(x, corner, shape):
    """The BF16 parts of the tile of ``x`` at ``corner`` (``bf16_parts`` of a vector load); a BF16
    tile is its only part, loaded as a gemm operand."""
    if x.dtype == dsl.bf16:
        return [dsl.load(x[corner], shape, role="operand")]
    return bf16_parts(dsl.load(x[corner], shape))


def _pairs(a_parts: int, b_parts: int) -> list[tuple[int, int]]:
    """The part products a K step runs, (i, j) with i + j < PARTS, the smallest terms first."""
    kept = [(i, j) for i in range(a_parts) for j in range(b_parts) if i + j < PARTS]
    return sorted(kept, key=lambda p: (-(p[0] + p[1]), p))


def _k_range(a, b, m, n, k_start, k_stop, BM, BN, BK, STAGES):
    """acc = A[m tile] @ B[n tile]^T over K blocks k_start .. k_stop - 1, by ``_pairs``."""
    acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
    for k in dsl.pipelined(k_stop, stages=STAGES, start=k_start):
        ap = _parts(a, (m * BM, k * BK), (BM, BK))
        bp = _parts(b, (n * BN, k * BK), (BN, BK))
        for i, j in _pairs(len(ap), len(bp)):
            dsl.gemm(ap[i], bp[j], acc, transpose_b=True)
    return acc


@dsl.kernel(bucketed=("M",))
def gemm_f32(a: dsl.Tensor["M", "K", dsl.f32 | dsl.bf16], b: dsl.Tensor["N", "K", dsl.f32 | dsl.bf16],
             c: dsl.Tensor["M", "N", dsl.f32], *,
             BM: dsl.Tunable = dsl.choice(128, 64),
             BN: dsl.Tunable = dsl.choice(128, 64, 256, 32),
             BK: dsl.Tunable = dsl.choice(32, 64),
             STAGES: dsl.Tunable = dsl.int_range(1, 4, default=2),
             SPLIT: dsl.Tunable = dsl.choice(1, 2, 4, 8, 16, 32)):
    k_blocks = dsl.cdiv(a.K, BK)
    tiles = (dsl.cdiv(a.M, BM), dsl.cdiv(b.N, BN))
    if SPLIT == 1:
        for m, n in dsl.grid(*tiles):
            dsl.store(c[m * BM, n * BN], _k_range(a, b, m, n, 0, k_blocks, BM, BN, BK, STAGES))
        return
    # a few rows (decode): SPLIT contiguous ranges of K blocks, their partial sums added in range order
    partial = dsl.workspace("partial", (SPLIT, a.M, b.N), dsl.f32)
    for m, n, s in dsl.grid(*tiles, SPLIT):
        acc = _k_range(a, b, m, n, *k_ranges(k_blocks, SPLIT, s), BM, BN, BK, STAGES)
        dsl.store(partial[s, m * BM, n * BN], acc)
    for m, n in dsl.grid(*tiles):
        dsl.store(c[m * BM, n * BN], sum_ranges(partial, (m * BM, n * BN), (BM, BN), SPLIT))


def gemm_f32_reference(a, b) -> dict:
    """The definition: an FP32 matmul of the operands' values."""
    return {"c": torch.matmul(a.float(), b.float().t())}


# -- the error bound (the module docstring derives it) ----------------------------------------------
def _magnitudes(split: bool) -> tuple[list[float], float]:
    """(the bound on each part's magnitude, the remainder's), as shares of |x|."""
    if not split:
        return [1.0], 0.0
    return [(1 + U_BF16) * U_BF16 ** i for i in range(PARTS)], U_BF16 ** PARTS


def split_error(a_split: bool, b_split: bool) -> float:
    """The dropped terms' share of ``|a||b|``: the part products ``_pairs`` leaves out, and
    ``(a - a_r) b_r + a_r b``."""
    (ma, ra), (mb, rb) = _magnitudes(a_split), _magnitudes(b_split)
    kept = set(_pairs(len(ma), len(mb)))
    dropped = sum(x * y for i, x in enumerate(ma) for j, y in enumerate(mb) if (i, j) not in kept)
    return dropped + (1 + ra) * rb + ra


def products(a_split: bool, b_split: bool) -> int:
    """The gemms a K step runs."""
    return len(_pairs(PARTS if a_split else 1, PARTS if b_split else 1))


def error_bound(a: torch.Tensor, b: torch.Tensor, a_split: bool = True, b_split: bool = True) -> torch.Tensor:
    """The largest ``|kernel - FP32 matmul|`` for each element of ``a @ b^T`` (M x N), where the
    kernel splits the operands named (an FP32 one; a BF16 one is not split)."""
    k = a.shape[-1]
    af, bf = a.float().abs(), b.float().abs()
    s = af.double() @ bf.double().t()
    n = k * products(a_split, b_split)  # the products the kernel adds
    rel = split_error(a_split, b_split) + n * ULP_ADD * (1 + 2.0 ** -5) + k * U_F32
    floor = 4 * TINY * (af.sum(-1, dtype=torch.float64)[:, None] + bf.sum(-1, dtype=torch.float64)[None, :] + 4 * k)
    return (rel * s + floor).float()


def _extra_error(case, output, inputs):
    return error_bound(inputs["a"], inputs["b"], inputs["a"].dtype == torch.float32,
                       inputs["b"].dtype == torch.float32)


def _operand(g, rows, k, case, which):
    """FP32 values with full 24-bit significands (so lo is not zero), times 2^exp_<which>; with
    ``spread``, each row times its own power of two over 2^-20 .. 2^20; with ``zeros``, row 0 and
    every 7th value zero; BF16 where the case says so (its values rounded)."""
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    if case.get("spread"):
        x = x * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).double())
    if case.get("zeros"):
        x[0] = 0.0
        x.view(-1)[::7] = 0.0
    x = (x * 2.0 ** case.get(f"exp_{which}", 0)).float()
    return x.to(torch.bfloat16) if case.get(f"{which}_dtype", "f32") == "bf16" else x


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    m, n, k = case["M"], case["N"], case["K"]
    out = {"a": _operand(g, m, k, case, "a"), "b": _operand(g, n, k, case, "b"),
           "c": torch.empty(m, n, dtype=torch.float32)}
    return {name: t.to(device) for name, t in out.items()}


def f32_projection_shapes(m: shapes.ModelDims, decode_m=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The projections each model runs against an FP32 matrix, with BF16 activations: V4.1's
    compressor (``wkv``, and ``wgate`` of the same shape) at decode rows and a prefill chunk; V4's
    Hadamard-128 on the index queries (every index head of each token) and on the index keys (one
    a decode step, ``PREFILL_CHUNK / 4`` a chunk)."""
    chunk = shapes.PREFILL_CHUNK
    rows: dict[str, list[tuple[str, int]]] = {}
    if m.name == shapes.V41_FLASH.name:  # FP32 compressor weights (model.md 2.13); V4's are BF16
        n, k = m.head_dim, m.hidden
        rows["compressor_wkv"] = [*((f"decode{b}", b) for b in decode_m), (f"prefill{chunk}", chunk)]
    else:  # the Hadamard of the index queries and keys (model.md 2.5.5); V4.1 has none
        n = k = m.index_head_dim
        rows["index_hadamard_q"] = [*((f"decode{b}", b * m.index_heads) for b in decode_m),
                                    (f"prefill{chunk}", chunk * m.index_heads)]
        rows["index_hadamard_k"] = [("decode1", 1), (f"prefill{chunk}", chunk // INDEX_RATIO)]
    return {f"{m.short}/{name}/{phase}": {"M": rows_m, "N": n, "K": k, "a_dtype": "bf16", "model": m.name}
            for name, phases in rows.items() for phase, rows_m in phases}


SPEC = register(Spec(
    kernel=gemm_f32,
    reference=gemm_f32_reference,
    make_inputs=_inputs,
    outputs=("c",),
    cases={
        "tiles_128": {"M": 128, "N": 128, "K": 128},
        # ragged M, N and K tails (K: 6 blocks of 32 and 4 left), a zero row and scattered zeros
        "ragged_zeros": {"M": 130, "N": 100, "K": 196, "zeros": True, "config": {"BM": 64, "BN": 64, "BK": 32}},
        "large": {"M": 64, "N": 72, "K": 96, "exp_a": 60, "exp_b": 40},  # products near 2^100
        "tiny": {"M": 40, "N": 64, "K": 64, "exp_a": -60, "exp_b": -40},  # near 2^-100: lo still normal
        "spread": {"M": 96, "N": 48, "K": 128, "spread": True},  # rows 2^-20 .. 2^20 apart
        "bf16_a": {"M": 70, "N": 96, "K": 160, "a_dtype": "bf16"},  # the runtime's compressor / Hadamard form
        "bf16_b": {"M": 33, "N": 40, "K": 96, "b_dtype": "bf16"},
        # decode: one row, 7 blocks of 32 (a ragged last one) in 4 ranges of 1, 2, 2 and 2 blocks
        "m1_split4": {"M": 1, "N": 64, "K": 216, "config": {"BM": 64, "BN": 32, "BK": 32, "SPLIT": 4}},
        "m1_bf16_a_split2": {"M": 1, "N": 36, "K": 256, "a_dtype": "bf16",
                             "config": {"BM": 64, "BN": 32, "BK": 64, "SPLIT": 2}},
    },
    build_cases={"f32_4096": {"M": 4096, "N": 4096, "K": 4096},
                 "bf16_a_decode": {"M": 1, "N": 512, "K": 5120, "a_dtype": "bf16"}},
    tolerance=lambda case, output: (0.0, 0.0),  # the whole bound is the elementwise one
    extra_error=_extra_error,
    flops=lambda c: 2.0 * c["M"] * c["N"] * c["K"] * products(c.get("a_dtype") != "bf16", c.get("b_dtype") != "bf16"),
    model_shapes=shapes.for_models(f32_projection_shapes),
    # a row of A or B (K) is a whole number of 16 bytes in either dtype, and one of C (N) of FP32
    sweep={"M": Dim(1, 300, large=4100), "N": Dim(4, 320, multiple=4, large=4104),
           "K": Dim(8, 336, multiple=8, large=4112), "a_dtype": OneOf("f32", "f32", "bf16"),
           "b_dtype": OneOf("f32", "f32", "bf16"), "exp_a": OneOf(0, 0, -50, 50), "spread": OneOf(False, True),
           "zeros": OneOf(False, True), "config": {"SPLIT": OneOf(1, 2, 4), "BK": OneOf(32, 64)}},
))
