"""Sparse decode attention with a sink: the reference against the runtime's attention and the
model's semantics (dead slots take no part, the sink only in the denominator), the interpreter
against the reference at the cases and at seeded random shapes, and the split's combine in a
fixed order: a sequence's bits do not depend on the batch around it."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import get
from duotile.kernels_spec.compare import check_outputs
from duotile.runtime.layers.common import Ctx, sparse_attention
from duotile.runtime.ops import FastOps

SPEC = get("sparse_mqa_decode")
CASE = {"B": 3, "H": 64, "D": 64, "N": 150, "L": 100, "holes": 0.3}
SMALL = {"BN": 32, "STAGES": 1}
CPU = torch.device("cpu")


def _call(x: dict, config: dict, with_lse: bool = True, case: dict | None = None) -> dict:
    """The kernel on ``x``'s inputs into fresh outputs (wo_a's FP8 input too where ``x`` has it,
    at ``case``'s constants)."""
    out = {"o": torch.full_like(x["o"], float("nan")), "lse": torch.full_like(x["lse"], float("nan"))}
    args = {k: x[k] for k in ("q", "kv", "idx", "sink", "positions", "cos", "sin", "lens") if k in x}
    args.update({k: torch.empty_like(x[k]) for k in ("o_q", "o_qs") if k in x})
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config,
                             constants=SPEC.constants_of(case) if case else None)
    if with_lse:
        kernel(**args, **out)
    else:
        kernel(**args, o=out["o"])
    return {**out, **{k: args[k] for k in ("o_q", "o_qs") if k in args}}


def _within_bound(case, x, got: dict) -> None:
    ref = SPEC.run_reference(x, case)
    check_outputs(SPEC, case, {**x, **got}, ref)


def test_reference_agrees_with_the_runtime_attention():
    """The runtime's decode attention (model.md 2.5.6 as the engine runs it) on the same rows:
    the gathered rows with a validity mask. Every sequence keeps a live slot (the runtime's
    softmax over no rows at all is 0 / 0)."""
    case = {**CASE, "valid": "all"}
    x = SPEC.make_inputs(case, CPU, 4)
    ref = SPEC.run_reference(x, case)
    idx = x["idx"]
    live = (idx >= 0) & (idx < x["kv"].shape[1])
    assert bool((~live).any()) and bool(live.any(1).all())
    keys = x["kv"][torch.arange(idx.shape[0])[:, None], idx.clamp(min=0).long()]
    o = sparse_attention(Ctx(FastOps()), x["q"], keys, live, x["sink"], x["q"].shape[-1] ** -0.5)
    assert torch.allclose(o, ref["o"].float(), atol=2e-2, rtol=2e-2)
    assert (o - ref["o"].float()).abs().max() <= 2.0 ** -7 * ref["o"].float().abs().max()


def test_dead_slots_are_absent_rows_not_zero_rows_and_the_sink_has_no_value():
    """A slot of -1 must not count as a zero row (score 0), and the sink must only enlarge the
    denominator: each of those readings gives outputs outside the tolerance, so the interpreter
    tests can tell them apart."""
    case = {**CASE, "holes": 0.5}
    x = SPEC.make_inputs(case, CPU, 5)
    ref = SPEC.run_reference(x, case)
    bound = SPEC.allowed_error(case, "o", ref["o"].float(), x)
    n = x["kv"].shape[1]
    zero_row = torch.cat([x["kv"], torch.zeros_like(x["kv"][:, :1])], 1)  # row n is all zeros
    as_zero = SPEC.reference(x["q"], zero_row, torch.where(x["idx"] < 0, n, x["idx"]), x["sink"])
    no_sink = SPEC.reference(x["q"], x["kv"], x["idx"], torch.full_like(x["sink"], -1e30))
    for wrong in (as_zero["o"], no_sink["o"]):
        assert bool(((wrong.float() - ref["o"].float()).abs() > bound).any())
    got = _call(x, {**SMALL, "SPLIT": 4})
    _within_bound(case, x, got)


@pytest.mark.parametrize("split", [1, 2, 8])
def test_no_live_slot_gives_zero_output_and_the_sink_as_lse(split):
    case = {**CASE, "valid": "none"}
    x = SPEC.make_inputs(case, CPU, 6)
    assert bool((x["idx"] < 0).all())
    got = _call(x, {**SMALL, "SPLIT": split})
    assert torch.equal(got["o"], torch.zeros_like(got["o"]))
    sink = x["sink"][None, :].expand_as(got["lse"])
    assert torch.allclose(got["lse"], sink, rtol=2.0 ** -20, atol=0.0)


def test_one_live_slot_is_that_row_weighted_against_the_sink():
    case = {**CASE, "valid": "one"}
    x = SPEC.make_inputs(case, CPU, 7)
    got = _call(x, {**SMALL, "SPLIT": 4})
    for b in range(case["B"]):
        (slot,) = torch.nonzero(x["idx"][b] >= 0)[:, 0].tolist()
        row = x["kv"][b, x["idx"][b, slot]].double()
        logit = x["q"][b].double() @ row / case["D"] ** 0.5
        want = torch.sigmoid(logit - x["sink"].double())[:, None] * row[None, :]
        assert torch.allclose(got["o"][b].double(), want, atol=1e-6, rtol=2.0 ** -7), b


def test_every_split_count_matches_the_reference():
    x = SPEC.make_inputs(CASE, CPU, 2)
    for split in (1, 2, 16):  # 4 slot blocks: 16 ranges leave some empty
        _within_bound(CASE, x, _call(x, {**SMALL, "SPLIT": split}))


def test_without_lse_the_output_is_the_same():
    x = SPEC.make_inputs(CASE, CPU, 3)
    for split in (1, 4):
        cfg = {**SMALL, "SPLIT": split}
        assert torch.equal(_call(x, cfg, with_lse=False)["o"], _call(x, cfg)["o"]), split


@pytest.mark.parametrize("name", sorted(SPEC.cases))
def test_cases_match_the_reference(name):
    case = SPEC.cases[name]
    x = SPEC.make_inputs(case, CPU, 11)
    _within_bound(case, x, _call(x, SPEC.config_of(case), case=case))


@pytest.mark.parametrize("seed", range(500, 504))
def test_random_cases_match_the_reference(seed):
    case = SPEC.random_case(random.Random(seed))
    x = SPEC.make_inputs(case, CPU, seed)
    _within_bound(case, x, _call(x, SPEC.config_of(case)))


def _sub(x: dict, rows: list[int]) -> dict:
    return {k: (v if k == "sink" else v[rows].contiguous()) for k, v in x.items()}


@pytest.mark.parametrize("split", [1, 4])
def test_a_sequence_gets_the_same_bits_whatever_the_batch(split):
    """Alone, in a prefix of the batch and at another place in a reordered batch: the same bits
    of o and lse (the ranges are combined in range order, whatever the batch size)."""
    x = SPEC.make_inputs({**CASE, "B": 4}, CPU, 8)
    cfg = {**SMALL, "SPLIT": split}
    full = _call(x, cfg)
    for rows in ([3], [0, 1], [2, 0, 3, 1]):
        part = _call(_sub(x, rows), cfg)
        for out in ("o", "lse"):
            assert torch.equal(part[out], full[out][rows]), (rows, out)


def test_the_kernel_passes_the_batch_invariance_check():
    from duotile.passes.check_batch_invariance import check_batch_invariance

    for split in (1, 16):
        check_batch_invariance(SPEC.kernel, config={"SPLIT": split})  # raises on a batch-dependent order


def _rotary(compressed: bool):
    from types import SimpleNamespace

    from duotile.runtime.layers.common import Rotary

    cfg = SimpleNamespace(qk_rope_head_dim=64, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16,
                          original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    return Rotary(cfg, compressed)


@pytest.mark.parametrize("compressed", [False, True], ids=["base10000", "yarn160000"])
@pytest.mark.parametrize("split", [1, 4])
def test_the_epilogue_is_the_runtimes_inverse_rope_of_the_plain_output_bit_for_bit(split, compressed):
    """The kernel's output with the epilogue is what the runtime makes of the plain output:
    ``act(rotary.apply(act(o), P, inverse=True))`` with the rotary's own tables, bit for bit."""
    rotary = _rotary(compressed)
    case = {"B": 4, "H": 64, "D": 128, "N": 150, "L": 100, "holes": 0.3}
    x = SPEC.make_inputs(case, CPU, 7)
    pos = torch.tensor([0, 63, 64, 517])  # across the tables' 64-position blocks
    cos, sin = rotary.cos_sin(torch.arange(640))
    cfg = {**SMALL, "SPLIT": split, "BD": 64}
    plain = _call(x, cfg)["o"]
    got = _call({**x, "positions": pos.to(torch.int32), "cos": cos.contiguous(), "sin": sin.contiguous()}, cfg)["o"]
    want = rotary.apply(plain, pos, inverse=True).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_partial_epilogue_is_refused():
    x = SPEC.make_inputs(CASE, CPU, 1)
    cos, _ = _rotary(False).cos_sin(torch.arange(8))
    with pytest.raises(Exception, match="positions, cos and sin together"):
        _call({**x, "positions": torch.zeros(3, dtype=torch.int32), "cos": cos.contiguous()}, {**SMALL, "SPLIT": 2})
