"""The interpreter runs a grid's programs together (a leading program axis): every program's
results are bitwise those it gets alone, whatever else is in its batch and however a memory op
reads its corners (windows or index tensors)."""

from __future__ import annotations

import random

import pytest
import sympy
import torch

from duotile import codegen, dsl
from duotile.codegen.interpret import machine, memory, scalars
from duotile.kernels_spec import load_all

# specs whose cases cover: loops whose bounds differ by program (K ranges, data-read stops),
# scalars read from data, gathers and scatters, float sums, transcendental functions
CASES = [("gemm_blockscaled", "v4_ragged"), ("moe_gemm_mxfp4", "v4_ragged"), ("moe_gemm_mxfp4", "v41_one_expert"),
         ("moe_permute", "skewed_t33_e256"), ("sparse_mqa_decode", "split4_holes"), ("topk", "mixed_k16"),
         ("sample", "ties_b6_v777"), ("flash_attention", "d128_causal"), ("rmsnorm", "t5_d1000")]


def _run(name, case_name, monkeypatch, **limits):
    for key, value in limits.items():
        monkeypatch.setattr(machine if hasattr(machine, key) else memory, key, value)
    spec = load_all()[name]
    case = spec.cases[case_name]
    inputs = spec.make_inputs(case, torch.device("cpu"), seed=3)
    kernel = codegen.compile(spec.kernel, "interpret", config=spec.config_of(case), constants=spec.constants_of(case))
    kernel(**inputs)
    return {k: inputs[k] for k in spec.outputs}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


@pytest.mark.parametrize("name,case_name", CASES)
def test_programs_together_give_each_program_its_own_results(name, case_name, monkeypatch):
    alone = _run(name, case_name, monkeypatch, ELEMENTS_AT_ONCE=1)  # one program a batch
    together = _run(name, case_name, monkeypatch)
    indexed = _run(name, case_name, monkeypatch, WINDOWS_AT_ONCE=0)  # every per-program corner by index tensors
    for out in alone:
        assert torch.equal(_bits(together[out]), _bits(alone[out])), out
        assert torch.equal(_bits(indexed[out]), _bits(alone[out])), out


def test_a_row_is_bitwise_the_same_in_a_batch_of_any_size():
    """rmsnorm (a float sum and a reciprocal square root a row): three rows alone and among 300."""
    spec = load_all()["rmsnorm"]
    kernel = codegen.compile(spec.kernel, "interpret", config={"ROWS": 1})
    big = spec.make_inputs({"T": 300, "D": 1000}, torch.device("cpu"), seed=4)
    small = {k: v[:3].clone() if v.dim() == 2 else v.clone() for k, v in big.items()}
    kernel(**big)
    kernel(**small)
    assert torch.equal(_bits(small["y"]), _bits(big["y"][:3]))


@dsl.kernel
def _triangle(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    """y[i] = sum of x[0..i]: program i loops i + 1 times (bounds that differ by program)."""
    for i in dsl.grid(x.N):
        acc = dsl.zeros((1,), dsl.f32)
        for j in dsl.range(i + 1):
            acc[:] = acc + dsl.load(x[j], (1,))
        dsl.store(y[i], acc)


def test_a_loop_whose_trips_differ_by_program_masks_the_others():
    x = torch.arange(1, 12, dtype=torch.float32)
    y = torch.full_like(x, -1.0)
    codegen.compile(_triangle, "interpret")(x=x, y=y)
    assert torch.equal(y, torch.cumsum(x, 0))


def test_integer_index_math_over_the_batch_is_exact():
    """Index expressions of per-program values (floor and ceiling of quotients, Mod, Min, Max) as
    integer tensor ops equal sympy's values one program at a time."""
    a, b = sympy.symbols("pid_a n_b", integer=True, nonnegative=True)
    exprs = [a // 4, (3 * a + 5) // 7 + 1, sympy.ceiling(a / 3), sympy.Mod(a, 5) * 128, sympy.Min(a, b) + 1,
             sympy.Max(2 * a, b), a // b, 128 * a + b - 7]
    rng = random.Random(0)
    values = [rng.randrange(0, 1 << 40) for _ in range(50)] + list(range(10))
    env = {"pid_a": torch.tensor(values), "n_b": 13}
    for e in exprs:
        form = scalars.integer_form(e)
        assert form is not None, e
        got = form(env)
        assert got.tolist() == [int(e.subs({a: v, b: 13})) for v in values], e


@dsl.kernel
def _unary(x: dsl.Tensor["T", "D", dsl.f32], y: dsl.Tensor["T", "D", dsl.f32], *, BD: dsl.Const = 8):
    for t in dsl.grid(x.T):
        v = dsl.load(x[t, 0], (1, BD))
        dsl.store(y[t, 0], dsl.exp2(v) + dsl.sigmoid(v) + dsl.log2(v * v + 1.0) * dsl.exp(-v))


def test_transcendental_functions_give_a_program_its_own_bits_in_any_batch(monkeypatch):
    """torch's vector and scalar paths of exp2 and sigmoid differ in the last bit, and which
    elements of a batched tensor take the scalar path depends on its size: each program's tile is
    computed alone."""
    x = torch.randn(300, 7, generator=torch.Generator().manual_seed(5)) * 10
    kernel = codegen.compile(_unary, "interpret", constants={"BD": 7})
    together = torch.zeros_like(x)
    kernel(x=x, y=together)
    monkeypatch.setattr(machine, "ELEMENTS_AT_ONCE", 1)
    alone = torch.zeros_like(x)
    kernel(x=x, y=alone)
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))
