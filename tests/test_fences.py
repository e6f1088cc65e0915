"""The GPU sweep's fenced inputs (tests/gpu/fences.py), on the CPU: the values are the inputs',
views of one storage stay views of one another, the memory around them reads as NaN / -1, and
a write past a tensor is named."""

from __future__ import annotations

import torch

from tests.gpu.fences import Fenced


def _around(t: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``t``'s storage from ``before`` elements ahead of it to ``after`` past its end, flat."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset() - before,
                                              (before + t.numel() + after,))


def test_fenced_inputs_hold_the_same_values_with_nan_around_them():
    x, i = torch.randn(3, 5), torch.arange(7, dtype=torch.int32)
    f = Fenced({"x": x, "i": i, "n": 3, "e": torch.empty(0)})
    assert torch.equal(f.inputs["x"], x) and torch.equal(f.inputs["i"], i) and f.inputs["n"] == 3
    assert f.inputs["x"].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    floats = _around(f.inputs["x"], 0, 8)
    assert floats[15:].isnan().all()
    ints = _around(f.inputs["i"], 2, 2)
    assert ints[:2].tolist() == [-1, -1] and ints[9:].tolist() == [-1, -1]
    assert f.breaches() == []


def test_views_of_one_storage_stay_views_of_one_another():
    kv = torch.randn(4, 6)
    f = Fenced({"kv": kv, "rows": kv[1:3], "t": kv.t(), "codes": kv.view(torch.uint8)})
    got = f.inputs
    assert torch.equal(got["rows"], kv[1:3]) and torch.equal(got["t"], kv.t()) and got["t"].stride() == (1, 6)
    got["kv"][1, 0] = 42.0  # a write through one is seen through the others
    assert got["rows"][0, 0] == 42.0 and got["t"][0, 1] == 42.0
    assert torch.equal(got["codes"], got["kv"].view(torch.uint8))
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1


def test_a_write_past_a_tensor_is_named():
    f = Fenced({"c": torch.zeros(2, 8), "d": torch.zeros(4, dtype=torch.bfloat16)})
    _around(f.inputs["c"], 0, 3)[16:] = 0.0  # three floats past the end
    _around(f.inputs["d"], 1, 0)[0] = 1.0  # one element before the start
    assert f.breaches() == ["c: 12 bytes after changed", "d: 2 bytes before changed"]
