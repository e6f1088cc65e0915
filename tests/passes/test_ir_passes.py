"""bind_shapes, verify_ir and fuse_elementwise on small IR fragments."""

from __future__ import annotations

import pytest
import sympy

from duotile import dsl
from duotile.dsl.errors import DslError
from duotile.dsl.ir import Op
from duotile.passes.bind_shapes import bind_shapes
from duotile.passes.fuse_elementwise import fuse_elementwise
from duotile.passes.verify_ir import verify_ir


@dsl.kernel
def softmax_rows(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32], *,
                 BN: dsl.Tunable = dsl.choice(2, 4)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        t = dsl.load(x[i * BN, 0], (BN, x.D))
        e = dsl.exp(t - t.max(axis=1)[:, None])
        dsl.store(y[i * BN, 0], e / e.sum(axis=1)[:, None])


def test_bind_shapes_specialises_sizes_and_grid():
    m = bind_shapes(softmax_rows.trace(config={"BN": 4}), {"N": 10, "D": 7})
    grid = m.grid
    assert grid.attrs["extents"] == [sympy.Integer(3)]
    load = next(op for op in m.walk() if op.name == "load")
    assert load.result.type.shape == (4, 7)
    assert m.shapes == {"D": 7, "N": 10}
    assert "shapes {D=7, N=10}" in str(m)


def test_bind_shapes_gives_each_call_its_own_sizes_when_binds_alternate(monkeypatch):
    """Bound expressions are kept by the sizes they were bound to: binding one trace at two sizes
    in turn, or a dynamic size, gives what a first bind at each gives."""
    from duotile.passes import bind_shapes as pass_module

    trace = softmax_rows.trace(config={"BN": 4})
    calls = [({"N": 10, "D": 7}, ()), ({"N": 64, "D": 5}, ()), ({"D": 7}, ("N",))]
    fresh = []
    for sizes, dynamic in calls:
        monkeypatch.setattr(pass_module, "_BOUND", {})
        fresh.append(str(bind_shapes(trace, sizes, dynamic)))
    for _ in range(2):
        assert [str(bind_shapes(trace, sizes, dynamic)) for sizes, dynamic in calls] == fresh
    assert "n_N" in fresh[2] and fresh[0] != fresh[1]


def test_bind_shapes_names_missing_sizes():
    with pytest.raises(DslError, match="no size given for D"):
        bind_shapes(softmax_rows.trace(), {"N": 3})


@dsl.kernel
def scaled_rows(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32],
                table: dsl.OptionalTensor["V", "D", dsl.f32] = None, *, BN: dsl.Const = 4):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        t = dsl.load(x[i * BN, 0], (BN, x.D))
        if table is not None:
            t = t * dsl.load(table[0, 0], (1, x.D))
        dsl.store(y[i * BN, 0], t)


def test_bind_shapes_leaves_a_size_only_an_absent_optional_tensor_has():
    m = bind_shapes(scaled_rows.trace(), {"N": 8, "D": 16})
    assert m.shapes == {"D": 16, "N": 8}
    assert m.param("table").shape == (1, 16)  # declared with size 1 where a target declares it
    present = bind_shapes(scaled_rows.trace(present={"table": True}), {"N": 8, "D": 16, "V": 3})
    assert present.shapes == {"D": 16, "N": 8, "V": 3}
    assert any(op.attrs.get("tensor") == "table" for op in present.walk())
    with pytest.raises(DslError, match="no size given for D"):  # a required tensor's size still is
        bind_shapes(scaled_rows.trace(), {"N": 8, "V": 3})


def test_fuse_elementwise_builds_maps_and_keeps_multi_use_values():
    m = fuse_elementwise(bind_shapes(softmax_rows.trace(), {"N": 8, "D": 16}))
    verify_ir(m)
    names = [op.name for op in m.walk()]
    assert "ew" not in names and "expand" not in names
    maps = [op for op in m.walk() if op.name == "map"]
    # exp(t - max) has two users (sum and the division), so it is its own map; the division is another
    assert len(maps) == 2
    assert str(maps[0].attrs["expr"]) == "exp(sub($0, expand1($1)))"
    assert str(maps[1].attrs["expr"]) == "div($0, expand1($1))"


def test_fusion_does_not_move_a_read_past_a_write():
    @dsl.kernel
    def k(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
        for _ in dsl.grid(1):
            buf = dsl.zeros((4,))
            old = buf + 1.0  # reads buf before it is written
            buf[:] = dsl.load(x[0], (4,))
            dsl.store(y[0], old * buf)

    m = fuse_elementwise(bind_shapes(k.trace(), {"N": 4}))
    body = m.grid.regions[0].ops
    first_map = next(i for i, op in enumerate(body) if op.name == "map")
    write = next(i for i, op in enumerate(body) if op.name == "map" and op.attrs["into"] is not None)
    assert first_map < write, "the read of buf must stay before the write"


def test_verify_rejects_use_outside_definition():
    m = bind_shapes(softmax_rows.trace(), {"N": 8, "D": 16})
    body = m.grid.regions[0].ops
    body.insert(0, Op("store", args=(body[0].result,), attrs={"tensor": "y", "offsets": (0, 0), "shape": (2, 16)}))
    with pytest.raises(DslError, match="before \\(or outside\\) its definition"):
        verify_ir(m)


def test_verify_rejects_writes_to_non_buffers():
    m = bind_shapes(softmax_rows.trace(), {"N": 8, "D": 16})
    body = m.grid.regions[0].ops
    load = body[0].result
    body.append(Op("assign", args=(load, load)))
    with pytest.raises(DslError, match="not a buffer"):
        verify_ir(m)


@dsl.kernel
def _two_sizes(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "KB", dsl.bf16], c: dsl.Tensor["M", "N", dsl.f32]):
    for m in dsl.grid(dsl.cdiv(a.M, 16)):
        x = dsl.load(a[m * 16, 0], (16, a.K), role="operand")
        y = dsl.load(b[0, 0], (16, b.KB), role="operand")
        acc = dsl.zeros((16, 16), dsl.f32, role="accumulator")
        dsl.gemm(x, y, acc, transpose_b=True)
        dsl.store(c[m * 16, 0], acc)


def test_a_gemm_over_two_size_symbols_is_checked_once_they_are_bound():
    """K and KB may be equal (a row of D channels against 2 DH packed ones is the real case): the
    spec line lets the gemm through, and verify_ir names it, with its line, where the bound sizes
    differ."""
    import torch

    from duotile import codegen

    t = {"a": torch.zeros(16, 32, dtype=torch.bfloat16), "c": torch.zeros(16, 16)}
    codegen.compile(_two_sizes, "interpret")(b=torch.zeros(16, 32, dtype=torch.bfloat16), **t)
    with pytest.raises(DslError, match=r"gemm inner dimensions differ: a gives K=32, b gives K=48") as err:
        codegen.compile(_two_sizes, "interpret")(b=torch.zeros(16, 48, dtype=torch.bfloat16), **t)
    assert "test_ir_passes.py" in str(err.value)
