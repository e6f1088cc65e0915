"""Random weights drawn on a device (runtime/random_weights.py): the stored formats of a checkpoint,
the same values for the same seed, a model that runs on them."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.inventory import tensor_specs
from duotile.runtime.layers.step import StepSeq
from duotile.runtime.presets import get_preset
from duotile.runtime.random_weights import RandomCheckpoint
from duotile.runtime.reference import Model


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_every_tensor_comes_in_its_stored_shape_and_dtype(name):
    cfg = get_preset(name)
    ckpt = RandomCheckpoint(cfg, seed=1)
    block = cfg.weight_block_size[0]
    for spec in tensor_specs(cfg):
        want = spec.stored(block)
        got = ckpt._stored(spec)
        assert set(got) == set(want), spec.name
        for part, (shape, dtype) in want.items():
            ok_dtype = got[part].dtype == dtype or (dtype == torch.int32 and got[part].dtype == torch.int64)
            assert tuple(got[part].shape) == tuple(shape) and ok_dtype, (part, got[part].shape, got[part].dtype)


def test_the_same_seed_draws_the_same_values_and_another_seed_others():
    cfg = get_preset("v4-tiny")
    a, b, c = RandomCheckpoint(cfg, seed=4), RandomCheckpoint(cfg, seed=4), RandomCheckpoint(cfg, seed=5)
    for name in ("layers.0.attn.wq_a", "layers.2.ffn.experts.3.w2", "embed.weight", "layers.0.ffn.gate.tid2eid"):
        assert torch.equal(a.get(name), b.get(name)), name
        assert not torch.equal(a.get(name), c.get(name)), name
    kind, codes, scales = a.packed("layers.2.ffn.experts.3.w2")
    assert (kind, codes.dtype, scales.dtype) == ("fp4", torch.uint8, torch.uint8)
    assert torch.equal(a.raw("layers.2.ffn.experts.3.w2.weight").view(torch.uint8), codes)
    with pytest.raises(KeyError):
        a.raw("layers.0.attn.no_such")


@pytest.mark.parametrize("packed_only", [False, True])
def test_a_model_runs_on_them_and_keeps_codes_alone_when_asked(packed_only):
    ckpt = RandomCheckpoint(get_preset("v41-tiny"), seed=2)
    model = Model(ckpt, packed_only=packed_only)
    assert model.weights_kept == ("packed" if packed_only else "dequantised")
    logits = model.forward([StepSeq(model.new_cache(), torch.arange(3, 23))])[0]
    assert logits.shape == (ckpt.config.vocab_size,) and bool(torch.isfinite(logits).all())
    kept = Model(ckpt, packed_only=not packed_only)
    full = kept.forward([StepSeq(kept.new_cache(), torch.arange(3, 23))])[0]
    assert torch.equal(logits, full)  # codes dequantised at each use are the kept values exactly
