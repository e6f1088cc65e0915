"""Odd safetensors headers and indexes are refused before any tensor is read, naming file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from duotile.runtime import weights
from duotile.runtime.headers import INDEX_NAME, read_all_headers, read_header
from duotile.runtime.weights import Checkpoint, CheckpointError

from .runtime_support import copy_of, read_raw, shard_of, write_raw


@pytest.fixture
def shard(tmp_path):
    """A three-tensor shard: a [4] F32 (16 bytes), b [2, 2] BF16 (8 bytes), c [8] I8 (8 bytes)."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(2, 2, dtype=torch.bfloat16), "c": torch.ones(8, dtype=torch.int8)},
              str(path))
    return path


def _edit(path, fn):
    header, body = read_raw(path)
    out = fn(header, body)
    body = out if isinstance(out, bytes) else body
    write_raw(path, header, body)


def _offsets(header, name, begin, end):
    header[name]["data_offsets"] = [begin, end]


def test_the_fixture_reads(shard):
    assert set(read_header(shard)) == {"a", "b", "c"}


@pytest.mark.parametrize(("edit", "tensor", "words"), [
    (lambda h, b: _offsets(h, "c", *h["b"]["data_offsets"]), "c", "overlap"),  # aliased: same range as b
    (lambda h, b: _offsets(h, "b", -8, 0), "b", "0 <= begin <= end"),
    (lambda h, b: _offsets(h, "b", 12, 20), "b", "overlap"),  # overlaps a's [0, 16)
    (lambda h, b: h["a"].pop("dtype"), "a", "has no dtype"),
    (lambda h, b: h["a"].__setitem__("dtype", "F128"), "a", "unsupported dtype"),
    (lambda h, b: h["b"].__setitem__("shape", [2, -2]), "b", "non-negative integers"),
    (lambda h, b: h["b"].__setitem__("data_offsets", "16-24"), "b", "0 <= begin <= end"),
    (lambda h, b: h.__setitem__("d", 7), "d", "not an object"),
])
def test_bad_entry_names_tensor_and_file(shard, edit, tensor, words):
    _edit(shard, edit)
    with pytest.raises(CheckpointError) as err:
        read_header(shard)
    msg = str(err.value)
    assert msg.startswith(f"tensor {tensor} in {shard}") and words in msg


def test_bytes_appended_to_a_shard(shard):
    _edit(shard, lambda h, b: b + b"\0" * 24)
    with pytest.raises(CheckpointError, match=r"24 bytes after tensor c belong to no tensor.*appended"):
        read_header(shard)


def test_a_gap_between_tensors(shard):
    def gap(h, b):
        h["c"]["data_offsets"] = [32, 40]  # 8 unclaimed bytes at 24..32
        return b + b"\0" * 8

    _edit(shard, gap)
    with pytest.raises(CheckpointError, match=r"tensor c in .*: bytes 24\.\.32 before it belong to no tensor"):
        read_header(shard)


def test_duplicate_keys_in_a_header(shard):
    header, body = read_raw(shard)
    text = json.dumps(header)
    dup = text[:-1] + ', "a": ' + json.dumps(header["a"]) + "}"
    write_raw(shard, dup, body)
    with pytest.raises(CheckpointError, match=r"safetensors header: duplicate entry 'a'"):
        read_header(shard)


def _two_shards(tmp_path, weight_map=None, same_name=False):
    save_file({"x": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"x" if same_name else "y": torch.ones(2)}, str(tmp_path / "s2.safetensors"))
    wm = weight_map if weight_map is not None else {"x": "s1.safetensors", "y": "s2.safetensors"}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tmp_path


def test_the_two_shard_fixture_reads(tmp_path):
    assert set(read_all_headers(_two_shards(tmp_path))) == {"x", "y"}


def test_one_tensor_in_two_shards(tmp_path):
    path = _two_shards(tmp_path, {"x": "s1.safetensors", "z": "s2.safetensors"}, same_name=True)
    with pytest.raises(CheckpointError, match=r"tensor x: in two shards, .*s1.safetensors and .*s2.safetensors"):
        read_all_headers(path)


def test_tensor_in_a_shard_the_index_does_not_name(tmp_path):
    path = _two_shards(tmp_path, {"x": "s2.safetensors", "y": "s2.safetensors"})
    path.joinpath("s1.safetensors").unlink()
    save_file({"y": torch.ones(2), "x": torch.ones(2)}, str(path / "s2.safetensors"))
    (path / INDEX_NAME).write_text(json.dumps({"weight_map": {"y": "s2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"tensor x in .*s2.safetensors: the index does not list it"):
        read_all_headers(path)


@pytest.mark.parametrize(("index", "words"), [
    ({"weight_map": [["x", "s1.safetensors"]]}, "weight_map is a list, expected an object"),
    ({"weight_map": {"x": "../s1.safetensors"}}, "not a shard file name"),
    ({"weight_map": {"x": 3}}, "not a shard file name"),
    ([], "no weight_map object"),
])
def test_malformed_index(tmp_path, index, words):
    path = _two_shards(tmp_path)
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=words):
        read_all_headers(path)


def test_duplicate_keys_in_the_index(tmp_path):
    path = _two_shards(tmp_path)
    (path / INDEX_NAME).write_text('{"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors", '
                                   '"x": "s2.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"index.json: duplicate entry 'x'"):
        read_all_headers(path)


def test_a_real_checkpoint_with_an_appended_shard_is_refused_before_reading_tensors(tmp_path, monkeypatch):
    path = copy_of("v4-tiny", tmp_path / "c")
    target = shard_of(path, "norm.weight")
    with target.open("ab") as fh:
        fh.write(b"\x00" * 100)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the headers were checked")

    monkeypatch.setattr(weights, "safe_open", no_reads)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert str(err.value).startswith(str(target)) and "100 bytes after tensor" in str(err.value)
