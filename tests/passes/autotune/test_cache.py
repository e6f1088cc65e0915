import json

import pytest

from duotile import dsl
from duotile.passes.autotune import cache as tc
from duotile.passes.autotune.cache import TuningCache, best_config, make_key


@dsl.kernel
def k1(x: dsl.Tensor["N", "D", dsl.f32], *, BN: dsl.Tunable = dsl.choice(2, 4)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(x[i * BN, 0], dsl.load(x[i * BN, 0], (BN, x.D)) * 2.0)


@dsl.kernel
def k1_edited(x: dsl.Tensor["N", "D", dsl.f32], *, BN: dsl.Tunable = dsl.choice(2, 4)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(x[i * BN, 0], dsl.load(x[i * BN, 0], (BN, x.D)) * 3.0)


@dsl.kernel(batch_dim="N")
def k1_batched(x: dsl.Tensor["N", "D", dsl.f32], *, BN: dsl.Tunable = dsl.choice(2, 4)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(x[i * BN, 0], dsl.load(x[i * BN, 0], (BN, x.D)) * 2.0)


k1_edited.name = "k1"  # same name, different body
TC = {"tilelang": "0.1.15", "nvcc": "13.0"}


def put(tmp_path, kernel=k1, target="sm90", shapes=None, toolchain=TC, config=None):
    shapes = shapes or {"N": 100, "D": 64}
    cache = TuningCache(tmp_path / "tuning.json")
    cache.put(make_key(kernel, target, shapes, "H200", toolchain), config or {"BN": 4}, time_ms=1.0)


def lookup(tmp_path, kernel=k1, target="sm90", shapes=None, toolchain=TC, device="H200"):
    return best_config(kernel, target, shapes or {"N": 100, "D": 64}, device, cache_dir=tmp_path, toolchain=toolchain)


def test_hit_within_a_shape_bucket(tmp_path):
    put(tmp_path)
    assert lookup(tmp_path) == {"BN": 4}
    assert lookup(tmp_path, shapes={"N": 128, "D": 64}) == {"BN": 4}  # same bucket (128)
    assert lookup(tmp_path, shapes={"N": 129, "D": 64}) is None  # next bucket


def test_invalidated_by_kernel_target_toolchain_or_device(tmp_path):
    put(tmp_path)
    assert k1.name == k1_edited.name
    assert lookup(tmp_path, kernel=k1_edited) is None
    assert lookup(tmp_path, target="sm100") is None
    assert lookup(tmp_path, toolchain={**TC, "tilelang": "0.1.16"}) is None
    assert lookup(tmp_path, device="H100") is None
    assert lookup(tmp_path) == {"BN": 4}


def test_batch_invariant_kernels_ignore_the_batch_size(tmp_path):
    put(tmp_path, kernel=k1_batched, shapes={"N": 3, "D": 64})
    assert lookup(tmp_path, kernel=k1_batched, shapes={"N": 4096, "D": 64}) == {"BN": 4}
    assert lookup(tmp_path, kernel=k1_batched, shapes={"N": 4096, "D": 128}) is None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "edit", "schema"])
def test_corrupt_or_stale_file_is_reported_and_rebuilt(tmp_path, damage):
    put(tmp_path)
    path = tmp_path / "tuning.json"
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    else:
        data = json.loads(text)
        if damage == "edit":  # a hand edit without updating the checksum
            next(iter(data["entries"].values()))["config"]["BN"] = 2
        else:
            data["schema"] = tc.SCHEMA + 1
        path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="not trusted"):
        cache = TuningCache(path)
    assert cache.entries == {} and cache.problems
    assert list(tmp_path.glob("tuning.json.corrupt-*"))
    assert lookup(tmp_path) is None  # the bad file was moved aside: nothing is trusted
    put(tmp_path, config={"BN": 2})  # rebuilt: usable again
    assert lookup(tmp_path) == {"BN": 2}


def test_shipped_table_answers_after_the_user_cache(tmp_path):
    shipped_dir = tmp_path / "shipped"
    put(shipped_dir, config={"BN": 2})
    user = tmp_path / "user"
    shipped = shipped_dir / "tuning.json"
    find = lambda: best_config(k1, "sm90", {"N": 100, "D": 64}, "H200", cache_dir=user, toolchain=TC,
                               shipped=shipped)
    assert find() == {"BN": 2}  # nothing of the user's: the shipped table answers
    put(user, config={"BN": 4})
    assert find() == {"BN": 4}  # the user's own sweep wins
    assert best_config(k1_edited, "sm90", {"N": 100, "D": 64}, "H200", cache_dir=tmp_path / "none",
                       toolchain=TC, shipped=shipped) is None  # an edited kernel is not served stale


def test_damaged_shipped_table_is_ignored_and_left_in_place(tmp_path):
    put(tmp_path / "shipped")
    shipped = tmp_path / "shipped" / "tuning.json"
    shipped.write_text(shipped.read_text()[:40])
    with pytest.warns(UserWarning, match="ignoring it"):
        got = best_config(k1, "sm90", {"N": 100, "D": 64}, "H200", cache_dir=tmp_path / "user", toolchain=TC,
                          shipped=shipped)
    assert got is None and shipped.exists() and not list(shipped.parent.glob("*.corrupt-*"))
    with pytest.warns(UserWarning, match="ignoring it"), pytest.raises(PermissionError):
        TuningCache(shipped, read_only=True).save()


def test_a_modelled_target_is_never_keyed_by_the_local_gpu(monkeypatch):
    """Regression: on a CUDA machine, sm100 rankings (a cost model) were keyed by the local GPU's name."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert tc.device_name("sm90") == "NVIDIA H200"
    assert tc.device_name("sm100") == "model:sm100"
    assert tc.device_name("ascend950") == "model:ascend950"


def test_two_shapes_of_one_bucket_keep_entries_of_their_own(tmp_path):
    """V4.1's router (N 384) and a compressor projection (N 512) share a bucket and want different
    tiles: each tuned shape keeps its entry, each call takes the one tuned at its exact shape, and a
    third shape of the bucket takes the nearest of them."""
    put(tmp_path, shapes={"N": 100, "D": 384}, config={"BN": 2})
    put(tmp_path, shapes={"N": 100, "D": 512}, config={"BN": 4})
    assert len(TuningCache(tmp_path / "tuning.json").entries) == 2
    assert lookup(tmp_path, shapes={"N": 100, "D": 384}) == {"BN": 2}
    assert lookup(tmp_path, shapes={"N": 100, "D": 512}) == {"BN": 4}
    # another N of the bucket: 0.26 octaves from one entry's shape, 0.68 from the other's
    assert lookup(tmp_path, shapes={"N": 120, "D": 384}) == {"BN": 2}
    assert lookup(tmp_path, shapes={"N": 120, "D": 512}) == {"BN": 4}


def test_an_entry_keyed_before_shapes_were_is_found_by_its_bucket(tmp_path):
    """A table written before keys held the exact shape still answers every shape of its bucket."""
    put(tmp_path, shapes={"N": 100, "D": 64})
    path = tmp_path / "tuning.json"
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    del entry["key"]["shape"]
    data["entries"] = {tc.key_hash(entry["key"]): entry}
    data["checksum"] = tc._checksum(data["entries"])
    path.write_text(json.dumps(data))
    assert lookup(tmp_path, shapes={"N": 100, "D": 64}) == {"BN": 4}
    assert lookup(tmp_path, shapes={"N": 100, "D": 40}) == {"BN": 4}  # same bucket (64)
    assert lookup(tmp_path, shapes={"N": 100, "D": 65}) is None  # the next bucket
