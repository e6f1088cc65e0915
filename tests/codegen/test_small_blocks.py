"""The sm90 / sm100 ``threads`` knob takes one or two warps for a kernel without a gemm
(``codegen/tilelang_cuda/target.py``: ``SMALL_BLOCKS``): a chain of row reductions over one short
row (the router's six picks, three reductions each) then reduces by warp shuffles alone, where
256 threads add a shared-memory exchange and two barriers to each. A gemm keeps whole warp
groups and is refused at its line (``capacity.check_warp_groups``)."""

from __future__ import annotations

import re

import pytest

from duotile import codegen
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import UnsupportedError
from duotile.dsl.tunables import ConfigValueError
from duotile.kernels_spec.registry import load_all

SPECS = load_all()


def _router_source(threads: int) -> str:
    spec = SPECS["router"]
    case = spec.model_shapes["v41/e384_top6/decode1"]
    k = codegen.compile(spec.kernel, "sm90", config={"threads": threads}, constants=spec.constants_of(case))
    return k.artifacts(**spec.meta_inputs(case))[0].stages["tilelang"]


@pytest.mark.parametrize("threads", [32, 64])
def test_a_gemm_free_kernel_builds_on_one_or_two_warps(threads):
    source = _router_source(threads)
    assert re.search(rf"T\.Kernel\(n_T, threads={threads}\)", source)


def test_the_searched_space_of_a_gemm_free_kernel_has_small_blocks_and_a_gemms_does_not():
    t = get_target("sm90")
    for name, small in (("router", True), ("gemm", False)):
        spec = SPECS[name]
        case = next(iter(spec.model_shapes.values()))
        sig = spec.kernel.bind(spec.meta_inputs(case))
        module = specialize(spec.kernel, sig, "sm90", {}, spec.constants_of(case))[0]
        values = t.knobs_for(module)["threads"].values()
        assert (32 in values and 64 in values) == small, name
        assert t.knobs_for(module)["threads"].default == 256


def test_a_gemm_on_two_warps_is_refused_at_its_line():
    spec = SPECS["gemm"]
    case = spec.model_shapes["v41/shared_w2/decode64"]
    k = codegen.compile(spec.kernel, "sm90", config={"threads": 64})
    with pytest.raises(UnsupportedError, match=r"gemm\.py:\d+.*whole warp groups of 128 threads; threads=64"):
        k.artifacts(**spec.meta_inputs(case))


def test_other_block_sizes_are_still_refused_by_name():
    spec = SPECS["router"]
    with pytest.raises(ConfigValueError, match="threads=96 is not allowed.*32 or 64 for a kernel without a gemm"):
        codegen.compile(spec.kernel, "sm90", config={"threads": 96})


def test_a_reduced_axis_not_a_power_of_two_is_padded_on_one_warp(tmp_path):
    """Regression: hc_pre's 4 x 24 mix at 32 threads failed in TileLang's lowering ("XOR-butterfly
    AllReduce requires logical_width ... a positive power of two, got 24"); its reduced axis is now
    padded to 32 (plan.reduce_padding), and the kernel lowers to CUDA. Lowered, not compiled: the
    failure lived in TileLang's lowering, and nvcc took 36 of this kernel's 46 s to build on two
    cores (its full sm90 build is the representative build's, test_model_shape_builds.py)."""
    from duotile.codegen.tilelang_cuda import toolchain
    from duotile.codegen.tilelang_cuda.plan import reduce_padding

    assert reduce_padding([4, 24], 1, 32) == (4, 32)
    assert reduce_padding([4, 24], 1, 256) == (4, 32)  # fewer elements than threads: the older rule
    assert reduce_padding([64, 448], 1, 256) is None  # a warp group or more: laid out as measured
    assert reduce_padding([1, 512], 1, 32) is None
    spec = SPECS["hc_pre"]
    case = spec.model_shapes["v4/site_d4096/decode1"]
    target = get_target("sm90")
    module, knobs = specialize(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90", {"threads": 32},
                               spec.constants_of(case))
    art = target.generate(module, knobs)
    (tmp_path / "hc_pre.py").write_text(art.stages["tilelang"])
    prim, configs = toolchain.load_generated(str(tmp_path / "hc_pre.py"), art.meta["entry"])
    cuda = toolchain.lower_to_cuda(prim, target.arch.sm, configs)
    assert "AllReduce<tl::SumOp, 32" in cuda and "threads=32" in art.stages["tilelang"]
