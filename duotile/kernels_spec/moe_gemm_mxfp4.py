"""The routed experts' W4A8 grouped GEMM (model.md 2.6, 2.7, 2.10, 4.1-4.3, 5.2): both grouped GEMMs
of the MoE, the fused ``w1`` / ``w3`` up-projection and the ``w2`` down-projection, over the rows
that ``moe_permute`` grouped by expert.

    out[r, n] = sum_k  a[r, k] * sa[r, k // ABLOCK] * w[e(r), n, k] * sw[e(r), n, k // 32]

* ``a`` (R x K, e4m3): the permuted activations, expert e's rows at ``offsets[e]`` ..
  ``offsets[e] + counts[e] - 1`` (``moe_permute``'s ``counts`` and exclusive ``offsets``, E + 1 of
  them, of which the kernel reads the first E); ``a_scale`` (R x KA, uint8) their UE8M0 codes, one
  per 1 x ``ABLOCK`` channels (128 in V4, 32 in V4.1: the quantiser's blocks, model.md 2.10).
* ``w`` (E x N x K/2, uint8): the MXFP4 expert weights as the checkpoint stores them ([out, in]),
  two e2m1 codes a byte, **the even input channel in the low nibble** (model.md 1.4, 4.1;
  ``quantize_fp4.py``; the runtime's ``quant.pack_fp4``); a code's bit 3 is the sign, bits 0-2 index
  {0, .5, 1, 1.5, 2, 3, 4, 6}. ``w_scale`` (E x N x K/32, uint8): a UE8M0 code per 32 input channels
  of an output row. The up-projection is ``w1`` and ``w3`` stacked along N (N = 2 x expert width).
* ``out`` (R x N, bf16): fp32 accumulation, one rounding to bf16. Rows outside every expert's
  range (``moe_permute``'s tail past ``offsets[E]``, pairs it left out) are not written.

K is a multiple of 32 (the weights' scale blocks; both models' widths are multiples of 128).
``counts`` and ``w`` name the same E, so a routing of another expert count is refused at the call.

**How a block finds its rows.** Three phases. Phase 0 writes the tile table: ``starts[e]``, the
row tiles (of ``BM`` rows) of the experts before e, ``starts[E]`` all of them, a lane's sum of the
tile counts ``ceil(counts[e'] / BM)`` before it, ``BE`` lanes a block (as ``moe_permute`` sums its
offsets). Phase 1 writes each row tile's expert, ``owner[t]``: the last e with ``starts[e] <= t``
(a compare and a sum over the E entries; experts without rows share their successor's start and
are passed over). Phase 2's grid is (row tile of the grouped list, column tile),
``(ceil(R / BM) + min(R, E)) x ceil(N / BN)``: the tiles sum ``ceil(counts[e] / BM)`` < R / BM +
(experts with rows), and at most min(R, E) experts have rows. Block t reads its expert as an index
(``dsl.scalar``), so the expert's weights and scales sit at a data offset, and its first row
``offsets[e] + (t - starts[e]) * BM`` likewise: its rows are read in place (a short tile's tail
reads the next expert's rows, or zeros past R, and the store by row index drops those outputs:
-1 past ``counts[e]``). A block past the last tile runs no K step (its ``stop=`` is 0). V4's w13
at a 4,096-token prefill chunk (R = 24,576, 256 experts, BM = 64) runs 640 row tiles; the decode
of one token (R = 6) 7, of which 6 hold a row.

**The arithmetic.** Each K step of BK columns reads the step's weight bytes as one (BN, BK / 2)
tile and the activations as one contiguous (BM, BK) e4m3 tile, both in shared memory ``STAGES``
steps ahead; the block's scale codes, weights' and activations', are loaded once before the K loop
(every code of its rows), and each step reads its own columns of them (``first=``). It then runs one gemm of
``dsl.mxfp8_values(x, sa)`` by ``dsl.mxfp4_values(byte, codes)``: block-scaled values on both
sides, lowered per target (docs/ffn_path.md):

* on a target whose tensor cores apply UE8M0 block scales, the generator's block-scaled rule
  takes this gemm at a tile that MMA takes (the shipped config's BM 128, BN 128, BK 128): the
  activations stay e4m3, the e2m1 weights become e4m3 bytes (exact), and the tensor cores apply
  both sides' codes, one a 32-column atom, at the FP8 rate. The products are exact at every code.
* elsewhere (no FP4 or block-scaled tensor cores, model.md 2.7) the values are made in bf16 on
  CUDA cores, the weights eight at a time by a device helper (about four instructions a value),
  the activations as e4m3 x 2^(code - 127) rounded to bf16, exact (e4m3 has four significant
  bits) for codes 10..246, where every such product is a normal bf16 number (the quantiser
  writes codes from 105, its amax floor of 1e-4, up); weights likewise wherever the value is a
  bf16 number, +-Inf beyond, NaN for code 255. One bf16 tensor-core gemm a step, the products
  exact in fp32.

The sums are the only roundings, in an order fixed whatever R is. No promotion (an fp32 partial
scaled and added, as in ``gemm_blockscaled``) follows a gemm: in the bf16 form both scales are
folded into the operands. For the weight scale that is forced: it varies along the output columns, and
the stored [E, N, K/32] layout gives a tile's codes as (BN, *) columns, which the DSL cannot turn
into the (1, BN) row a promotion of a (BM, BN) partial needs (a load lays tile axes onto the
tensor's trailing axes in order; there is no transpose). The price of the bf16 form is tensor
cores at half the fp8 rate.

Decode path: a row's sum runs over the same K steps in the same order whatever R is and wherever
the row sits in its tile (batch dimension R, dynamic: one build serves every token count).
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.builder import error
from . import model_shapes as shapes
from .gemm_blockscaled import ue8m0_values
from .registry import Dim, OneOf, Spec, register

WBLOCK = 32  # input channels a weight scale covers (MXFP4)
FP8_MAX = 448.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code & 7 (model.md 4.1)
UNWRITTEN = 2.0 ** 100  # what ``out`` holds before a call in the cases: rows no expert covers keep it


FAR = 1 << 30  # a tile table entry past the experts: never at or before a row tile


@dsl.kernel(batch_dim="R", dynamic=("R",))
def moe_gemm_mxfp4(a: dsl.Tensor["R", "K", dsl.f8e4m3], a_scale: dsl.Tensor["R", "KA", dsl.u8],
                   w: dsl.Tensor["E", "N", "KH", dsl.u8], w_scale: dsl.Tensor["E", "N", "KW", dsl.u8],
                   counts: dsl.Tensor["E", dsl.i32], offsets: dsl.Tensor["E1", dsl.i32],
                   out: dsl.Tensor["R", "N", dsl.bf16], *,
                   ABLOCK: dsl.Const = 128,
                   BM: dsl.Tunable = dsl.choice(64, 16, 32, 128),
                   BN: dsl.Tunable = dsl.choice(128, 64, 32, 256),
                   BK: dsl.Tunable = dsl.choice(128, 64, 32),  # whole 32-value scale blocks
                   STAGES: dsl.Tunable = dsl.int_range(1, 3, default=2),
                   BE: dsl.Tunable = dsl.choice(128, 64, 256)):
    if BK % ABLOCK and ABLOCK % BK:
        raise error(f"BK = {BK} and ABLOCK = {ABLOCK}: a K step must hold whole activation scale blocks "
                    f"or lie within one (BK a multiple or a divisor of ABLOCK)")
    n_e = w.E
    # phase 0, the tile table: starts[e] = the row tiles of the experts before e (starts[E]: all)
    starts = dsl.workspace("starts", (offsets.E1,), dsl.i32)
    for c in dsl.grid(dsl.cdiv(offsets.E1, BE)):
        lanes = dsl.arange(BE)
        before = dsl.zeros((BE,), dsl.i32)
        for j in dsl.range(c + 1):  # the chunks of counts up to this one
            tiles = (dsl.load(counts[j * BE], (BE,), other=0) + (BM - 1)) // BM
            before[:] = before + dsl.where(j * BE + lanes[None, :] < c * BE + lanes[:, None], tiles[None, :], 0
                                           ).sum(axis=1)
        dsl.store(starts[c * BE], before)
    # phase 1, each row tile's expert: the last whose first tile is at or before it (experts without
    # tiles share their successor's start and are passed over); a tile past them all gets E - 1.
    # A phase of its own: searched inside the GEMM's block, beside the weights' shared-memory tile,
    # TileLang 0.1.15's layout inference found no layout for the block ("no available layout found").
    # The row tiles that can hold rows: sum_e ceil(counts[e] / BM) < R / BM + (experts with rows), and
    # at most min(R, E) experts have rows
    n_tiles = dsl.cdiv(a.R, BM) + dsl.minimum(a.R, n_e)
    owner = dsl.workspace("owner", (n_tiles,), dsl.i32)
    for c in dsl.grid(dsl.cdiv(n_tiles, BE)):
        lanes = dsl.arange(BE)
        tile = c * BE + lanes
        seen = dsl.zeros((BE,), dsl.i32)
        for j in dsl.range(dsl.cdiv(n_e, BE)):
            first = dsl.where(j * BE + lanes < n_e, dsl.load(starts[j * BE], (BE,), other=FAR), FAR)
            seen[:] = seen + (first[None, :] <= tile[:, None]).to(dsl.i32).sum(axis=1)
        dsl.store(owner[c * BE], seen - 1)
    # phase 2: a block per row tile of the grouped list and column tile
    for t, n in dsl.grid(n_tiles, dsl.cdiv(w.N, BN)):
        live = dsl.load(starts[n_e], (1,)) > t  # a row tile of some expert
        e = dsl.scalar(dsl.where(live, dsl.load(owner[t], (1,)), 0))
        begin = dsl.load(offsets[e], (1,))  # expert e's rows: begin .. begin + counts[e] - 1
        first = begin + (t - dsl.load(starts[e], (1,))) * BM  # the tile's first row
        local = first + dsl.arange(BM)
        rows = dsl.where(live & (local < begin + dsl.load(counts[e], (1,))), local, -1)
        # its rows are read in place (a short tile's tail reads the next expert's rows, or zeros
        # past R, whose outputs the store by ``rows`` drops)
        r0 = dsl.scalar(dsl.where(live, first, 0))
        acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
        steps = dsl.where(live, dsl.cdiv(a.K, BK), 0).to(dsl.i32)  # a block past the tiles runs no K step
        # every scale code of the block's rows, once: a step's own codes are 4 bytes a row, which
        # bulk copies (16 bytes a row at least) do not take, so loaded a step they cost a global
        # latency a step (benchmarks/results/bench_moe_gemm_mxfp4.md)
        # (padded to whole K steps: a ragged last step reads codes of 0 for its zero bytes)
        codes = dsl.load(w_scale[e, n * BN, 0], (BN, dsl.cdiv(a.K, BK) * (BK // WBLOCK)), role="operand")
        sa = dsl.load(a_scale[r0, 0], (BM, dsl.cdiv(dsl.cdiv(a.K, BK) * BK, ABLOCK)), role="operand")
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=STAGES, stop=steps):
            byte = dsl.load(w[e, n * BN, k * (BK // 2)], (BN, BK // 2), role="operand")
            x = dsl.load(a[r0, k * BK], (BM, BK), role="operand")
            # the step's activation codes: one a block, or the one block the step lies in
            xv = dsl.mxfp8_values(x, sa, first=(k * BK) // ABLOCK, block=min(BK, ABLOCK))
            dsl.gemm(xv, dsl.mxfp4_values(byte, codes, first=k * (BK // WBLOCK)), acc, transpose_b=True)
        dsl.store(out[rows, n * BN], acc.to(dsl.bf16))


# -- reference ------------------------------------------------------------------------------------
def fp4_values(packed: torch.Tensor, high_first: bool = False) -> torch.Tensor:
    """Packed e2m1 bytes [..., K/2] as their values [..., K] in float64 (model.md 1.4, 4.1): element
    2k in the low nibble, 2k + 1 in the high one (``high_first`` swaps them: a wrong reading)."""
    b = packed.to(torch.int64)
    lo, hi = b & 15, b >> 4
    codes = torch.stack((hi, lo) if high_first else (lo, hi), dim=-1).flatten(-2)
    mag = torch.tensor(FP4_GRID, dtype=torch.float64, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def activations(a, a_scale, ABLOCK: int = 128) -> torch.Tensor:
    """The activations' values (R x K, float64): each e4m3 value times its block's scale."""
    return a.double() * ue8m0_values(a_scale).repeat_interleave(ABLOCK, -1)[:, :a.shape[-1]]


def expert_weights(w, w_scale, e: int, k: int, high_first: bool = False) -> torch.Tensor:
    """Expert e's weight values (N x K, float64): each e2m1 value times its 32-block's scale."""
    return fp4_values(w[e], high_first)[:, :k] * ue8m0_values(w_scale[e]).repeat_interleave(WBLOCK, -1)[:, :k]


def _per_expert(a, a_scale, w, w_scale, counts, offsets, ABLOCK, fn, fill, high_first=False):
    """``fn(x_e, w_e)`` in each expert's rows (float64), ``fill`` elsewhere; an expert without
    rows is never dequantised (a model shape's weights are gigabytes)."""
    x = activations(a, a_scale, ABLOCK)
    res = torch.full((a.shape[0], w.shape[1]), fill, dtype=torch.float64, device=a.device)
    for e in range(w.shape[0]):
        lo, n = int(offsets[e]), int(counts[e])
        if n > 0:
            res[lo:lo + n] = fn(x[lo:lo + n], expert_weights(w, w_scale, e, a.shape[-1], high_first))
    return res


def moe_gemm_mxfp4_reference(a, a_scale, w, w_scale, counts, offsets, ABLOCK: int = 128,
                             high_first: bool = False) -> dict:
    """model.md 2.7's W4A8 product, expert by expert: both operands dequantised to float64 (every
    e4m3 and e2m1 value times a power of two is exact there, and the sums of these sizes lose
    nothing a bf16 result keeps), expert e's rows times its weights, rounded once to bf16. Rows no
    expert covers hold ``UNWRITTEN``, what the cases' ``out`` starts with. ``high_first`` reads the
    nibbles in the wrong order (the tests' counter-check)."""
    res = _per_expert(a, a_scale, w, w_scale, counts, offsets, ABLOCK, lambda x, wv: x @ wv.t(), UNWRITTEN,
                      high_first)
    return {"out": res.to(torch.bfloat16)}


# -- inputs ---------------------------------------------------------------------------------------
def _ablock(case) -> int:
    """A case's ABLOCK: named, or (model shapes, whose keys are all sizes) K over its blocks KA."""
    return case.get("ABLOCK", case["K"] // case["KA"] if "KA" in case else 128)


def _counts(case, rows: int, g: torch.Generator) -> torch.Tensor:
    """Rows per expert, summing to ``rows``: ``ragged`` (expert e drawn with weight (e + 1)^2, some
    with none), ``empty`` (every other expert without rows, the rest uniform), ``one`` (one expert,
    not the first, takes every row), ``uniform``."""
    e, kind = case["E"], case.get("counts", "ragged")
    if kind == "one":
        c = torch.zeros(e, dtype=torch.int64)
        c[e // 2] = rows
        return c
    if kind == "ragged":
        p = torch.arange(1, e + 1, dtype=torch.float64) ** 2
    elif kind == "empty":
        p = (torch.arange(e) % 2 == 1).double() if e > 1 else torch.ones(1, dtype=torch.float64)
    elif kind == "uniform":
        p = torch.ones(e, dtype=torch.float64)
    else:
        raise ValueError(f"unknown counts kind {kind!r}")
    if rows == 0:
        return torch.zeros(e, dtype=torch.int64)
    picks = torch.multinomial(p, rows, replacement=True, generator=g)
    return torch.bincount(picks, minlength=e)


def _codes(shape, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.uint8, device=g.device)


# UE8M0 code ranges (activation, weight) by case kind; "edge" pairs the extremes (_scale_codes)
SCALE_KINDS = {
    "normal": ((118, 134), (112, 128)),  # activations near 2^0, weights near 2^-8
    "spread": ((97, 157), (97, 157)),  # 2^-30 .. 2^30 each
}
# "edge", by activation block: the smallest activation codes whose every value is a normal bf16
# against the largest weight codes whose every value is finite; the largest activation codes against
# the smallest weight codes whose every value is normal; codes up to the quantiser's floor (105)
# against weight codes 0 and 1, whose values below 2^-126 CUDA builds flush (terms under 2^-100)
EDGE = [((10, 12), (240, 252)), ((240, 246), (2, 14)), ((100, 105), (0, 1))]


def _scale_codes(kind: str, r: int, e: int, n: int, k: int, ablock: int, g: torch.Generator):
    """(activation codes R x ceil(K / ABLOCK), weight codes E x N x K / 32)."""
    ka, kw = -(-k // ablock), k // WBLOCK
    if kind != "edge":
        (alo, ahi), (wlo, whi) = SCALE_KINDS[kind]
        return _codes((r, ka), alo, ahi, g), _codes((e, n, kw), wlo, whi, g)
    sa = torch.empty(r, ka, dtype=torch.uint8, device=g.device)
    sw = torch.empty(e, n, kw, dtype=torch.uint8, device=g.device)
    for j in range(ka):  # an activation block and the weight blocks inside it take one pairing
        (alo, ahi), (wlo, whi) = EDGE[j % len(EDGE)]
        sa[:, j] = _codes((r,), alo, ahi, g)
        lo, hi = j * ablock // WBLOCK, min(kw, (j + 1) * ablock // WBLOCK)
        sw[:, :, lo:hi] = _codes((e, n, hi - lo), wlo, whi, g)
    return sa, sw


def _fp8_values(shape, g: torch.Generator) -> torch.Tensor:
    """e4m3 values over the format's range (subnormals to 448), with signs."""
    x = torch.randn(shape, generator=g, device=g.device) * torch.exp2(
        torch.randint(-8, 7, shape, generator=g, device=g.device).float())
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _nibbles(e: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Packed weights (E x N x K/2) whose two nibbles of a byte never decode to the same value: the
    even element's code at random, the odd one's another magnitude (and a random sign)."""
    even = torch.randint(0, 16, (e, n, k // 2), generator=g, device=g.device)
    shift = torch.randint(1, 8, (e, n, k // 2), generator=g, device=g.device)
    odd = ((even & 7) + shift) % 8 | (torch.randint(0, 2, (e, n, k // 2), generator=g, device=g.device) << 3)
    return (even | odd << 4).to(torch.uint8)  # model.md 1.4: the even element in the low nibble


def _inputs(case, device, seed):
    r, e, n, k, ablock = case["R"], case["E"], case["N"], case["K"], _ablock(case)
    if device.type == "meta":  # shapes and dtypes only (a model shape's weights are gigabytes)
        return {"a": torch.empty(r, k, dtype=torch.float8_e4m3fn), "a_scale": torch.empty(r, -(-k // ablock),
                                                                                             dtype=torch.uint8),
                "w": torch.empty(e, n, k // 2, dtype=torch.uint8),
                "w_scale": torch.empty(e, n, k // WBLOCK, dtype=torch.uint8),
                "counts": torch.empty(e, dtype=torch.int32), "offsets": torch.empty(e + 1, dtype=torch.int32),
                "out": torch.empty(r, n, dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(seed)  # the routing (small), on the CPU everywhere
    # the bulk (weights of gigabytes at the model's shapes) drawn where it is used: the CPU's draws
    # are the same as ever, a GPU's are its own (seeded too)
    gd = g if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    tail = case.get("tail", 0)  # rows past offsets[E]: pairs moe_permute left out
    c = _counts(case, max(r - tail, 0), g)
    off = torch.zeros(e + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(c, 0)
    if case.get("values") == "nibbles":  # one nonzero activation a row: each output reads one weight
        packed = _nibbles(e, n, k, gd)
        a = torch.zeros(r, k, device=gd.device)
        a[torch.arange(r, device=gd.device), torch.randint(0, k, (r,), generator=gd, device=gd.device)] = 1.0
        a = a.to(torch.float8_e4m3fn)
    else:  # every byte: two codes at random
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gd, dtype=torch.uint8, device=gd.device)
        a = _fp8_values((r, k), gd)
    sa, sw = _scale_codes(case.get("scales", "normal"), r, e, n, k, ablock, gd)
    out = {"a": a, "a_scale": sa, "w": packed, "w_scale": sw,
           "counts": c.to(torch.int32), "offsets": off.to(torch.int32),
           "out": torch.full((r, n), UNWRITTEN, dtype=torch.bfloat16, device=gd.device)}
    return {name: t.to(device) for name, t in out.items()}


# -- tolerance ------------------------------------------------------------------------------------
ATOL = 2.0 ** -100  # terms of weight values below 2^-126, which CUDA builds flush: under 2^-100 in the cases
RTOL = 2.0 ** -7  # the bf16 rounding of kernel and reference: at most one bf16 ulp apart
# The products of bf16 operands are exact in fp32; what remains is the fp32 sum of K of them, in
# an order (and, on tensor cores, with an alignment of each instruction's products) that differs
# from the reference's exact one. Each add errs at most one fp32 ulp (2^-23) of the magnitude of
# the terms so far, round to nearest or toward zero alike: K x 2^-23 of sum_k |a sa w sw| bounds
# it (2^-11 at K = 4096; the tensor cores' 16- or 32-deep instructions round about K / 16 times).
ACCUMULATION_ULPS = 2.0 ** -23


def magnitude(inputs: dict, ablock: int) -> torch.Tensor:
    """sum_k |a sa| |w sw| per output element (float64; 0 in rows no expert covers): the size of
    the terms a rounding error is relative to."""
    x = {k: inputs[k] for k in ("a", "a_scale", "w", "w_scale", "counts", "offsets")}
    return _per_expert(**x, ABLOCK=ablock, fn=lambda xe, wv: xe.abs() @ wv.abs().t(), fill=0.0)


def _accumulation_error(case, output, inputs):
    return (magnitude(inputs, _ablock(case)) * (case["K"] * ACCUMULATION_ULPS)).float()


def moe_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict:
    """Both grouped GEMMs of a model's routed experts (model.md 5.2): ``w13``, the ``w1`` / ``w3``
    up-projection fused (N = 2 x expert width, K = hidden), and ``w2`` (N = hidden, K = width), over
    the ``experts_per_token x T`` grouped rows of the decode batches ``decode_t`` and a prefill
    chunk; the activations' scale blocks (128 in V4, 32 in V4.1) as KA along K (ABLOCK is K / KA)."""
    out = {}
    gemms = {"w13": (2 * m.moe_intermediate, m.hidden), "w2": (m.hidden, m.moe_intermediate)}
    rows = [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]
    for name, (n, k) in gemms.items():
        for phase, t in rows:
            out[f"{m.short}/e{m.experts}_{name}/{phase}"] = {
                "R": m.experts_per_token * t, "E": m.experts, "N": n, "K": k, "KA": -(-k // m.fp8_block),
                "model": m.name}
    return out


SPEC = register(Spec(
    kernel=moe_gemm_mxfp4,
    reference=moe_gemm_mxfp4_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={
        # V4 blocks: ragged counts over 6 experts, some empty, a tail of rows no expert covers
        "v4_ragged": {"R": 37, "E": 6, "N": 72, "K": 256, "tail": 3,
                      "config": {"BM": 16, "BN": 128, "BK": 128}},
        # V4.1 blocks: 128-wide steps over four activation scale blocks, every other expert empty
        "v41_empty_experts": {"R": 20, "E": 8, "N": 64, "K": 192, "ABLOCK": 32, "counts": "empty",
                              "config": {"BM": 16, "BN": 64, "BK": 128}},
        # one expert with every row: its row tiles span the whole list
        "v41_one_expert": {"R": 40, "E": 4, "N": 40, "K": 96, "ABLOCK": 32, "counts": "one",
                           "config": {"BM": 16, "BN": 64, "BK": 32}},
        # steps shorter than an activation block (two 64-column steps share one code), wide tiles
        "v4_half_steps": {"R": 9, "E": 3, "N": 136, "K": 384, "config": {"BM": 16, "BN": 128, "BK": 64}},
        # each row reads one weight: a swapped nibble order reads the other element of its byte
        "nibble_order": {"R": 24, "E": 3, "N": 32, "K": 64, "ABLOCK": 32, "values": "nibbles",
                         "config": {"BM": 16, "BN": 32, "BK": 64}},
        # the extreme codes at which both operands are still exact (EDGE), against complementary ones
        "edge_codes_v4": {"R": 12, "E": 4, "N": 32, "K": 384, "scales": "edge",
                          "config": {"BM": 16, "BN": 32, "BK": 128}},
        "edge_codes_v41": {"R": 10, "E": 3, "N": 48, "K": 96, "ABLOCK": 32, "scales": "edge",
                           "config": {"BM": 16, "BN": 64, "BK": 64}},
        # scales 2^-30 .. 2^30 on each side, uniform counts, 64-row tiles
        "spread_uniform": {"R": 70, "E": 2, "N": 64, "K": 128, "scales": "spread", "counts": "uniform",
                           "config": {"BM": 64, "BN": 64, "BK": 128}},
        # no rows at all
        "no_rows": {"R": 4, "E": 3, "N": 32, "K": 64, "tail": 4, "config": {"BM": 16, "BN": 32, "BK": 64}},
    },
    build_cases={"v41_w13_decode16": {"R": 96, "E": 384, "N": 4608, "K": 5120, "ABLOCK": 32},
                 "v4_w2_prefill": {"R": 24576, "E": 256, "N": 4096, "K": 2048}},
    tolerance=lambda case, out: (ATOL, RTOL),
    extra_error=_accumulation_error,
    constants_of=lambda case: {"ABLOCK": _ablock(case)},
    flops=lambda c: 2.0 * c["R"] * c["N"] * c["K"],
    # compulsory bytes: the fp8 rows and their codes, bf16 out, and the weights (half a byte a
    # weight, a code per 32) of the experts with rows, at most min(E, R) of them
    bytes_moved=lambda c: (c["R"] * c["K"] * (1 + 1 / _ablock(c)) + 2 * c["R"] * c["N"]
                           + min(c["E"], c["R"]) * c["N"] * c["K"] * (0.5 + 1 / WBLOCK)),
    model_shapes=shapes.for_models(moe_shapes),
    # small enough for the interpreter, which runs (ceil(R / BM) + E) x ceil(N / BN) programs; the large
    # draws keep a float64 reference's expert weights near 100 MB
    sweep={"R": Dim(1, 40, large=4100), "E": Dim(1, 4, large=64), "N": Dim(8, 80, multiple=8, large=2048),
           "K": Dim(32, 160, multiple=32, large=5120), "ABLOCK": OneOf(32, 128),
           "counts": OneOf("ragged", "empty", "one", "uniform"), "scales": OneOf("normal", "spread", "edge"),
           "tail": OneOf(0, 0, 2), "values": OneOf("random", "random", "nibbles"),
           "config": {"BM": OneOf(16, 32, 64), "BN": OneOf(32, 64), "BK": OneOf(32, 64, 128)}},
))
