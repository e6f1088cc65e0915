"""``dsl.require``: a condition on a kernel's sizes that a call must meet. Where a read past a
tensor's end would take zeros silently (a cache row one format too short), the call is refused
with the spec's message at the spec's line, once its sizes are known."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import DslError


@dsl.kernel
def head(x: dsl.Tensor["R", "C", dsl.f32], out: dsl.Tensor["R", "K", dsl.f32], *, K: dsl.Const = 4):
    dsl.require(x.C >= out.K + 2, "x's rows must hold K values and 2 more")
    for r in dsl.grid(x.R):
        dsl.store(out[r, 0], dsl.load(x[r, 2], (1, 4)))


@dsl.kernel(dynamic=("R", "C"))
def head_dynamic(x: dsl.Tensor["R", "C", dsl.f32], out: dsl.Tensor["R", "K", dsl.f32], *, K: dsl.Const = 4):
    dsl.require(x.C >= out.K + 2, "x's rows must hold K values and 2 more")
    for r in dsl.grid(x.R):
        dsl.store(out[r, 0], dsl.load(x[r, 2], (1, 4)))


@dsl.kernel(dynamic=("R", "C"))
def head_two_phases(x: dsl.Tensor["R", "C", dsl.f32], out: dsl.Tensor["R", "K", dsl.f32], *, K: dsl.Const = 4):
    dsl.require(x.C >= out.K + 2, "x's rows must hold K values and 2 more")
    for r in dsl.grid(x.R):
        dsl.store(out[r, 0], dsl.load(x[r, 2], (1, 4)))
    for r in dsl.grid(x.R):
        dsl.store(out[r, 0], dsl.load(out[r, 0], (1, 4)) * 2.0)


def _call(cols: int, kernel=head):
    x = torch.arange(3 * cols, dtype=torch.float32).reshape(3, cols)
    out = torch.zeros(3, 4)
    codegen.compile(kernel, "interpret")(x=x, out=out)
    return x, out


def test_a_call_that_meets_the_condition_runs():
    x, out = _call(6)
    assert torch.equal(out, x[:, 2:6])


def test_a_call_that_does_not_is_refused_at_the_spec_line_with_its_sizes():
    with pytest.raises(DslError, match=r"x's rows must hold K values and 2 more \(sizes .*'C': 5") as err:
        _call(5)
    assert "test_require.py:16" in str(err.value)


def test_a_condition_on_a_dynamic_size_is_checked_at_each_call_the_build_serves():
    """One build serves every value of a dynamic size, so its conditions are checked at each new
    call shape (regression: they were left unchecked, and a too-short row read zeros silently)."""
    kernel = codegen.compile(head_dynamic, "interpret")
    for cols in (6, 9):
        x = torch.arange(3 * cols, dtype=torch.float32).reshape(3, cols)
        out = torch.zeros(3, 4)
        kernel(x=x, out=out)
        assert torch.equal(out, x[:, 2:6])
    with pytest.raises(DslError, match=r"x's rows must hold K values and 2 more \(sizes .*'C': 5") as err:
        kernel(x=torch.zeros(3, 5), out=torch.zeros(3, 4))
    assert "test_require.py:" in str(err.value)


def test_a_kernel_of_several_phases_keeps_its_conditions_in_each():
    """Regression: the phases a kernel splits into carried none of its conditions, so one on a
    dynamic size went unchecked in a two-phase kernel."""
    kernel = codegen.compile(head_two_phases, "interpret")
    x = torch.arange(18, dtype=torch.float32).reshape(3, 6)
    out = torch.zeros(3, 4)
    kernel(x=x, out=out)
    assert torch.equal(out, 2 * x[:, 2:6])
    with pytest.raises(DslError, match="x's rows must hold K values and 2 more"):
        kernel(x=torch.zeros(3, 5), out=torch.zeros(3, 4))


def test_a_condition_decided_while_tracing_fails_at_once_and_a_non_condition_is_refused():
    def make(text):
        src = f"def k(x: dsl.Tensor['R', dsl.f32], out: dsl.Tensor['R', dsl.f32]):\n    {text}\n" \
              "    for _ in dsl.grid(1):\n        dsl.store(out[0], dsl.load(x[0], (4,)))\n"
        scope = {"dsl": dsl}
        exec(compile(src, "fragment.py", "exec"), scope)  # noqa: S102
        return dsl.kernel(scope["k"])

    args = {"x": torch.zeros(4), "out": torch.zeros(4)}
    with pytest.raises(DslError, match="four is not five") as err:
        codegen.compile(make("dsl.require(4 == 5, 'four is not five')"), "interpret")(**args)
    assert "fragment.py:2" in str(err.value)
    with pytest.raises(DslError, match="dsl.require takes a comparison of sizes"):
        codegen.compile(make("dsl.require(x.R + 1, 'no comparison')"), "interpret")(**args)
