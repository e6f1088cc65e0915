"""A reduction of a register tile whose elements do not divide the block's threads (a 1 x 7 row at
256 threads) on sm90 / sm100: its source is copied to shared memory padded along the reduced axis
with the reduction's identity, so that TileLang lays it over every thread. TileLang 0.1.15 lays
the 1 x 7 tile on 252 of 256 threads and failed ("Inconsistent layouts between src and dst in
ReduceOp") where the result is broadcast back over the row: topk at K = 7 (the merge's rank sum
over the 7 picks, the output slots' max over them)."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import dsl
from duotile.codegen.compile import specialize, specialize_phases
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda.capacity import usage
from duotile.codegen.tilelang_cuda.plan import reduce_padding


@dsl.kernel
def spread(x: dsl.Tensor["B", "N", dsl.f32], y: dsl.Tensor["B", "N", dsl.f32]):
    for b in dsl.grid(x.B):
        row = dsl.load(x[b, 0], (1, x.N))
        # each reduction broadcast back over the row: every thread reads its result
        dsl.store(y[b, 0], row - row.max(axis=1)[:, None] + row.min(axis=1)[:, None] + row.sum(axis=1)[:, None])


def _tensors(n):
    return {"x": torch.empty(3, n), "y": torch.empty(3, n)}


def test_padding_spreads_the_source_over_every_thread():
    assert reduce_padding([1, 7], 1, 256) == (1, 8)
    assert reduce_padding([16, 7], 1, 256) == (16, 8)  # 112 -> 128 elements
    assert reduce_padding([7], 0, 128) == (8,)
    assert reduce_padding([3, 5], 1, 256) == (3, 256)  # 3 rows: only a whole multiple of 256 spreads
    for shape in ([1, 8], [1, 1], [4, 64], [1, 512], [2, 384]):  # divide the threads, or at least as many
        assert reduce_padding(shape, 1, 256) is None


def _tilelang(kernel, tensors, target):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return module, knobs, get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_reduces_a_padded_shared_copy(target):
    pytest.importorskip("tilelang")
    module, knobs, text = _tilelang(spread, _tensors(7), target)
    assert knobs["threads"] == 256
    assert text.count('_src_smem = T.alloc_shared((1, 8,), "float32")') == 3
    for identity in ('-T.infinity("float32")', 'T.infinity("float32")', "T.float32(0.0)"):  # max, min, sum
        assert f"_src_smem[i0, 7 + i1] = {identity}" in text
    assert text.count("T.copy(x0_frag, ") == 3 and "_src_smem[0:1, 0:7])" in text
    assert all("_src_smem, " in line for line in text.splitlines() if "T.reduce_" in line)
    arch = get_target(target).arch
    assert usage(module, arch, 256)["shared"] == 3 * 8 * 4  # counted against shared memory
    _, _, even = _tilelang(spread, _tensors(8), target)  # 8 divides 256: reduced in registers
    assert "_src_smem" not in even and "T.reduce_sum(x0_frag, " in even


def _lower(text: str, entry: str, target: str, workdir) -> tuple[str, dict]:
    """TileLang's lowering of generated source to CUDA (where the layouts are inferred), no nvcc:
    the CUDA source and the pass options the source asks for."""
    from duotile.codegen.tilelang_cuda import toolchain

    py = workdir / f"{entry}.py"
    py.write_text(text)
    prim, configs = toolchain.load_generated(str(py), entry)
    return toolchain.lower_to_cuda(prim, get_target(target).arch.sm, configs), configs


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_padded_reductions_lower(target, tmp_path):
    pytest.importorskip("tilelang")
    _, _, text = _tilelang(spread, _tensors(7), target)
    cuda, _ = _lower(text, "spread_kernel", target, tmp_path)
    assert "AllReduce" in cuda and "__syncthreads();" in cuda  # the shared copy is fenced before it is read


@pytest.mark.slow
def test_topk_at_k7_lowers_for_sm90(tmp_path):
    """The shape sweep's topk draw B = 5, L = 101, K = 7 at the config a user gets with no tuning
    entry: it lowers. (The round-by-round top-k's merge reduced K-wide lists of 7 slots, which
    TileLang spread over 252 of 256 threads; the threshold select has no such lists, and its
    slots past K, 8 here, are filled as a power-of-two tile.)"""
    pytest.importorskip("tilelang")
    from duotile.kernels_spec import load_all

    spec = load_all()["topk"]
    case = {"B": 5, "L": 101, "K": 7}
    target = get_target("sm90")
    phases, knobs = specialize_phases(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), target, {},
                                      spec.constants_of(case))
    texts = [target.generate(m, target.phase_knobs(m, knobs)).stages["tilelang"] for m in phases]
    assert len(texts) == 1 and 'T.alloc_fragment((8,), "int32")' in texts[0]
    for m, text in zip(phases, texts):
        assert "__global__" in _lower(text, f"{m.name}_kernel", "sm90", tmp_path)[0]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_padded_reduction_compiles(tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.tilelang_cuda import toolchain

    _, _, text = _tilelang(spread, _tensors(7), "sm90")
    cuda, configs = _lower(text, "spread_kernel", "sm90", tmp_path)
    cu = tmp_path / "spread.cu"
    cu.write_text(cuda)
    toolchain.nvcc(str(cu), get_target("sm90").arch.sm, str(tmp_path / "spread.cubin"), "cubin",
                   toolchain.device_flags(configs))
    assert (tmp_path / "spread.cubin").stat().st_size > 0
