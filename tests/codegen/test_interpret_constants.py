"""The interpreter's constant tensors are made once per value, dtype and device; a value's sign
and NaN-ness survive the sharing (-0.0 equals 0.0 as a Python key, and the sign decides bits)."""

from __future__ import annotations

import math

import torch

from duotile.codegen.interpret.compute import constant


def test_minus_zero_and_zero_are_different_constants():
    neg, pos = constant(-0.0, torch.float32, torch.device("cpu")), constant(0.0, torch.float32, torch.device("cpu"))
    assert math.copysign(1.0, neg.item()) == -1.0 and math.copysign(1.0, pos.item()) == 1.0


def test_a_constant_is_shared_by_value_and_dtype():
    cpu = torch.device("cpu")
    assert constant(1.5, torch.float32, cpu) is constant(1.5, torch.float32, cpu)
    assert constant(1.5, torch.bfloat16, cpu).dtype == torch.bfloat16
    assert constant(3, torch.int32, cpu) is not constant(3, torch.int64, cpu)
    assert torch.isnan(constant(float("nan"), torch.float32, cpu))
