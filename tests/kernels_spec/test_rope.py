"""rope on the interpreter against the runtime's Rotary (plain and YaRN tables, forward and
inverse, query heads and single rows): bit for bit, as the spec's f32 operations are its."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec import get
from duotile.runtime.generated import GeneratedOps
from duotile.runtime.layers.common import Ctx, Rotary
from duotile.runtime.ops import FastOps
from duotile.runtime.presets import get_preset

SPEC = get("rope")


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "yarn"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(5, 4, 128), (6, 128)], ids=["heads", "rows"])
def test_the_kernel_is_the_runtimes_rotary_bit_for_bit(compressed, inverse, shape):
    cfg = get_preset("v41-tiny")
    rotary = Rotary(cfg, compressed)
    g = torch.Generator().manual_seed(len(shape) + 2 * compressed + inverse)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16).float()
    positions = torch.tensor([0, 63, 64, 200, 7, 131][: shape[0]])  # across 64-position table blocks
    want = rotary.apply(x, positions, inverse)
    got = GeneratedOps(FastOps())._rope(Ctx(FastOps()), rotary, x, positions, inverse)
    assert torch.equal(got, want)


def test_a_swapped_sin_sign_or_pair_order_is_caught():
    case = SPEC.cases["q_t3_h8_d128"]
    x = SPEC.make_inputs(case, torch.device("cpu"), 2)
    want = SPEC.run_reference(x, case)["out"]
    inverse = SPEC.reference(x["x"], x["positions"], x["cos"], x["sin"], ROPE=64, INVERSE=True)["out"]
    swapped = x["x"].float().clone()
    swapped[..., -64:] = swapped[..., -64:].view(*swapped.shape[:-1], 32, 2).flip(-1).flatten(-2)
    paired = SPEC.reference(swapped, x["positions"], x["cos"], x["sin"])["out"]
    for wrong in (inverse, paired):
        assert not torch.allclose(wrong, want, atol=1e-3)
    assert torch.equal(want[..., :64], x["x"].float()[..., :64])  # the nope channels are copied
