"""The indexer restricted to the candidate pool (``indexer_logits_pool``) on the interpreter: each
finite pool logit is the decode form's (``indexer_logits``) logit of its position bit for bit, a
column maps back to its position, the -inf mask is exactly the dead columns, and the top-k over
the pool logits mapped back to positions is the top-k of the full row masked by the pool (the
``select_topk`` contract: ties to the lowest index, ascending, -1 empty)."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.kernels_spec import get
from duotile.kernels_spec.indexer_logits_pool import pool_positions
from duotile.runtime.layers.attention_v41 import pool_blocks, pool_to_positions
from duotile.runtime.layers.common import select_topk

POOL, FULL = get("indexer_logits_pool"), get("indexer_logits")
CPU = torch.device("cpu")


def _pool_logits(case: dict, inputs: dict, config: dict | None = None, target: str = "interpret") -> torch.Tensor:
    out = {**inputs, "logits": torch.full_like(inputs["logits"], float("nan"))}
    cfg = POOL.config_of(case) if config is None else config
    codegen.compile(POOL.kernel, target, config=cfg, constants=POOL.constants_of(case))(**out)
    return out["logits"]


def _full_logits(case: dict, inputs: dict, config: dict | None, target: str = "interpret") -> torch.Tensor:
    """The decode form over every key row of the same inputs, at the same ratio (``config`` None:
    the config a user gets)."""
    b, rows = inputs["k"].shape[:2]
    out = {k: inputs[k] for k in ("q", "w", "k", "pos")}
    out["logits"] = torch.full((b, rows), float("nan"), device=inputs["k"].device)
    codegen.compile(FULL.kernel, target, config=config, constants={"RATIO": case.get("RATIO", 1)})(**out)
    return out["logits"]


def _live(case: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column's position and whether it is live: a listed block's position that is visible
    and held by the cache."""
    p = pool_positions(inputs["blocks"], case.get("BLOCK", 8))
    visible = (inputs["pos"].long() + 1) // case.get("RATIO", 1)
    return p, (p >= 0) & (p < visible[:, None]) & (p < case["L"])


AGREEMENT = ["v41_mixed", "straddle", "wild_blocks", "few_heads", "ties_ints", "mxfp4_keys", "mxfp4_few_heads",
             "model_block"]


@pytest.mark.parametrize("name", AGREEMENT)
@pytest.mark.parametrize("config", [{"BN": 32, "NB": 2, "STAGES": 1}, {"BN": 64, "NB": 1, "STAGES": 2}])
def test_each_finite_pool_logit_is_the_full_rows_logit_bit_for_bit(name, config):
    case = POOL.cases[name]
    inputs = POOL.make_inputs(case, CPU, 3)
    got = _pool_logits(case, inputs, config)
    full = _full_logits(case, inputs, config)
    p, live = _live(case, inputs)
    assert torch.equal(torch.isneginf(got), ~live), "the -inf mask is not exactly the dead columns"
    want = full.gather(1, p.clamp(min=0, max=case["L"] - 1))
    assert live.any() and torch.equal(got[live].view(torch.int32), want[live].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm90)")
@pytest.mark.parametrize("name", ["v41_mixed", "mxfp4_keys", "model_block", "ties_ints"])
@pytest.mark.parametrize("config", [{"BN": 64, "NB": 2, "STAGES": 1}, None])
def test_sm90_pool_logits_are_the_full_rows_bit_for_bit(name, config):
    """On the sm90 builds, at one config (or each form at the config a user gets): each finite pool
    logit is the decode form's logit of its position, bit for bit."""
    case = POOL.cases[name]
    inputs = POOL.make_inputs(case, torch.device("cuda"), 3)
    out = {**inputs, "logits": torch.full_like(inputs["logits"], float("nan"))}
    codegen.compile(POOL.kernel, "sm90", config=config, constants=POOL.constants_of(case))(**out)
    got = out["logits"].cpu()
    full = _full_logits(case, inputs, config, "sm90").cpu()
    p, live = _live(case, {k: v.cpu() for k, v in inputs.items()})
    assert torch.equal(torch.isneginf(got), ~live)
    want = full.gather(1, p.clamp(min=0, max=case["L"] - 1))
    assert torch.equal(got[live].view(torch.int32), want[live].view(torch.int32))


def test_bits_do_not_depend_on_the_config():
    """The row sum and the gemm are per row: another tiling of the pool gives the same bits."""
    case = POOL.cases["mxfp4_keys"]
    inputs = POOL.make_inputs(case, CPU, 5)
    a = _pool_logits(case, inputs, {"BN": 32, "NB": 1, "STAGES": 1})
    b = _pool_logits(case, inputs, {"BN": 128, "NB": 2, "STAGES": 2})
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_columns_map_back_to_positions():
    blocks = torch.tensor([[0, 3, 7, -1], [5, -1, -1, -1]], dtype=torch.int32)
    p = pool_positions(blocks, 4)
    assert p[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 28, 29, 30, 31, -1, -1, -1, -1]
    assert p[1].tolist() == [20, 21, 22, 23] + [-1] * 12
    sel = torch.tensor([[1, 4, 9, -1], [0, 3, -1, -1]])
    assert pool_to_positions(sel, blocks, 4).tolist() == [[1, 12, 29, -1], [20, 23, -1, -1]]


def test_block_list_of_a_boolean_pool():
    """The reference path's blocks: each block holding a pool position, ascending, -1 after them;
    a block cut by the row's end or the visible count still counts."""
    pool = torch.zeros(2, 21, dtype=torch.bool)
    pool[0, [2, 9, 10, 20]] = True
    assert pool_blocks(pool, 4, 5).tolist() == [[0, 2, 5, -1, -1], [-1] * 5]
    assert pool_blocks(pool, 4, 5).dtype == torch.int32


def _pool_mask(case: dict, inputs: dict) -> torch.Tensor:
    """(B, L) bool: the live positions of the block lists."""
    p, live = _live(case, inputs)
    mask = torch.zeros(case["B"], case["L"] + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(live, p, case["L"]), True)
    return mask[:, :-1]


@pytest.mark.parametrize("name", ["straddle", "ties_ints", "mxfp4_keys", "model_block", "fewer_blocks_than_kb"])
@pytest.mark.parametrize("k", [5, 40, 512])
def test_top_k_of_the_pool_is_the_top_k_of_the_masked_full_row(name, k):
    """Exact indices (ties to the lowest position, ascending, -1 for an empty slot): the pool's
    columns run in ascending positions, so a tie broken by column is broken by position."""
    case = POOL.cases[name]
    inputs = POOL.make_inputs(case, CPU, 11)
    config = {"BN": 32, "NB": 2, "STAGES": 1}
    got = pool_to_positions(select_topk(_pool_logits(case, inputs, config), k), inputs["blocks"], case.get("BLOCK", 8))
    full = _full_logits(case, inputs, config)
    want = select_topk(full.masked_fill(~_pool_mask(case, inputs), float("-inf")), k)
    assert torch.equal(got, want)


def test_ties_case_has_ties_in_the_pool():
    """The ties case holds what it claims: equal finite logits among the pool's columns."""
    case = POOL.cases["ties_ints"]
    inputs = POOL.make_inputs(case, CPU, 11)
    got = _pool_logits(case, inputs)
    for row in got:
        fin = row[torch.isfinite(row)]
        assert fin.numel() > fin.unique().numel()


def test_wrong_logits_width_is_refused_naming_the_spec_line():
    case = POOL.cases["no_blocks"]
    inputs = POOL.make_inputs(case, CPU, 1)
    inputs["logits"] = torch.empty(case["B"], case["KB"] * 8 + 1)
    with pytest.raises(dsl.DslError, match=r"KB \* BLOCK columns.*indexer_logits_pool\.py:\d+|"
                                           r"indexer_logits_pool\.py:\d+.*KB \* BLOCK columns"):
        _pool_logits(case, inputs)


def test_bad_block_constant_is_refused():
    case = {**POOL.cases["no_blocks"], "BLOCK": 0}
    inputs = POOL.make_inputs(POOL.cases["no_blocks"], CPU, 1)
    with pytest.raises(dsl.DslError, match="BLOCK 0 must be a positive int"):
        _pool_logits(case, inputs)


def test_a_call_whose_key_stacks_do_not_fit_its_queries_is_refused():
    """One build serves every batch and context (B, L and KS dynamic): a key stack too few for the
    queries, or more than one where every query reads the one (``SHARED``), is refused at the call."""
    case = POOL.cases["v41_mixed"]
    inputs = POOL.make_inputs(case, CPU, 3)
    kernel = codegen.compile(POOL.kernel, "interpret", config=POOL.config_of(case), constants=POOL.constants_of(case))
    with pytest.raises(dsl.DslError, match="k must hold a key stack a query"):
        kernel(**{**inputs, "k": inputs["k"][:3].contiguous()})
    shared = codegen.compile(POOL.kernel, "interpret", config=POOL.config_of(case),
                             constants={**POOL.constants_of(case), "SHARED": True})
    with pytest.raises(dsl.DslError, match="SHARED: k must hold one key stack"):
        shared(**inputs)
    shared(**{**inputs, "k": inputs["k"][:1].contiguous()})  # one stack: every query reads it


@pytest.mark.parametrize("name", ["shared_chunk", "shared_chunk_mxfp4", "shared_longer_than_rows"])
def test_a_chunks_shared_keys_give_each_query_the_logits_of_its_own_copy(name):
    """``SHARED``: the chunk's queries read one key stack; the logits are those of the decode form
    given each query a copy of that stack, bit for bit."""
    case = POOL.cases[name]
    inputs = POOL.make_inputs(case, CPU, 5)
    got = _pool_logits(case, inputs)
    b = inputs["q"].shape[0]
    own = {**inputs, "k": inputs["k"].expand(b, -1, -1).contiguous()}
    want = _pool_logits({**case, "SHARED": False}, own, POOL.config_of(case))
    assert torch.equal(got, want)
    assert bool(torch.isfinite(got).any()) and bool(torch.isneginf(got).any())
