"""Sparse decode attention over V4-Flash's cache rows as stored (model.md 3.1, 3.2), dequantised in
the kernel: ``sparse_mqa_decode`` with the K = V rows in V4's row format, which ``kv_insert``
(FORMAT ``"fp8_nope"``) writes and ``runtime/stored.py`` keeps, for the window ring and the
compressed rows alike. A row of R bytes holds, for D channels of which the last ``ROPE`` are rope:

* bytes ``[0, n)``, n = D - ROPE: the nope channels, e4m3;
* bytes ``[n, n + 2 ROPE)``: the rope channels, bf16 (little-endian), unquantised;
* bytes ``[n + 2 ROPE, n + 2 ROPE + n / 64)``: a UE8M0 code a 64 nope channels; then padding
  (584 bytes a row at D = 512, ROPE = 64: 448 + 128 + 7 + 1, against 1,024 in BF16).

Nope channel c is ``kv[b, j, c] x 2^(kv_scale[b, j, n + 2 ROPE + c // 64] - 127)``; rope channel
n + i is ``kv_rope[b, j, n / 2 + i]``. The kernel takes the ring three times, as the same memory:
``kv`` (B, W, R) e4m3, ``kv_scale`` (B, W, R) u8 and ``kv_rope`` (B, W, R / 2) bf16; and,
optionally (V4's CSA and HCA layers), the compressed rows (B, N, R) likewise (``cmp``,
``cmp_scale``, ``cmp_rope``).

The index list is ``sparse_mqa_decode_fp8``'s: with compressed rows its first ``ring_slots(W)``
slots (W rounded up to a multiple of 128) name ring rows and the rest compressed rows (-1, or an
index past its tensor's rows, names no row). Everything else is ``sparse_mqa_decode``'s: the sink, the
scale D^-0.5, the split over ``SPLIT`` ranges with its fixed-order combine (bitwise batch
invariant), the outputs and their tolerance. A block of slots is gathered from one tensor, each
row split by columns (``_attend``'s column groups): the nope channels become a bf16 operand
(``dsl.mxfp8_values``, exact for every code the quantisers write) and the rope channels are one
already. The scores sum both groups' products; each group keeps its own output accumulator.

Model shapes (V4 alone: V4.1's rows are all FP8, ``sparse_mqa_decode_fp8``): the SWA layers read
their ring alone, 128 rows a query; a CSA layer its ring and its top-512 of a 64K context's 16,384
compressed rows (ratio 4), 640 a query; an HCA layer its ring and every visible compressed row of
a 1M context, 128 + 8,192; decode batches 1, 16 and 64. The runtime's V4 decode calls it (the
model op ``sparse_attention_stored``) on the rows its cache keeps as bytes.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .column_groups import column_groups
from .decode_epilogue import epilogue_of
from .decode_fp8_out import DERIVED, fp8_out_constants, fp8_out_of
from .kv_insert import row_bytes
from .registry import Dim, OneOf, Spec, register
from .sparse_mqa_decode import (
    SMALL,
    _error_bound,
    _tolerance,
    decode,
    layer_kinds,
    own_list,
    random_inputs,
    sparse_mqa_decode_reference,
)
from .sparse_mqa_decode import SPEC as BF16_SPEC
from .sparse_mqa_decode_fp8 import check_block, joint_index, ring_slots, split_list, stored_row_cases

CODE_BLOCK = 64  # nope channels a UE8M0 code covers in V4's rows
HCA_GOAL_BATCH = 4  # docs/attention_path.md: V4 HCA decode at a 1M context, batch 4


def _code_columns(nope):
    """The code bytes a row's tile reads: the nope channels' codes, rounded up to a power of two
    (V4's 7 codes and the padding byte after them: one 8-byte read)."""
    return dsl.next_pow2(nope // CODE_BLOCK)


def row_groups(values, scales, rope, at, slots, nope, ROPE, BN, nope_groups=None):
    """Rows ``slots`` (-1 reads zeros) of one row tensor, by column group: the nope channels'
    bf16 operands, one a group of ``nope_groups`` ((first, width) pairs, whole code blocks; all
    nope channels in one by default), then the rope channels' (each (BN, width)). ``at``: the
    indices before the row's (a sequence's ``(b,)`` in a per-sequence stack, ``()`` in one pool
    of rows)."""
    codes = dsl.load(scales[(*at, slots, nope + 2 * ROPE)], (BN, _code_columns(nope)), role="operand")
    nope_values = [dsl.mxfp8_values(dsl.load(values[(*at, slots, first)], (BN, width), role="operand"), codes,
                                    first=first // CODE_BLOCK, block=CODE_BLOCK)
                   for first, width in nope_groups or ((0, nope),)]
    return (*nope_values, dsl.load(rope[(*at, slots, nope // 2)], (BN, ROPE), role="operand"))


def nope_column_groups(nope, ROPE, DG):
    """The output's column groups: the nope channels in ``DG`` groups of whole code blocks, then
    the rope channels (``sparse_mqa_decode.column_groups``: a target whose accumulators live in
    TMEM takes several); (nope groups, every group)."""
    groups = column_groups(nope, DG) or ((0, nope),)
    if DG > 1:
        width = groups[0][1]
        for cond in (width >= CODE_BLOCK, CODE_BLOCK * (width // CODE_BLOCK) >= width):
            dsl.require(cond, f"DG {DG}: a group of the nope channels must be whole {CODE_BLOCK}-channel code blocks")
    return groups, (*groups, (nope, ROPE))


# SPLIT defaults to 16, the two-phase form, as sparse_mqa_decode's
@dsl.kernel(batch_dim="B", dynamic=("B", "L", "N", "P", "QR"))
def sparse_mqa_decode_fp8_nope(q: dsl.Tensor["B", "H", "D", dsl.bf16], kv: dsl.Tensor["B", "W", "R", dsl.f8e4m3],
                               kv_scale: dsl.Tensor["B", "W", "R", dsl.u8],
                               kv_rope: dsl.Tensor["B", "W", "RH", dsl.bf16], idx: dsl.Tensor["B", "L", dsl.i32],
                               sink: dsl.Tensor["H", dsl.f32], o: dsl.Tensor["B", "H", "D", dsl.bf16],
                               lse: dsl.OptionalTensor["B", "H", dsl.f32] = None,
                               cmp: dsl.OptionalTensor["B", "N", "R", dsl.f8e4m3] = None,
                               cmp_scale: dsl.OptionalTensor["B", "N", "R", dsl.u8] = None,
                               cmp_rope: dsl.OptionalTensor["B", "N", "RH", dsl.bf16] = None,
                               positions: dsl.OptionalTensor["B", dsl.i32] = None,
                               cos: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                               sin: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                               o_q: dsl.OptionalTensor["QR", "D", dsl.f8e4m3] = None,
                               o_qs: dsl.OptionalTensor["QR", "QD", dsl.u8] = None,
                               lens: dsl.OptionalTensor["B", dsl.i32] = None, *,
                               GROUPS: dsl.Const = 8, QBLOCK: dsl.Const = 128,
                               ROPE: dsl.Const = 64,
                               BN: dsl.Tunable = dsl.choice(64, 32, 128),
                               STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
                               SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32),
                               BD: dsl.Tunable = dsl.choice(128, 64, 256),
                               DG: dsl.Tunable = dsl.choice(1, 2, 7)):
    if len({cmp is None, cmp_scale is None, cmp_rope is None}) > 1:
        raise dsl.DslError("sparse_mqa_decode_fp8_nope: give cmp, cmp_scale and cmp_rope together (the compressed "
                           "rows as values, codes and rope channels), or none")
    if not (isinstance(ROPE, int) and ROPE > 0 and ROPE % 16 == 0):
        raise dsl.DslError(f"ROPE {ROPE!r} must be a positive multiple of 16 (the rope channels)")
    d = q.D
    nope = d - ROPE
    # (sizes compare as symbols: == and % would decide before binding)
    for cond in (nope >= CODE_BLOCK, CODE_BLOCK * (nope // CODE_BLOCK) >= nope):
        dsl.require(cond, f"D - ROPE (the nope channels) must be a positive multiple of {CODE_BLOCK}, a UE8M0 "
                          f"code's block")
    dsl.require(kv.R >= nope + 2 * ROPE + _code_columns(nope),
                "kv's rows (R bytes) are short of D - ROPE e4m3 values, ROPE bf16 channels and the codes read")
    views = [("kv", kv, kv_rope)] + ([] if cmp is None else [("cmp", cmp, cmp_rope)])
    for name, rows, rope in views:
        for cond in (2 * rope.RH >= rows.R, 2 * rope.RH <= rows.R):
            dsl.require(cond, f"{name}_rope must be {name}'s rows as bf16 (R / 2 columns)")

    check_block(BN)
    nope_groups, columns = nope_column_groups(nope, ROPE, DG)

    def rows_of(b):
        def window(slots):  # an index past the ring reads zeros
            return list(row_groups(kv, kv_scale, kv_rope, (b,), dsl.where(slots < kv.W, slots, -1), nope, ROPE, BN,
                                   nope_groups))

        def compressed(slots):
            return list(row_groups(cmp, cmp_scale, cmp_rope, (b,), dsl.where(slots < cmp.N, slots, -1), nope, ROPE,
                                    BN, nope_groups))

        if cmp is None:
            return window
        ring = ring_slots(kv.W) // BN  # the list's blocks of ring rows
        return [(0, ring, window, kv.W), (ring, None, compressed, cmp.N)]

    epilogue = epilogue_of("sparse_mqa_decode_fp8_nope", q, positions, cos, sin, ROPE)
    decode(q, kv, idx, sink, o, lse, BN, STAGES, SPLIT, BD, rows_of, kv.W, columns=columns,
           epilogue=epilogue, fp8_out=fp8_out_of("sparse_mqa_decode_fp8_nope", q, o_q, o_qs, GROUPS, QBLOCK), lens=lens)


def stored_rows(nope_values: torch.Tensor, rope: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Rows as the cache keeps them (u8 [..., R], ``kv_insert.row_bytes``): the e4m3 nope values'
    bytes, the bf16 rope channels' bytes, the codes, zero bytes to a multiple of 8 codes."""
    pad = codes.new_zeros(*codes.shape[:-1], -codes.shape[-1] % 8)
    return torch.cat([nope_values.view(torch.uint8), rope.to(torch.bfloat16).contiguous().view(torch.uint8),
                      codes, pad], -1)


def rows_dequantised(rows: torch.Tensor, d: int, rope: int = 64) -> torch.Tensor:
    """The values of rows as stored (u8 [..., R]) in float64: each nope e4m3 value times 2^(code -
    127) of its 64 channels (NaN for code 255), then the bf16 rope channels."""
    nope = d - rope
    values = rows[..., :nope].contiguous().view(torch.float8_e4m3fn).double()
    codes = rows[..., nope + 2 * rope : nope + 2 * rope + nope // CODE_BLOCK]
    scale = torch.where(codes == 255, torch.nan, torch.exp2(codes.double() - 127))
    rope_values = rows[..., nope : nope + 2 * rope].contiguous().view(torch.bfloat16).double()
    return torch.cat([values * scale.repeat_interleave(CODE_BLOCK, -1), rope_values], -1)


def all_rows(d: int, kv, cmp=None, rope: int = 64) -> torch.Tensor:
    """Every row a slot can name, dequantised (float64): the window's W, then the compressed N."""
    window = rows_dequantised(kv.view(torch.uint8), d, rope)
    return window if cmp is None else torch.cat([window, rows_dequantised(cmp.view(torch.uint8), d, rope)], 1)


def sparse_mqa_decode_fp8_nope_reference(q, kv, kv_scale, kv_rope, idx, sink, cmp=None, cmp_scale=None,
                                         cmp_rope=None, positions=None, cos=None, sin=None, ROPE: int = 64,
                                         GROUPS=None, QBLOCK=None, lens=None) -> dict:
    """model.md 2.5.6 over the dequantised rows (3.1's row format), window rows first; with
    ``positions``, the output's rope channels rotated by -P (``sparse_mqa_decode``'s epilogue); with
    ``lens``, a query's slots at and past its length are dead."""
    idx = joint_index(own_list(idx, lens), kv.shape[1], None if cmp is None else cmp.shape[1])
    return sparse_mqa_decode_reference(q, all_rows(q.shape[-1], kv, cmp, ROPE), idx, sink, positions, cos, sin)


def _bound(case, output, inputs):
    rows, cmp = all_rows(inputs["q"].shape[-1], inputs["kv"], inputs.get("cmp")), inputs.get("cmp")
    idx = joint_index(inputs["idx"], inputs["kv"].shape[1], None if cmp is None else cmp.shape[1])
    return _error_bound(case, output, {**inputs, "kv": rows, "idx": idx})


def _random_rows(shape, d: int, g, device, codes) -> torch.Tensor:
    """Rows (u8 ``shape`` + [R]) of e4m3 values of about unit size, codes drawn from ``codes``
    (lo, hi) and bf16 rope channels."""
    nope, rope = d - 64, 64
    values = (torch.randn(*shape, nope, generator=g, device=device) * 4).to(torch.float8_e4m3fn)
    lo, hi = codes
    code = torch.randint(lo, hi + 1, (*shape, nope // CODE_BLOCK), generator=g, device=device, dtype=torch.uint8)
    rope_values = torch.randn(*shape, rope, generator=g, device=device).to(torch.bfloat16)
    return stored_rows(values, rope_values, code)


def _views(prefix: str, rows: torch.Tensor) -> dict:
    return {prefix: rows.view(torch.float8_e4m3fn), f"{prefix}_scale": rows,
            f"{prefix}_rope" if prefix == "cmp" else "kv_rope": rows.view(torch.bfloat16)}


def _inputs(case, device, seed):
    """``sparse_mqa_decode``'s inputs, its index list over the ``W`` ring rows and the ``N``
    compressed ones (none where the case names no N), with the rows as stored (64 rope channels)."""
    b, h, d, w, n = case["B"], case["H"], case["D"], case["W"], case.get("N", 0)
    base = random_inputs({**case, "N": w + n}, device, seed, (b, h, d), (b, 0, d))
    r = row_bytes(d, "fp8_nope")
    if device.type == "meta":
        out = {**base, **_views("kv", torch.empty(b, w, r, dtype=torch.uint8))}
        return {**out, **_views("cmp", torch.empty(b, n, r, dtype=torch.uint8))} if n else out
    g = torch.Generator(device=device).manual_seed(seed + 7)
    codes = case.get("codes", (122, 132))
    out = {**base, **_views("kv", _random_rows((b, w), d, g, device, codes))}
    if not n:
        return out
    return {**out, **_views("cmp", _random_rows((b, n), d, g, device, codes)),
            "idx": split_list(base["idx"], w, n, case)}


def _model_shapes(m) -> dict:
    """V4's SWA layers (the window ring alone, L = 128) and its compressed layer kinds
    (``layer_kinds``: the ring and the top-512 of a 64K context's CSA rows, or every visible HCA
    row at 1M) at decode batches 1, 16 and 64; the HCA layer also at batch 4, where the attention
    path's speed goal for V4 is set (8,320 rows at a 1M context), and as the runtime calls it: with
    each query's list length (``lens``: its lists differ by sequence), another build than CSA's."""
    if m.short != "v4":
        return {}
    ring = {"H": m.heads, "D": m.head_dim, "W": m.window, "model": m.name}
    out = {f"{m.short}/swa{m.window}/decode{b}": {**ring, "B": b, "L": m.window} for b in shapes.DECODE_SAMPLE}
    for kind, (length, rows) in layer_kinds(m).items():
        goal = (HCA_GOAL_BATCH,) if kind.startswith("hca") else ()
        for b in sorted({*shapes.DECODE_SAMPLE, *goal}):
            own = {"lens": "full"} if kind.startswith("hca") else {}  # every list at L: the worst case
            out[f"{m.short}/{kind}/decode{b}"] = {**ring, "B": b, "L": length, "N": rows - m.window, **own}
    return out


def _bytes(c) -> float:
    """A row's bytes for each slot, the queries and outputs in bf16, the list."""
    return float(c["B"] * (c["L"] * row_bytes(c["D"], "fp8_nope") + 4 * c["H"] * c["D"] + 4 * c["L"]))


def _as_ring(case: dict) -> dict:
    """A sparse_mqa_decode case at D = 128 (64 nope channels, 64 rope) whose N rows are the ring's."""
    return {**{("W" if k == "N" else k): v for k, v in case.items()}, "D": 128}


SPEC = register(Spec(
    kernel=sparse_mqa_decode_fp8_nope,
    reference=sparse_mqa_decode_fp8_nope_reference,
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        # sparse_mqa_decode's own cases over a ring of as many rows (its N rows as the W ring rows)
        **{name: _as_ring(BF16_SPEC.cases[name]) for name in ("split4_holes", "one_phase_ragged", "few_heads",
                                                               "all_dead", "repeats")},
        # codes far from 127: nope values near 2^-20 and 2^20 (still exact in bf16)
        "wide_codes": {"B": 2, "H": 64, "D": 192, "W": 64, "L": 64, "codes": (107, 147),
                       "config": {**SMALL, "SPLIT": 2}},
        "window_ring": {"B": 3, "H": 64, "D": 512, "W": 128, "L": 128, "holes": 0.1, "config": {"SPLIT": 8}},
        **stored_row_cases(128),  # (a CSA / HCA layer; the epilogue)
        # the nope channels in DG groups of whole code blocks, then the rope channels: 2 of 64 at D
        # 192; V4's 7 of 64 at D 512
        "groups2_ring_and_compressed_rope": {"B": 2, "H": 64, "D": 192, "W": 40, "N": 120, "L": 200, "holes": 0.3,
                                             "rope": "random", "P": 500, "config": {**SMALL, "SPLIT": 2, "DG": 2}},
        "groups7_window_ring_one_phase": {"B": 2, "H": 64, "D": 512, "W": 128, "L": 128, "holes": 0.1,
                                          "config": {"SPLIT": 1, "DG": 7}},
        # each query's own list length (lens: an HCA layer's lists differ by sequence), split 4 and 1
        "lens_ring_and_compressed_rope": {"B": 5, "H": 64, "D": 128, "W": 40, "N": 200, "L": 250, "holes": 0.3,
                                          "lens": True, "rope": "random", "P": 500, "config": {**SMALL, "SPLIT": 4}},
        "lens_one_phase": {"B": 4, "H": 64, "D": 128, "W": 40, "N": 120, "L": 200, "lens": True,
                           "config": {**SMALL, "SPLIT": 1}},
    },
    build_cases={"v4_swa": {"B": 16, "H": 64, "D": 512, "L": 128, "W": 128},
                 "v4_csa": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 16384},
                 # as the runtime calls it: with the inverse rope epilogue, a 64K context's table
                 "v4_csa_rope": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 16384, "rope": "random",
                                 "P": 1 << 16},
                 # and with wo_a's FP8 input (fp8_wo_a): 8 groups, a code per 128 channels
                 "v4_csa_rope_fp8_out": {"B": 16, "H": 64, "D": 512, "W": 128, "L": 640, "N": 16384,
                                         "rope": "random", "P": 1 << 16, "GROUPS": 8, "QBLOCK": 128}},
    tolerance=_tolerance,
    extra_error=_bound,
    derived=DERIVED,
    constants_of=fp8_out_constants,
    flops=lambda c: 4.0 * c["B"] * c["H"] * c["L"] * c["D"],
    bytes_moved=_bytes,
    model_shapes=shapes.for_models(_model_shapes),
    sweep={"B": Dim(1, 4, large=64), "H": OneOf(64, 4), "D": OneOf(128, 192, 512), "L": Dim(1, 260, large=4000),
           "W": OneOf(128, 16, 1),  # the ring's rows, then N compressed ones
           "N": Dim(1, 300, large=100000), "holes": OneOf(0.0, 0.3, 0.9), "valid": OneOf("ragged", "all", "one"),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BN": OneOf(32, 64)}},
))
