"""The lightning indexer's decode logits on the interpreter: the reference within the derived
bound, the -inf mask exact (no visible row gives a row of -inf), small-integer inputs and tied
rows bit for bit, a sequence's bits independent of the batch, agreement with the runtime's
``index_scores``, and a bound tight enough to catch a wrong value."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import get
from duotile.kernels_spec.compare import check_outputs
from duotile.kernels_spec.model_shapes import V4_FLASH, V41_FLASH
from duotile.runtime.layers.common import Ctx, index_scores
from duotile.runtime.ops import FastOps

SPEC = get("indexer_logits")
CPU = torch.device("cpu")


def _run(case: dict, inputs: dict, config: dict | None = None) -> torch.Tensor:
    out = {**inputs, "logits": torch.full_like(inputs["logits"], float("nan"))}
    cfg = SPEC.config_of(case) if config is None else config
    codegen.compile(SPEC.kernel, "interpret", config=cfg, constants=SPEC.constants_of(case))(**out)
    return out["logits"]


def _visible(case: dict, inputs: dict) -> torch.Tensor:
    """(B, L) bool: row j of sequence b is visible, j < (P_b + 1) // RATIO."""
    vis = (inputs["pos"].long() + 1) // case.get("RATIO", 4)
    return torch.arange(case["L"])[None, :] < vis[:, None]


def _check(case: dict, inputs: dict, got: torch.Tensor) -> None:
    want = SPEC.run_reference(inputs, case)["logits"]
    check_outputs(SPEC, case, {**inputs, "logits": got}, {"logits": want})
    visible = _visible(case, inputs)
    assert torch.equal(torch.isneginf(got), ~visible), "the -inf mask is not exactly the invisible rows"
    assert bool(torch.isfinite(got[visible]).all())


@pytest.mark.parametrize("name", sorted(SPEC.cases))
def test_case_matches_reference_and_masks_exactly(name):
    case = SPEC.cases[name]
    inputs = SPEC.make_inputs(case, CPU, 7)
    _check(case, inputs, _run(case, inputs))


def test_cases_cover_no_some_and_all_rows_visible():
    """The cases hold what they claim: a sequence with no visible row (a row of -inf), one with a
    single row, one whose position lies past the rows it holds, and exact ties."""
    mixed = SPEC.cases["v4_mixed"]
    vis = _visible(mixed, SPEC.make_inputs(mixed, CPU, 7)).sum(1).tolist()
    assert vis[0] == 0 and vis[1] == 1 and vis[3] == vis[4] == mixed["L"]
    few = SPEC.cases["few_visible"]
    assert _visible(few, SPEC.make_inputs(few, CPU, 7)).sum(1).tolist() == [5] * few["B"]
    none = SPEC.cases["none_visible"]
    got = _run(none, SPEC.make_inputs(none, CPU, 7))
    assert bool(torch.isneginf(got).all())
    ties = SPEC.cases["ties_ints"]
    got = _run(ties, SPEC.make_inputs(ties, CPU, 7))
    assert torch.equal(got[:, 1], got[:, 3]) and got.unique().numel() < got.numel()


@pytest.mark.parametrize("seed", range(6))
def test_seeded_random_cases(seed):
    case = SPEC.random_case(random.Random(500 + seed))
    inputs = SPEC.make_inputs(case, CPU, 500 + seed)
    _check(case, inputs, _run(case, inputs))


def test_small_integer_inputs_are_exact():
    """Every partial sum is an integer below 2^24 (times a power of two): exact in any order."""
    for cfg in ({"BN": 32, "NB": 1, "STAGES": 1}, {"BN": 64, "NB": 2, "STAGES": 2}):
        case = {"B": 2, "H": 32, "L": 90, "D": 128, "RATIO": 2, "values": "ints", "visible": "mixed"}
        inputs = SPEC.make_inputs(case, CPU, 3)
        got = _run(case, inputs, cfg)
        assert torch.equal(got, SPEC.run_reference(inputs, case)["logits"]), cfg


@pytest.mark.parametrize("config", [{"BN": 32, "NB": 2, "STAGES": 1}, {"BN": 64, "NB": 1, "STAGES": 2}])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(config):
    case = {"B": 5, "H": 64, "L": 130, "D": 128, "RATIO": 4}
    inputs = SPEC.make_inputs(case, CPU, 11)
    full = _run(case, inputs, config)
    for b in (0, 2, 4):
        one = {k: v[b:b + 1].contiguous() for k, v in inputs.items()}
        assert torch.equal(_run({**case, "B": 1}, one, config), full[b:b + 1]), b
    head = {k: v[:3].contiguous() for k, v in inputs.items()}
    assert torch.equal(_run({**case, "B": 3}, head, config), full[:3])


def test_agrees_with_the_runtimes_index_scores():
    """The runtime's formula (layers/common.py), with its dot products kept in f32 (the reference
    model rounds them to BF16 there, which this kernel does not), per sequence."""
    case = {"B": 3, "H": 32, "L": 70, "D": 128, "RATIO": 2}
    inputs = SPEC.make_inputs(case, CPU, 5)
    got = _run(case, inputs, {"BN": 32, "NB": 1, "STAGES": 1})
    ctx = Ctx(ops=FastOps(), dtype=torch.float32)
    bound = SPEC.allowed_error(case, "logits", got, inputs)
    for b in range(case["B"]):
        n_vis = (inputs["pos"][b:b + 1].long() + 1) // case["RATIO"]
        want = index_scores(ctx, inputs["q"][b:b + 1], inputs["w"][b:b + 1], inputs["k"][b], n_vis)[0]
        assert torch.equal(torch.isneginf(want), torch.isneginf(got[b]))
        fin = torch.isfinite(want)
        assert bool(((got[b][fin] - want[fin]).abs() <= 2 * bound[b][fin]).all()), b


def test_the_bound_is_tight_enough_to_catch_a_wrong_value():
    case = {"B": 2, "H": 64, "L": 64, "D": 128, "RATIO": 1, "visible": "all"}
    inputs = SPEC.make_inputs(case, CPU, 9)
    want = SPEC.run_reference(inputs, case)["logits"]
    bound = SPEC.allowed_error(case, "logits", want, inputs)
    assert float((bound / want.abs().clamp(min=1e-3)).median()) < 5e-3  # the worst case, not the typical
    wrong = want.clone()
    wrong[1, 5] += 4 * bound[1, 5]
    with pytest.raises(AssertionError, match="1/128 elements off"):
        check_outputs(SPEC, case, {**inputs, "logits": wrong}, {"logits": want})
    masked = want.clone()
    masked[0, 0] = float("-inf")  # a visible row scored -inf
    with pytest.raises(AssertionError, match="1/128 elements off"):
        check_outputs(SPEC, case, {**inputs, "logits": masked}, {"logits": want})


def test_model_shapes_follow_each_models_indexer():
    shapes = SPEC.model_shapes
    for m, ratios in ((V4_FLASH, {4}), (V41_FLASH, {1, 2})):
        mine = SPEC.model_cases(m.name)
        assert {c["RATIO"] for c in mine.values()} == ratios
        assert all(c["H"] == m.index_heads and c["D"] == m.index_head_dim for c in mine.values())
        assert all(c["L"] in {4096 // c["RATIO"], 65536 // c["RATIO"], (1 << 20) // c["RATIO"]}
                   for c in mine.values())
    assert shapes["v4/r4_ctx1m/decode64"]["L"] == 262144 and shapes["v41/r1_ctx1m/decode16"]["L"] == 1 << 20
    assert all(c["B"] * c["L"] <= 1 << 24 for c in shapes.values())


def test_fp8_keys_with_power_of_two_scales_equal_their_bf16_values_bit_for_bit():
    """Row j's scale multiplies row j's dots: with scales that are powers of two every product of
    the dequantised row is the FP8 one scaled exactly, so both forms give the same bits."""
    case = {"B": 3, "H": 32, "L": 75, "D": 128, "RATIO": 2, "dtype": "f8e4m3"}
    inputs = SPEC.make_inputs(case, CPU, 13)
    inputs["k_scale"] = torch.exp2(torch.randint(-12, 4, inputs["k_scale"].shape).float())
    cfg = {"BN": 32, "NB": 2, "STAGES": 1}
    fp8 = _run(case, inputs, cfg)
    bf16 = {**inputs, "k": (inputs["k"].float() * inputs["k_scale"][:, :, None]).to(torch.bfloat16)}
    bf16.pop("k_scale")
    assert torch.equal(bf16["k"].float(), inputs["k"].float() * inputs["k_scale"][:, :, None])  # exact
    assert torch.equal(fp8, _run({**case, "dtype": "bf16"}, bf16, cfg))
    _check(case, inputs, fp8)
