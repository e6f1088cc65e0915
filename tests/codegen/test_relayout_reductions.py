"""Reductions of tiles of different shapes whose results meet in elementwise work, on sm90 / sm100:
each is reduced into a fragment of its own and read back through shared memory, so that TileLang
chooses the layout of the fragment the kernel reads. TileLang 0.1.15 gives a reduction's result the
layout its source implies and failed ("no available layout found") where two such layouts meet:
the row sums of a 64 x 1 and a 64 x 64 tile added at 256 threads, and moe_permute's positions at
K = 1 (each slot's match, a 64 x 1 sum, plus the earlier tokens' matches, a 64 x 64 sum)."""

from __future__ import annotations

import pytest
import torch

from duotile import dsl
from duotile.codegen.compile import specialize, specialize_phases
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda.capacity import usage
from duotile.codegen.tilelang_cuda.plan import make_plan


@dsl.kernel
def two_sums(a: dsl.Tensor["R", "W", dsl.i32], b: dsl.Tensor["R", "U", dsl.i32], y: dsl.Tensor["R", dsl.i32]):
    for i in dsl.grid(dsl.cdiv(a.R, 64)):
        narrow = dsl.load(a[i * 64, 0], (64, a.W)).sum(axis=1)
        wide = dsl.load(b[i * 64, 0], (64, b.U)).sum(axis=1)
        dsl.store(y[i * 64], narrow + wide)


@dsl.kernel
def max_and_sum(a: dsl.Tensor["R", "W", dsl.f32], y: dsl.Tensor["R", dsl.f32]):
    for i in dsl.grid(dsl.cdiv(a.R, 64)):
        row = dsl.load(a[i * 64, 0], (64, a.W))
        dsl.store(y[i * 64], row.max(axis=1) + row.sum(axis=1))  # one source: one layout


def _ints(w, u):
    return {"a": torch.zeros(64, w, dtype=torch.int32), "b": torch.zeros(64, u, dtype=torch.int32),
            "y": torch.zeros(64, dtype=torch.int32)}


def _tilelang(kernel, tensors, target):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return module, knobs, get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_reductions_of_different_shapes_are_laid_out_anew(target):
    module, knobs, text = _tilelang(two_sums, _ints(1, 64), target)
    arch = get_target(target).arch
    reduces = [op for op in module.walk() if op.name == "reduce"]
    assert knobs["threads"] == 256 and {id(op) for op in reduces} == make_plan(module, arch, 256).relayout
    for shape in ("64, 1,", "64, 64,"):  # each reduced into a fragment of its own, read back through shared
        assert f"T.alloc_fragment(({shape})" in text
    assert text.count('_red = T.alloc_fragment((64,), "int32")') == 2
    assert text.count('_smem = T.alloc_shared((64,), "int32")') == 2
    for line in (ln.strip() for ln in text.splitlines() if "T.reduce_sum(" in ln):
        red = line.split(", ")[1]
        frag = red.removesuffix("_red")
        assert red.endswith("_red") and f"T.copy({red}, {frag}_smem)" in text and f"T.copy({frag}_smem, {frag})" in text
    assert usage(module, arch, 256)["shared"] == 2 * 64 * 4  # counted against shared memory


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_reductions_of_one_shape_keep_their_layout(target):
    arch = get_target(target).arch
    for kernel, tensors in ((two_sums, _ints(64, 64)),
                            (max_and_sum, {"a": torch.zeros(64, 64), "y": torch.zeros(64)})):
        module, _, text = _tilelang(kernel, tensors, target)
        assert not make_plan(module, arch, 256).relayout and "_red = " not in text and "T.alloc_shared" not in text


def _lower(text: str, entry: str, target: str, workdir) -> str:
    """TileLang's lowering of generated source to CUDA (where the layouts are inferred), no nvcc."""
    from duotile.codegen.tilelang_cuda import toolchain

    py = workdir / f"{entry}.py"
    py.write_text(text)
    prim, configs = toolchain.load_generated(str(py), entry)
    return toolchain.lower_to_cuda(prim, get_target(target).arch.sm, configs)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_relaid_reductions_lower(target, tmp_path):
    pytest.importorskip("tilelang")
    _, _, text = _tilelang(two_sums, _ints(1, 64), target)
    cuda = _lower(text, "two_sums_kernel", target, tmp_path)
    assert "__syncthreads();" in cuda  # the shared copies are fenced before they are read


@pytest.mark.slow
def test_moe_permute_at_k1_lowers_for_sm90(tmp_path):
    """The shape sweep's moe_permute draw T = 17, E = 1, K = 1 at the config a user gets with no
    tuning entry (the defaults: BT 64, BE 128); every phase. Phase 2's positions add each slot's
    match (a 64 x 1 sum) to the earlier tokens' matches (a 64 x 64 sum) and to the earlier tiles'."""
    pytest.importorskip("tilelang")
    from duotile.kernels_spec import load_all

    spec = load_all()["moe_permute"]
    case = {"T": 17, "E": 1, "K": 1}
    target = get_target("sm90")
    phases, knobs = specialize_phases(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), target, {},
                                      spec.constants_of(case))
    assert phases[2].config["BT"] == 64 and knobs["threads"] == 256
    texts = [target.generate(m, target.phase_knobs(m, knobs)).stages["tilelang"] for m in phases]
    assert texts[2].count("_red = T.alloc_fragment((64,), ") == 3  # the slot's, earlier tokens', earlier tiles'
    for m, text in zip(phases, texts):
        assert "__global__" in _lower(text, f"{m.name}_kernel", "sm90", tmp_path)
