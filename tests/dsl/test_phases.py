"""Kernels of several phases: grids run one after another, sharing ``dsl.workspace`` tensors
(tracing, the errors, ``split_phases``, and running them on the interpreter)."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize, specialize_phases
from duotile.dsl.errors import DslError
from duotile.passes.split_phases import split_phases
from duotile.passes.verify_ir import verify_ir


@dsl.kernel
def row_sums_twice(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", dsl.f32], *,
                   BN: dsl.Tunable = dsl.choice(4, 8)):
    """Phase 0 writes each row's sum to a workspace; phase 1 doubles it into y."""
    sums = dsl.workspace("sums", (x.N,), dsl.f32)
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(sums[i * BN], dsl.load(x[i * BN, 0], (BN, x.D)).sum(axis=1))
    for j in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(y[j * BN], dsl.load(sums[j * BN], (BN,)) * 2.0)


def test_two_grids_trace_as_two_phases_sharing_the_workspace():
    module = row_sums_twice.trace()
    assert [op.name for op in module.body.ops] == ["grid", "grid"]
    assert [p.name for p in module.workspaces] == ["sums"]
    assert "sums: workspace<N x f32>" in str(module)
    phases = split_phases(module)
    assert [(p.name, p.phase) for p in phases] == [("row_sums_twice_p0", 0), ("row_sums_twice_p1", 1)]
    assert all(len(p.body.ops) == 1 and [q.name for q in p.params] == ["x", "y", "sums"] for p in phases)
    with pytest.raises(ValueError, match="2 phases"):
        module.grid  # noqa: B018 - a property that refuses to pick one phase


def test_phases_run_in_order_on_the_interpreter():
    # small integers: every sum is exact, so the check is equality (a random row whose sum
    # cancels to near zero made an allclose of (3x).sum against 3 * x.sum fail now and then)
    x = torch.randint(-8, 9, (10, 3), generator=torch.Generator().manual_seed(0)).float()
    y = torch.zeros(10)
    kernel = codegen.compile(row_sums_twice, "interpret")
    kernel(x=x, y=y)
    assert torch.equal(y, 2 * x.sum(1))
    (phases, artifacts, call), = kernel._cache.values()
    assert len(phases) == len(artifacts) == 2
    ws = call.workspaces["sums"]
    kernel(x=x * 3, y=y)  # a second call reuses the workspace, and rewrites it
    assert call.workspaces["sums"] is ws and torch.equal(y, 6 * x.sum(1))


def test_an_outgrown_workspace_is_kept_alive_for_the_graphs_that_hold_its_address():
    """A CUDA graph captured with a call holds its workspace's address: a larger call of the same
    build must not free it (tiny V4.1's logits turned NaN on an H100 when it did). The outgrown
    workspace stays referenced in ``retired``; new ones are a power of two long."""
    import weakref

    kernel = codegen.compile(row_sums_twice_dynamic, "interpret", config={"BN": 4})
    g = torch.Generator().manual_seed(0)
    for n in (5, 40, 3, 70):
        x = torch.randint(-8, 9, (n, 3), generator=g).float()
        y = torch.zeros(n)
        kernel(x=x, y=y)
        assert torch.equal(y, 2 * x.sum(1)), n
        if n == 5:
            (call,) = {id(c): c for c in kernel._calls.values()}.values()
            first = call.workspaces["sums"]
            held, address = weakref.ref(first), first.data_ptr()
            del first
    assert len({id(c) for c in kernel._calls.values()}) == 1 and call.workspaces["sums"].numel() == 128  # 70 -> 128
    assert [w["sums"].numel() for w in call.retired] == [8, 64]  # 5 -> 8, then 40 -> 64; 3 fit in 64
    assert held() is not None and held().data_ptr() == address  # the first is alive at its address


def test_specialize_names_the_multi_phase_kernel():
    sig = row_sums_twice.bind({"x": torch.zeros(8, 2), "y": torch.zeros(8)})
    phases, _ = specialize_phases(row_sums_twice, sig)
    assert len(phases) == 2
    with pytest.raises(DslError, match="runs in 2 phases; use specialize_phases"):
        specialize(row_sums_twice, sig)


@dsl.kernel
def reads_scratch_first(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    scratch = dsl.workspace("scratch", (x.N,), dsl.f32)
    for i in dsl.grid(dsl.cdiv(x.N, 4)):
        dsl.store(y[i * 4], dsl.load(scratch[i * 4], (4,)))
    for j in dsl.grid(dsl.cdiv(x.N, 4)):
        dsl.store(scratch[j * 4], dsl.load(x[j * 4], (4,)))


def test_reading_a_workspace_before_an_earlier_phase_writes_it_names_the_line():
    with pytest.raises(DslError, match=r"test_phases.py:\d+.*reads workspace 'scratch' before an earlier phase"):
        verify_ir(reads_scratch_first.trace())


def _ws_in_grid(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for _i in dsl.grid(1):
        dsl.workspace("w", (4,), dsl.f32)


def _ws_clash(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    dsl.workspace("y", (4,), dsl.f32)
    for _i in dsl.grid(1):
        dsl.store(y[0], dsl.load(x[0], (4,)))


def _ws_bad_name(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    dsl.workspace("two words", (4,), dsl.f32)


def _op_between_grids(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for _i in dsl.grid(1):
        dsl.store(y[0], dsl.load(x[0], (4,)))
    dsl.zeros((4,))
    for _j in dsl.grid(1):
        dsl.store(y[0], dsl.load(x[0], (4,)))


def _grid_in_grid(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for _i in dsl.grid(1):
        for _j in dsl.grid(1):
            dsl.store(y[0], dsl.load(x[0], (4,)))


@pytest.mark.parametrize("fn, message", [
    (_ws_in_grid, r"test_phases.py:\d+.*dsl.workspace must be declared at the kernel's top level"),
    (_ws_clash, r"test_phases.py:\d+.*workspace 'y' clashes with another tensor"),
    (_ws_bad_name, r"test_phases.py:\d+.*a workspace name must be an identifier"),
    (_op_between_grids, r"test_phases.py:\d+.*`alloc` outside dsl.grid"),
    (_grid_in_grid, r"test_phases.py:\d+.*dsl.grid must be an outermost statement"),
])
def test_phase_and_workspace_errors_name_the_line(fn, message):
    with pytest.raises(DslError, match=message):
        dsl.kernel(fn).trace()


def _helper_loop(x, y, i):
    for k in dsl.range(2):  # the kernel's line (the call) is what the builder sees: no `for` to read
        dsl.store(y[i * 2 + k], dsl.load(x[i * 2 + k], (1,)))


@dsl.kernel
def loops_in_a_helper(x: dsl.Tensor["N", dsl.f32], y: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(dsl.cdiv(x.N, 2)):
        _helper_loop(x, y, i)


def test_a_loop_in_a_helper_function_traces():
    """Regression: naming a loop whose ``for`` is not on the kernel's line fell back to the
    builtin ``range``, which inside the DSL's ops module is ``dsl.range``: endless recursion."""
    x, y = torch.arange(6.0), torch.zeros(6)
    codegen.compile(loops_in_a_helper, "interpret")(x=x, y=y)
    assert torch.equal(y, x)


@dsl.kernel(dynamic=("N",))
def row_sums_twice_dynamic(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", dsl.f32], *,
                           BN: dsl.Tunable = dsl.choice(4, 8)):
    """``row_sums_twice`` with N dynamic: one build, its workspace sized per call."""
    sums = dsl.workspace("sums", (x.N,), dsl.f32)
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(sums[i * BN], dsl.load(x[i * BN, 0], (BN, x.D)).sum(axis=1))
    for j in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(y[j * BN], dsl.load(sums[j * BN], (BN,)) * 2.0)


def test_a_dynamic_workspace_grows_and_its_views_follow_it():
    """Views of the workspace are kept per size: a call at a size that no longer fits makes a new
    workspace, and a size seen before then views the new one, not the one it replaced."""
    kernel = codegen.compile(row_sums_twice_dynamic, "interpret", config={"BN": 4})
    for n in (8, 20, 8, 3):
        x, y = torch.randint(-8, 9, (n, 3), generator=torch.Generator().manual_seed(n)).float(), torch.zeros(n)
        kernel(x=x, y=y)
        assert torch.equal(y, 2 * x.sum(1)), n
    (call,) = {id(c): c for c in kernel._calls.values()}.values()  # one build served every size
    ws = call.workspaces["sums"]
    assert ws.numel() == 32  # 20 rounded up to a power of two
    assert all(v["sums"].untyped_storage().data_ptr() == ws.untyped_storage().data_ptr()
               for v in call._views.values())


@dsl.kernel(dynamic=("N", "M"))
def sums_with_optional_rows(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", dsl.f32],
                            extra: dsl.OptionalTensor["M", "D", dsl.f32] = None, *, BN: dsl.Tunable = dsl.choice(4)):
    """Two phases over x's rows, plus ``extra``'s first row where given: its size M is carried by
    an optional tensor alone."""
    sums = dsl.workspace("sums", (x.N,), dsl.f32)
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        row = dsl.load(x[i * BN, 0], (BN, x.D)).sum(axis=1)
        if extra is not None:
            row = row + dsl.load(extra[0, 0], (1, x.D)).sum(axis=1)
        dsl.store(sums[i * BN], row)
    for j in dsl.grid(dsl.cdiv(x.N, BN)):
        dsl.store(y[j * BN], dsl.load(sums[j * BN], (BN,)) * 2.0)


def test_a_size_only_an_optional_tensor_carries_is_read_without_sympy(monkeypatch):
    """Regression: a dynamic size that only an optional tensor gives (sparse_mqa_decode_fp8's
    compressed rows N, the decode epilogue's table length P) sent every call through
    ``Module.dynamic_sizes``' sympy printing: ~100 us of host time a call, which left the GPU
    idle and timed the stored-row decode at 201 us. The call reads each size at places found once
    (``Module.dynamic_places``), the first given tensor that carries it."""
    kernel = codegen.compile(sums_with_optional_rows, "interpret")
    g = torch.Generator().manual_seed(3)
    x, extra = torch.randint(-8, 9, (8, 3), generator=g).float(), torch.randint(-8, 9, (5, 3), generator=g).float()
    y = torch.zeros(8)
    kernel(x=x, y=y, extra=extra)
    assert torch.equal(y, 2 * (x.sum(1) + extra[0].sum()))
    kernel(x=x, y=y)  # without extra: a build of its own, where M is no size
    assert torch.equal(y, 2 * x.sum(1))
    call = next(c for c in kernel._calls.values() if "extra" in {p.name for p in c.phases[0].params})
    want = call.phases[0].dynamic_sizes({"x": x, "y": y, "extra": extra})
    assert dict(call._places) == {"n_N": (("x", 0), ("y", 0)), "n_M": (("extra", 0),)}
    # the launches replaced (the interpreter reads the sizes itself): the call's own path alone
    seen = []
    call.fns = [lambda args: seen.append(args["sums"].shape) for _ in call.fns]
    monkeypatch.setattr(type(call.phases[0]), "dynamic_places", lambda *a: pytest.fail("places found again"))
    for n, m in ((8, 7), (12, 5)):
        kernel(x=torch.zeros(n, 3), y=torch.zeros(n), extra=torch.zeros(m, 3))
    assert want == {"n_N": 8, "n_M": 5} and seen == [(8,), (8,), (12,), (12,)]
    # the workspace grew at N = 12: the views of the smaller one were dropped
    assert [dict(k[0]) for k in call._views] == [{"n_N": 12, "n_M": 5}]
