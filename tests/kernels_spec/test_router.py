"""The MoE router's selection (kernels_spec/router.py) on the interpreter: bit for bit against its
reference in every case, ties to the lowest index, a bias that picks but does not weigh, equal
rows, one build for every token count, its softplus against float64, and agreement with the
runtime's own router (runtime/layers/moe.py) on the same logits. The hash form (V4's first
layers): the table's row for each token id, in the table's order, repeated ids and the table's
first and last rows, weights from the unbiased scores, and the runtime's hash routing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from duotile import codegen
from duotile.dsl.errors import DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.router import router_reference, softplus
from duotile.runtime.layers.common import Ctx
from duotile.runtime.layers.moe import MoE
from duotile.runtime.ops import FastOps, InvariantOps

SPEC = load_all()["router"]


def route(logits: torch.Tensor, bias: torch.Tensor, topk: int = 6, config: dict | None = None):
    t = logits.shape[0]
    experts = torch.full((t, topk), -1, dtype=torch.int32)
    weights = torch.full((t, topk), float("nan"))
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config, constants={"TOPK": topk})
    kernel(logits=logits, bias=bias, experts=experts, weights=weights)
    return experts, weights


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    """Both outputs, bitwise (the spec's weight tolerance is for GPUs' expf / logf)."""
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=7)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    assert torch.equal(inputs["experts"], want["experts"])
    assert torch.equal(inputs["weights"], want["weights"])


def test_ties_go_to_the_lowest_index_in_order():
    logits = torch.full((2, 256), -1.0)
    logits[0, [200, 17, 5, 130, 64, 255, 3]] = 2.0  # seven tied at the top: the six lowest, ascending
    logits[1, [9, 250]] = 3.0
    logits[1, [100, 8, 40, 41]] = 1.0  # two above, then four tied
    experts, weights = route(logits, torch.zeros(256))
    assert experts.tolist() == [[3, 5, 17, 64, 130, 200], [9, 250, 8, 40, 41, 100]]
    assert torch.equal(weights[0], torch.full((6,), 0.25))


def test_bias_picks_and_the_unbiased_scores_weigh():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 384, generator=g)
    bias = torch.zeros(384)
    bias[[7, 70, 300]] = 50.0  # taken first whatever their logits, in index order (equal biased score
    logits[:, [7, 70, 300]] = 0.0  # only where the logits are equal too)
    experts, weights = route(logits, bias)
    assert (experts[:, :3] == torch.tensor([7, 70, 300], dtype=torch.int32)).all()
    s = torch.sqrt(softplus(logits))
    top3 = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :3]
    assert torch.equal(experts[:, 3:].long(), top3)  # the rest by score alone
    chosen = s.gather(-1, experts.long())
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5, rtol=1e-6, atol=0)
    assert torch.allclose(weights.sum(-1), torch.full((4,), 1.5), rtol=1e-6)


def test_equal_rows_pick_the_first_experts_with_equal_weights():
    for value in (-40.0, 0.0, 1e-30, 3.0, 1e30):
        experts, weights = route(torch.full((3, 256), value), torch.zeros(256))
        assert experts.tolist() == [list(range(6))] * 3, value
        assert torch.equal(weights, weights[:1, :1].expand(3, 6)), value  # one value throughout
        assert weights[0, 0].item() == pytest.approx(0.25, rel=1e-6), value  # 1.5 / 6, to the sum's rounding


def test_a_negative_bias_can_push_the_top_scores_out():
    logits = torch.zeros(1, 256)
    logits[0, :6] = 5.0
    bias = torch.zeros(256)
    bias[:6] = -10.0  # below every other expert's biased score
    experts, _ = route(logits, bias)
    assert experts.tolist() == [[6, 7, 8, 9, 10, 11]]


def test_one_build_serves_every_token_count_row_by_row():
    """T is dynamic and the batch dimension: a row's experts and weights are bitwise the same
    whatever rows are routed beside it."""
    g = torch.Generator().manual_seed(11)
    logits, bias = torch.randn(37, 384, generator=g), 0.1 * torch.randn(384, generator=g)
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 4})
    full_e, full_w = torch.empty(37, 6, dtype=torch.int32), torch.empty(37, 6)
    kernel(logits=logits, bias=bias, experts=full_e, weights=full_w)
    for lo, hi in ((0, 1), (5, 21), (36, 37), (3, 37)):
        e, w = torch.empty(hi - lo, 6, dtype=torch.int32), torch.empty(hi - lo, 6)
        kernel(logits=logits[lo:hi].contiguous(), bias=bias, experts=e, weights=w)
        assert torch.equal(e, full_e[lo:hi]) and torch.equal(w, full_w[lo:hi]), (lo, hi)


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_rows_a_program_do_not_change_the_result(rows):
    inputs = SPEC.make_inputs({"T": 19, "E": 256, "values": "mixed"}, torch.device("cpu"), seed=2)
    want = router_reference(inputs["logits"], inputs["bias"])
    e, w = route(inputs["logits"], inputs["bias"], config={"ROWS": rows})
    assert torch.equal(e, want["experts"]) and torch.equal(w, want["weights"])


def test_softplus_is_accurate_in_both_tails():
    """The compensated log1p keeps softplus within a few ulp of float64 everywhere, where plain
    log(1 + exp(-|x|)) is 0 below x = -17 and off by up to 2^-24 absolute above it."""
    x = torch.cat([torch.linspace(-100, 100, 20001), -torch.logspace(-30, 2, 500), torch.logspace(-30, 2, 500)])
    got = softplus(x).double()
    want = F.softplus(x.double(), threshold=1000)
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert ((got - want).abs() <= 2 * ulp + 1e-45).all()
    assert softplus(torch.tensor([-30.0])).item() == pytest.approx(math.exp(-30), rel=1e-6)


def _runtime_moe(gate, bias, topk=6, scale=1.5):
    cfg = SimpleNamespace(num_experts_per_tok=topk, routed_scaling_factor=scale)
    return MoE(cfg, gate, bias, None, experts=[], shared=None, act_block=128)


@pytest.mark.parametrize("ops", [FastOps(), InvariantOps()], ids=["fast", "invariant"])
@pytest.mark.parametrize("experts_n,hidden", [(256, 96), (384, 128)])
def test_agrees_with_the_runtime_router(ops, experts_n, hidden):
    """The runtime's route() on the same logits (its own gate GEMM) picks the same experts; its
    weights agree to a few ulp (it takes torch's softplus and sums by torch.sum or a tree)."""
    g = torch.Generator().manual_seed(experts_n)
    x = torch.randn(23, hidden, generator=g).to(torch.bfloat16)
    gate = torch.randn(experts_n, hidden, generator=g) / math.sqrt(hidden)
    bias = 0.05 * torch.randn(experts_n, generator=g)
    ctx = Ctx(ops=ops)
    moe = _runtime_moe(gate, bias)
    want_idx, want_w = moe.route(ctx, x, torch.arange(23))
    logits = ops.linear(x.float(), gate)
    experts, weights = route(logits.contiguous(), bias)
    assert torch.equal(experts.long(), want_idx)
    assert torch.allclose(weights, want_w, rtol=4e-7, atol=0), (weights - want_w).abs().max()


def test_the_reference_mirrors_the_runtimes_selection_rule():
    """Both stable-sort the biased scores: the same experts on tie-heavy rows."""
    inputs = SPEC.make_inputs({"T": 16, "E": 256, "values": "ties"}, torch.device("cpu"), seed=5)
    s = torch.sqrt(F.softplus(inputs["logits"]))
    idx = torch.sort(s + inputs["bias"], dim=-1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(router_reference(inputs["logits"], inputs["bias"])["experts"].long(), idx)


def route_hashed(logits, table, tokens, config=None):
    t, k = logits.shape[0], table.shape[1]
    experts = torch.full((t, k), -1, dtype=torch.int32)
    weights = torch.full((t, k), float("nan"))
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config, constants={"TOPK": k})
    kernel(logits=logits, tid2eid=table, token_ids=tokens, experts=experts, weights=weights)
    return experts, weights


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_hash_rows_are_the_tables_rows_of_the_token_ids(index):
    """Repeated ids get the same row; ids 0 and V - 1 read the table's first and last rows; the
    experts keep the table's order (not sorted, not by score)."""
    g = torch.Generator().manual_seed(4)
    v, e = 129280, 256
    table = torch.rand(v, e, generator=g).topk(6, dim=1).indices.to(index)
    table[0] = torch.tensor([255, 0, 17, 3, 200, 9])
    table[v - 1] = torch.tensor([1, 2, 254, 128, 127, 64])
    tokens = torch.tensor([0, v - 1, 5, 0, v - 1, 5, 77, 0], dtype=index)
    logits = torch.randn(8, e, generator=g)
    experts, weights = route_hashed(logits, table, tokens, config={"ROWS": 4})
    assert experts.tolist()[0] == [255, 0, 17, 3, 200, 9] and experts.tolist()[1] == [1, 2, 254, 128, 127, 64]
    assert torch.equal(experts.long(), table[tokens.long()].long())
    s = torch.sqrt(softplus(logits))
    chosen = s.gather(-1, experts.long())
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5, rtol=1e-6, atol=0)
    want = router_reference(logits, tid2eid=table, token_ids=tokens)
    assert torch.equal(experts, want["experts"]) and torch.equal(weights, want["weights"])


def test_hash_weights_follow_the_scores_not_the_bias_or_the_top_scores():
    """A table row of low-scoring experts keeps them; each row's weights sum to SCALE; a row that
    repeats an expert weighs both copies alike."""
    logits = torch.full((3, 64), -3.0)
    logits[:, :6] = 8.0  # the score top 6, which no table row names
    table = torch.tensor([[10, 11, 12, 13, 14, 15], [63, 62, 61, 60, 59, 58], [20, 20, 21, 22, 23, 24]],
                         dtype=torch.int32)
    experts, weights = route_hashed(logits, table, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert torch.equal(experts, table)
    # equal scores, equal weights, each 1.5 / 6 up to the rounding of the six scores' sum, whose
    # order is the CPU's vector width's (a sum of six equal values is not always six times one)
    assert torch.equal(weights[:2], weights[:2, :1].expand(2, 6))
    assert torch.allclose(weights[:2], torch.full((2, 6), 0.25), rtol=2.0 ** -21, atol=0)
    assert weights[2, 0] == weights[2, 1] and torch.allclose(weights.sum(-1), torch.full((3,), 1.5), rtol=1e-6)


def test_hash_one_build_serves_every_token_count_row_by_row():
    inputs = SPEC.make_inputs({"T": 29, "E": 256, "V": 500, "hash": True, "tokens": "repeat"}, torch.device("cpu"), 3)
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 8})
    args = {k: v for k, v in inputs.items() if k not in SPEC.outputs}
    full_e, full_w = torch.empty(29, 6, dtype=torch.int32), torch.empty(29, 6)
    kernel(**args, experts=full_e, weights=full_w)
    for lo, hi in ((0, 1), (3, 20), (28, 29)):
        e, w = torch.empty(hi - lo, 6, dtype=torch.int32), torch.empty(hi - lo, 6)
        kernel(logits=args["logits"][lo:hi].contiguous(), tid2eid=args["tid2eid"],
               token_ids=args["token_ids"][lo:hi].contiguous(), experts=e, weights=w)
        assert torch.equal(e, full_e[lo:hi]) and torch.equal(w, full_w[lo:hi]), (lo, hi)


def test_a_call_names_one_form():
    logits, bias = torch.randn(2, 64), torch.zeros(64)
    table, tokens = torch.zeros(10, 6, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    out = {"experts": torch.empty(2, 6, dtype=torch.int32), "weights": torch.empty(2, 6)}
    kernel = codegen.compile(SPEC.kernel, "interpret")
    for args in ({"bias": bias, "tid2eid": table, "token_ids": tokens}, {}, {"tid2eid": table}):
        with pytest.raises(DslError, match="bias .score routing. or tid2eid and token_ids"):
            kernel(logits=logits, **args, **out)


@pytest.mark.parametrize("ops", [FastOps(), InvariantOps()], ids=["fast", "invariant"])
def test_hash_form_agrees_with_the_runtime_hash_router(ops):
    """The runtime's route() with a tid2eid table (its hash layers) on the same logits: the same
    experts, weights to a few ulp."""
    g = torch.Generator().manual_seed(21)
    v, e, hidden = 3000, 256, 96
    x = torch.randn(19, hidden, generator=g).to(torch.bfloat16)
    gate = torch.randn(e, hidden, generator=g) / math.sqrt(hidden)
    table = torch.rand(v, e, generator=g).topk(6, dim=1).indices
    tokens = torch.randint(0, v, (19,), generator=g)
    tokens[:3] = torch.tensor([0, v - 1, 0])
    moe = MoE(SimpleNamespace(num_experts_per_tok=6, routed_scaling_factor=1.5), gate, None, table,
              experts=[], shared=None, act_block=128)
    want_idx, want_w = moe.route(Ctx(ops=ops), x, tokens)
    logits = ops.linear(x.float(), gate)
    experts, weights = route_hashed(logits.contiguous(), table, tokens)
    assert torch.equal(experts.long(), want_idx)
    assert torch.allclose(weights, want_w, rtol=4e-7, atol=0), (weights - want_w).abs().max()


def test_hash_model_shapes_are_v4s_alone():
    hashed = {k: c for k, c in SPEC.model_shapes.items() if c.get("hash")}
    assert sorted(hashed) == [f"v4/e256_top6_hash/{p}" for p in ("decode1", "decode16", "decode64", "prefill4096")]
    assert all(c["V"] == 129280 and c["model"] == "v4-flash" for c in hashed.values())
