"""MoE dispatch (kernels_spec/moe_permute.py) on the interpreter: bit for bit against its reference
in every case and at seeded random shapes, the reference against a plain loop over the pairs, the
grouped list's invariants (order and where invert each other, experts grouped in token order),
tiles that do not change the result, and one build for every token count."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.moe_permute import moe_permute_reference

SPEC = load_all()["moe_permute"]


def permute(ids: torch.Tensor, experts: int, config: dict | None = None, kernel=None) -> dict:
    t, k = ids.shape
    out = {"counts": torch.full((experts,), -7, dtype=torch.int32),
           "offsets": torch.full((experts + 1,), -7, dtype=torch.int32),
           "order": torch.full((t * k,), -7, dtype=torch.int32), "where": torch.full((t, k), -7, dtype=torch.int32)}
    (kernel or codegen.compile(SPEC.kernel, "interpret", config=config))(topk_ids=ids, **out)
    return out


def loop_reference(ids: torch.Tensor, experts: int) -> dict:
    """The grouped list built pair by pair, expert by expert."""
    flat = ids.reshape(-1).tolist()
    counts = [sum(1 for x in flat if x == e) for e in range(experts)]
    order = [p for e in range(experts) for p, x in enumerate(flat) if x == e]
    order += [-1] * (len(flat) - len(order))  # the pairs left out
    where = [-1] * len(flat)
    for q, p in enumerate(order):
        if p >= 0:
            where[p] = q
    offsets = [sum(counts[:e]) for e in range(experts + 1)]
    return {"counts": counts, "offsets": offsets, "order": order, "where": where}


def check_invariants(ids: torch.Tensor, out: dict, experts: int):
    flat = ids.reshape(-1).long()
    where, order = out["where"].reshape(-1).long(), out["order"].long()
    placed = (flat >= 0) & (flat < experts)
    assert torch.equal(where[~placed], torch.full_like(where[~placed], -1))
    assert torch.equal(order[where[placed]], torch.nonzero(placed).reshape(-1))  # order inverts where
    total = int(out["offsets"][-1])
    assert total == int(placed.sum()) and (order[total:] == -1).all()
    got = flat[order[:total]]
    assert (got[1:] >= got[:-1]).all()  # grouped by expert, ascending
    assert all((order[lo:hi].diff() > 0).all() for lo, hi in zip(out["offsets"][:-1], out["offsets"][1:]))


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_is_bit_exact_and_grouped(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    for name in SPEC.outputs:
        assert torch.equal(inputs[name], want[name]), name
    check_invariants(inputs["topk_ids"], inputs, case["E"])


@pytest.mark.parametrize("seed", [101, 102, 103])
def test_seeded_random_cases_are_bit_exact(seed):
    case = SPEC.random_case(random.Random(seed))
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    for name in SPEC.outputs:
        assert torch.equal(inputs[name], want[name]), (name, case, seed)


@pytest.mark.parametrize("kind", ["router", "skewed", "repeat", "outside", "one"])
def test_the_reference_is_the_grouped_list_pair_by_pair(kind):
    case = {"T": 17, "E": 12, "K": 6, "ids": kind}
    ids = SPEC.make_inputs(case, torch.device("cpu"), seed=5)["topk_ids"]
    got = moe_permute_reference(ids, 12)
    want = loop_reference(ids, 12)
    for name in SPEC.outputs:
        assert got[name].reshape(-1).tolist() == want[name], name


def test_hand_made_routing():
    ids = torch.tensor([[2, 0], [2, 2], [5, 0]], dtype=torch.int32)  # token 1 names expert 2 twice; 5 >= E
    out = permute(ids, 4, config={"BT": 16, "BE": 64})
    assert out["counts"].tolist() == [2, 0, 3, 0]  # experts 1 and 3 have no rows
    assert out["offsets"].tolist() == [0, 2, 2, 5, 5]
    assert out["order"].tolist() == [1, 5, 0, 2, 3, -1]  # expert 0: pairs 1, 5; expert 2: 0, 2, 3
    assert out["where"].tolist() == [[2, 0], [3, 4], [-1, 1]]


def test_one_expert_takes_every_row():
    ids = torch.full((37, 6), 255, dtype=torch.int32)
    out = permute(ids, 256, config={"BT": 16, "BE": 128})
    assert out["counts"][:255].eq(0).all() and int(out["counts"][255]) == 37 * 6
    assert out["offsets"][:256].eq(0).all() and int(out["offsets"][256]) == 37 * 6
    assert torch.equal(out["order"], torch.arange(37 * 6, dtype=torch.int32))


@pytest.mark.parametrize("config", [{"BT": 16, "BE": 64}, {"BT": 32, "BE": 256}, {"BT": 128, "BE": 128}])
def test_tiles_do_not_change_the_result(config):
    inputs = SPEC.make_inputs({"T": 45, "E": 64, "ids": "ragged"}, torch.device("cpu"), seed=9)
    out = permute(inputs["topk_ids"], 64, config=config)
    want = moe_permute_reference(inputs["topk_ids"], 64)
    assert all(torch.equal(out[n], want[n]) for n in SPEC.outputs)


def test_one_build_serves_every_token_count():
    """T (and the list's length P) are dynamic: one compiled kernel, called at 1, 3 and 50 tokens."""
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"BT": 16, "BE": 64})
    for t in (1, 3, 50):
        ids = SPEC.make_inputs({"T": t, "E": 64}, torch.device("cpu"), seed=t)["topk_ids"]
        out = permute(ids, 64, kernel=kernel)
        want = moe_permute_reference(ids, 64)
        assert all(torch.equal(out[n], want[n]) for n in SPEC.outputs), t
    assert len(kernel._cache) == 1
