"""The scaled-value ops' device helpers (codegen/tilelang_cuda/device_helpers.py) on the GPU: the
sm90 builds of the fragment kernels of tests/dsl over every byte at every scale give the
interpreter's values bit for bit (NaN where it has NaN). The host tests run the helpers' source
with their PTX emulated; these run the PTX itself (cvt.rn.f16x2.e4m3x2's byte order, the bf16
multiplies' subnormals)."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from tests.dsl import test_mxfp4_values, test_mxfp8_values, test_nvfp4_values

pytestmark = pytest.mark.gpu


def _every_byte_at_every_scale(scale_dtype: torch.dtype, groups: int, values_dtype=torch.uint8) -> tuple:
    """256 rows of all 256 bytes, row r with every scale byte r."""
    values = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(values_dtype)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, groups).view(scale_dtype)
    return values, scales


def _same(kernel, inputs: dict, out: str) -> None:
    cpu = {k: v.clone() for k, v in inputs.items()}
    codegen.compile(kernel, "interpret")(**cpu)
    gpu = {k: v.cuda() for k, v in inputs.items()}
    codegen.compile(kernel, "sm90")(**gpu)
    got, want = gpu[out].cpu(), cpu[out]
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_mxfp4_every_byte_at_every_code():
    w, s = _every_byte_at_every_scale(torch.uint8, 16)
    _same(test_mxfp4_values.unpack, {"w": w, "s": s, "out": torch.zeros(256, 512, dtype=torch.bfloat16)}, "out")


def test_nvfp4_every_byte_at_every_e4m3_scale():
    w, s = _every_byte_at_every_scale(torch.float8_e4m3fn, 32)
    _same(test_nvfp4_values.unpack, {"w": w, "s": s, "out": torch.zeros(256, 512, dtype=torch.bfloat16)}, "out")


def test_mxfp8_every_e4m3_byte_at_every_code():
    x, s = _every_byte_at_every_scale(torch.uint8, 8, torch.float8_e4m3fn)
    _same(test_mxfp8_values.scale, {"x": x, "s": s, "out": torch.zeros(256, 256, dtype=torch.bfloat16)}, "out")
