"""Sparse decode attention over V4.1-Flash's cache rows as stored (model.md 3.4), dequantised in the
kernel: ``sparse_mqa_decode`` with the K = V rows read from two row formats, each row its values and
then its scales, as the cache keeps them (``kv_insert.py`` writes the window's, ``runtime/stored.py``
keeps both).

* the window ring, rows of R >= D + D / 32 bytes: D e4m3 values, then D / 32 UE8M0 codes, one a 32
  channels (rope channels included; 528 bytes a row at D = 512, against 1,024 in BF16). The kernel
  takes the ring twice, as the same memory: ``kv`` (B, W, R) e4m3 for the values and ``kv_scale``
  (B, W, R) u8 for the codes. Channel c is ``kv[b, j, c] x 2^(kv_scale[b, j, D + c // 32] - 127)``;
* optionally the compressed rows (V4.1's CSA2 layers), rows of RC >= D / 2 + D / 16 bytes:
  NVFP4-like, e2m1 codes two a byte (the even channel in the low nibble), then an E4M3 scale a 16
  channels, no global scale (288 bytes a row); again twice, ``cmp`` (B, N, RC) u8 and ``cmp_scale``
  (B, N, RC) e4m3. Channel c is ``e2m1(cmp[b, j], c) x cmp_scale[b, j, D / 2 + c // 16]``.

With compressed rows, the index list's first ``ring_slots(W)`` slots (W rounded up to a multiple of
128: 128 for the models' rings) name window rows (a value j: ring row j) and its slots from there
on name compressed rows (j: compressed row j), as a decode step lists them: its window's W slots in
position order, -1 up to ``ring_slots(W)``, then its selected rows. Without compressed rows every
slot names a window row. -1, or an index past its tensor's rows, names no row. Everything else is
``sparse_mqa_decode``'s: the sink, the split over ``SPLIT`` ranges with its fixed-order combine
(bitwise batch invariant), the outputs and their tolerance. ``BN`` divides 128, so a block of
slots lies in one part of the list: it is gathered from one tensor and turned into one bf16
operand (``dsl.mxfp8_values`` or ``dsl.nvfp4_values``, both exact for every code the quantisers
write). The kernel computes what ``sparse_mqa_decode`` computes over the dequantised rows, with
two loops over the list's blocks, one a format.

Model shapes (V4.1 alone: V4's rows keep 64 BF16 rope channels beside 448 FP8 ones): the SWA
layers (0 and 1) read their ring alone, 128 rows a query; a CSA2 layer reads its ring and its
top-512 compressed rows, 640 a query, of a 64K context's 32,768 (ratio 2); decode batches 1, 16
and 64. The runtime's V4.1 decode calls it (the model op ``sparse_attention_stored``) on the rows
its cache keeps as bytes (``runtime/stored.py``).
"""

from __future__ import annotations

import torch

from .. import dsl
from ..dsl.ops import NVFP4_BLOCK
from . import model_shapes as shapes
from .column_groups import column_groups
from .decode_epilogue import epilogue_of
from .decode_fp8_out import DERIVED, fp8_out_constants, fp8_out_of
from .moe_gemm_mxfp4 import fp4_values
from .registry import Dim, OneOf, Spec, register
from .sparse_mqa_decode import (
    SMALL,
    _error_bound,
    _tolerance,
    decode,
    own_list,
    random_inputs,
    sparse_mqa_decode_reference,
)
from .sparse_mqa_decode import SPEC as BF16_SPEC

CODE_BLOCK = 32  # channels a UE8M0 code covers in V4.1's window rows
RING_ALIGN = 128  # the list's ring part: the ring's rows rounded up to a multiple of this


def ring_slots(w):
    """The index list's slots that name ring rows, before its compressed rows: the ring's ``w``
    rows rounded up to a multiple of 128 (whole blocks of every block size the kernels take)."""
    return -(-w // RING_ALIGN) * RING_ALIGN


def check_block(BN) -> None:
    """A block of slots must lie in one part of the list (ring rows, or compressed rows)."""
    if RING_ALIGN % BN:
        raise dsl.DslError(f"BN {BN!r} must divide {RING_ALIGN}, the list's ring part's alignment")


# SPLIT defaults to 16, the two-phase form, as sparse_mqa_decode's
@dsl.kernel(batch_dim="B", dynamic=("B", "L", "N", "P", "QR"))
def sparse_mqa_decode_fp8(q: dsl.Tensor["B", "H", "D", dsl.bf16], kv: dsl.Tensor["B", "W", "R", dsl.f8e4m3],
                          kv_scale: dsl.Tensor["B", "W", "R", dsl.u8], idx: dsl.Tensor["B", "L", dsl.i32],
                          sink: dsl.Tensor["H", dsl.f32], o: dsl.Tensor["B", "H", "D", dsl.bf16],
                          lse: dsl.OptionalTensor["B", "H", dsl.f32] = None,
                          cmp: dsl.OptionalTensor["B", "N", "RC", dsl.u8] = None,
                          cmp_scale: dsl.OptionalTensor["B", "N", "RC", dsl.f8e4m3] = None,
                          positions: dsl.OptionalTensor["B", dsl.i32] = None,
                          cos: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                          sin: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                          o_q: dsl.OptionalTensor["QR", "D", dsl.f8e4m3] = None,
                          o_qs: dsl.OptionalTensor["QR", "QD", dsl.u8] = None,
                          lens: dsl.OptionalTensor["B", dsl.i32] = None, *,
                          GROUPS: dsl.Const = 8, QBLOCK: dsl.Const = 128,
                          BN: dsl.Tunable = dsl.choice(64, 32, 128),
                          STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
                          SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32),
                          BD: dsl.Tunable = dsl.choice(128, 64, 256),
                          DG: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    if (cmp is None) != (cmp_scale is None):
        raise dsl.DslError("sparse_mqa_decode_fp8: give cmp and cmp_scale together (the compressed rows and "
                           "their scales), or neither")

    d = q.D
    dsl.require(kv.R >= d + d // CODE_BLOCK, "kv's rows (R bytes) are short of D e4m3 values and their D / 32 codes")
    if cmp is not None:
        dsl.require(cmp.RC >= d // 2 + d // NVFP4_BLOCK,
                    "cmp's rows (RC bytes) are short of D / 2 bytes of e2m1 pairs and their D / 16 scales")
    check_block(BN)
    columns = column_groups(d, DG)

    def rows_of(b):
        def window(slots):
            win = dsl.where(slots < kv.W, slots, -1)  # an index past the ring reads zeros
            tiles = [dsl.mxfp8_values(dsl.load(kv[b, win, first], (BN, width), role="operand"),
                                      dsl.load(kv_scale[b, win, d + first // CODE_BLOCK], (BN, width // CODE_BLOCK),
                                               role="operand"))
                     for first, width in columns or ((0, d),)]
            return tiles if columns else tiles[0]

        def compressed(slots):
            rows = dsl.where(slots < cmp.N, slots, -1)
            tiles = [nvfp4_rows(cmp, cmp_scale, (b,), rows, width, BN, first=first, d=d)
                     for first, width in columns or ((0, d),)]
            return tiles if columns else tiles[0]

        if cmp is None:
            return window
        ring = ring_slots(kv.W) // BN  # the list's blocks of ring rows
        return [(0, ring, window, kv.W), (ring, None, compressed, cmp.N)]

    epilogue = epilogue_of("sparse_mqa_decode_fp8", q, positions, cos, sin)
    decode(q, kv, idx, sink, o, lse, BN, STAGES, SPLIT, BD, rows_of, kv.W, columns=columns, epilogue=epilogue,
           fp8_out=fp8_out_of("sparse_mqa_decode_fp8", q, o_q, o_qs, GROUPS, QBLOCK), lens=lens)


def nvfp4_rows(packed, scales, at, slots, width, BN, first=0, d=None):
    """Rows ``slots`` (-1 reads zeros) of NVFP4-like rows of ``d`` values (``width`` by default),
    dequantised, their columns ``first`` .. ``first + width`` (BN, width): the e2m1 pairs of
    ``packed`` and the E4M3 scales of ``scales`` (the same bytes typed twice; a row's scales after
    its d / 2 bytes of pairs). ``at``: the indices before the row's (a sequence's ``(b,)`` in a
    per-sequence stack, ``()`` in one pool of rows)."""
    d = width if d is None else d
    return dsl.nvfp4_values(dsl.load(packed[(*at, slots, first // 2)], (BN, width // 2), role="operand"),
                            dsl.load(scales[(*at, slots, d // 2 + first // NVFP4_BLOCK)], (BN, width // NVFP4_BLOCK),
                                     role="operand"))


def dequantised(kv: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """The rows' values in float64: each e4m3 value times 2^(code - 127) of its 32 channels (NaN
    for code 255)."""
    scale = torch.where(kv_scale == 255, torch.nan, torch.exp2(kv_scale.double() - 127))
    return kv.double() * scale.repeat_interleave(CODE_BLOCK, -1)[..., :kv.shape[-1]]


def nvfp4_dequantised(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """NVFP4-like rows in float64: each e2m1 value (element 2j in byte j's low nibble) times the E4M3
    scale of its 16 channels."""
    return fp4_values(packed) * scales.double().repeat_interleave(NVFP4_BLOCK, -1)


def ring_rows(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Window rows as the cache keeps them (u8 [..., D + D / 32]): the e4m3 values' bytes, then the
    codes."""
    return torch.cat([values.view(torch.uint8), codes], -1)


def compressed_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Compressed rows as the cache keeps them (u8 [..., D / 2 + D / 16]): the e2m1 pairs, then the
    E4M3 scales' bytes."""
    return torch.cat([packed, scales.view(torch.uint8)], -1)


def joint_index(idx: torch.Tensor, w: int, n: int | None) -> torch.Tensor:
    """The kernels' index list (its first ``ring_slots(w)`` slots ring rows, the rest the ``n``
    compressed rows; ``n`` None: every slot a ring row) as indices into the ring's rows followed
    by the compressed ones (``all_rows``), -1 for no row."""
    if n is None:
        return torch.where((idx >= 0) & (idx < w), idx, -1)
    ring = torch.arange(idx.shape[-1], device=idx.device) < ring_slots(w)
    return torch.where(ring, torch.where((idx >= 0) & (idx < w), idx, -1),
                       torch.where((idx >= 0) & (idx < n), idx + w, -1))


def all_rows(d: int, kv, kv_scale, cmp=None, cmp_scale=None) -> torch.Tensor:
    """Every row a slot can name, dequantised (float64): the window's W, then the compressed N
    (the kernel's tensors: each format's rows as values and as scale bytes)."""
    window = dequantised(kv[..., :d], kv_scale[..., d : d + d // CODE_BLOCK])
    if cmp is None:
        return window
    half = d // 2
    return torch.cat([window, nvfp4_dequantised(cmp[..., :half], cmp_scale[..., half : half + d // NVFP4_BLOCK])], 1)


def sparse_mqa_decode_fp8_reference(q, kv, kv_scale, idx, sink, cmp=None, cmp_scale=None, positions=None, cos=None,
                                    sin=None, GROUPS=None, QBLOCK=None, lens=None) -> dict:
    """model.md 2.5.6 over the dequantised rows (3.4's row formats), window rows first; with
    ``positions``, the output's rope channels rotated by -P (``sparse_mqa_decode``'s epilogue); with
    ``lens``, a query's slots at and past its length are dead."""
    idx = joint_index(own_list(idx, lens), kv.shape[1], None if cmp is None else cmp.shape[1])
    return sparse_mqa_decode_reference(q, all_rows(q.shape[-1], kv, kv_scale, cmp, cmp_scale), idx, sink,
                                       positions, cos, sin)


def _dequantised_inputs(inputs: dict) -> dict:
    rows = all_rows(inputs["q"].shape[-1], inputs["kv"], inputs["kv_scale"], inputs.get("cmp"),
                    inputs.get("cmp_scale"))
    cmp = inputs.get("cmp")
    return {**inputs, "kv": rows, "idx": joint_index(inputs["idx"], inputs["kv"].shape[1],
                                                     None if cmp is None else cmp.shape[1])}


def _bound(case, output, inputs):
    return _error_bound(case, output, _dequantised_inputs(inputs))


def _inputs(case, device, seed):
    """``sparse_mqa_decode``'s inputs, its index list over the ``W`` ring rows and the ``N``
    compressed ones (none where the case names no N), with the rows as stored: e4m3 values of about
    unit size with codes around 127 (``codes`` = (lo, hi): the range drawn from), and e2m1 bytes
    with E4M3 scales of about 2^-2 .. 2^2."""
    b, h, d, w, n = case["B"], case["H"], case["D"], case["W"], case.get("N", 0)
    base = random_inputs({**case, "N": w + n}, device, seed, (b, h, d), (b, 0, d))
    if device.type == "meta":
        ring = torch.empty(b, w, d + d // CODE_BLOCK, dtype=torch.uint8)
        out = {**base, "kv": ring.view(torch.float8_e4m3fn), "kv_scale": ring}
        if n:
            rows = torch.empty(b, n, d // 2 + d // NVFP4_BLOCK, dtype=torch.uint8)
            out.update(cmp=rows, cmp_scale=rows.view(torch.float8_e4m3fn))
        return out
    g = torch.Generator(device=device).manual_seed(seed + 7)
    lo, hi = case.get("codes", (122, 132))
    kv = (torch.randn(b, w, d, generator=g, device=device) * 4).to(torch.float8_e4m3fn)
    codes = torch.randint(lo, hi + 1, (b, w, d // CODE_BLOCK), generator=g, device=device, dtype=torch.uint8)
    ring = ring_rows(kv, codes)
    out = {**base, "kv": ring.view(torch.float8_e4m3fn), "kv_scale": ring}
    if n:
        packed = torch.randint(0, 256, (b, n, d // 2), generator=g, device=device, dtype=torch.uint8)
        scales = torch.exp2(torch.randint(-2, 3, (b, n, d // NVFP4_BLOCK), generator=g,
                                          device=device).float()).to(torch.float8_e4m3fn)
        rows = compressed_rows(packed, scales)
        out.update(cmp=rows, cmp_scale=rows.view(torch.float8_e4m3fn), idx=split_list(base["idx"], w, n, case))
    return out


def split_list(idx: torch.Tensor, w: int, n: int, case: dict) -> torch.Tensor:
    """An index list over W + N rows (``random_inputs``') as the kernels read it: ring rows in its
    first ``ring_slots(w)`` slots, compressed rows after (its holes kept); with ``out_of_range``,
    slot 2 names a row past the ring and the first compressed slot one past the compressed rows."""
    ring_part = ring_slots(w)
    ring = torch.arange(idx.shape[-1], device=idx.device) < ring_part
    out = torch.where(idx < 0, -1, torch.where(ring, idx % w, idx % n)).to(idx.dtype)
    if case.get("out_of_range") and idx.shape[-1] > ring_part:
        out[:, 2], out[:, ring_part] = w, n
    return out


def _model_shapes(m) -> dict:
    """V4.1's SWA layers (the window ring alone, L = N = 128) and CSA2 layers (the ring and the
    top-512 of a 64K context's 32,768 compressed rows) at decode batches 1, 16 and 64."""
    if m.short != "v41":
        return {}
    ring = {"H": m.heads, "D": m.head_dim, "W": m.window, "model": m.name}
    out = {}
    for b in shapes.DECODE_SAMPLE:
        out[f"{m.short}/swa{m.window}/decode{b}"] = {**ring, "B": b, "L": m.window}
        out[f"{m.short}/csa_r2_topk{m.window + m.index_topk}/decode{b}"] = {**ring, "B": b, "N": (1 << 16) // 2,
                                                                             "L": m.window + m.index_topk}
    return out


def _bytes(c) -> float:
    """A row's bytes (values and codes) for each slot, window rows first (the model shapes' lists
    are the ring, then the compressed rows), the queries and outputs in bf16, the list."""
    d, window = c["D"], min(c["L"], c["W"])
    rows = window * (d + d // CODE_BLOCK) + (c["L"] - window) * (d // 2 + d // NVFP4_BLOCK)
    return float(c["B"] * (rows + 4 * c["H"] * d + 4 * c["L"]))


def _as_ring(case: dict) -> dict:
    """A sparse_mqa_decode case whose N rows are the window ring's W rows."""
    return {("W" if k == "N" else k): v for k, v in case.items()}


def stored_row_cases(d: int) -> dict:
    """The cases both stored-row decode specs take, rows of ``d`` channels: window rows and
    compressed rows in one list (a layer with compressed rows: the first ring_slots(W) slots name
    ring rows, the rest compressed rows), and the inverse rope epilogue
    (``decode_epilogue.Epilogue``): split and one-phase forms, positions past the table (zeros),
    around the ring's boundaries, at 0."""
    def case(**c):
        return {"H": 64, "D": d, **c}
    return {
        "ring_and_compressed": case(B=3, W=40, N=200, L=250, holes=0.3, config={**SMALL, "SPLIT": 4}),
        "ring_and_compressed_one_phase": case(B=2, H=4, W=16, N=74, L=200, config={**SMALL, "SPLIT": 1}),
        "ring_and_compressed_repeats": case(B=2, D=128, W=8, N=16, L=256, valid="all", repeat=True,
                                            out_of_range=True, config={**SMALL, "SPLIT": 2}),
        # a SPLIT range that runs from ring blocks into compressed ones
        "ring_and_compressed_straddle": case(B=2, W=64, N=90, L=224, holes=0.2, config={**SMALL, "SPLIT": 2}),
        # a ring of 200 rows: a ring part of two 128-slot stretches
        "ring_past_128": case(B=2, W=200, N=50, L=300, holes=0.2, config={**SMALL, "SPLIT": 3}),
        "rope_ring_and_compressed": case(B=3, W=40, N=200, L=250, holes=0.3, rope="random", P=500,
                                         config={**SMALL, "SPLIT": 4, "BD": 64}),
        "rope_one_phase": case(B=3, H=4, W=16, N=74, L=200, rope="wrap", P=600, base=160000.0,
                               config={**SMALL, "SPLIT": 1}),
        "rope_past_table": case(B=3, W=64, L=64, rope="past", P=70, config={**SMALL, "SPLIT": 2}),
        "rope_at_zero_one_phase": case(B=2, W=32, L=32, rope="zero", config={**SMALL, "SPLIT": 1}),
        # wo_a's FP8 input (``decode_fp8_out``): in the combine, and in the one-phase form's own phase
        "fp8_out_rope": case(B=3, W=40, N=200, L=250, holes=0.3, rope="random", P=500, GROUPS=8, QBLOCK=32,
                             config={**SMALL, "SPLIT": 4}),
        "fp8_out_one_phase": case(B=2, H=4, W=16, N=74, L=200, rope="wrap", P=600, GROUPS=2, QBLOCK=d // 2,
                                  config={**SMALL, "SPLIT": 1}),
    }


SPEC = register(Spec(
    kernel=sparse_mqa_decode_fp8,
    reference=sparse_mqa_decode_fp8_reference,
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        # sparse_mqa_decode's own cases over a ring of as many rows (its N rows as the W ring rows)
        **{name: _as_ring(BF16_SPEC.cases[name]) for name in ("split4_holes", "one_phase_ragged", "few_heads",
                                                               "all_dead", "repeats")},
        # codes far from 127: rows of values near 2^-20 and 2^20 (still exact in bf16)
        "wide_codes": {"B": 2, "H": 64, "D": 128, "W": 64, "L": 64, "codes": (107, 147),
                       "config": {**SMALL, "SPLIT": 2}},
        "window_ring": {"B": 3, "H": 64, "D": 512, "W": 128, "L": 128, "holes": 0.1, "config": {"SPLIT": 8}},
        **stored_row_cases(64),
        # the output's columns in DG groups: each group's FP8 values with its codes, its NVFP4 pairs
        # with its scales
        "groups4_ring_and_compressed_rope": {"B": 2, "H": 64, "D": 128, "W": 40, "N": 120, "L": 200, "holes": 0.3,
                                             "rope": "random", "P": 500, "config": {**SMALL, "SPLIT": 2, "DG": 4}},
        "groups2_ring_and_compressed_one_phase": {"B": 2, "H": 4, "D": 64, "W": 16, "N": 74, "L": 200,
                                                  "config": {**SMALL, "SPLIT": 1, "DG": 2}},
        # each query's own list length (lens), ending in the ring part or among the compressed rows
        "lens_ring_and_compressed": {"B": 5, "H": 64, "D": 64, "W": 40, "N": 200, "L": 250, "holes": 0.3,
                                     "lens": True, "config": {**SMALL, "SPLIT": 4}},
    },
    build_cases={"v41_swa": {"B": 16, "H": 64, "D": 512, "L": 128, "W": 128},
                 "v41_csa": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 32768},
                 # as the runtime calls it: with the inverse rope epilogue, a 64K context's table
                 "v41_csa_rope": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 32768, "rope": "random",
                                  "P": 1 << 16},
                 # and with wo_a's FP8 input (fp8_wo_a): 8 groups, a code per 32 channels
                 "v41_csa_rope_fp8_out": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 32768,
                                          "rope": "random", "P": 1 << 16, "GROUPS": 8, "QBLOCK": 32}},
    tolerance=_tolerance,
    extra_error=_bound,
    derived=DERIVED,
    constants_of=fp8_out_constants,
    flops=lambda c: 4.0 * c["B"] * c["H"] * c["L"] * c["D"],
    bytes_moved=_bytes,
    model_shapes=shapes.for_models(_model_shapes),
    sweep={"B": Dim(1, 4, large=64), "H": OneOf(64, 4), "D": OneOf(64, 128), "L": Dim(1, 260, large=4000),
           "W": OneOf(128, 16, 1),  # the ring's rows, then N compressed ones
           "N": Dim(1, 300, large=100000), "holes": OneOf(0.0, 0.3, 0.9), "valid": OneOf("ragged", "all", "one"),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BN": OneOf(32, 64)}},
))
