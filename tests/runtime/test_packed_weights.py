"""Weights kept as released: with the generated kernels the model holds the FP8 / FP4 codes and
their scales alone (no FP32 copy), the routed experts' codes stacked once, and reports the bytes."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime import quant
from duotile.runtime.layers.common import Ctx, Linear, WeightSource
from duotile.runtime.ops import FastOps
from duotile.runtime.reference import Model
from duotile.runtime.weights import Checkpoint, CheckpointError


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_packed_codes_are_the_stored_ones_and_dequantise_to_get(ckpt_dir, name):
    ckpt = Checkpoint.open(ckpt_dir(name))
    block = ckpt.config.weight_block_size[0]
    for tensor in ("layers.0.attn.wq_b", "layers.2.ffn.experts.3.w2"):
        kind, codes, scales = ckpt.packed(tensor)
        assert scales.dtype == torch.uint8 and torch.equal(scales, ckpt.raw(f"{tensor}.scale").view(torch.uint8))
        assert codes.dtype == (torch.float8_e4m3fn if kind == "fp8" else torch.uint8)
        assert torch.equal(quant.dequantize_packed((kind, codes, scales), block), ckpt.get(tensor))
    with pytest.raises(KeyError, match="not a packed weight"):
        ckpt.packed("layers.0.attn_norm.weight")


def test_a_packed_only_linear_dequantises_at_each_use_and_keeps_nothing(ckpt_dir):
    ckpt = Checkpoint.open(ckpt_dir("v41-tiny"))
    ws = WeightSource(ckpt, packed=True, dequantised=False)
    lin = ws.linear("layers.0.attn.wq_b")
    assert lin._weight is None and lin.packed[0] == "fp8"
    torch.testing.assert_close(lin.weight, ckpt.get("layers.0.attn.wq_b"), rtol=0, atol=0)
    assert lin._weight is None  # dequantised for the use, not kept
    x = torch.randn(3, lin.packed[1].shape[1]).to(torch.bfloat16)
    full = WeightSource(ckpt).linear("layers.0.attn.wq_b")
    assert torch.equal(lin(Ctx(FastOps()), x), full(Ctx(FastOps()), x))
    with pytest.raises(ValueError, match="the weight, its packed codes, or both"):
        Linear(None, 32)
    with pytest.raises(ValueError, match="keep the packed codes, the dequantised weights, or both"):
        WeightSource(ckpt, packed=False, dequantised=False)


def test_a_corrupt_code_is_refused_when_read_packed_too(tmp_path):
    """Kept as released, a weight's codes are still checked: a NaN e4m3 code fails the load."""
    from ..hostile.runtime_support import copy_of, rewrite_tensor

    path = copy_of("v41-tiny", tmp_path / "c")

    def nan(t):
        codes = t.view(torch.uint8).clone()
        codes[0, 0] = 0x7F
        return codes.view(t.dtype)

    rewrite_tensor(path, "layers.0.attn.wq_b.weight", nan)
    with pytest.raises(CheckpointError, match="NaN e4m3"):
        Checkpoint.open(path).packed("layers.0.attn.wq_b")


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_the_generated_model_keeps_the_codes_alone_with_the_experts_stacked_once(ckpt_dir, name):
    ckpt = Checkpoint.open(ckpt_dir(name))
    packed, full = Model(ckpt, kernels="generated"), Model(ckpt)
    assert packed.weights_kept == "packed" and full.weights_kept == "dequantised"
    assert packed.weight_bytes < full.weight_bytes / 2, (packed.weight_bytes, full.weight_bytes)
    moe = packed.blocks[0].moe
    stack = moe.stack
    w13 = stack["w13"]
    e1 = moe.experts[1]
    assert e1.w1._weight is None and e1.w1.packed[1].data_ptr() == w13[1].data_ptr()  # a view of the stack
    assert torch.equal(e1.w3.packed[1], w13[1, w13.shape[1] // 2:])
    torch.testing.assert_close(e1.w2.weight, full.blocks[0].moe.experts[1].w2.weight, rtol=0, atol=0)
    assert full.blocks[0].moe.stack is None
