"""The sparse-attention top-k (kernels_spec/topk.py) on the interpreter: exact against its
reference in every case and at seeded random shapes, ties to the lowest index across chunks,
indices ascending with -1 after them, the same result at every chunk size, a row's result bitwise
the same alone and in a batch, and the reference against the runtime's ``select_topk``."""

from __future__ import annotations

import random
import re

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.topk import topk_reference
from duotile.runtime.layers.common import select_topk

SPEC = load_all()["topk"]
NEG_INF = float("-inf")


def select(scores: torch.Tensor, k: int, config: dict | None = None) -> torch.Tensor:
    idx = torch.full((scores.shape[0], k), -7, dtype=torch.int32)
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config or {"CHUNK": 64},
                             constants={"TOPK": k})
    kernel(scores=scores, idx=idx)
    return idx


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_exactly(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)["idx"]
    assert inputs["idx"].dtype == torch.int32 and torch.equal(inputs["idx"], want)


@pytest.mark.parametrize("seed", range(500, 508))
def test_seeded_random_cases_match_the_reference_exactly(seed):
    case = SPEC.random_case(random.Random(seed))
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    assert torch.equal(inputs["idx"], SPEC.run_reference(inputs, case)["idx"]), (seed, case)


def test_ties_go_to_the_lowest_index_across_chunks_and_come_back_ascending():
    """Row 0: the maximum in five places over four 64-wide chunks, K = 4: the four lowest of them.
    Row 1: two above, then a tie of four for the last two slots. Row 2: three visible, -1 after."""
    scores = torch.full((3, 250), -3.0)
    scores[0, [200, 70, 5, 130, 64]] = 9.0
    scores[1, [240, 3]] = 5.0
    scores[1, [180, 66, 65, 100]] = 1.0
    scores[2] = NEG_INF
    scores[2, [249, 0, 128]] = torch.tensor([-1.0, -2.0, -0.5])
    got = select(scores, 4)
    assert got.tolist() == [[5, 64, 70, 130], [3, 65, 66, 240], [0, 128, 249, -1]]


def test_zero_signs_are_equal_and_infinity_is_a_score():
    scores = torch.tensor([[0.0, -0.0, float("inf"), -1.0, 0.0, float("inf"), NEG_INF, -0.0]])
    assert select(scores, 5).tolist() == [[0, 1, 2, 4, 5]]  # both +inf, then the three lowest zeros
    assert select(scores, 8).tolist() == [[0, 1, 2, 3, 4, 5, 7, -1]]  # all but the -inf


@pytest.mark.parametrize("phased", [False, True])
@pytest.mark.parametrize("chunk", [16, 64, 128, 1024])
def test_the_chunk_size_and_the_phases_do_not_change_the_result(chunk, phased):
    inputs = SPEC.make_inputs({"B": 4, "L": 700, "K": 48, "values": "ties", "visible": "mixed"},
                              torch.device("cpu"), seed=9)
    want = topk_reference(inputs["scores"], TOPK=48)["idx"]
    assert torch.equal(select(inputs["scores"], 48, {"CHUNK": chunk, "PHASED": phased}), want)


def test_a_row_selects_the_same_alone_and_in_any_batch():
    """B is the batch dimension: one build, each row's result bitwise the same whatever rows sit
    beside it and whatever the batch size."""
    inputs = SPEC.make_inputs({"B": 13, "L": 300, "K": 20, "values": "dup_max"}, torch.device("cpu"), seed=4)
    scores = inputs["scores"]
    full = select(scores, 20)
    assert torch.equal(full, topk_reference(scores, TOPK=20)["idx"])
    for lo, hi in ((0, 1), (5, 6), (12, 13), (2, 9)):
        assert torch.equal(select(scores[lo:hi].contiguous(), 20), full[lo:hi]), (lo, hi)
    shuffled = torch.flip(scores, [0]).contiguous()
    assert torch.equal(select(shuffled, 20), torch.flip(full, [0]))


@pytest.mark.parametrize("case_name", ["mixed_k16", "ties_k32", "dup_max_k24", "scattered_k12", "all_neg_inf_k4",
                                       "fewer_than_k_k64", "exactly_k_k64", "model_k512"])
def test_the_reference_agrees_with_the_runtimes_selection(case_name):
    """The runtime's select_topk (runtime/layers/common.py), on the same scores: the same indices
    (it returns int64 and pads with -1 the same way)."""
    case = SPEC.cases[case_name]
    scores = SPEC.make_inputs(case, torch.device("cpu"), seed=6)["scores"]
    k = case["K"]
    assert torch.equal(topk_reference(scores, TOPK=k)["idx"].long(), select_topk(scores, k))


def test_the_reference_pads_rows_shorter_than_k():
    scores = torch.tensor([[0.5, NEG_INF, 2.0]])
    assert topk_reference(scores, TOPK=5)["idx"].tolist() == [[0, 2, -1, -1, -1]]
    assert select(scores, 5).tolist() == [[0, 2, -1, -1, -1]]
    assert topk_reference(torch.empty(2, 0), TOPK=3)["idx"].tolist() == [[-1] * 3] * 2


def test_model_shapes_cover_both_models_at_k512():
    shapes = SPEC.model_shapes
    assert {c["K"] for c in shapes.values()} == {512}
    assert {c["L"] for c in SPEC.model_cases("v4").values()} == {1024, 16384, 262144}
    assert max(c["L"] for c in SPEC.model_cases("v41").values()) == 1 << 20
    assert {c["B"] for c in shapes.values()} == {1, 16, 64} and len(shapes) == 16
    assert shapes["v4/r4_ctx1m/decode16"]["L"] == shapes["v41/r1_ctx256k/decode16"]["L"]  # one build for both


def test_the_cuda_source_selects_by_threshold():
    """One launch, a block a row: the visible count, the 16 counting passes (the last 15 a device
    loop), the count above T and the selection, each a loop over the row's tiles (the slots by
    dsl.cumsum: the SCAN helper).
    PHASED: a block a tile and a phase a pass. No sequential round over K in either."""
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import generate_case

    (one,) = generate_case(SPEC, {"B": 2, "L": 4096, "K": 512}, "sm90", config={"CHUNK": 1024})
    text = one.stages["tilelang"]
    assert "T.import_source(SCAN)" in text and text.count('"duotile_scan_write"') == 2  # ties, then slots
    # (a loop of a few tiles that only loads and counts is unrolled: codegen/tilelang_cuda/unrolled_loads.py)
    loops = re.findall(r"for (\w+) in T\.(?:serial|unroll)\(0, (\d+)\):", text)
    # the visible count, pass 0 (its thresholds constants), passes 1-15 as one device loop around
    # one count (unrolled, they were 15 copies that TileLang took minutes to lower), the count above
    # T, the selection
    assert [n for _, n in loops] == ["4", "4", "15", "4", "4", "4"], loops
    phases = generate_case(SPEC, {"B": 2, "L": 4096, "K": 512}, "sm90", config={"CHUNK": 1024, "PHASED": True})
    assert len(phases) == 1 + 16 + 1 + 1
    assert all("T.Kernel(n_B * 4" in a.stages["tilelang"].replace("(4 * n_B", "(n_B * 4") for a in phases)
