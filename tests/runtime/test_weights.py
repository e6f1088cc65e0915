"""Checkpoint writer and validating lazy reader: formats, sharding, and clear errors on corruption."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from duotile.runtime import quant
from duotile.runtime.inventory import tensor_specs
from duotile.runtime.presets import get_preset
from duotile.runtime.weights import INDEX_NAME, Checkpoint, CheckpointError, write_random_checkpoint


@pytest.fixture(scope="module")
def small_v4(tmp_path_factory):
    """A V4 tiny checkpoint cut into many small shards."""
    return write_random_checkpoint(get_preset("v4-tiny"), tmp_path_factory.mktemp("v4s"), seed=7,
                                   max_shard_bytes=2 << 20)


def test_writer_produces_sharded_checkpoint_with_index(small_v4):
    index = json.loads((small_v4 / INDEX_NAME).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((small_v4 / f).is_file() for f in files)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for f in files for t in load_file(str(small_v4 / f)).values())


@pytest.mark.parametrize(("name", "block"), [("v4-tiny", 128), ("v41-tiny", 32)])
def test_stored_formats_follow_the_release(ckpt_dir, name, block):
    ckpt = Checkpoint.open(ckpt_dir(name))
    cfg = ckpt.config
    w, s = ckpt.raw("layers.0.attn.wq_b.weight"), ckpt.raw("layers.0.attn.wq_b.scale")
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (-(-w.shape[0] // block), -(-w.shape[1] // block))
    e = ckpt.raw("layers.2.ffn.experts.3.w2.weight")
    assert e.dtype == torch.int8 and e.shape == (cfg.hidden_size, cfg.moe_intermediate_size // 2)
    assert ckpt.raw("layers.2.ffn.experts.3.w2.scale").shape == (cfg.hidden_size, cfg.moe_intermediate_size // 32)
    assert ckpt.raw("layers.0.hc_attn_fn").dtype == torch.float32
    assert ckpt.raw("embed.weight").dtype == torch.bfloat16
    # dequantised values re-encode to the stored bytes exactly (dequantisation is lossless)
    wq, ws = quant.quantize_fp8_blocks(ckpt.get("layers.0.attn.wq_b"), block)
    assert torch.equal(wq.view(torch.uint8), w.view(torch.uint8)) and torch.equal(ws.float(), s.float())
    deq = ckpt.get("layers.2.ffn.experts.3.w2")
    assert torch.equal(quant.dequantize_fp4_rows(*quant.quantize_fp4_rows(deq)), deq)
    for spec in tensor_specs(cfg):
        assert tuple(ckpt.get(spec.name).shape) == spec.shape


def test_v4_and_v41_inventories_hold_the_model_specific_tensors(ckpt_dir):
    v4, v41 = Checkpoint.open(ckpt_dir("v4-tiny")), Checkpoint.open(ckpt_dir("v41-tiny"))
    assert "layers.0.ffn.gate.tid2eid" in v4.specs and "layers.2.ffn.gate.bias" in v4.specs
    assert "layers.2.attn.indexer.compressor.ape" in v4.specs and "hc_head_fn" in v4.specs
    assert "mtp.0.e_proj" in v4.specs and "mtp.0.hc_head_fn" in v4.specs
    assert "layers.1.engram.embed" in v41.specs and "layers.5.attn.indexer.wk.weight" in v41.specs
    assert "layers.5.attn.compressor.wgate.weight" not in v41.specs  # ratio 1: no gate
    assert "layers.3.attn.indexer.wq_b" not in v41.specs  # Reuse layer
    assert "layers.7.attn.indexer.wq_b" in v41.specs and "mtp.0.ffn.experts.3.w1" in v41.specs
    tid = v4.get("layers.0.ffn.gate.tid2eid")
    assert tid.shape == (1024, 6) and int(tid.max()) < 16
    assert all(len(set(row)) == 6 for row in tid.tolist())


def test_reader_is_lazy(ckpt_dir):
    ckpt = Checkpoint.open(ckpt_dir("v4-tiny"))
    assert ckpt._handles == {}
    ckpt.get("norm.weight")
    assert len(ckpt._handles) == 1


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _shard_of(path, tensor):
    return path / json.loads((path / INDEX_NAME).read_text())["weight_map"][tensor]


def _rewrite(path, tensor, fn):
    shard = _shard_of(path, tensor)
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard))
    return shard


def test_truncated_shard_names_tensor_and_file(small_v4, tmp_path):
    path = _copy(small_v4, tmp_path / "c")
    shard = _shard_of(path, "head.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert "truncated" in str(err.value) and shard.name in str(err.value) and "tensor " in str(err.value)


def test_wrong_dtype_names_tensor_and_file(small_v4, tmp_path):
    path = _copy(small_v4, tmp_path / "c")
    name = "layers.1.attn.wkv.weight"
    shard = _rewrite(path, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=f"tensor {name} in .*{shard.name}: dtype torch.bfloat16"):
        Checkpoint.open(path)


def test_wrong_shape_names_tensor_and_file(small_v4, tmp_path):
    path = _copy(small_v4, tmp_path / "c")
    name = "layers.2.attn.compressor.ape"
    shard = _rewrite(path, name, lambda t: t.__setitem__(name, t[name][:2].clone()))
    with pytest.raises(CheckpointError, match=f"tensor {name} in .*{shard.name}: shape \\[2, 256\\]"):
        Checkpoint.open(path)


def test_missing_tensor_and_missing_shard(small_v4, tmp_path):
    path = _copy(small_v4, tmp_path / "c")
    name = "layers.3.ffn.experts.5.w3.scale"
    _rewrite(path, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"tensor {name}: missing"):
        Checkpoint.open(path)
    path2 = _copy(small_v4, tmp_path / "d")
    _shard_of(path2, "embed.weight").unlink()
    with pytest.raises(CheckpointError, match="tensor .*: its shard .* is missing"):
        Checkpoint.open(path2)


def test_unexpected_tensor_and_bad_directory(small_v4, tmp_path):
    path = _copy(small_v4, tmp_path / "c")
    shard = _rewrite(path, "norm.weight", lambda t: t.__setitem__("layers.0.attn.bogus", torch.zeros(3)))
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"]["layers.0.attn.bogus"] = shard.name
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor layers.0.attn.bogus in .*not part of"):
        Checkpoint.open(path)
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize(("name", "experts"), [("v4-tiny", 16), ("v41-tiny", 4)])
def test_mtp_and_dspark_weights_load(build, name, experts):
    model = build(name)
    nextn = model.nextn_weights()
    cfg = model.config
    assert nextn["mtp.0.attn.wq_a"].shape == (cfg.q_lora_rank, cfg.hidden_size)
    assert sum(1 for k in nextn if k.startswith("mtp.0.ffn.experts.") and k.endswith(".w1")) == experts
    assert all(torch.isfinite(t.float()).all() for t in nextn.values())
    assert ("mtp.0.e_proj" in nextn) == (name == "v4-tiny")


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_writer_drawing_a_tensor_in_row_chunks_writes_the_same_bytes(tmp_path, name):
    """The writer draws and encodes a large tensor a few rows at a time (a real-dimension layer's FP8
    and FP4 codes never exist as FP32 at once); with 4,096-value chunks, which split hundreds of the tiny
    presets' FP8 / FP4 / FP8-row / BF16 tensors, every file is byte-identical to one draw per tensor."""
    from duotile.runtime.weights import chunk_rows

    cfg = get_preset(name)
    chunked = [s for s in tensor_specs(cfg) if chunk_rows(cfg, s, 4096) < s.shape[0]]
    assert {"fp8", "fp4", "bf16"} <= {s.kind for s in chunked}
    whole = write_random_checkpoint(cfg, tmp_path / "whole", seed=3, chunk_elements=1 << 40)
    parts = write_random_checkpoint(cfg, tmp_path / "parts", seed=3, chunk_elements=4096)
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in parts.iterdir())
    assert all((whole / f).read_bytes() == (parts / f).read_bytes() for f in files)


def test_writer_lets_each_shard_go_before_drawing_past_it(tmp_path, monkeypatch):
    """Streaming: each shard is written once its last tensor is drawn, never after a later shard's
    tensors have been drawn, so memory holds one shard and one logical tensor at a time."""
    from duotile.runtime import weights

    cfg = get_preset("v4-tiny")
    plan = weights.shard_plan(cfg, 1 << 20)
    events = []
    draw, save = weights._stored_value, weights.save_file
    monkeypatch.setattr(weights, "_stored_value", lambda *a: events.append(("draw", a[1].name)) or draw(*a))
    monkeypatch.setattr(weights, "save_file", lambda shard, f, **kw: events.append(("save", set(shard))) or
                        save(shard, f, **kw))
    weights.write_random_checkpoint(cfg, tmp_path, seed=1, max_shard_bytes=1 << 20)
    logical_of = {n: s.name for s in tensor_specs(cfg) for n in s.stored(cfg.weight_block_size[0])}
    saves = [names for kind, names in events if kind == "save"]
    assert [set(s) for s in plan] == saves and len(saves) > 3
    drawn = []
    for kind, what in events:
        if kind == "draw":
            drawn.append(what)
        else:  # the tensors drawn so far, one logical tensor past this shard's last at most
            last = max((logical_of[n] for n in what), key=drawn.index)
            assert drawn.index(last) == len(drawn) - 1


def test_shard_plan_of_the_real_dimensions_needs_no_values():
    """The plan of a released configuration comes from sizes alone (no 100 GB drawn to plan it)."""
    from duotile.runtime.weights import shard_plan

    cfg = get_preset("v41-flash")
    plan = shard_plan(cfg, 4 << 30)
    stored = {n: v for s in tensor_specs(cfg) for n, v in s.stored(cfg.weight_block_size[0]).items()}
    assert sorted(n for shard in plan for n in shard) == sorted(stored)
    big = [n for n, (shape, dtype) in stored.items() if torch.Size(shape).numel() * dtype.itemsize > 4 << 30]
    assert big and all([n] in plan for n in big)  # a tensor over the limit: a shard of its own
