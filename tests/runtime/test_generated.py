"""The runtime with duotile's generated kernels serving model ops (`kernels="generated"`)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from benchmarks.model_agreement import nudged
from duotile.codegen.choose_config import choose_config
from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.runtime import model_ops
from duotile.runtime.engine import LLM
from duotile.runtime.generated import _OP_OF, GeneratedOps
from duotile.runtime.layers.common import Ctx, index_scores, rms_norm, select_topk, topk
from duotile.runtime.layers.moe import MoE
from duotile.runtime.layers.step import StepSeq
from duotile.runtime.ops import FastOps, InvariantOps
from duotile.runtime.reference import make_ops
from duotile.runtime.sampler import SamplingParams
from duotile.runtime.scheduler import Scheduler

from .test_engine import _run, _same, _watched_prompt


def test_the_rms_norm_op_runs_the_rmsnorm_kernel_and_counts_it():
    ctx = Ctx(GeneratedOps(FastOps()))
    x, w = torch.randn(2, 5, 96), 1 + 0.1 * torch.randn(96)
    got = rms_norm(ctx, x, w, 1e-6)
    torch.testing.assert_close(got, FastOps().rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert ctx.tally.snapshot() == {"rms_norm": (1, 0)} and got.shape == x.shape and got.dtype == torch.float32
    # no weight (V4's per-head norm): the kernel with a weight of ones, which scales by exactly 1
    torch.testing.assert_close(rms_norm(ctx, x, None, 1e-6), FastOps().rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-6)
    empty = rms_norm(ctx, x[:0], w, 1e-6)  # no rows: served without a launch
    assert empty.shape == (0, 5, 96) and ctx.tally.snapshot() == {"rms_norm": (3, 0)}
    assert ctx.ops.sum is not None and ctx.ops.invariant is False  # primitives are the base flavour's


def test_row_gathers_from_tables_of_any_row_count_share_one_build():
    """gather_rows serves the MoE's gather from a step's token rows (a table of T rows, T changing
    every step) as well as the embedding: the table's row count is dynamic, one build a width
    (a build per token count before: 8 in an 8-token generation of tiny V4.1)."""
    ops = GeneratedOps(FastOps())
    ctx = Ctx(ops)
    for rows in range(1, 6):
        table = torch.randn(rows, 48)
        tokens = torch.tensor([rows - 1, 0, rows - 1])
        assert torch.equal(ops.kernel_for("embed")(ctx, table, tokens), table[tokens])
    assert ops.builds() == {"embed": 1}


def test_top_k_over_rows_that_grow_a_row_a_step_builds_once_a_power_of_two():
    """A decode step's index scores grow with the context; the kernel specialises their length,
    a padded size: a call's scores are padded with -inf to the power-of-two bucket: 3..40 scores a row, 5 builds (one
    a step before; 46 builds in 7 minutes of a 256-token generation on the H200, 2026-12-04), and
    the reference's indices at every length, ties and rows that see fewer than k included."""
    ctx = Ctx(GeneratedOps(FastOps()))
    g = torch.Generator().manual_seed(0)
    for n in range(3, 41):
        scores = torch.randint(0, 6, (2, n), generator=g).float()  # ties
        scores[1, n // 2:] = float("-inf")  # a row that sees fewer than k
        assert torch.equal(topk(ctx, scores, 8), select_topk(scores, 8)), n
    assert ctx.ops.builds() == {"topk": 5}


def test_empty_index_calls_are_answered_without_a_launch_or_the_reference():
    """Before a sequence's first compressed row the indexer has no keys and top-k no scores: the
    kernels' side answers (an empty score matrix; every slot -1, as select_topk) with no launch,
    so the op report counts a generated call and no reference call (they fell back before)."""
    ctx = Ctx(GeneratedOps(FastOps()), dtype=torch.bfloat16)
    none = torch.empty(3, 0)
    got = topk(ctx, none, 8)
    assert torch.equal(got, select_topk(none, 8)) and got.dtype == torch.long
    qi, wts = torch.randn(3, 4, 16), torch.rand(3, 4)
    scores = index_scores(ctx, qi, wts, torch.empty(0, 16), torch.zeros(3, dtype=torch.long))
    assert scores.shape == (3, 0) and scores.dtype == torch.float32
    assert ctx.ops.builds() == {} and ctx.tally.snapshot() == {"topk": (1, 0), "index_scores": (1, 0)}


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_a_short_generation_makes_no_reference_call(ckpt_dir, name):
    """A 3-token prompt (no compressed row at the first steps) and 3 tokens: every op of the report
    on a generated kernel, none on the reference."""
    llm = LLM(ckpt_dir(name), kernels="generated")
    llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    report = llm.last_stats.ops
    assert report and {op: ref for op, (_, ref) in report.items() if ref} == {}, report
    assert all(gen > 0 for gen, _ in report.values()), report


@pytest.mark.parametrize("block", [32, 128])
def test_an_fp8_projection_keeps_fp32_as_its_reference_does(block):
    """linear_q on the interpreter: the quantiser's codes are the reference's and the products are
    exact, so only the FP32 sums' order may differ (2^-20 of |x| |W| is ample). A BF16 C, as the
    block-scaled GEMM once wrote, is 2^-9 off: it moved the tiny models' logits by 0.5."""
    from duotile.runtime import quant
    from duotile.runtime.layers.common import Linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g) * 0.05
    codes, scales = quant.quantize_fp8_blocks(w, block)
    lin = Linear(quant.dequantize_fp8_blocks(codes, scales, block), block,
                 ("fp8", codes, scales.view(torch.uint8)))
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    got = lin(Ctx(GeneratedOps(FastOps())), x)
    want = lin(Ctx(FastOps()), x)
    terms = quant.act_quant(x.float(), block).abs() @ lin.weight.abs().T
    assert got.dtype == want.dtype == torch.float32
    assert bool(((got - want).abs() <= 2.0 ** -20 * terms).all())
    assert not torch.equal(got, got.to(torch.bfloat16).float())  # not BF16 values


def test_unknown_kernels_choice_is_rejected():
    with pytest.raises(ValueError, match="kernels: 'triton' is not one of reference, generated"):
        make_ops(False, "triton")
    assert isinstance(make_ops(True, "generated").base, InvariantOps)


def test_every_served_op_is_a_model_op_with_a_spec():
    ops = GeneratedOps(FastOps())
    assert set(ops._serves) <= set(model_ops.OPS)
    # served by other ops' specs: the collapse and the head by hc_post's and the norm's and gemm's, the
    # grouped wo_a by quantize and gemm_blockscaled
    assert set(_OP_OF.values()) | {"hc_collapse", "lm_head", "grouped_linear_q"} == set(ops._serves)
    with pytest.raises(ValueError, match="not one of OPS"):
        model_ops.model_op("no_such_op")


# the reference body of each served op, and how its kernel's result may differ from it on the same
# inputs: discrete results exactly; attention writes BF16 (one rounding of |o| <= 2^-7 relative of
# a row's largest output); the indexer keeps q . k in FP32 where the reference rounds it to BF16
# (2^-8 of each of at most H * |q . k| terms)
# mHC: the mixes are FP32 in another order, through the Sinkhorn (1e-4 relative); the collapse,
# the expand and the head write the activation dtype (a BF16 rounding either way: one ulp, 2^-7
# relative), and so do Engram's gated update and the MoE (their sums in another order; both
# measured bitwise equal on these models, 2026-12-01)
def _reference_of(op):
    from duotile.runtime import engine, reference
    from duotile.runtime.layers import attention_v41, cache_rows, common, compressor, engram, mhc, moe

    ops = {"rms_norm": common.rms_norm, "embed": reference.embed, "topk": common.topk, "route": MoE.choose,
            "sparse_attention": common.sparse_attention, "index_scores": common.index_scores,
            "hc_pre": mhc.HCSite.mixes, "hc_collapse": mhc.collapse, "hc_post": mhc.expand,
            "hc_head": mhc.HCHead.__call__, "linear_q": common.Linear._quantised, "sample": engine.sample_tokens,
            "linear": common.matmul, "lm_head": reference.lm_head, "engram_hash": engram.Engram.rows_of,
            "engram": engram.Engram.__call__, "moe_experts": moe.MoE.experts_out,
            "candidate_pool": attention_v41.pick_pool, "compress": compressor.pool_windows,
            "compress_decode": compressor.pool_decode,
            "rope": common.rope, "kv_round": common.round_rows, "kv_encode": cache_rows.kv_encode,
            "sparse_attention_stored": cache_rows.sparse_attention_stored,
            "sparse_attention_rows": cache_rows.sparse_attention_rows, "kv_insert": cache_rows.kv_insert,
            "index_scores_pool": attention_v41.index_scores_pool, "grouped_linear_q": common.grouped_linear_q}
    return ops[op].__wrapped__


def _same_state(a, b, start: int, ratio: int, overlap: bool) -> bool:
    """Two compressor states alike after ``start`` tokens (each in whichever form its op left it):
    the open window's tokens, and the previous window's A halves."""
    a, b = copy.deepcopy(a), copy.deepcopy(b)
    a.as_lists(start, ratio, overlap)
    b.as_lists(start, ratio, overlap)
    pairs = [(a.pending_c, b.pending_c), (a.pending_z, b.pending_z)]
    if a.prev_c is not None or b.prev_c is not None:
        if a.prev_c is None or b.prev_c is None:
            return False
        pairs += [(a.prev_c, b.prev_c), (a.prev_z, b.prev_z)]
    return all(x.shape == y.shape and torch.equal(x, y.to(x.device)) for x, y in pairs)


def _same_states(op, args, before) -> bool:
    """The states a pooling op advanced (``args``) and the reference's (``before``) alike after it."""
    ratio, overlap = args[5], args[6]
    if op == "compress":
        return _same_state(args[1], before, args[4] + args[2].shape[0], ratio, overlap)
    return all(_same_state(a, b, p + 1, ratio, overlap) for a, b, p in zip(args[1], before, args[4]))


def _same_rows(got: torch.Tensor, want: torch.Tensor, d: int, fmt: str) -> bool:
    """Two stacks of window rings as stored (format ``fmt``) hold the same values, to one e4m3 step
    of each value (a kernel's norm sums in another order and may move a bf16 rounding,
    kv_insert.py's tolerance); a row laid out otherwise decodes to other values altogether."""
    from duotile.runtime.stored import decode_rows

    g, w = decode_rows(got, d, fmt), decode_rows(want.to(got.device), d, fmt)
    return bool(((g - w).abs() <= 2.0 ** -3 * w.abs() + 2.0 ** -9 * w.abs().amax(-1, keepdim=True)).all())


def _close(got, want, rtol, atol=1e-6) -> bool:
    return bool(((got.float() - want.float()).abs() <= rtol * want.float().abs() + atol).all())


def _agree(op, got, want, args) -> bool:
    if op == "sample":
        return got == want
    if op == "compress":  # the pooled rows: FP32 softmax pooling in another order; the window index exact
        return got[1] == want[1] and got[0].shape == want[0].shape and _close(got[0], want[0], 1e-5)
    if op == "compress_decode":
        return got.shape == want.shape and _close(got, want, 1e-5)
    if op == "candidate_pool":  # the boolean pool (None where left out) and its block list
        return all(g is w is None or torch.equal(g, w.to(g.device)) for g, w in zip(got, want))
    if op in ("embed", "topk", "engram_hash"):
        return torch.equal(got, want.to(got.device))  # (the reference's Engram rows are on the CPU)
    if op == "rope":  # x c -+ y s of a pair: the reference rounds both products; a GPU build fuses
        # one into an FMA (one rounding fewer): 2 ulps of |x| + |y| at most (bit for bit on the CPU)
        x = args[2].float()
        pair = x.abs().reshape(*x.shape[:-1], x.shape[-1] // 2, 2).sum(-1).repeat_interleave(2, -1)
        return got.dtype == want.dtype and bool(((got - want).abs() <= 2.0 ** -22 * pair).all())
    if op == "kv_round":  # the cache format's round trip is defined bit for bit (-0 apart from +0)
        return got.dtype == want.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    if op == "kv_encode":  # the cache rows' bytes: the quantisers' reference, bit for bit
        return got.dtype == want.dtype == torch.uint8 and torch.equal(got, want.to(got.device))
    if op == "route":
        return torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=4e-7, atol=0)
    if op == "rms_norm":
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if op == "hc_pre":
        return all(_close(g, w, 1e-4) for g, w in zip(got, want))
    if op in ("linear", "lm_head"):  # FP32 sums of exact products in another order
        x, w = (args[1], args[2]) if op == "linear" else (args[1], args[3])
        if op == "lm_head":  # after the final norm, whose FP32 sum order differs too (1e-5)
            return _close(got, want, 1e-3, 1e-4)
        rows = x.reshape(-1, x.shape[-1]).float()
        split = [not torch.equal(t.float(), t.to(torch.bfloat16).float()) for t in (rows, w)]
        if any(split):  # gemm_f32: the dropped lo terms and its FP32 sums, as its spec derives them
            from duotile.kernels_spec.gemm_f32 import error_bound

            n = w.shape[0]
            return _close(got.reshape(-1, n), want.reshape(-1, n), 0.0, error_bound(rows, w.float(), *split))
        return _close(got, want, 0.0, x.shape[-1] * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T) + 1e-7)
    if op == "linear_q":  # FP32 out, as the reference: sums in another order (on sm90 the fp8 tensor
        linear, x = args[0], args[2].float()  # cores' narrower adds: gemm_blockscaled's ACCUMULATION)
        from duotile.kernels_spec.gemm_blockscaled import ACCUMULATION
        from duotile.runtime import quant

        terms = quant.act_quant(x, linear.act_block).abs() @ linear.weight.abs().T
        return got.dtype == want.dtype and _close(got, want, 0.0, ACCUMULATION * terms + 1e-7)
    if op == "grouped_linear_q":  # linear_q's bound, a group at a time
        from duotile.kernels_spec.gemm_blockscaled import ACCUMULATION
        from duotile.runtime import quant

        og, linear = args[1].float(), args[2]
        t, groups, k = og.shape
        x = quant.act_quant(og.reshape(t, groups * k), linear.act_block).view(t, groups, k).abs()
        w = linear.weight.view(groups, -1, k).abs()
        terms = torch.cat([x[:, g] @ w[g].T for g in range(groups)], -1)
        return got.dtype == want.dtype and _close(got, want, 0.0, ACCUMULATION * terms + 1e-7)
    if op in ("hc_collapse", "hc_post", "hc_head", "engram"):
        return got.dtype == want.dtype and _close(got, want, 2.0 ** -7)
    if op == "moe_experts":  # BF16 out; inside, the SwiGLU output is rounded to BF16 and FP8 on
        # both sides, and sums in another order (sm90's FP8 tensor cores add in fewer bits) can put
        # an element on the other side of a rounding step: the step moves every output of that
        # token by a fraction of the row's scale, not of its own (possibly cancelled) value. Bound
        # (chosen, not derived): a BF16 ulp of the element and two of the row's largest output.
        # Measured on the H200, 2026-12-02: 1-3 ulps at magnitudes 1-2; bitwise on the CPU.
        scale = want.float().abs().amax(-1, keepdim=True)
        return got.dtype == want.dtype and _close(got, want, 2.0 ** -7, 2.0 ** -6 * scale)
    if op in ("sparse_attention", "sparse_attention_stored", "sparse_attention_rows"):
        return bool(((got - want).abs() <= 2.0 ** -7 * want.abs().amax(-1, keepdim=True) + 1e-6).all())
    return _index_agree(op, got, want, args)


def _index_agree(op, got, want, args) -> bool:
    """The indexer's scores (the full rows, or the pool's columns: the full rows' bound gathered at
    their positions) and the reference's: the same -inf mask, the finite ones within the bound."""
    qi, wts, keys = args[1], args[2], args[3]
    if keys.dtype == torch.uint8:  # V4.1's index keys as stored: their values bound the error
        from duotile.runtime.stored import decode_rows

        keys = decode_rows(keys, qi.shape[-1], "mxfp4")
    k = keys.float().abs()
    dots = torch.einsum("shc,snc->shn", qi.float().abs(), k) if k.dim() == 3 else qi.float().abs() @ k.T
    terms = dots * wts.float().abs()[:, :, None]  # |q_h||k| per head
    bound = 2.0 ** -8 * (terms.sum(1) if terms.dim() == 3 else terms) + 1e-6
    if op == "index_scores_pool":
        from duotile.runtime.layers.attention_v41 import pool_columns

        p = pool_columns(args[5], args[6]).to(bound.device)
        bound = bound.gather(1, p.clamp(0, max(bound.shape[1] - 1, 0))) if bound.shape[1] else bound.new_zeros(p.shape)
    fin = torch.isfinite(want)
    return torch.equal(fin, torch.isfinite(got)) and bool(((got - want).abs()[fin] <= bound[fin]).all())


def _difference(got, want) -> str:
    """The largest difference of two results (tensors or tuples of them), in a few words."""
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    out = []
    for g, w in pairs:
        if torch.is_tensor(g) and torch.is_tensor(w) and g.shape == w.shape:
            err = (g.float() - w.float().to(g.device)).abs()
            top = err.max().item() if err.numel() else 0.0
            out.append(f"{tuple(g.shape)} {g.dtype}: max |diff| {top:.3g}, "
                       f"{int((err > 0).sum())} elements differ")
        else:
            out.append(f"{type(g).__name__} vs {type(w).__name__}")
    return "; ".join(out)


# served by a method: the first argument is the layer
METHODS = ("route", "hc_pre", "hc_head", "engram_hash", "engram", "moe_experts")


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_each_kernel_agrees_with_its_reference_op_on_the_models_own_inputs(ckpt_dir, name):
    """Every call a generated kernel serves in a generation is run by the reference op too, on the
    same arguments; the two agree within the op's bound (exactly for embedding rows, top-k and the
    chosen experts). What the forward then does with them is the reference model's."""
    llm = LLM(ckpt_dir(name), kernels="generated")
    each_op_agrees(llm, name)
    every_build_lowers_for_the_gpu_targets(llm)  # the same generation's calls, on sm90 / sm100


def agreement_generation(llm: LLM):
    """The generation the per-op check watches: two requests, greedy and sampled, three tokens each."""
    return llm.generate([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]], [SamplingParams(max_tokens=3, ignore_eos=True),
                        SamplingParams(temperature=0.8, seed=5, max_tokens=3, ignore_eos=True)])


def each_op_agrees(llm: LLM, name: str) -> None:
    """The check above on an engine made on any device (test_gpu.py runs it on the sm90 builds)."""
    ops, seen, told = llm.model.ctx.ops, {}, []

    def checked(op, kernel):
        def run(*args, **kw):
            pooling = op in ("compress", "compress_decode")
            before = copy.deepcopy(args[1]) if pooling else None  # the state(s) it advances
            ring = args[-1].clone() if op == "kv_insert" else None  # the rings it writes
            got = kernel(*args, **kw)
            if got is not NotImplemented and ring is not None:  # the reference into the rings as they were
                written, args[-1][:] = args[-1].clone(), ring
                _reference_of(op)(*args, **kw)
                agree = _same_rows(written, args[-1], args[2].shape[-1], kw.get("fmt", "fp8/32"))
                args[-1][:] = written
                seen.setdefault(op, []).append(agree)
            elif got is not NotImplemented:
                if before is not None:  # the reference from the same state; both states after must match
                    want = _reference_of(op)(args[0], before, *args[2:], **kw)
                    agree = _agree(op, got, want, args) and _same_states(op, args, before)
                else:
                    want = _reference_of(op)(*args, **kw)
                    agree = _agree(op, got, want, args[1:] if op in METHODS else args)
                seen.setdefault(op, []).append(agree)
                if not agree:  # at once: a GPU run cut by a time limit still says which op and call
                    told.append(f"disagrees: {op} call {len(seen[op])}: {_difference(got, want)}")
                    print(told[-1], flush=True)
            return got
        return run

    ops._serves = {op: checked(op, k) for op, k in ops._serves.items()}
    agreement_generation(llm)
    want_ops = {"rms_norm", "embed", "topk", "route", "sparse_attention_rows", "index_scores", "hc_pre",
                "hc_collapse", "hc_post", "linear_q", "sample", "linear", "lm_head", "compress", "compress_decode",
                "rope", "kv_round"}
    want_ops |= {"moe_experts", "kv_encode", "kv_insert", "sparse_attention_stored"}
    want_ops |= {"hc_head"} if name == "v4-tiny" else {"engram_hash", "engram", "candidate_pool", "index_scores_pool"}
    want_ops |= {"grouped_linear_q"} if llm.model.ctx.fp8_wo_a else set()
    assert set(seen) == want_ops, set(seen)
    assert [op for op, v in sorted(seen.items()) if not all(v)] == [], "\n".join(told[:20])
    report = llm.last_stats.ops
    assert all(report[op][0] == len(seen[op]) for op in want_ops), report


def test_a_generation_reports_generated_and_reference_calls_per_op(ckpt_dir):
    llm = LLM(ckpt_dir("v41-tiny"), kernels="generated")
    llm.generate([1, 2, 3], SamplingParams(max_tokens=1))  # the prefill step alone (the interpreter is slow)
    first = llm.last_stats.ops
    assert first["embed"] == (1, 0) and first["sample"] == (1, 0) and first["kv_round"][0] > 0 == first["kv_round"][1]
    llm.generate([1, 2, 3], SamplingParams(max_tokens=1))
    assert llm.last_stats.ops == first  # per generation, not since the engine was made
    ref = LLM(ckpt_dir("v41-tiny"))
    ref.generate([1, 2, 3], SamplingParams(max_tokens=1))
    on_ref = ref.last_stats.ops
    assert all(g == 0 for g, _ in on_ref.values()) and set(first) <= set(on_ref)
    assert set(on_ref) - set(first) == {"act_quant", "expert"}  # inside moe_experts, which a kernel serves


def test_batch_invariance_holds_with_generated_kernels(ckpt_dir):
    """The kernels reduce each row alone, in an order fixed by their configs: a request's logits
    and tokens stay bitwise the same alone and among 2 others with its prompt in chunks of 5. (A
    smaller request than test_engine.py's, which mixes in 5 and 16 others on the reference ops:
    on a CPU the interpreter makes each generated step seconds long.)"""
    llm = LLM(ckpt_dir("v41-tiny"), batch_invariant=True, kernels="generated")
    prompt = _watched_prompt(llm.config.vocab_size)[:12]
    watched = SamplingParams(temperature=0.9, max_tokens=4, seed=7, ignore_eos=True, return_logits=True)
    alone = _run(llm, prompt, watched, 1, 0, None, 256, 16, seed=0)
    served = llm.last_stats.ops
    assert served["rms_norm"][0] > 0 and all(served[op] == (served[op][0], 0) and served[op][0] > 0 for op in (
        "topk", "route", "sparse_attention_rows", "sparse_attention_stored", "kv_encode", "index_scores", "hc_pre",
        "hc_collapse", "hc_post", "moe_experts", "sample", "engram", "candidate_pool", "compress", "kv_round",
        "index_scores_pool")), served
    assert served["rope"][0] > 0
    llm.scheduler = Scheduler(16, 64, 5)  # the prompt in chunks of 5 beside two short requests
    others = SamplingParams(temperature=0.7, max_tokens=2, seed=3, ignore_eos=True)
    mixed = llm.generate([[5, 6, 7], prompt, [9]], [others, watched, SamplingParams(max_tokens=3)])[1]
    assert _same(mixed, alone)
    # among 4 and then 15 random others (greedy and tempered, prompts of 1 to 6 tokens: the interpreter
    # is slow), at places 3 and 9 of the order, each prompt whole
    for n, at in ((5, 3), (16, 9)):
        assert _same(_run(llm, prompt, watched, n, at, None, 300, 16, seed=n, top_k=False, longest=6), alone), n


def test_generated_kernels_take_the_tuned_config(monkeypatch):
    """The runtime compiles with config=None, so codegen.compile takes a tuned config when the cache
    or the shipped table has one; here a stand-in cache answers ROWS=2, ALIGN=1024."""
    from duotile.passes.autotune import cache

    asked = []

    def fake_lookup(kernel, target, shapes, **kw):
        asked.append((kernel.name, target, dict(shapes)))
        return {"ROWS": 2, "ALIGN": 1024}, []

    monkeypatch.setattr(cache, "lookup", fake_lookup)
    ctx = Ctx(GeneratedOps(FastOps()))
    rms_norm(ctx, torch.randn(5, 64), torch.ones(64), 1e-6)
    assert asked and asked[0][:2] == ("rmsnorm", "interpret")
    (kernel,) = ctx.ops._kernels.values()
    ((module,), _artifacts, _fn), = kernel._cache.values()
    assert module.config == {"ROWS": 2, "ALIGN": 1024}


def test_a_generation_with_a_changing_batch_builds_once_per_width(capsys, tmp_path):
    """Token counts change every step (prefill chunks, a batch that shrinks as requests finish):
    the rmsnorm build is dynamic in them, so builds are bounded by the distinct widths. The
    generation's build signatures are saved for ``duotile build --signatures``: one a build."""
    from duotile.cli import main
    from duotile.codegen import prebuild

    sigs = tmp_path / "sigs.json"
    assert main(["generate", "--prompt-ids", "1", "2", "3", "--max-tokens", "4", "--requests", "3",
                 "--kernels", "generated", "--no-progress", "--save-builds", str(sigs)]) == 0
    out = capsys.readouterr().out.splitlines()
    saved = prebuild.load(sigs)
    assert sum(s.spec == "rmsnorm" for s in saved) == int(re.search(
        r"on (\d+) build", next(ln for ln in out if ln.startswith("op rms_norm:"))).group(1))
    assert f"builds: {len(saved)} signatures written to {sigs}" in out
    line = next(ln for ln in out if ln.startswith("op rms_norm:"))
    calls, builds = (int(n) for n in re.match(r"op rms_norm: (\d+) generated \(on (\d+) build", line).groups())
    assert calls > 20 and 1 <= builds <= 3, line
    # two round trips (the window's FP8, the index keys' MXFP4): two builds, every call; the NVFP4
    # compressed rows are stored as bytes (kv_encode), never rounded as values
    line = next(ln for ln in out if ln.startswith("op kv_round:"))
    calls, builds = (int(n) for n in re.match(r"op kv_round: (\d+) generated \(on (\d+) build\(s\)\), 0 reference$",
                                              line).groups())
    assert calls > 20 and builds == 2, line
    # kv_encode's NVFP4 rows and MXFP4 index keys (its FP8 window rows share linear_q's quantize
    # builds): a build a format and power-of-two bucket of the rows (1, 2, 3 sequences; the prompt's)
    line = next(ln for ln in out if ln.startswith("op kv_encode:"))
    calls, builds = (int(n) for n in re.match(r"op kv_encode: (\d+) generated \(on (\d+) build\(s\)\), 0 reference$",
                                              line).groups())
    assert calls >= 10 and 2 <= builds <= 8, line
    # a decode step's window rows go into the rings by kv_insert: one build (its batch is dynamic)
    line = next(ln for ln in out if ln.startswith("op kv_insert:"))
    assert re.match(r"op kv_insert: \d+ generated \(on 1 build\(s\)\), 0 reference$", line), line


def _signatures(llm: LLM) -> list[tuple[str, object, dict, dict]]:
    """(spec, kernel, meta tensors, constants) for every build the engine's kernels made: one call
    of each signature with its dynamic sizes left out (a GPU target builds those once too)."""
    from duotile.kernels_spec import get

    return [(sig.spec, get(sig.spec).kernel, sig.meta_tensors(), dict(sig.constants))
            for sig in llm.model.ctx.ops.signatures()]


def every_build_lowers_for_the_gpu_targets(llm: LLM) -> None:
    """Every build signature the engine's kernels made (on the interpreter) is also specialised and
    generated for sm90 and sm100 with the config a user gets: the interpreter takes any tile, the GPU
    generators do not (a 4-head decode's 4-row accumulator cannot be split over sm90's warps)."""
    calls = _signatures(llm)
    specs = {spec for spec, *_ in calls}
    assert specs >= {"sparse_mqa_prefill", "rmsnorm", "topk", "moe_gemm_mxfp4"}
    assert specs & {"sparse_mqa_decode_fp8", "sparse_mqa_decode_fp8_nope"}  # V4.1's rows as bytes, V4's
    failed = []
    for target in ("sm90", "sm100"):
        tgt = get_target(target)
        for spec, kernel, tensors, constants in calls:
            sig = kernel.bind(tensors)
            try:
                config = choose_config(kernel, target, sig, constants)
                phases, knobs = specialize_phases(kernel, sig, tgt, config, constants)
                for m in phases:
                    tgt.generate(m, tgt.phase_knobs(m, knobs))
            except Exception as err:  # noqa: BLE001 - every failing call is listed
                failed.append(f"{target} {spec} {sig.shapes}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    assert not failed, "\n".join(failed)


def test_the_sample_kernel_draws_a_batch_as_each_row_alone():
    """The batched `sample` op on its kernel (interpreter): greedy and tempered rows in one launch
    give each row's reference token; a batch holding a top-k request stays on the reference."""
    from duotile.runtime import engine

    rows = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3)]
    seeds, positions = [11, 12, 2**62 + 3], [4, 9, 100]
    ops = GeneratedOps(FastOps())
    got = ops._sample(Ctx(ops), rows, params, seeds, positions)
    assert got == engine.sample_tokens.__wrapped__(None, rows, params, seeds, positions)
    filtered = [*params[:2], SamplingParams(temperature=0.7, top_p=0.9)]
    assert ops._sample(Ctx(ops), rows, filtered, seeds, positions) is NotImplemented


def _teacher_forced(llm: LLM, seq: list[int], first: int) -> torch.Tensor:
    """FP32 logits at every position from ``first`` on, the whole sequence in one forward."""
    model = llm.model
    return model.forward([StepSeq(model.new_cache(), torch.tensor(seq))], all_logits=True)[0][first:-1]


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_generated_logits_stay_within_twice_the_references_own_spread(ckpt_dir, name):
    """A tiny random checkpoint sits on its quantisers' rounding steps: the reference itself, with
    its linear outputs moved by 2^-20 relative (a few FP32 ulps), moves its logits by up to 1.0
    (V4.1) / 0.46 (V4) over this sequence, and a greedy token changes wherever the top two logits
    are closer than that (gaps of 0.01-0.2 occur within 32 steps). So the generated model is held to
    the reference's own spread rather than to its greedy tokens: on the reference's 32 greedy
    tokens (teacher forced), every logit within twice that spread (measured on 2026-12-04: 1.17
    against 1.01, 0.55 against 0.46). A wrong kernel moves them by the logits' own size (~4)."""
    prompt = [3, 17, 29, 101, 7, 55, 8]
    reference = LLM(ckpt_dir(name))
    greedy = reference.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)])[0]
    seq = prompt + list(greedy.token_ids)
    ref = _teacher_forced(reference, seq, len(prompt) - 1)

    moved = nudged(lambda: _teacher_forced(reference, seq, len(prompt) - 1), ops=("linear",))  # model_agreement.py's
    spread = (moved - ref).abs().max().item()
    assert 0.1 < spread < 2.0, spread  # the sensitivity this bound rests on, as measured

    generated = LLM(ckpt_dir(name), kernels="generated")
    got = _teacher_forced(generated, seq, len(prompt) - 1)
    served = generated.model.ctx.tally.snapshot()
    assert all(served[op][0] > 0 and served[op][1] == 0 for op in ("linear", "sparse_attention_rows", "moe_experts"))
    assert (got - ref).abs().max().item() <= 2 * spread


def test_a_kernel_is_made_once_whatever_the_order_of_its_constants():
    ops, dev = GeneratedOps(FastOps()), torch.device("cpu")
    first = ops._kernel("kv_round", dev, {"FORMAT": "fp8", "BLOCK": 64, "FLOOR": 0.0})
    assert ops._kernel("kv_round", dev, {"BLOCK": 64, "FLOOR": 0.0, "FORMAT": "fp8"}) is first
    assert ops._kernel("kv_round", dev, {"FORMAT": "fp8", "BLOCK": 32, "FLOOR": 0.0}) is not first
    assert len(ops._kernels) == 2


def test_a_steps_positions_go_to_the_device_once_for_all_its_rope_calls():
    """Every layer's rope calls of a step pass the step's one positions tensor: its blocks and its
    shipped indices are worked out once (four rope calls a layer made four host reads and copies);
    other positions (a compressor's) get their own, and the rotations are the reference's."""
    from duotile.runtime.layers.common import Rotary
    from duotile.runtime.presets import get_preset

    ops = GeneratedOps(FastOps())
    rotary = Rotary(get_preset("v41-tiny"), compressed=False)
    positions, other = torch.tensor([3, 70, 129]), torch.tensor([3, 70, 129])
    first = ops._rope_rows(positions, rotary.BLOCK, torch.device("cpu"))
    assert ops._rope_rows(positions, rotary.BLOCK, torch.device("cpu"))[2] is first[2]
    again = ops._rope_rows(other, rotary.BLOCK, torch.device("cpu"))
    assert again[2] is not first[2] and torch.equal(again[2], first[2]) and first[:2] == (0, 2)
    x = torch.randn(3, 2, 128)
    ctx = Ctx(ops)
    for _ in range(2):
        assert torch.equal(ops._rope(ctx, rotary, x, positions), rotary.apply(x, positions))
