"""Division on tiles has one meaning on every target: `/` is true division (integer operands are
divided in floating point), `//` and `%` floor like Python's on integers, and a zero divisor in a
tile gives 0 for `//` and the dividend for `%`. The interpreter is checked numerically against
Python; sm90, sm100 and Ascend against the TIR text they generate, and through TileLang."""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError

N = 128  # one tile of N elements: a whole number of vectors over the CUDA threads


@dsl.kernel
def divide(x: dsl.Tensor["N", dsl.i32], y: dsl.Tensor["N", dsl.i32], q: dsl.Tensor["N", dsl.i32],
           r: dsl.Tensor["N", dsl.i32], f: dsl.Tensor["N", dsl.f32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        b = dsl.load(y[0], (N,))
        dsl.store(q[0], a // b)
        dsl.store(r[0], a % b)
        dsl.store(f[0], a / b)


@dsl.kernel
def divide_by_scalars(x: dsl.Tensor["N", dsl.i64], q: dsl.Tensor["N", dsl.i64], r: dsl.Tensor["N", dsl.i64],
                      f: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(q[0], a // 3 + 7 // a)
        dsl.store(r[0], a % -3 + a % (i + 2))
        dsl.store(f[0], a / 2)


def _python(a: int, b: int) -> tuple[int, int, float]:
    if b == 0:
        return 0, a, (float("nan") if a == 0 else float("inf") * (1 if a > 0 else -1))
    return a // b, a % b, a / b


def _operands():
    pairs = [(a, b) for a in range(-9, 10) for b in (-4, -3, -2, -1, 0, 1, 2, 3)]
    pairs = (pairs * 2)[:N]
    x = torch.tensor([a for a, _ in pairs], dtype=torch.int32)
    y = torch.tensor([b for _, b in pairs], dtype=torch.int32)
    return pairs, x, y


def test_interpreter_floors_like_python_and_defines_a_zero_divisor():
    pairs, x, y = _operands()
    q, r, f = torch.zeros(N, dtype=torch.int32), torch.zeros(N, dtype=torch.int32), torch.zeros(N)
    codegen.compile(divide, "interpret")(x=x, y=y, q=q, r=r, f=f)
    for k, (a, b) in enumerate(pairs):
        wq, wr, wf = _python(a, b)
        assert (int(q[k]), int(r[k])) == (wq, wr), (a, b)
        assert int(q[k]) * b + int(r[k]) == a  # the identity holds at b == 0 too
        assert (wf != wf and f[k] != f[k]) or float(f[k]) == pytest.approx(wf), (a, b)


def test_interpreter_scalar_operands_and_int64():
    x = torch.arange(-64, 64, dtype=torch.int64)
    q, r = torch.zeros(N, dtype=torch.int64), torch.zeros(N, dtype=torch.int64)
    f = torch.zeros(N)
    codegen.compile(divide_by_scalars, "interpret")(x=x, q=q, r=r, f=f)
    for k, a in enumerate(x.tolist()):
        assert int(q[k]) == a // 3 + (7 // a if a else 0), a
        assert int(r[k]) == a % -3 + a % 2, a  # the grid index i is 0
        assert float(f[k]) == a / 2


def test_true_division_of_integers_is_f32():
    module = divide.trace(config={})
    div = next(op for op in module.walk() if op.attrs.get("fn") == "div")
    assert div.result.type.dtype == dsl.f32
    assert all(a.type.dtype == dsl.f32 for a in div.args)


def _line(fn, needle: str) -> str:
    src, start = inspect.getsourcelines(fn.fn)
    return f"test_dsl_division.py:{start + next(i for i, s in enumerate(src) if needle in s)}"


@dsl.kernel
def store_quotient(x: dsl.Tensor["N", dsl.i32], y: dsl.Tensor["N", dsl.i32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(y[0], a / 2)  # a float: `//` keeps integers


@dsl.kernel
def floor_of_floats(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(y[0], a // 2.0)


@dsl.kernel
def mod_of_float_scalar(x: dsl.Tensor["N", dsl.i32], y: dsl.Tensor["N", dsl.f32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(y[0], a % 0.5)


@dsl.kernel
def by_constant_zero(x: dsl.Tensor["N", dsl.i32], y: dsl.Tensor["N", dsl.i32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(y[0], a // 0)


@dsl.kernel
def mod_of_mask(x: dsl.Tensor["N", dsl.i32], y: dsl.Tensor["N", dsl.i32]):
    for _ in dsl.grid(1):
        a = dsl.load(x[0], (N,))
        dsl.store(y[0], (a > 0) % 2)


@pytest.mark.parametrize("kernel,needle,message", [
    (store_quotient, "dsl.store(y[0], a / 2)", "cannot store a f32 tile into i32 tensor 'y'"),
    (floor_of_floats, "a // 2.0", "`//` takes integer tiles and integer scalars, got f32"),
    (mod_of_float_scalar, "a % 0.5", "`%` takes integer tiles and integer scalars, got f32"),
    (by_constant_zero, "a // 0", "integer `//` by the constant 0"),
    (mod_of_mask, "(a > 0) % 2", "`%` takes integer tiles, not booleans"),
])
def test_refusals_name_the_spec_line(kernel, needle, message):
    with pytest.raises(DslError, match=message) as err:
        kernel.trace(config={})
    assert _line(kernel, needle) in str(err.value)


def _generated(kernel, target: str, tensors: dict) -> str:
    tgt = get_target(target)
    module, knobs = specialize(kernel, kernel.bind(tensors), tgt)
    return tgt.generate(module, knobs).stages["tilelang"]


def _divide_tensors():
    i, z = torch.zeros(N, dtype=torch.int32), torch.zeros(N)
    return {"x": i, "y": i, "q": i, "r": i, "f": z}


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_prints_floor_division_with_the_zero_rule(target):
    text = _generated(divide, target, _divide_tensors())
    zero, one = 'T.cast(0, "int32")', 'T.cast(1, "int32")'
    a, b = "x0_frag[i0]", "y1_frag[i0]"
    safe = f"T.if_then_else({b} == {zero}, {one}, {b})"  # no division by 0 is ever executed
    assert f"T.if_then_else({b} == {zero}, {zero}, T.floordiv({a}, {safe}))" in text
    assert f"T.if_then_else({b} == {zero}, {a}, T.floormod({a}, {safe}))" in text
    assert f'(T.cast({a}, "float32") / T.cast({b}, "float32"))' in text


def test_ascend_prints_the_same_semantics():
    text = _generated(divide, "ascend950", _divide_tensors())
    assert "T.if_then_else(y_" in text and "== T.int32(0), T.int32(0), T.floordiv(x_" in text
    assert "T.floormod(x_" in text and "T.if_then_else(y_" in text and "== T.int32(0), T.int32(1), y_" in text
    assert '(T.cast(x_' in text and '"float32") / T.cast(y_' in text


def test_constant_divisors_need_no_guard_and_index_divisors_are_widened():
    i64, z = torch.zeros(N, dtype=torch.int64), torch.zeros(N)
    text = _generated(divide_by_scalars, "sm90", {"x": i64, "q": i64, "r": i64, "f": z})
    assert "T.floordiv(x0_frag[i0], 3)" in text and "T.floormod(x0_frag[i0], -3)" in text
    assert 'T.cast((i + 2), "int64")' in text  # an index expression divisor of an int64 tile
    assert "T.if_then_else(x0_frag[i0] == T.cast(0, \"int64\"), T.cast(0, \"int64\"), T.floordiv(7," in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_lowers_integer_division(target):
    pytest.importorskip("tilelang")
    t = _divide_tensors()
    a = codegen.compile(divide, target).artifact(**t)
    assert a.files["cubin"].endswith(".cubin")  # `/` on int32 was a raw TVM error before


@pytest.mark.slow
def test_ascend_lowers_integer_division():
    pytest.importorskip("tilelang")
    a = codegen.compile(divide, "ascend950").artifact(**_divide_tensors())
    assert "__simt_vf__" in a.stages["ascend"]
