"""The grouped ``wo_a`` as engines run it (``Model(fp8_wo_a=True)``, ``--fp8-wo-a``): its input
quantised to FP8 like every other FP8 projection's, its FP8 codes read by ``gemm_blockscaled`` over
the groups (model.md 2.5.7, 2.10's note), where the released reference runs it in BF16 on the
dequantised weight (the default)."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime import quant
from duotile.runtime.engine import LLM
from duotile.runtime.layers.common import Ctx, grouped_linear_q
from duotile.runtime.ops import FastOps
from duotile.runtime.reference import Model
from duotile.runtime.sampler import SamplingParams
from duotile.runtime.weights import Checkpoint

from .test_generated import each_op_agrees


def test_the_reference_op_is_each_groups_quantised_input_times_its_weight(ckpt_dir):
    """model.md 2.5.7 with 2.10's quantisation point: group g's [T, K] input, e4m3 with a UE8M0
    code per block, times rows g * N .. (g + 1) * N of the weight."""
    model = Model(Checkpoint.open(ckpt_dir("v4-tiny")), fp8_wo_a=True)
    wo_a = model.blocks[0].attn.wo_a
    groups, n = model.config.o_groups, model.config.o_lora_rank
    og = torch.randn(3, groups, wo_a.weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    got = grouped_linear_q(Ctx(FastOps()), og, wo_a)
    for g in range(groups):
        x = quant.act_quant(og[:, g].float(), wo_a.act_block)
        want = x @ wo_a.weight[g * n:(g + 1) * n].T
        assert torch.allclose(got[:, g * n:(g + 1) * n], want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[:, :n], og[:, 0].float() @ wo_a.weight[:n].T)  # the input was quantised


def test_generated_kernels_serve_it_and_agree_with_the_reference_op(ckpt_dir):
    """Every op of a generation with ``fp8_wo_a`` on the interpreter against its reference op, the
    grouped ``wo_a`` among them (linear_q's bound a group)."""
    llm = LLM(ckpt_dir("v41-tiny"), kernels="generated", fp8_wo_a=True)
    each_op_agrees(llm, "v41-tiny")
    ops = llm.last_stats.ops
    assert ops["grouped_linear_q"][1] == 0 and "linear" in ops
    # every attention call, a decode step's and a prefill chunk's, wrote wo_a's FP8 input itself, which
    # wo_a then took as it was
    attention = ops["sparse_attention_stored"][0] + ops["sparse_attention_rows"][0]
    assert ops["sparse_attention_rows"][0] > 0 and llm.model.ctx.ops.fused_fp8_inputs == attention


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_the_decode_kernels_fp8_input_gives_the_quantised_inputs_results(ckpt_dir, name):
    """wo_a's input written by the attention kernels (``decode_fp8_out``) or quantised after them
    (``quantize``): the same bits, so the same tokens and logits, bit for bit."""
    prompts, params = [list(range(3, 15)), [2, 7]], SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
    fused_llm = LLM(ckpt_dir(name), kernels="generated", fp8_wo_a=True)
    fused = fused_llm.generate(prompts, [params] * 2)
    assert fused_llm.model.ctx.ops.fused_fp8_inputs > 0
    apart = LLM(ckpt_dir(name), kernels="generated", fp8_wo_a=True)
    apart.model.ctx.ops._fp8_output = lambda ctx, o, args: {}  # no FP8 output: wo_a quantises its input
    separate = apart.generate(prompts, [params] * 2)
    assert apart.model.ctx.ops.fused_fp8_inputs == 0
    for a, b in zip(fused, separate):
        assert a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_with_the_kernels_wo_a_is_kept_as_its_codes_or_in_bf16(ckpt_dir):
    """Packed weights (the generated kernels' default): with ``fp8_wo_a`` ``wo_a`` keeps its codes
    and scales alone; without, its dequantised value alone, in BF16 (exact: an e4m3 code times a
    power of two), where it kept that value in FP32 beside the codes."""
    ckpt = Checkpoint.open(ckpt_dir("v41-tiny"))
    plain, fp8 = Model(ckpt, kernels="generated"), Model(ckpt, kernels="generated", fp8_wo_a=True)
    reference = Model(ckpt)
    for p, f, r in zip(plain.blocks, fp8.blocks, reference.blocks):
        assert f.attn.wo_a._weight is None and p.attn.wo_a.packed is None
        assert p.attn.wo_a.weight.dtype == torch.bfloat16 and r.attn.wo_a.weight.dtype == torch.float32
        assert torch.equal(p.attn.wo_a.weight.float(), r.attn.wo_a.weight)
    codes = sum(b.attn.wo_a.packed[1].numel() for b in fp8.blocks)
    scales = sum(b.attn.wo_a.packed[2].numel() for b in fp8.blocks)
    assert plain.weight_bytes - fp8.weight_bytes == 2 * codes - (codes + scales)


def test_it_needs_quantisation(ckpt_dir):
    with pytest.raises(ValueError, match="fp8_wo_a: wo_a's input is quantised to FP8, and with quant=False"):
        Model(Checkpoint.open(ckpt_dir("v4-tiny")), quant=False, fp8_wo_a=True)
