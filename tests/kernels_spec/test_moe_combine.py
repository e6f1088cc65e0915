"""MoE combine (kernels_spec/moe_combine.py) on the interpreter: bit for bit against its reference
in every case (weighted ones too) and at seeded random shapes, a token's row the same alone as in a
batch, the slots added in the runtime's batch-invariant order, and bitwise agreement with the
runtime's MoE (runtime/layers/moe.py) under InvariantOps, whose experts apply the routing weight
before their down projection."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.moe_combine import add_in_order, moe_combine_reference, tree_order
from duotile.kernels_spec.moe_permute import moe_permute_reference
from duotile.runtime.layers.common import Ctx
from duotile.runtime.layers.moe import MoE
from duotile.runtime.ops import InvariantOps

SPEC = load_all()["moe_combine"]


def run(case, inputs, config=None):
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config if config is not None else SPEC.config_of(case),
                             constants=SPEC.constants_of(case))
    kernel(**inputs)
    return inputs["out"]


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_is_bit_exact_on_the_interpreter(case_name):
    """Weighted cases too: the interpreter multiplies and adds as the reference does (the spec's
    tolerance is for a GPU's fused multiply-adds)."""
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=4)
    got = run(case, inputs)
    assert torch.equal(got, SPEC.run_reference(inputs, case)["out"])


@pytest.mark.parametrize("seed", [201, 202, 203, 204])
def test_seeded_random_cases_are_bit_exact(seed):
    case = SPEC.random_case(random.Random(seed))
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    assert torch.equal(run(case, inputs), SPEC.run_reference(inputs, case)["out"]), (case, seed)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_token_alone_gets_the_bits_it_gets_in_a_batch(weighted):
    case = {"T": 21, "D": 384, "weighted": weighted}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=8)
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"BT": 8, "BD": 128})
    kernel(**inputs)
    full = inputs["out"].clone()
    for lo, hi in ((0, 1), (7, 8), (20, 21), (3, 16)):
        part = {k: (v[lo:hi].contiguous() if k in ("where", "shared_out", "weights", "out") else v)
                for k, v in inputs.items()}
        part["out"] = torch.full_like(part["out"], float("nan"))
        kernel(**part)  # the same expert rows, a batch of hi - lo tokens
        assert torch.equal(part["out"], full[lo:hi]), (lo, hi)


def test_slots_add_in_the_invariant_tree_order():
    assert tree_order(6) == (((0, 4), (2, None)), ((1, 5), (3, None)))
    assert tree_order(1) == 0 and tree_order(3) == ((0, 2), (1, None))
    # terms whose f32 sum depends on the order: one after another each 2^-24 rounds away (ties to
    # even), in the tree two of them meet first and 2^-23 survives
    tiny = 2.0 ** -24
    terms = [torch.tensor([v], dtype=torch.float32) for v in (1.0, tiny, tiny, 0.0, tiny, tiny)]
    want = InvariantOps().sum(torch.stack(terms, 1), 1)
    assert torch.equal(add_in_order(tree_order(6), lambda k: terms[k]), want)
    sequential = sum(terms[1:], terms[0])
    assert sequential.item() == 1.0 and want.item() == 1.0 + 2.0 ** -23  # the order matters for these terms


def test_a_pair_left_out_adds_nothing():
    rows = torch.randn(4, 16).to(torch.bfloat16)
    where = torch.tensor([[0, -1], [4, 3]], dtype=torch.int32)  # -1 and 4 (>= P) read zero rows
    shared = torch.randn(2, 16).to(torch.bfloat16)
    inputs = {"expert_out": rows, "where": where, "shared_out": shared, "out": torch.empty(2, 16, dtype=torch.bfloat16)}
    got = run({"K": 2}, inputs, config={"BT": 1, "BD": 128})
    want = torch.stack([rows[0].float() + shared[0].float(), rows[3].float() + shared[1].float()]).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(got, moe_combine_reference(rows, where, shared, TOPK=2)["out"])


class _Elementwise:
    """A stand-in expert the runtime's MoE can call: bf16(tanh(x * a) * w), row by row alone, so
    its rows do not depend on how the runtime batches them (a GEMM's could)."""

    def __init__(self, a: float):
        self.a = a

    def __call__(self, ctx, x, weight=None):
        y = torch.tanh(x.float() * self.a)
        if weight is not None:
            y = y * weight[:, None]
        return ctx.act(y).float()


@pytest.mark.parametrize("experts_n,topk", [(16, 6), (8, 3)])
def test_agrees_bitwise_with_the_runtime_moe(experts_n, topk):
    """The runtime weighs each expert's rows before w2 and sums the slots by InvariantOps; the
    kernel, given those rows in the grouped order of moe_permute, gives the same bf16 bits."""
    g = torch.Generator().manual_seed(experts_n)
    t, hidden = 19, 64
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    gate = torch.randn(experts_n, hidden, generator=g) / 8
    experts = [_Elementwise(0.5 + e / 7) for e in range(experts_n)]
    shared = _Elementwise(1.3)
    cfg = SimpleNamespace(num_experts_per_tok=topk, routed_scaling_factor=1.5)
    moe = MoE(cfg, gate, torch.zeros(experts_n), None, experts=experts, shared=shared, act_block=128)
    ctx = Ctx(ops=InvariantOps(), quant=False)
    want = moe(ctx, x, torch.arange(t))
    idx, w = moe.route(ctx, x, torch.arange(t))
    perm = moe_permute_reference(idx.to(torch.int32), experts_n)
    rows = torch.empty(t * topk, hidden, dtype=torch.bfloat16)
    for q, p in enumerate(perm["order"].tolist()):  # each expert's rows, weighted, in the grouped order
        tok, slot = divmod(p, topk)
        rows[q] = experts[int(idx[tok, slot])](ctx, x[tok:tok + 1], w[tok, slot:slot + 1])[0].to(torch.bfloat16)
    inputs = {"expert_out": rows, "where": perm["where"], "shared_out": shared(ctx, x).to(torch.bfloat16),
              "out": torch.empty(t, hidden, dtype=torch.bfloat16)}
    got = run({"K": topk}, inputs, config={"BT": 4, "BD": 128})
    assert torch.equal(got, want)
