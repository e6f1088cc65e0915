"""Level 1: the DSL front end on tiny kernels: tracing, types, and errors that name the line."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import CallError, DslError


@dsl.kernel
def scale_rows(x: dsl.Tensor["N", "D", dsl.f32], s: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32], *,
               BN: dsl.Tunable = dsl.choice(4, 8)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        t = dsl.load(x[i * BN, 0], (BN, x.D))
        dsl.store(y[i * BN, 0], t * dsl.load(s[i * BN], (BN,))[:, None])


def test_trace_prints_typed_ir_with_source_lines():
    text = str(scale_rows.trace(config={"BN": 8}))
    assert "kernel scale_rows(x: tensor<N x D x f32>" in text
    assert "load x[8*i, 0] -> f32[8xD] vector" in text
    assert "expand(" in text and "ew.mul(" in text
    assert "# line" in text


def test_tunables_and_defaults():
    assert scale_rows.default_config() == {"BN": 4}
    with pytest.raises(DslError, match="no tunable 'BQ'"):
        scale_rows.resolve_config({"BQ": 2})


def test_interpreter_runs_a_user_kernel():
    x, s = torch.randn(10, 3), torch.randn(10)
    y = torch.zeros(10, 3)
    codegen.compile(scale_rows, "interpret")(x=x, s=s, y=y)
    assert torch.allclose(y, x * s[:, None])


def test_call_errors_name_the_argument_and_dimension():
    k = codegen.compile(scale_rows, "interpret")
    with pytest.raises(CallError, match=r"argument 's' has N=9, but argument 'x' bound N=10"):
        k(x=torch.zeros(10, 3), s=torch.zeros(9), y=torch.zeros(10, 3))
    with pytest.raises(CallError, match="argument 'y' has dtype bf16, expected f32"):
        k(x=torch.zeros(10, 3), s=torch.zeros(10), y=torch.zeros(10, 3, dtype=torch.bfloat16))
    with pytest.raises(CallError, match="missing tensor argument 'y'"):
        k(x=torch.zeros(10, 3), s=torch.zeros(10))


def _line_of(fn, needle: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(fn.fn)
    return start + next(i for i, line in enumerate(src) if needle in line)


@dsl.kernel
def bad_store(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.bf16]):
    for i in dsl.grid(x.N):
        t = dsl.load(x[i], (1,))
        dsl.store(y[i], t)  # f32 into bf16: must be cast


@dsl.kernel
def bad_gemm(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16]):
    for _ in dsl.grid(1):
        acc = dsl.zeros((16, 16), dsl.f32, role="accumulator")
        dsl.gemm(dsl.load(a[0, 0], (16, 32), role="operand"), dsl.load(b[0, 0], (16, 16), role="operand"), acc,
                 transpose_b=True)


@dsl.kernel
def branch_on_tile(x: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(x.N):
        t = dsl.load(x[i], (1,))
        if t > 0:
            pass


@pytest.mark.parametrize("kernel,needle,message", [
    (bad_store, "dsl.store(y[i], t)", "cannot store a f32 tile into bf16 tensor 'y'"),
    (bad_gemm, "dsl.gemm(", "gemm inner dimensions differ: a gives K=32, b gives K=16"),
    (branch_on_tile, "if t > 0", "a tile has no truth value"),
])
def test_dsl_errors_name_the_kernel_line(kernel, needle, message):
    with pytest.raises(DslError, match=message) as info:
        kernel.trace()
    assert info.value.loc is not None
    assert info.value.loc.line == _line_of(kernel, needle)
    assert f"test_frontend.py:{info.value.loc.line}" in str(info.value)


def test_parameters_need_annotations():
    with pytest.raises(DslError, match="needs an annotation"):
        @dsl.kernel
        def nope(x):
            pass


def test_unknown_role_is_rejected():
    @dsl.kernel
    def k(x: dsl.Tensor["N", dsl.f32]):
        for _ in dsl.grid(1):
            dsl.zeros((4,), role="scratchpad")

    with pytest.raises(DslError, match="unknown memory role 'scratchpad'"):
        k.trace()
