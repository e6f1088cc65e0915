"""FP8 block-scaled GEMM (model.md 2.7, 2.10, 4, 5.1; V4.1 in 1.7, 2.13, 4.3): every dense FP8
projection of V4-Flash and V4.1-Flash, and the grouped ``wo_a`` of both.

    C[g] = sum over K blocks kb of  (A[g][:, kb] @ B[g][:, kb]^T) * sa[g][:, kb] * sb[g][n // BLOCK, kb]

* ``a`` (G x M x K, e4m3): the activations, quantised per row and ``BLOCK`` channels by the
  quantiser (``quantize.py``); ``a_scale`` (G x M x KB, uint8) its UE8M0 codes, KB = ceil(K / BLOCK).
* ``b`` (G x N x K, e4m3): the weight as the checkpoint stores it ([out, in]); ``b_scale``
  (G x ceil(N / BLOCK) x KB, uint8) one UE8M0 code per BLOCK x BLOCK weight block. Both releases
  store these scales as UE8M0 (``F8_E8M0`` tensors in V4, ``scale_fmt: ue8m0`` in V4.1), never as
  fp32, so the kernel takes codes only: a ``float8_e8m0fnu`` tensor is passed as its uint8 view.
* ``BLOCK`` is 128 for V4 (1 x 128 activation and 128 x 128 weight blocks) and 32 for V4.1
  (``weight_block_size [32, 32]``, MXFP8's 1 x 32 activations).
* ``c`` (G x M x N, bf16 or f32): fp32 accumulation, one rounding to C's dtype. The runtime
  takes FP32, as its reference projection keeps it (a BF16 C, one rounding of every projection,
  moved the tiny models' logits by about 0.5 where the sum order alone moves them by 0.03); the
  benchmarks' peer writes BF16. The reference rounds to bf16 either way, and the tolerance
  (``RTOL``: one bf16 ulp) covers an FP32 C too.

G is the group axis of ``wo_a`` (8 groups of [T x 4096 -> 1024]); the dense projections pass
G = 1 (``x[None]``). A group's A, C and scales are contiguous [M, *] slices, i.e. the attention
output is read group-major ([G, T, 4096]), not as the [T, G * 4096] rows model.md writes.

UE8M0 codes become scales with bit operations: ``code << 23`` is the f32 whose biased exponent is
the code, i.e. 2^(code - 127), for codes 1..254; code 0 is 2^-127 (the subnormal 0x00400000) and
code 255 is NaN. The scale of an output element and K block is ``sa * sb``, formed before it meets
the partial sum, so that a large and a small code (2^127 x 2^-126) never overflow on the way. CUDA
builds flush f32 subnormals: there a code-0 scale, and any ``sa * sb`` under 2^-126, count as zero;
such terms are below 2^-101 in size (|partial| < 2^25), within the tolerance's absolute part. The
quantisers never write code 0 (the activations' amax floor 1e-4 gives codes >= 105, the weight
codec's 2^-100 codes >= 19).

Promotion, as DeepGEMM does it: each K step loads ``BK`` columns and runs one gemm per scale block
in it (``BK / BLOCK`` of them when BK > BLOCK), each into a fresh fp32 partial that is scaled and
added to the accumulator; with BK < BLOCK (BLOCK a multiple of BK) each step promotes with its
block's scale. So BK must divide BLOCK or be a multiple of it. Speed: at V4.1's 32-wide blocks a
promotion (two multiplies and an add per accumulator element) follows every 32 of K, about as
much CUDA-core work as the tensor cores' 32-deep gemm it follows, and TileLang waits for each
gemm before its promotion; V4's 128-wide blocks promote a quarter as often. Overlapping the
promotion with the next gemm (the manual schedule's two step fragments) is not done yet for
per-block scales.

``SCALES = "operands"`` computes the same sum with the scales in the operands instead: one gemm
a K step of ``dsl.mxfp8_values(a, sa)`` by ``dsl.mxfp8_values(b, sb)``, each weight row's codes
gathered from its block row, and no promotion. A target whose tensor cores apply UE8M0 block
scales runs it as one block-scaled MMA a step at the FP8 rate, exact products at every code (its
shipped config; docs/ffn_path.md). Elsewhere the values are made bf16 first (exact for codes
10..246, which the quantisers and checkpoints stay within: the edge-code cases are the promotion
form's), at half the tensor-core rate: the promotion form stays the default.

Decode (M = 1..64) reads the whole weight for a few rows: the kernel is weight-bandwidth bound
and a grid of output tiles fills few SMs. ``SPLIT`` cuts the K steps into that many contiguous
ranges (phase 0 writes each range's fp32 partial into a workspace) and phase 1 adds the ranges
in order, so a row's result is the same at every M and on every run (no atomics); the same split
serves every M (``batch_dim="M"``), prefill included, where it costs a round trip of
``SPLIT x M x N`` fp32 partial sums. ``SPLIT = 1`` is one phase.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.builder import error
from . import model_shapes as shapes
from .gemm import k_ranges, sum_ranges
from .registry import Dim, OneOf, Spec, register

FP8_MAX = 448.0
NAN_BITS = 0x7FC00000  # the f32 quiet NaN: UE8M0 code 255
CODE0_BITS = 0x00400000  # 2^-127, an f32 subnormal: UE8M0 code 0


def _pow2(code):
    """UE8M0 codes (any integer tile) -> the f32 scales 2^(code - 127), from bits."""
    c = code.to(dsl.i32)
    bits = dsl.where(c.eq(255), NAN_BITS, dsl.where(c.eq(0), CODE0_BITS, c << 23))
    return bits.bitcast(dsl.f32)


def _column_codes(b_scale, g, n, kb, BN, BLOCK):
    """The weight scale codes of output columns n*BN .. n*BN+BN-1 at K block kb, a (1, BN) tile:
    each column takes the code of its block row (a tile may touch several)."""
    first = n * BN // BLOCK
    rows = BN // BLOCK if BN % BLOCK == 0 else (BN - 1) // BLOCK + 2  # block rows a tile can touch
    rel = ((dsl.arange(BN) + n * BN % BLOCK) // BLOCK)[None, :]  # each column's row, from the first
    code = dsl.load(b_scale[g, first, kb], (1, 1)).to(dsl.i32)
    for r in range(1, rows):
        code = dsl.where(rel.eq(r), dsl.load(b_scale[g, first + r, kb], (1, 1)).to(dsl.i32), code)
    return code


def _scaled_operands(a, a_scale, b, b_scale, g, m, n, k_start, k_stop, BM, BN, BK, BLOCK, STAGES):
    """The same sum with the scales in the operands (``SCALES="operands"``): one gemm a step of
    ``dsl.mxfp8_values`` by ``dsl.mxfp8_values``, each side's codes a tile beside its values (a
    weight row's codes are those of its block row: a gather of the code rows by row index). No
    promotion follows a gemm: a target with a block-scaled MMA applies the codes in it, at the FP8
    rate; elsewhere the values are made bf16 first (half the rate, and CUDA-core work a step)."""
    groups = BK // BLOCK or 1  # the step's code columns: one a block, or the one block it lies in
    acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
    block_rows = (n * BN + dsl.arange(BN)) // BLOCK  # each output column's weight block row
    for k in dsl.pipelined(k_stop, stages=STAGES, start=k_start):
        col = k * BK
        x = dsl.load(a[g, m * BM, col], (BM, BK), role="operand")
        xs = dsl.load(a_scale[g, m * BM, col // BLOCK], (BM, groups), role="operand")
        w = dsl.load(b[g, n * BN, col], (BN, BK), role="operand")
        ws = dsl.load(b_scale[g, block_rows, col // BLOCK], (BN, groups), role="operand")
        dsl.gemm(dsl.mxfp8_values(x, xs), dsl.mxfp8_values(w, ws), acc, transpose_b=True)
    return acc


def _partial(a, a_scale, b, b_scale, g, m, n, k_start, k_stop, BM, BN, BK, BLOCK, STAGES, SCALES="promote"):
    """The block-scaled sum over K steps k_start .. k_stop-1 (BK columns each) of one output tile.
    The scales are decoded into buffers once a block (BM + BN elements), so the promotion costs a
    multiply-add per accumulator element (two multiplies and an add where the tile's columns
    span several weight block rows)."""
    if SCALES == "operands":
        return _scaled_operands(a, a_scale, b, b_scale, g, m, n, k_start, k_stop, BM, BN, BK, BLOCK, STAGES)
    width = min(BK, BLOCK)  # columns of one gemm: one scale block, or a step within one
    one_row = BLOCK % BN == 0  # the tile's columns lie in one weight block row: sb is one value
    acc = dsl.zeros((BM, BN), dsl.f32)
    row_scale = dsl.empty((BM, 1), dsl.f32)  # sa, times sb where sb is one value
    col_scale = None if one_row else dsl.empty((1, BN), dsl.f32)
    for k in dsl.pipelined(k_stop, stages=STAGES, start=k_start):
        for j in range(BK // width):  # unrolled: the scale blocks of this step
            col = k * BK + j * width
            kb = col // BLOCK
            a_tile = dsl.load(a[g, m * BM, col], (BM, width), role="operand")
            b_tile = dsl.load(b[g, n * BN, col], (BN, width), role="operand")
            part = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
            dsl.gemm(a_tile, b_tile, part, transpose_b=True)
            sa = _pow2(dsl.load(a_scale[g, m * BM, kb], (BM, 1)))
            if one_row:
                row_scale[:] = sa * _pow2(dsl.load(b_scale[g, n * BN // BLOCK, kb], (1, 1)))
                acc[:] = acc + part * row_scale
            else:
                row_scale[:] = sa
                col_scale[:] = _pow2(_column_codes(b_scale, g, n, kb, BN, BLOCK))
                acc[:] = acc + part * (row_scale * col_scale)  # the scale first: no overflow on the way
    return acc


# SPLIT defaults to 4, the two-phase form, for the tuning cache key (see gemm_splitk.py)
@dsl.kernel(batch_dim="M", dynamic=("M",))
def gemm_blockscaled(a: dsl.Tensor["G", "M", "K", dsl.f8e4m3], a_scale: dsl.Tensor["G", "M", "KB", dsl.u8],
                     b: dsl.Tensor["G", "N", "K", dsl.f8e4m3], b_scale: dsl.Tensor["G", "NB", "KB", dsl.u8],
                     c: dsl.Tensor["G", "M", "N", dsl.bf16 | dsl.f32], *,
                     BLOCK: dsl.Const = 128,
                     BM: dsl.Tunable = dsl.choice(64, 128, 16),
                     BN: dsl.Tunable = dsl.choice(128, 64, 256, 32, 192),
                     BK: dsl.Tunable = dsl.choice(128, 64, 256, 32),
                     STAGES: dsl.Tunable = dsl.int_range(2, 4, default=3),
                     SPLIT: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16, 32),
                     SCALES: dsl.Tunable = dsl.enum("promote", "operands")):
    if BK % BLOCK and BLOCK % BK:
        raise error(f"BK = {BK} and BLOCK = {BLOCK}: a K step must hold whole scale blocks or lie "
                    f"within one (BK a multiple or a divisor of BLOCK)")
    steps = dsl.cdiv(a.K, BK)
    n_tiles = dsl.cdiv(b.N, BN)
    if SPLIT == 1:
        for g, m, n in dsl.grid(a.G, dsl.cdiv(a.M, BM), n_tiles):
            acc = _partial(a, a_scale, b, b_scale, g, m, n, 0, steps, BM, BN, BK, BLOCK, STAGES, SCALES)
            dsl.store(c[g, m * BM, n * BN], acc.to(c.dtype))
        return
    partial = dsl.workspace("partial", (SPLIT, a.G, a.M, b.N), dsl.f32)
    for gn, m, s in dsl.grid(a.G * n_tiles, dsl.cdiv(a.M, BM), SPLIT):  # group and column tile in one axis
        g, n = gn // n_tiles, gn % n_tiles
        acc = _partial(a, a_scale, b, b_scale, g, m, n, *k_ranges(steps, SPLIT, s), BM, BN, BK, BLOCK, STAGES,
                       SCALES)
        dsl.store(partial[s, g, m * BM, n * BN], acc)
    for g, m, n in dsl.grid(a.G, dsl.cdiv(a.M, BM), n_tiles):
        dsl.store(c[g, m * BM, n * BN], sum_ranges(partial, (g, m * BM, n * BN), (BM, BN), SPLIT).to(c.dtype))


# -- reference ------------------------------------------------------------------------------------
def ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes as their values 2^(code - 127) in float64 (code 255: NaN), float8_e8m0fnu's
    meaning, computed with a power of two (exact in float64) on any device."""
    values = torch.pow(2.0, codes.double() - 127.0)
    return torch.where(codes == 255, torch.full_like(values, float("nan")), values)


def _expanded_scales(a_scale, b_scale, n: int, k: int, block: int):
    """Each element's scale (float64): G x M x K for A, G x N x K for B."""
    sa = ue8m0_values(a_scale).repeat_interleave(block, -1)[..., :k]
    sb = ue8m0_values(b_scale).repeat_interleave(block, -2).repeat_interleave(block, -1)
    return sa, sb[:, :n, :k]


def gemm_blockscaled_reference(a, a_scale, b, b_scale, BLOCK: int = 128) -> dict:
    """model.md 2.7's sum over K blocks, s_act[blk] * s_w[blk] * (a_q . w_q), in exact arithmetic:
    each fp8 element times its block's scale (a power of two, exact in float64), one float64 matmul
    (products of e4m3 values are exact, sums of these sizes lose nothing a bf16 result keeps),
    rounded once to bf16. The kernel's fp32 accumulation is what the tolerance admits."""
    sa, sb = _expanded_scales(a_scale, b_scale, b.shape[1], a.shape[-1], BLOCK)
    out = (a.double() * sa) @ (b.double() * sb).transpose(1, 2)
    return {"c": out.to(torch.bfloat16)}


# -- inputs ---------------------------------------------------------------------------------------
def _codes(kind: str, shape, lo_hi, g: torch.Generator) -> torch.Tensor:
    lo, hi = lo_hi
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int32)


# UE8M0 code ranges (activation, weight) per case kind; "edge" is set per K block in _scale_codes
SCALE_KINDS = {
    "normal": ((118, 134), (112, 128)),  # activations near 2^0, weights near 2^-8
    "spread": ((97, 157), (97, 157)),  # 2^-30 .. 2^30 each: blocks that differ by up to 2^120
}


def _scale_codes(kind: str, gs: int, m: int, nb: int, kb: int, g: torch.Generator):
    """(activation codes G x M x KB, weight codes G x NB x KB). ``edge``: the extreme codes, by K
    block: 1..2 against 230..254, 252..254 against 1..30 (scales up to 2^127 whose products stay
    in range), and 0 (2^-127) against weights of at most 2^-7, whose terms are below 2^-100."""
    if kind != "edge":
        (alo, ahi), (blo, bhi) = SCALE_KINDS[kind]
        return _codes(kind, (gs, m, kb), (alo, ahi), g), _codes(kind, (gs, nb, kb), (blo, bhi), g)
    ranges = [((1, 2), (230, 254)), ((252, 254), (1, 30)), ((0, 0), (100, 120))]
    sa = torch.empty(gs, m, kb, dtype=torch.int32)
    sb = torch.empty(gs, nb, kb, dtype=torch.int32)
    for j in range(kb):
        ra, rb = ranges[j % 3]
        sa[:, :, j] = _codes(kind, (gs, m), ra, g)
        sb[:, :, j] = _codes(kind, (gs, nb), rb, g)
    return sa, sb


def _fp8_values(shape, g: torch.Generator) -> torch.Tensor:
    """e4m3 values over the format's range (subnormals to 448), with signs."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 7, shape, generator=g).float())
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _block(case) -> int:
    """A case's BLOCK: named, or (model shapes, whose keys are all sizes) K over the scale blocks KB."""
    return case.get("BLOCK", case["K"] // case["KB"] if "KB" in case else 128)


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    gs, m, n, k, block = case.get("G", 1), case["M"], case["N"], case["K"], _block(case)
    kb, nb = -(-k // block), -(-n // block)
    a, b = _fp8_values((gs, m, k), g), _fp8_values((gs, n, k), g)
    if case.get("zero_rows"):
        a[:, ::3] = 0.0  # every third row
    sa, sb = _scale_codes(case.get("scales", "normal"), gs, m, nb, kb, g)
    out = {"a": a, "a_scale": sa.to(torch.uint8), "b": b, "b_scale": sb.to(torch.uint8),
           "c": torch.empty(gs, m, n, dtype=torch.float32 if case.get("out") == "f32" else torch.bfloat16)}
    return {name: t.to(device) for name, t in out.items()}


# -- tolerance ------------------------------------------------------------------------------------
ATOL = 2.0 ** -100  # terms a flush-to-zero target drops: |partial| * 2^-126 < 2^-101
RTOL = 2.0 ** -7  # the bf16 rounding of kernel and reference: at most one bf16 ulp apart
# fp8 tensor cores add products with a mantissa narrower than fp32 (about 13 bits along one gemm;
# gemm.py's _fp8_accumulation_error), and the fp32 promotions, split ranges and combine add
# K / BLOCK + SPLIT roundings of 2^-24: an element's error scales with sum_k |a_ik sa b_jk sb|.
# Measured on an H200 (2026-12-01, the user's config at V4 and V4.1 prefill shapes of 4,096 rows,
# the error beyond the bf16 rounding over that magnitude): at most 2^-10.95 where a block is one
# 128-deep gemm (four tensor-core instructions before a promotion) and 2^-11.44 at 32-wide blocks;
# deterministic (two runs equal). 2^-11 cut off the 128-wide worst case; 2^-10 keeps a factor 2.
ACCUMULATION = 2.0 ** -10


def magnitude(inputs: dict, block: int) -> torch.Tensor:
    """sum_k |a_ik| sa_ik |b_jk| sb_jk per output element (float64): the size of the terms a
    rounding error is relative to."""
    a, b = inputs["a"], inputs["b"]
    sa, sb = _expanded_scales(inputs["a_scale"], inputs["b_scale"], b.shape[1], a.shape[-1], block)
    return (a.double().abs() * sa) @ (b.double().abs() * sb).transpose(1, 2)


def _accumulation_error(case, output, inputs):
    return (magnitude(inputs, _block(case)) * ACCUMULATION).float()


def blockscaled_shapes(m: shapes.ModelDims, decode_m=shapes.DECODE_SAMPLE) -> dict:
    """The FP8 projections of ``dense_gemms`` at the decode rows and a prefill chunk, with the
    scale blocks of the model's block (128 or 32) as sizes, KB along K and NB along N (BLOCK is
    K / KB); ``wo_a`` as its ``o_groups`` groups."""
    out = {}
    rows = [*((f"decode{b}", b) for b in decode_m), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]
    for name, (n, k, stored) in shapes.dense_gemms(m).items():
        if stored != "f8e4m3":
            continue
        for phase, t in rows:
            case = {"G": m.o_groups if name == "wo_a" else 1, "M": t, "N": n, "K": k,
                    "KB": -(-k // m.fp8_block), "NB": -(-n // m.fp8_block)}
            out[f"{m.short}/{name}/{phase}"] = {**case, "model": m.name}
    return out


SPEC = register(Spec(
    kernel=gemm_blockscaled,
    reference=gemm_blockscaled_reference,
    make_inputs=_inputs,
    outputs=("c",),
    cases={
        # V4 blocks, ragged M, N and K (K = 208: a last block of 80 columns), split 4
        "v4_ragged": {"M": 5, "N": 200, "K": 208, "config": {"BM": 64, "BN": 64, "BK": 128, "SPLIT": 4}},
        # V4.1 blocks, 128-wide steps of four 32-column gemms, a tile over two weight block rows
        "v41_sub_blocks": {"M": 9, "N": 72, "K": 336, "BLOCK": 32,
                           "config": {"BM": 64, "BN": 64, "BK": 128, "SPLIT": 2}},
        # steps shorter than a block: two 64-column steps promote with one scale
        "v4_half_steps": {"M": 3, "N": 136, "K": 400, "config": {"BM": 16, "BN": 128, "BK": 64, "SPLIT": 1}},
        # scales 2^-30 .. 2^30 on each side, every third row zero
        "spread_zero_rows": {"M": 7, "N": 96, "K": 256, "BLOCK": 32, "scales": "spread", "zero_rows": True,
                             "config": {"BM": 64, "BN": 32, "BK": 64, "SPLIT": 4}},
        # the extreme codes 0, 1, 2, 252..254 against complementary weight scales
        "edge_codes": {"M": 4, "N": 64, "K": 384, "BLOCK": 32, "scales": "edge",
                       "config": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 1}},
        "edge_codes_v4": {"M": 6, "N": 136, "K": 768, "scales": "edge",
                          "config": {"BM": 64, "BN": 128, "BK": 256, "SPLIT": 2}},
        # the grouped form (wo_a): three groups, each its own weights and scales
        "groups": {"G": 3, "M": 5, "N": 48, "K": 160, "BLOCK": 32,
                   "config": {"BM": 64, "BN": 64, "BK": 64, "SPLIT": 2}},
        # FP32 out (the runtime's projections, whose reference keeps FP32): C rounded once, from FP32
        "f32_out": {"M": 5, "N": 72, "K": 256, "BLOCK": 32, "out": "f32", "config": {"BM": 64, "BN": 64, "BK": 64,
                                                                                       "SPLIT": 2}},
        "f32_out_v4": {"M": 3, "N": 136, "K": 384, "out": "f32", "config": {"BM": 16, "BN": 128, "BK": 128,
                                                                             "SPLIT": 1}},
        # K steps past K: a 256-wide step over K = 192 at 32-wide blocks, whose codes of blocks 6 and 7
        # lie past the scale tensor (the tiny V4.1's Engram projection at its user config, which read
        # the byte after them: codegen/tilelang_cuda/unit_axes.py)
        "step_past_k": {"M": 20, "N": 1280, "K": 192, "BLOCK": 32, "out": "f32",
                        "config": {"BM": 64, "BN": 32, "BK": 256, "SPLIT": 1}},
        # more ranges than K steps: empty ranges add nothing
        "empty_ranges": {"M": 2, "N": 40, "K": 96, "config": {"BM": 16, "BN": 64, "BK": 32, "SPLIT": 8}},
        # the scales in the operands (the form a block-scaled MMA takes): V4.1's blocks with a ragged
        # last step, steps inside a 128-block, a tile over two weight block rows and groups with
        # spread scales, and the tile a block-scaled MMA takes (128 x 128 x 128) at V4's blocks
        "operands_v41": {"M": 9, "N": 72, "K": 336, "BLOCK": 32,
                         "config": {"BM": 64, "BN": 64, "BK": 128, "SPLIT": 2, "SCALES": "operands"}},
        "operands_half_steps": {"M": 3, "N": 136, "K": 400,
                                "config": {"BM": 16, "BN": 128, "BK": 64, "SPLIT": 1, "SCALES": "operands"}},
        "operands_groups_spread": {"G": 2, "M": 7, "N": 96, "K": 256, "BLOCK": 32, "scales": "spread",
                                   "config": {"BM": 64, "BN": 32, "BK": 64, "SPLIT": 4, "SCALES": "operands"}},
        "operands_mma_tile": {"M": 130, "N": 264, "K": 384,
                              "config": {"BM": 128, "BN": 128, "BK": 128, "SPLIT": 1, "SCALES": "operands"}},
    },
    build_cases={"v4_wo_b_decode": {"M": 16, "N": 4096, "K": 8192},
                 "v41_wq_b_prefill": {"M": 4096, "N": 32768, "K": 1280, "BLOCK": 32}},
    tolerance=lambda case, out: (ATOL, RTOL),
    extra_error=_accumulation_error,
    constants_of=lambda case: {"BLOCK": _block(case)},
    flops=lambda c: 2.0 * c.get("G", 1) * c["M"] * c["N"] * c["K"],
    # compulsory bytes: fp8 A and B, bf16 (or f32) C, one byte a scale block
    bytes_moved=lambda c: c.get("G", 1) * (c["M"] * c["K"] + c["N"] * c["K"]
                                           + (4 if c.get("out") == "f32" else 2) * c["M"] * c["N"]
                                           + (c["M"] + -(-c["N"] // _block(c))) * -(-c["K"] // _block(c))),
    model_shapes=shapes.for_models(blockscaled_shapes),
    # rows of A, B (K bytes) and C (2N bytes) are whole 16 bytes, as TMA needs
    sweep={"G": OneOf(1, 1, 2), "M": Dim(1, 70, large=4100), "N": Dim(8, 200, multiple=8, large=4104),
           "K": Dim(16, 320, multiple=16, large=8208), "BLOCK": OneOf(32, 128),
           "scales": OneOf("normal", "spread", "edge"), "zero_rows": OneOf(False, True),
           "config": {"SPLIT": OneOf(1, 2, 4, 8), "BK": OneOf(32, 64, 128, 256), "BN": OneOf(32, 64, 128),
                      "BM": OneOf(16, 64)}},
))
