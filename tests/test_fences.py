"""The GPU sweep's fenced inputs (tests/gpu/fences.py), on the CPU: the values are the inputs',
the memory around them reads as NaN / -1, and a write past a tensor is named."""

from __future__ import annotations

import torch

from tests.gpu.fences import FENCE, Fenced


def test_fenced_inputs_hold_the_same_values_with_nan_around_them():
    x, i = torch.randn(3, 5), torch.arange(7, dtype=torch.int32)
    f = Fenced({"x": x, "i": i, "t": torch.randn(4, 4).t(), "n": 3})
    assert torch.equal(f.inputs["x"], x) and torch.equal(f.inputs["i"], i) and f.inputs["n"] == 3
    assert not f.inputs["t"].is_contiguous()  # a strided view is left where it is
    past = f.inputs["x"].view(-1).untyped_storage()
    floats = torch.empty(0).set_(past, FENCE // 4, (15 + 8,))  # the tensor and 8 floats after it
    assert torch.equal(floats[:15], x.view(-1)) and floats[15:].isnan().all()
    ints = torch.empty(0, dtype=torch.int32).set_(f.inputs["i"].untyped_storage(), FENCE // 4 - 2, (11,))
    assert ints[:2].tolist() == [-1, -1] and ints[9:].tolist() == [-1, -1]
    assert f.breaches() == []


def test_a_write_past_a_tensor_is_named():
    f = Fenced({"c": torch.zeros(2, 8), "d": torch.zeros(4, dtype=torch.bfloat16)})
    wide = torch.empty(0).set_(f.inputs["c"].untyped_storage(), FENCE // 4, (16 + 3,))
    wide[16:] = 0.0  # three floats past the end
    early = torch.empty(0, dtype=torch.bfloat16).set_(f.inputs["d"].untyped_storage(), FENCE // 2 - 1, (1,))
    early[0] = 1.0
    assert f.breaches() == ["c: 12 bytes after changed", "d: 2 bytes before changed"]
