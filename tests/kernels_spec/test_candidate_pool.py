"""V4.1's candidate pool (kernels_spec/candidate_pool.py) on the interpreter: the same pool as the
runtime's ``candidate_pool`` (runtime/layers/attention_v41.py) on the same inputs, in its cases
and at seeded random shapes; the two output forms describe one pool; ties go to the lowest block
across chunks, the newest visible block is forced in, all -inf blocks stay out; the tile sizes do
not change the result; a row's pool is the same alone and in a batch; the model shapes."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec import model_shapes as ms
from duotile.kernels_spec.candidate_pool import candidate_pool_reference
from duotile.runtime.layers.attention_v41 import candidate_pool as runtime_pool

SPEC = load_all()["candidate_pool"]
NEG_INF = float("-inf")
SMALL = {"W": 16, "ROWS": 4, "RT": 8, "WM": 64}


def run(scores: torch.Tensor, visible, kb: int, block: int = 8, config: dict | None = None) -> dict:
    visible = torch.as_tensor(visible, dtype=torch.int32)
    out = {"blocks": torch.full((scores.shape[0], kb), -7, dtype=torch.int32),
           "pool": torch.full(scores.shape, 7, dtype=torch.uint8)}
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config or SMALL,
                             constants={"BLOCK": block, "TOPK_BLOCKS": kb})
    kernel(scores=scores, visible=visible, **out)
    return out


def expand(blocks: torch.Tensor, visible: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The positions the block ids name, below each row's visible count."""
    pool = torch.zeros(blocks.shape[0], n + block, dtype=torch.bool)
    for r, row in enumerate(blocks.tolist()):
        for j in row:
            if j >= 0:
                pool[r, j * block:(j + 1) * block] = True
    return pool[:, :n] & (torch.arange(n)[None, :] < visible.long()[:, None])


def check_against_runtime(inputs: dict, case: dict) -> None:
    c = SPEC.constants_of(case)
    want = runtime_pool(inputs["scores"], inputs["visible"], c["BLOCK"], c["TOPK_BLOCKS"])
    assert inputs["pool"].dtype == torch.uint8 and torch.equal(inputs["pool"].bool(), want), case
    blocks = inputs["blocks"]
    assert torch.equal(expand(blocks, inputs["visible"], want.shape[1], c["BLOCK"]), want), case
    for row in blocks.tolist():  # ascending, distinct, then -1
        n = sum(j >= 0 for j in row)
        assert all(a < b for a, b in zip(row[:n], row[1:n])) and row[n:] == [-1] * (len(row) - n), (case, row)


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_gives_the_runtimes_pool(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=6)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    check_against_runtime(inputs, case)
    want = SPEC.run_reference(inputs, case)
    assert all(torch.equal(inputs[o], want[o]) for o in SPEC.outputs)


@pytest.mark.parametrize("seed", range(700, 706))
def test_seeded_random_cases_give_the_runtimes_pool(seed):
    case = SPEC.random_case(random.Random(seed))
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    check_against_runtime(inputs, case)


def test_ties_forcing_and_empty_blocks():
    """40 positions, 5 blocks of 8, two kept. Row 0: blocks 1, 2 and 4 tie at the maximum, block 4
    is the newest (forced): blocks 1 and 4. Row 1: only block 3 has a finite score, visible 10
    (newest block 1): blocks 1 and 3; but block 3 holds no visible position, so the pool is
    positions 8 and 9 and ``blocks`` lists 1 alone. Row 2: nothing visible, all -inf: empty.
    Row 3: +inf in blocks 0 and 2, the newest is 3: the two +inf blocks win over the forced one."""
    scores = torch.full((4, 40), NEG_INF)
    scores[0, :] = -1.0
    scores[0, [9, 17, 33]] = 5.0
    scores[1, 27] = 3.0
    scores[3, :] = 0.0
    scores[3, [3, 20]] = float("inf")
    visible = [40, 10, 0, 30]
    got = run(scores, visible, 2, config={"W": 2, "ROWS": 2, "RT": 2, "WM": 16})  # blocks over three chunks
    assert got["blocks"].tolist() == [[1, 4], [1, -1], [-1, -1], [0, 2]]
    pools = [torch.nonzero(row).reshape(-1).tolist() for row in got["pool"]]
    assert pools == [[*range(8, 16), *range(32, 40)], [8, 9], [], [*range(0, 8), *range(16, 24)]]
    want = runtime_pool(scores, torch.tensor(visible), 8, 2)
    assert torch.equal(got["pool"].bool(), want)


def test_signed_zeros_tie_and_fewer_blocks_than_kept():
    """Blocks of 2. -0.0 and 0.0 are one score: beside the forced block 2, block 0 wins over
    block 1. 3 blocks with 16 kept: every block that is not all -inf."""
    scores = torch.tensor([[-0.0, -1.0, 0.0, -2.0, 0.0, -0.0], [NEG_INF, NEG_INF, 1.0, NEG_INF, 2.0, NEG_INF]])
    assert run(scores, [6, 6], 2, block=2)["blocks"].tolist() == [[0, 2], [1, 2]]
    got = run(scores, [5, 6], 16, block=2)
    assert got["blocks"].tolist() == [[0, 1, 2] + [-1] * 13, [1, 2] + [-1] * 14]
    assert got["pool"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]


@pytest.mark.parametrize("config", [{"W": 8, "ROWS": 2, "RT": 4, "WM": 32},
                                    {"W": 32, "ROWS": 16, "RT": 16, "WM": 1024},
                                    {"W": 64, "ROWS": 64, "RT": 512, "WM": 2048}])
def test_the_tile_sizes_do_not_change_the_pool(config):
    case = {"B": 5, "N": 3001, "KB": 40, "values": "ties", "visible": "mixed"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=9)
    got = run(inputs["scores"], inputs["visible"], 40, config=config)
    want = candidate_pool_reference(inputs["scores"], inputs["visible"], 8, 40)
    assert torch.equal(got["blocks"], want["blocks"]) and torch.equal(got["pool"], want["pool"])


def test_a_row_gets_the_same_pool_alone_and_in_any_batch():
    inputs = SPEC.make_inputs({"B": 9, "N": 500, "KB": 7, "values": "scattered"}, torch.device("cpu"), seed=4)
    scores, visible = inputs["scores"], inputs["visible"]
    full = run(scores, visible, 7)
    for lo, hi in ((0, 1), (4, 5), (8, 9), (2, 7)):
        part = run(scores[lo:hi].contiguous(), visible[lo:hi], 7)
        assert torch.equal(part["blocks"], full["blocks"][lo:hi]) and torch.equal(part["pool"], full["pool"][lo:hi])


def test_model_shapes_are_v41_decode_and_prefill_at_its_pool():
    shapes = SPEC.model_shapes
    assert SPEC.model_cases("v4") == {} and shapes == SPEC.model_cases("v41")
    assert (ms.V41_FLASH.candidate_block, ms.V41_FLASH.candidate_topk_blocks) == (8, 2048)
    assert {(c["KB"], c["BLOCK"]) for c in shapes.values()} == {(2048, 8)}
    assert {c["B"] for c in shapes.values()} == {*ms.DECODE_BATCHES, ms.PREFILL_CHUNK}
    assert {c["N"] for c in shapes.values()} == {1 << 12, 1 << 16, 1 << 20}
    assert shapes["v41/r1_ctx1m/prefill4096"]["N"] == 1 << 20 and len(shapes) == 12


def test_the_block_list_alone_is_the_same_and_the_pool_phase_is_not_generated():
    """A call without ``pool`` (a decode step's: its Reindex layers read the block list alone)
    writes the same block list, and its build has no phase that writes a pool row."""
    inputs = SPEC.make_inputs({"B": 3, "N": 700, "KB": 9, "values": "scattered"}, torch.device("cpu"), seed=5)
    both = run(inputs["scores"], inputs["visible"], 9)
    blocks = torch.full((3, 9), -7, dtype=torch.int32)
    codegen.compile(SPEC.kernel, "interpret", config=SMALL, constants={"BLOCK": 8, "TOPK_BLOCKS": 9})(
        scores=inputs["scores"], visible=torch.as_tensor(inputs["visible"], dtype=torch.int32), blocks=blocks)
    assert torch.equal(blocks, both["blocks"])
    consts = {"BLOCK": 8, "TOPK_BLOCKS": 2048}
    meta = SPEC.meta_inputs({"B": 16, "N": 1 << 20, "KB": 2048})
    grids = {}
    for name, present in (("with", meta), ("alone", {k: v for k, v in meta.items() if k != "pool"})):
        sig = SPEC.kernel.bind(present)
        module = SPEC.kernel.trace(sig.dtypes, sig.present, None, consts)
        grids[name] = sum(op.name == "grid" for op in module.walk())
    assert grids["alone"] == grids["with"] - 1
