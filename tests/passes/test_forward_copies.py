"""forward_copies: a plain copy goes away when its source is not rewritten while the copy is read."""

from __future__ import annotations

import torch

from duotile import dsl
from duotile.codegen.interpret.machine import Interpreter
from duotile.passes.bind_shapes import bind_shapes
from duotile.passes.fold_bounds import fold_bounds
from duotile.passes.forward_copies import forward_copies
from duotile.passes.fuse_elementwise import fuse_elementwise


@dsl.kernel
def row_softmax(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32]):
    N, D = x.N, x.D
    for i in dsl.grid(N // 4):
        t = dsl.load(x[i * 4, 0], (4, D))
        cols = dsl.arange(D)[None, :]
        masked = dsl.where(cols < D, t, float("-inf"))  # always true: fold_bounds leaves a copy
        e = dsl.exp(masked - masked.max(axis=1)[:, None])
        dsl.store(y[i * 4, 0], e / e.sum(axis=1)[:, None])


@dsl.kernel
def overwritten(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for _ in dsl.grid(1):
        buf = dsl.load(x[0], (x.N,)) * 1.0
        acc = dsl.zeros((x.N,), dsl.f32)
        acc[:] = buf
        snapshot = acc + 0.0  # stays: a real computation, not a copy
        copy = dsl.where(dsl.arange(x.N) < x.N, acc, 0.0)  # becomes a copy of acc after folding
        acc[:] = acc * 3.0  # acc rewritten while the copy is still to be read
        dsl.store(y[0], copy + snapshot + acc)


def _lower(kernel, shapes):
    return fold_bounds(fuse_elementwise(bind_shapes(kernel.trace(), shapes)))


def _copies(module):
    return [op for op in module.walk() if op.name == "map" and op.attrs.get("into") is None
            and op.attrs["expr"].kind == "arg"]


def test_copy_left_by_a_folded_mask_is_forwarded():
    module = _lower(row_softmax, {"N": 8, "D": 16})
    assert len(_copies(module)) == 1
    x = torch.randn(8, 16)
    want = torch.softmax(x, dim=1)
    forwarded = forward_copies(module)
    assert not _copies(forwarded)
    y = torch.zeros(8, 16)
    Interpreter(forwarded, {"x": x, "y": y}).run()
    torch.testing.assert_close(y, want)


def test_copy_of_a_buffer_rewritten_before_its_use_stays():
    module = _lower(overwritten, {"N": 8})
    before = len(_copies(module))
    assert before == 1
    module = forward_copies(module)
    assert len(_copies(module)) == before
    x, y = torch.randn(8), torch.zeros(8)
    Interpreter(module, {"x": x, "y": y}).run()
    torch.testing.assert_close(y, x + x + 3 * x)
