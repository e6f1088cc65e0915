"""Sparse attention with an attention sink over a prefill chunk (model.md 2.5.6, 2.13, 5.4): ``T``
query tokens of one sequence, ``H`` heads each (64 x 512 in both models), every token with its own
index list ``idx`` (T, L) into the sequence's rows ``kv`` (N, D): its causal window and its
selected (CSA, V4.1's CSA2) or all visible (HCA) compressed rows, merged into one list padded with
-1. For head h of token t the math is the decode kernel's (``sparse_mqa_decode.py``):

    l_j   = (q_th . kv[idx_tj]) * D^-0.5                 over the live slots j (0 <= idx_tj < N)
    o_th  = sum_j exp(l_j) kv[idx_tj] / (exp(sink_h) + sum_j exp(l_j))
    lse_th = log(exp(sink_h) + sum_j exp(l_j))

with the same rules for dead slots (-1 or outside the rows: no part in the softmax), repeats
(counted as often as listed) and a list without live slots (``o`` 0, ``lse`` the sink).

With ``positions`` / ``cos`` / ``sin`` the output's rope channels are rotated by -P at each token's
position and with ``o_q`` / ``o_qs`` the output is also written as ``wo_a``'s FP8 input, group-major:
the decode kernels' epilogue (``decode_epilogue.py``, ``decode_fp8_out.py``) with the chunk's T tokens
as its queries, so a prefill chunk's attention output goes to the grouped output projection as a
decode step's does, with no ``rope`` or ``quantize`` call between.

With the compressed rows as the cache stores them (V4.1's NVFP4-like ``cmp`` / ``cmp_scale``, V4's
FP8-nope ``cmp_nope`` / ``cmp_codes`` / ``cmp_rope``: ``prefill_rows.py``) the kernel dequantises them
in its gather: a token's list then names ``kv`` rows (the window's, BF16) in its first
``ring_slots(WINDOW)`` slots and stored rows after them, so the runtime hands a chunk its sequence's
compressed rows as stored, not decoded to BF16 first.

A block per token runs the decode kernel's online softmax (``_attend``) over its list in
``BN``-slot blocks and finishes with the sink (``finish``): one phase (two more with the
epilogue: the rotation, then the quantisation), the chunk's tokens giving
the parallelism a decode step takes from its split. Each token's result depends on its own list
alone, in a fixed order, so a token's bits do not depend on how its prompt is chunked (batch
dimension ``T``). Tokens of a chunk share most of their rows (a window slides by one, their
top-k lists overlap), and this form gathers each token's rows afresh: blocks of query tokens
sharing one gather is the step after.

Model shapes: a 4,096-token chunk, the rows per token of each compressed layer kind (window +
top-512 = 640 for CSA / CSA2; V4's HCA at 1M context every visible compressed row, 128 + 8,192),
and ``N`` the chunk's rows with the compressed rows of a 64K context (CSA) or the list (HCA).
``T``, ``L``, ``N``, ``NC``, ``P`` and ``QR`` are dynamic: one build serves every chunk, list and table.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .decode_epilogue import epilogue_of, inverse_rope, rope_phase, rotated_bound
from .decode_fp8_out import DERIVED, fp8_out_constants, fp8_out_of, quant_phase
from .prefill_rows import Stored, joined, row_sources, stored_inputs
from .registry import Dim, OneOf, Spec, register
from .sparse_mqa_decode import _attend, _tolerance, finish, layer_kinds, random_inputs, sparse_mqa_decode_reference
from .sparse_mqa_decode import _error_bound as _decode_bound


@dsl.kernel(batch_dim="T", dynamic=("T", "L", "N", "NC", "P", "QR"))
def sparse_mqa_prefill(q: dsl.Tensor["T", "H", "D", dsl.bf16], kv: dsl.Tensor["N", "D", dsl.bf16],
                       idx: dsl.Tensor["T", "L", dsl.i32], sink: dsl.Tensor["H", dsl.f32],
                       o: dsl.Tensor["T", "H", "D", dsl.bf16],
                       lse: dsl.OptionalTensor["T", "H", dsl.f32] = None,
                       positions: dsl.OptionalTensor["T", dsl.i32] = None,
                       cos: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                       sin: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                       o_q: dsl.OptionalTensor["QR", "D", dsl.f8e4m3] = None,
                       o_qs: dsl.OptionalTensor["QR", "QD", dsl.u8] = None,
                       cmp: dsl.OptionalTensor["NC", "RC", dsl.u8] = None,
                       cmp_scale: dsl.OptionalTensor["NC", "RC", dsl.f8e4m3] = None,
                       cmp_nope: dsl.OptionalTensor["NC", "RC", dsl.f8e4m3] = None,
                       cmp_codes: dsl.OptionalTensor["NC", "RC", dsl.u8] = None,
                       cmp_rope: dsl.OptionalTensor["NC", "RH", dsl.bf16] = None, *,
                       GROUPS: dsl.Const = 8, QBLOCK: dsl.Const = 128, WINDOW: dsl.Const = 128,
                       ROPE: dsl.Const = 64,
                       BN: dsl.Tunable = dsl.choice(64, 32, 128),
                       STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
                       DG: dsl.Tunable = dsl.choice(1, 2, 4, 7, 8)):
    stored = Stored.of(cmp, cmp_scale, cmp_nope, cmp_codes, cmp_rope)
    rows_of, columns = row_sources(q, kv, stored, WINDOW, ROPE, BN, DG)
    epilogue = epilogue_of("sparse_mqa_prefill", q, positions, cos, sin, ROPE if columns else None)
    fp8_out = fp8_out_of("sparse_mqa_prefill", q, o_q, o_qs, GROUPS, QBLOCK)

    if epilogue is not None:
        epilogue.one_phase()
    for t in dsl.grid(q.T):
        attended = _attend(q, kv, idx, t, 0, dsl.cdiv(idx.L, BN), BN, STAGES, kv_rows=rows_of, columns=columns)
        finish(q, sink, o, lse, t, *attended, columns=columns, epilogue=epilogue)
    if epilogue is not None:
        rope_phase(q, o, epilogue)
    if fp8_out is not None:
        quant_phase(q, o, fp8_out)


GATHER_BYTES = 1 << 30  # the float64 rows a reference chunk gathers at most (a 4,096-token chunk of
# V4's HCA layer reads 8,448 rows a token: 141 GB gathered at once)


def token_ranges(count: int, per_token_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive ranges of ``count`` queries, each's gathered rows (``per_token_bytes`` a query)
    within ``budget`` bytes (at least one query a range; one empty range for no queries)."""
    step = max(1, budget // max(1, per_token_bytes))
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)] or [(0, 0)]


def _token_chunks(q, idx):
    """Token ranges whose gathered float64 rows (tokens x L x D x 8 bytes) fit GATHER_BYTES."""
    return token_ranges(q.shape[0], idx.shape[1] * q.shape[-1] * 8, GATHER_BYTES)


def _per_chunk(q, kv, idx, positions=None):
    """Each token chunk's slices of the inputs, its tokens all reading the one set of rows (a view),
    and its positions (None without)."""
    return [(q[lo:hi], kv[None].expand(hi - lo, -1, -1), idx[lo:hi], None if positions is None else positions[lo:hi])
            for lo, hi in _token_chunks(q, idx)]


def sparse_mqa_prefill_reference(q, kv, idx, sink, positions=None, cos=None, sin=None, GROUPS=None,
                                 QBLOCK=None, WINDOW=128, ROPE=64, **stored) -> dict:
    """The decode reference with every token reading the sequence's one set of rows (``joined``:
    the stored compressed rows' values, ``stored``, after ``kv``), a chunk of tokens at a time
    (each token's softmax is its own); with ``positions``, the output's rope channels rotated by -P
    (``inverse_rope``). The FP8 output is a function of the kernel's own ``o`` (``Spec.derived``)."""
    kv, idx = joined(q, kv, idx, stored, WINDOW, ROPE)
    parts = [sparse_mqa_decode_reference(qc, rows, ic, sink) for qc, rows, ic, _ in _per_chunk(q, kv, idx)]
    out = {name: torch.cat([p[name] for p in parts]) for name in ("o", "lse")}
    if positions is not None:
        out["o"] = inverse_rope(out["o"], positions, cos, sin)
    return out


def _error_bound(case, output, inputs):
    rotate = output == "o" and inputs.get("positions") is not None
    plain = {k: v for k, v in inputs.items() if k in ("q", "kv", "idx", "sink")}
    kv, idx = joined(inputs["q"], inputs["kv"], inputs["idx"], inputs, case.get("WINDOW", 128))
    parts = []
    for qc, rows, ic, pc in _per_chunk(inputs["q"], kv, idx, inputs.get("positions")):
        bound = _decode_bound(case, output, {**plain, "q": qc, "kv": rows, "idx": ic})
        if rotate:  # the plain bound is 2^-8 of each channel's size A (``rotated_bound`` takes A)
            bound = rotated_bound(bound.double() * 2.0 ** 8, {**inputs, "positions": pc}).float()
        parts.append(bound)
    return torch.cat(parts)


def _inputs(case, device, seed):
    """``random_inputs`` over the ``N`` rows; with ``NC``, that many compressed rows as stored too
    (``prefill_rows.stored_inputs``: the case's ``FORMAT`` and ``WINDOW``)."""
    t, h, d, n, nc = case["T"], case["H"], case["D"], case["N"], case.get("NC", 0)
    base = random_inputs({**case, "B": t, "N": n + nc}, device, seed, (t, h, d), (n, d))
    return stored_inputs(case, device, seed, base) if nc else base


def _constants(case) -> dict:
    """The FP8 output's constants and, with stored compressed rows, the window part's ``WINDOW``."""
    return {**fp8_out_constants(case), **({"WINDOW": case.get("WINDOW", 128)} if case.get("NC") else {})}


def _model_shapes(m) -> dict:
    """A prefill chunk per compressed layer kind (``sparse_mqa_decode.layer_kinds``: its list
    length L), its rows N the chunk's own beside the compressed rows a decode step reads."""
    t = shapes.PREFILL_CHUNK
    return {f"{m.short}/{kind}/prefill{t}": {"T": t, "H": m.heads, "D": m.head_dim, "L": length, "N": t + n,
                                             "model": m.name}
            for kind, (length, n) in layer_kinds(m).items()}


SMALL = {"BN": 32, "STAGES": 1}
SPEC = register(Spec(
    kernel=sparse_mqa_prefill,
    reference=sparse_mqa_prefill_reference,
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        "holes": {"T": 5, "H": 64, "D": 64, "N": 300, "L": 200, "holes": 0.3, "config": SMALL},
        "ragged": {"T": 6, "H": 64, "D": 64, "N": 90, "L": 96, "config": SMALL},
        # a small model's 4 heads, padded to 64 zero queries never stored
        "few_heads": {"T": 4, "H": 4, "D": 64, "N": 60, "L": 70, "holes": 0.3, "config": SMALL},
        "all_but_one": {"T": 3, "H": 64, "D": 64, "N": 50, "L": 100, "valid": "one", "config": SMALL},
        "all_dead": {"T": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "config": SMALL},
        "repeats": {"T": 2, "H": 64, "D": 64, "N": 20, "L": 128, "valid": "all", "repeat": True,
                    "out_of_range": True, "config": SMALL},
        "spread": {"T": 3, "H": 64, "D": 64, "N": 200, "L": 160, "spread": 30.0, "sink": 20.0, "holes": 0.5,
                   "config": {"BN": 64, "STAGES": 2}},
        # the epilogue (``decode_epilogue``): positions anywhere, around the ring and table blocks, past the table
        "rope_holes": {"T": 5, "H": 64, "D": 128, "N": 300, "L": 200, "holes": 0.3, "rope": "random",
                       "config": SMALL},
        "rope_few_heads_wrap": {"T": 3, "H": 4, "D": 64, "N": 40, "L": 50, "rope": "wrap", "P": 600,
                                "base": 160000.0, "config": SMALL},
        "rope_past_table": {"T": 4, "H": 64, "D": 128, "N": 60, "L": 64, "rope": "past", "P": 70, "config": SMALL},
        "rope_all_dead": {"T": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "rope": "random",
                          "config": SMALL},
        # wo_a's FP8 input (``decode_fp8_out``), with and without the rotation, a block straddling both parts
        "fp8_out_rope": {"T": 3, "H": 4, "D": 128, "N": 60, "L": 70, "rope": "wrap", "P": 600, "GROUPS": 2,
                         "QBLOCK": 32, "config": SMALL},
        "fp8_out_rope_straddle": {"T": 2, "H": 64, "D": 256, "N": 90, "L": 100, "rope": "random", "GROUPS": 8,
                                  "QBLOCK": 128, "config": SMALL},
        "fp8_out_all_dead": {"T": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "GROUPS": 8, "QBLOCK": 32,
                             "config": SMALL},
        # compressed rows as stored (V4.1's NVFP4-like), dequantised in the kernel: the list's first 128
        # slots name the BF16 rows, the rest the stored ones; a short window (16 of its 128 slots)
        "stored_holes": {"T": 5, "H": 64, "D": 64, "N": 150, "NC": 90, "L": 200, "holes": 0.3, "config": SMALL},
        "stored_short_window_out_of_range": {"T": 3, "H": 64, "D": 64, "N": 40, "NC": 60, "L": 180, "WINDOW": 16,
                                             "out_of_range": True, "config": SMALL},
        "stored_rope_fp8_out": {"T": 3, "H": 4, "D": 128, "N": 60, "NC": 70, "L": 190, "rope": "wrap", "P": 600,
                                "GROUPS": 2, "QBLOCK": 32, "config": {"BN": 64, "STAGES": 2}},
        # V4's FP8-nope rows: two column groups (64 nope channels, 64 rope), the window's BF16 rows split alike
        "stored_nope_holes": {"T": 4, "H": 64, "D": 128, "N": 100, "NC": 80, "L": 200, "FORMAT": "fp8_nope",
                              "holes": 0.3, "config": SMALL},
        "stored_nope_rope_fp8_out_out_of_range": {"T": 3, "H": 4, "D": 128, "N": 50, "NC": 70, "L": 170,
                                                  "FORMAT": "fp8_nope", "WINDOW": 16, "out_of_range": True,
                                                  "rope": "random", "GROUPS": 2, "QBLOCK": 32, "config": SMALL},
        # the output's columns in DG groups: BF16 rows, stored NVFP4 rows with the epilogue and wo_a's
        # FP8 input, V4's stored rows (the nope channels in two groups, then the rope channels)
        "groups4_holes": {"T": 4, "H": 64, "D": 128, "N": 200, "L": 150, "holes": 0.3,
                          "config": {**SMALL, "DG": 4}},
        "stored_groups2_rope_fp8_out": {"T": 3, "H": 4, "D": 128, "N": 60, "NC": 70, "L": 190, "rope": "wrap",
                                        "P": 600, "GROUPS": 2, "QBLOCK": 32, "config": {**SMALL, "DG": 2}},
        "stored_nope_groups2": {"T": 3, "H": 64, "D": 192, "N": 100, "NC": 80, "L": 200, "FORMAT": "fp8_nope",
                                "holes": 0.3, "rope": "random", "config": {**SMALL, "DG": 2}},
    },
    build_cases={"v41_csa2": {"T": 4096, "H": 64, "D": 512, "L": 640, "N": 36992}},
    tolerance=_tolerance,
    extra_error=_error_bound,
    derived=DERIVED,
    constants_of=_constants,
    flops=lambda c: 4.0 * c["T"] * c["H"] * c["L"] * c["D"],
    bytes_moved=lambda c: 2.0 * (c["T"] * c["L"] * c["D"] + 2 * c["T"] * c["H"] * c["D"]) + 4.0 * c["T"] * c["L"],
    model_shapes=shapes.for_models(_model_shapes),
    sweep={"T": Dim(1, 6, large=64), "H": OneOf(64, 64, 4), "D": OneOf(64, 128), "L": Dim(1, 260, large=9000),
           "N": Dim(1, 300, large=300000), "holes": OneOf(0.0, 0.3, 0.9), "repeat": OneOf(False, True),
           "valid": OneOf("ragged", "all", "one"), "spread": OneOf(1.0, 10.0), "sink": OneOf(1.0, 10.0),
           "config": {"BN": OneOf(32, 64)}},
))
