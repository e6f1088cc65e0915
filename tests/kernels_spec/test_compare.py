"""The comparator every level of the ladder shares (compare.py). It once lived twice, and the GPU
copy compared exact outputs with ``torch.equal``: a NaN the reference asks for (an MXFP4 block with
an Inf) never equals itself, so a right kv_round build was reported as differing in its 80 NaN
elements."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs, mismatch

KV_ROUND = load_all()["kv_round"]
CASE = {"T": 2, "D": 4, "FORMAT": "mxfp4"}


def _out(*values):
    return {"out": torch.tensor(values, dtype=torch.float32).view(2, 2)}


def test_matching_nans_are_equal_whatever_their_payload():
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32).item()
    nan_b = torch.tensor([-0x00400001], dtype=torch.int32).view(torch.float32).item()  # another payload, sign set
    assert mismatch(KV_ROUND, CASE, _out(nan_a, 1.0, 2.0, 3.0), _out(nan_b, 1.0, 2.0, 3.0)) is None


@pytest.mark.parametrize("got,want", [((float("nan"), 1.0, 2.0, 3.0), (0.0, 1.0, 2.0, 3.0)),
                                      ((0.0, 1.0, 2.0, 3.0), (float("nan"), 1.0, 2.0, 3.0)),
                                      ((-0.0, 1.0, 2.0, 3.0), (0.0, 1.0, 2.0, 3.0)),
                                      ((0.5, 1.0, 2.0, 3.0), (0.5, 1.0, 2.0, 3.5))])
def test_an_exact_spec_sees_every_difference(got, want):
    off = mismatch(KV_ROUND, CASE, _out(*got), _out(*want))
    assert off is not None and "1/4 elements" in off
    with pytest.raises(AssertionError, match="kv_round/out differs"):
        check_outputs(KV_ROUND, CASE, _out(*got), _out(*want))


def test_a_tolerance_spec_counts_a_nan_against_a_number_as_off_and_matching_nans_as_equal():
    spec = load_all()["rmsnorm"]
    case = next(iter(spec.cases.values()))
    inputs = spec.make_inputs(case, torch.device("cpu"), seed=1)
    ref = spec.run_reference(inputs, case)
    out = spec.outputs[0]
    assert not spec.exact and mismatch(spec, case, {**inputs, out: ref[out].clone()}, ref) is None
    broken = ref[out].clone()
    broken.view(-1)[0] = float("nan")
    assert "1/" in mismatch(spec, case, {**inputs, out: broken}, ref)
    assert mismatch(spec, case, {**inputs, out: broken}, {**ref, out: broken.clone()}) is None
