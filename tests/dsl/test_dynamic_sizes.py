"""Dynamic sizes: one build serves every value of a size the kernel leaves dynamic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.driver import generate_case
from duotile.dsl.errors import DslError
from duotile.kernels_spec.registry import get
from duotile.passes.bind_shapes import bind_shapes


def test_one_interpreter_build_serves_every_row_count():
    spec = get("mqa_decode")
    kernel = codegen.compile(spec.kernel, "interpret", config={"BN": 32, "SPLIT": 4, "STAGES": 1})
    for rows, batch in ((1, 1), (37, 3), (200, 2)):
        case = {"B": batch, "H": 64, "R": rows, "D": 128}
        inputs = spec.make_inputs(case, torch.device("cpu"), seed=rows)
        kernel(**inputs)
        want = spec.run_reference(inputs, case)["o"].float()
        assert (inputs["o"].float() - want).abs().max() < 2e-2, rows
    assert len(kernel._cache) == 1


def test_bound_module_keeps_the_dynamic_size_as_a_symbol():
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.meta_inputs({"T": 7, "D": 256}))
    module = bind_shapes(spec.kernel.trace(sig.dtypes, sig.present), sig.static_shapes, sig.dynamic)
    assert module.shapes == {"D": 256} and module.dynamic == ("T",)
    assert "n_T" in str(module) and "dynamic {T as n_T}" in str(module)


def test_a_tile_shaped_by_a_dynamic_size_is_refused_at_its_line():
    @dsl.kernel(dynamic=("N",))
    def copy_all(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
        for _ in dsl.grid(1):
            dsl.store(y[0], dsl.load(x[0], (x.N,)))

    x = torch.zeros(8)
    with pytest.raises(DslError, match="dynamic size"):
        codegen.compile(copy_all, "interpret")(x=x, y=x.clone())


def test_dynamic_names_a_dimension():
    with pytest.raises(DslError, match="not a dimension"):
        @dsl.kernel(dynamic=("Q",))
        def bad(x: dsl.Tensor["N", dsl.f32]):
            for _ in dsl.grid(1):
                pass


def test_sm90_source_declares_the_size_once_for_every_value():
    spec = get("mqa_decode")
    src = generate_case(spec, {"B": 3, "H": 64, "R": 700, "D": 512}, "sm90", use_tuned=False)[0].stages["tilelang"]
    assert 'n_R = T.dynamic("n_R")' in src and 'n_B = T.dynamic("n_B")' in src
    assert 'kv: T.Tensor((n_B, n_R, 512,), "bfloat16")' in src
    assert "< n_R)" in src  # the row mask stays: no size proves it


def test_ascend_specialises_each_size():
    spec = get("rmsnorm")
    kernel = codegen.compile(spec.kernel, "ascend950")
    keys = set()
    for t in (3, 5):
        sig = spec.kernel.bind(spec.meta_inputs({"T": t, "D": 512}))
        keys.add(sig.with_static(sig.dynamic).key())
    assert len(keys) == 2 and kernel.target == "ascend950"


def test_bucketed_size_builds_once_per_bucket():
    spec = get("gemm")
    keys = [spec.kernel.bind(spec.meta_inputs({"M": m, "N": 128, "K": 64})).key() for m in (33, 64, 65, 100)]
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]


def test_static_copy_of_a_kernel_keys_every_size():
    spec = get("mqa_decode")
    static = dataclasses.replace(spec.kernel, dynamic=())
    a, b = (static.bind(spec.meta_inputs({"B": 1, "H": 64, "R": r, "D": 128})).key() for r in (10, 11))
    assert a != b


def test_a_repeated_call_skips_binding_and_a_changed_one_is_checked_again(monkeypatch):
    """Calls with the shapes, dtypes and devices of an earlier call reuse its loaded phases
    without binding again; a call that differs (a dtype here) is bound and refused as before."""
    from duotile.dsl.errors import CallError

    spec = get("gemm_splitk")
    kernel = codegen.compile(spec.kernel, "interpret", config={"SPLIT": 2, "BM": 64, "BN": 64, "BK": 64})
    inputs = spec.make_inputs({"M": 3, "N": 64, "K": 128}, torch.device("cpu"), 0)
    prepared = []
    real = kernel._prepare
    monkeypatch.setattr(kernel, "_prepare", lambda tensors: prepared.append(1) or real(tensors))
    for _ in range(3):
        kernel(**inputs)
    assert len(prepared) == 1
    want = spec.run_reference(inputs, {"M": 3, "N": 64, "K": 128})["c"]
    assert torch.allclose(inputs["c"].float(), want.float(), atol=0.1, rtol=1e-2)
    with pytest.raises(CallError, match="dtype"):
        kernel(**{**inputs, "a": inputs["a"].float()})
    assert len(prepared) == 2
