"""The batch-invariance and prefill/decode checks on CUDA (run on the H200 with `-m gpu`).

A test on the generated kernels first builds what its workload meets in parallel processes
(``build_ahead``: the workload run with the calls not yet built on the reference, their signatures
built, again until nothing new): met one at a time, a tiny model's hundred-odd sm90 builds take
longer than a test's time limit. ``DUOTILE_BUILD_JOBS`` sets the processes (default: the CPUs, at
most 15)."""

from __future__ import annotations

import os

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.layers.step import StepSeq
from duotile.runtime.reference import Model
from duotile.runtime.weights import Checkpoint

from . import test_engine as te
from .conftest import tokens
from .test_generated import agreement_generation, each_op_agrees

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BUILD_JOBS = int(os.environ.get("DUOTILE_BUILD_JOBS", min(15, os.cpu_count() or 1)))


def built_ahead(llm: LLM, workload) -> LLM:
    """``llm`` with every kernel ``workload(llm)`` meets built (module docstring)."""
    from duotile.runtime.generated.ahead import build_ahead

    build_ahead(llm.model.ctx.ops, lambda: workload(llm), BUILD_JOBS, log=print)
    return llm


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_batch_invariant_mode_is_bitwise_independent_of_the_batch_on_cuda(ckpt_dir, name):
    llm = LLM(ckpt_dir(name), batch_invariant=True, device="cuda")
    alone = te._alone(llm)
    assert len(alone.logits) == te.WATCHED.max_tokens
    for k in range(len(te.MIXES)):
        assert te._same(te._mixed(llm, k), alone), te.MIXES[k]


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_prefill_then_decode_bitwise_on_cuda(ckpt_dir, name):
    model = Model(Checkpoint.open(ckpt_dir(name)), batch_invariant=True, device="cuda")
    seq = tokens(70, model.config.vocab_size, seed=31)
    full = model.forward([StepSeq(model.new_cache(), seq)], all_logits=True)[0]
    cache = model.new_cache()
    got = [model.forward([StepSeq(cache, seq[:17])])[0]]
    got += [model.forward([StepSeq(cache, seq[p : p + 1])])[0] for p in range(17, 70)]
    assert torch.equal(torch.stack(got), full[16:])


@pytest.mark.parametrize("name, fp8_wo_a", [("v41-tiny", False), ("v4-tiny", False), ("v41-tiny", True)])
def test_generated_kernels_agree_with_their_reference_ops_on_cuda(ckpt_dir, name, fp8_wo_a):
    """test_generated.py's per-op check on the sm90 builds: every call a kernel serves, rerun by
    the reference op on the same arguments, agrees within the op's bound (and, with ``fp8_wo_a``,
    the grouped wo_a on its FP8 codes)."""
    llm = built_ahead(LLM(ckpt_dir(name), device="cuda", kernels="generated", fp8_wo_a=fp8_wo_a),
                      agreement_generation)
    each_op_agrees(llm, name)
    assert {k.target for k in llm.model.ctx.ops._kernels.values()} == {"sm90"}


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_generated_kernels_keep_batch_invariance_on_cuda(ckpt_dir, name):
    """On the sm90 builds a request is bitwise the same alone and among 2, 5 and 16 others, with
    its prompt in chunks of 1, 3, 6 and 16."""
    llm = built_ahead(LLM(ckpt_dir(name), batch_invariant=True, device="cuda", kernels="generated"), te._alone)
    alone = te._alone(llm)
    served = llm.last_stats.ops
    # both models' rows as bytes; V4.1's Reindex layers score the pool alone
    decode = ("sparse_attention_stored", "kv_insert") + (("index_scores_pool",) if name == "v41-tiny" else ())
    for op in ("rms_norm", "topk", "route", "sparse_attention_rows", *decode, "index_scores", "hc_pre", "hc_post",
               "moe_experts", "compress", "rope"):
        assert served[op][0] > 0 and served[op][1] == 0, (op, served[op])
    for k in range(len(te.MIXES)):
        assert te._same(te._mixed(llm, k), alone), te.MIXES[k]


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_generated_kernels_keep_batch_invariance_at_batch_64_on_cuda(ckpt_dir, name):
    """The watched request alone, then among 63 random others (prompts of 1 to 48 tokens, sampled
    or greedy, finishing at different steps) at place 40, all 64 decoding together: bitwise the same."""
    llm = built_ahead(LLM(ckpt_dir(name), batch_invariant=True, device="cuda", kernels="generated"), te._alone)
    alone = te._alone(llm)
    mixed = te._run(llm, te._watched_prompt(llm.config.vocab_size), te.WATCHED, 64, 40, None, 4096, 64,
                    seed=64, longest=48)
    assert te._same(mixed, alone)


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_sections_replayed_from_cuda_graphs_match_eager_launches_bitwise(ckpt_dir, name):
    """The watched request among 15 others (mix 3 of test_engine.py): with each layer's attention
    projections and FFN half replayed from CUDA graphs and with every kernel launched from Python
    (eager, the default),
    the same tokens, bitwise the same logits and the same op report; graphs did replay. The graphs
    run as a user runs them, without ``DUOTILE_GRAPHS_CHECK``: the check's eager run of each
    section changes what lies past each tensor, and so hid a kernel's read past one (the tiny
    V4.1's Engram projection, codegen/tilelang_cuda/unit_axes.py) that gave NaN under graphs."""
    eager = built_ahead(LLM(ckpt_dir(name), device="cuda", kernels="generated"), te._alone)
    want = te._mixed(eager, 3)
    graphed = LLM(ckpt_dir(name), device="cuda", kernels="generated", graphs=True)
    got = te._mixed(graphed, 3)
    assert te._same(got, want) and graphed.last_stats.ops == eager.last_stats.ops
    sections = graphed.model.ctx.sections
    assert sections.replays > 0 and not sections.eager, sections.report()


def _sync_sites(fn) -> list[str]:
    """``fn()`` under torch's sync debug mode set to warn: one entry per call that waited for the
    GPU, with the last frames of its stack outside Python's and torch's own, so that a failure
    lists every such call at once."""
    import traceback
    import warnings

    sites: list[str] = []

    def show(message, *_args, **_kw):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "site-packages" not in f.filename and "/lib/python" not in f.filename]
        sites.append(f"{str(message).splitlines()[0][:90]}\n" + "".join(traceback.format_list(frames[-4:])))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return list(dict.fromkeys(sites))


def test_sync_sites_lists_each_waiting_call():
    """The check above can fail: a read of a GPU value and a blocking copy to the GPU are listed."""
    import inspect

    x = torch.ones(4, device="cuda")

    def waits():
        x.sum().item()
        torch.arange(3).to("cuda")

    sites = _sync_sites(waits)
    first = inspect.getsourcelines(waits)[1]  # the line of `def waits`; the two calls follow it
    for line in (first + 1, first + 2):  # a call may warn more than once (torch's own layers): each is named
        assert any(f"line {line}, in waits" in s for s in sites), (line, sites)


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_a_decode_step_makes_no_host_sync(ckpt_dir, name):
    """A decode step of 16 requests on the generated kernels (after two warm-up steps) queues its
    work and returns: no call in it waits for the GPU (torch's sync debug mode)."""
    model = Model(Checkpoint.open(ckpt_dir(name)), device="cuda", kernels="generated")
    caches = [model.new_cache() for _ in range(16)]
    seqs = [tokens(9 + i, model.config.vocab_size, seed=i) for i in range(16)]
    model.forward([StepSeq(c, s) for c, s in zip(caches, seqs)])
    for step in range(2):
        model.forward([StepSeq(c, torch.tensor([step + 5])) for c in caches])
    batch = [StepSeq(c, torch.tensor([7])) for c in caches]
    sites = _sync_sites(lambda: model.forward(batch))
    assert not sites, f"{len(sites)} call(s) waited for the GPU:\n" + "\n".join(sites)


@pytest.mark.parametrize("name", ["v4-flash", "v41-flash"])
def test_real_size_logits_stay_within_twice_the_references_own_spread_on_cuda(name):
    """A released configuration's real widths and expert counts on 4 layers (every layer kind of
    the model represented), random weights drawn on the GPU: the generated model's teacher-forced
    FP32 logits over 48 random tokens stay within twice the reference's own spread under a 2^-20
    nudge of every linear output (``benchmarks/model_agreement.py``, which also reports the share
    of positions whose greedy token differs); every op of the forward runs a generated kernel."""
    from benchmarks.model_agreement import agreement

    row = agreement(name, layers=4, tokens=48, device="cuda", jobs=15)
    print(f"{name}: max error {row['max_error']:.4g} (bound {row['bound']:.4g}), "
          f"greedy token differs at {100 * row['greedy_differs']:.1f}% of positions")
    assert row["reference_calls"] == 0 and row["generated_calls"] > 0
    assert 0.0 < row["spread"] < row["logit_scale"], row  # the bound rests on a measured, finite sensitivity
    assert row["within_bound"], row
