"""fold_bounds: masks that bound sizes decide are removed; the others stay; results do not change."""

from __future__ import annotations

import sympy
import torch

from duotile import dsl
from duotile.codegen.interpret.machine import Interpreter
from duotile.kernels_spec import get
from duotile.passes.bind_shapes import bind_shapes
from duotile.passes.fold_bounds import fold_bounds, interval
from duotile.passes.fuse_elementwise import fuse_elementwise


@dsl.kernel
def masked_scale(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32], *, BN: dsl.Tunable = dsl.choice(64)):
    N = x.N
    for i in dsl.grid(dsl.cdiv(N, BN)):
        t = dsl.load(x[i * BN], (BN,))
        cols = i * BN + dsl.arange(BN)
        dsl.store(y[i * BN], dsl.where((cols < N) & (cols >= 0), t * 2.0, -1.0))


def _lowered(kernel, shapes, config=None):
    return fuse_elementwise(bind_shapes(kernel.trace(config=config), shapes))


def _map_exprs(module):
    return [str(op.attrs["expr"]) for op in module.walk() if op.name == "map"]


def test_interval_of_index_expressions():
    n, m = sympy.symbols("n m", integer=True)
    env = {n: (0, 31), m: (0, 7)}
    assert interval(128 * n + 5, env) == (5, 31 * 128 + 5)
    assert interval(sympy.Min(32, m + 1), env) == (1, 8)
    assert interval(sympy.ceiling(n / 4), env) == (0, 8)
    assert interval(sympy.Symbol("unknown") + 1, env) is None


def test_mask_folds_when_sizes_divide_and_stays_when_ragged():
    folded = _map_exprs(fold_bounds(_lowered(masked_scale, {"N": 256})))
    assert not any("where" in e for e in folded), folded
    ragged = _map_exprs(fold_bounds(_lowered(masked_scale, {"N": 250})))
    assert any("where(lt(" in e and "ge(" not in e for e in ragged), ragged  # the >= 0 half always holds


def test_folded_module_computes_the_same_values():
    for n in (256, 250):
        x = torch.randn(n)
        outs = []
        for fold in (False, True):
            module = _lowered(masked_scale, {"N": n})
            module = fold_bounds(module) if fold else module
            y = torch.full((n,), 7.0)
            Interpreter(module, {"x": x, "y": y}).run()
            outs.append(y)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0], x * 2.0)


def test_attention_masks_fold_for_aligned_lengths_and_keep_the_causal_diagonal():
    spec = get("flash_attention")
    shapes = {"B": 1, "H": 1, "S": 4096, "D": 128}
    plain = _map_exprs(fold_bounds(_lowered(spec.kernel, shapes)))
    assert not any("where" in e for e in plain), plain
    causal = fold_bounds(fuse_elementwise(bind_shapes(spec.kernel.trace(constants={"CAUSAL": True}), shapes)))
    kept = [e for e in _map_exprs(causal) if "where" in e]
    assert kept and all("le(" in e and "lt(" not in e for e in kept), kept
    ragged = _map_exprs(fold_bounds(_lowered(spec.kernel, {**shapes, "S": 1000})))
    assert any("where(lt(" in e for e in ragged)


@dsl.kernel
def tail_rows(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32], *, BN: dsl.Tunable = dsl.choice(64)):
    N = x.N
    for _ in dsl.grid(1):
        for i in dsl.range(dsl.cdiv(N, BN), start=2):  # blocks 2 .. cdiv(N, BN) - 1
            t = dsl.load(x[i * BN], (BN,))
            cols = i * BN + dsl.arange(BN)
            dsl.store(y[i * BN], dsl.where(cols < N, t + 1.0, 0.0))


def test_loop_with_a_start_is_bounded_by_its_end():
    # the loop's "extent" is its end bound: with N = 256 the mask always holds for blocks 2 and 3
    # (the first version took start .. start + end - 1 and kept the mask)
    assert not any("where" in e for e in _map_exprs(fold_bounds(_lowered(tail_rows, {"N": 256}))))
    module = fold_bounds(_lowered(tail_rows, {"N": 250}))
    assert any("where(lt(" in e for e in _map_exprs(module))
    x, y = torch.randn(250), torch.zeros(250)
    Interpreter(module, {"x": x, "y": y}).run()
    assert torch.equal(y[128:], x[128:] + 1.0) and torch.equal(y[:128], torch.zeros(128))


def test_an_unbound_iota_is_left_undecided():
    """Regression: a mask on ``arange(next_pow2(E)) < E`` in a module whose sizes were not bound
    yet (the tuner's and the config choice's knob filter read the traced module) crashed on
    ``int()`` of a symbol; the condition is now undecided and stays."""
    import sympy

    from duotile.dsl.dtypes import i32
    from duotile.dsl.expr import Node
    from duotile.passes.fold_bounds import node_interval, truth

    e = sympy.Symbol("E", integer=True, positive=True)
    iota = Node("iota", (e,), i32, (), 0)
    assert node_interval(iota, {}) is None
    assert truth(Node("lt", (e,), i32, (iota, Node("scalar", (), i32, (), e))), {}) is None
