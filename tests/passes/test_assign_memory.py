"""assign_memory on tiny fragments, with a made-up target model (the pass is target-neutral)."""

from __future__ import annotations

import pytest

from duotile import dsl
from duotile.dsl.ir import Role
from duotile.passes.assign_memory import assign_memory, memory_usage
from duotile.passes.bind_shapes import bind_shapes
from duotile.passes.fuse_elementwise import fuse_elementwise
from duotile.passes.memory_model import MemoryModel


def toy(smem: int = 1 << 20, acc: int | None = None) -> MemoryModel:
    caps = {"smem": smem}
    if acc is not None:
        caps["acc"] = acc
    return MemoryModel("toy", {Role.OPERAND: "smem", Role.ACCUMULATOR: "acc", Role.VECTOR: "regs"}, caps,
                       {"smem": "shared memory", "acc": "accumulator memory"})


@dsl.kernel
def mm(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16], c: dsl.Tensor["M", "N", dsl.bf16], *,
       BM: dsl.Tunable = dsl.choice(64, 128), BK: dsl.Tunable = dsl.choice(32, 64),
       STAGES: dsl.Tunable = dsl.int_range(1, 4, default=2)):
    for m, n in dsl.grid(dsl.cdiv(a.M, BM), dsl.cdiv(b.N, BM)):
        acc = dsl.zeros((BM, BM), dsl.f32, role="accumulator")
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=STAGES):
            at = dsl.load(a[m * BM, k * BK], (BM, BK), role="operand")
            bt = dsl.load(b[n * BM, k * BK], (BM, BK), role="operand")
            dsl.gemm(at, bt, acc, transpose_b=True)
        dsl.store(c[m * BM, n * BM], acc.to(dsl.bf16))


@dsl.kernel
def two_phases(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32]):
    for i in dsl.grid(x.N // 64):
        first = dsl.load(x[i * 64, 0], (64, x.D), role="operand")  # 64x128x4 = 32 KiB
        dsl.store(y[i * 64, 0], first)
        second = dsl.load(x[i * 64, 0], (64, x.D), role="operand")  # first is dead here
        dsl.store(y[i * 64, 0], second)


def bound(kernel, shapes, **config):
    return fuse_elementwise(bind_shapes(kernel.trace(config=config), shapes))


def test_scopes_are_annotated_from_roles():
    m = assign_memory(bound(mm, dict(M=256, N=256, K=256)), toy())
    scopes = {op.result.hint: op.attrs["scope"] for op in m.walk() if op.result is not None}
    assert scopes["a"] == "smem" and scopes["b"] == "smem" and scopes["buf"] == "acc"
    assert "scope=smem" in str(m)


def test_pipelined_loads_cost_one_buffer_per_stage():
    m = bound(mm, dict(M=256, N=256, K=256), BM=64, BK=32, STAGES=3)
    use = memory_usage(m, toy())
    assert use["smem"].peak == 3 * 2 * (64 * 32 * 2)  # 2 tiles x 3 stages of bf16[64x32]
    assert use["acc"].peak == 64 * 64 * 4


def test_dead_values_do_not_add_up():
    use = memory_usage(bound(two_phases, dict(N=128, D=128)), toy())
    assert use["smem"].peak == 64 * 128 * 4  # never both tiles at once


def test_loop_carried_buffer_is_live_for_the_whole_loop():
    m = bound(mm, dict(M=128, N=128, K=256), BM=64, BK=32, STAGES=1)
    use = memory_usage(m, toy())
    hints = {x.value.hint for x in use["acc"].at}
    assert hints == {"buf"}  # the accumulator is live while the loads are
    assert {x.value.hint for x in use["smem"].at} == {"a", "b"}


def test_overflow_names_memory_sizes_and_line():
    m = bound(mm, dict(M=256, N=256, K=256), BM=128, BK=64, STAGES=4)  # 4 x 2 x 16 KiB = 128 KiB
    with pytest.raises(dsl.CapacityError) as err:
        assign_memory(m, toy(smem=100 * 1024))
    msg = str(err.value)
    assert "toy: shared memory overflow" in msg and "131072 bytes (128.0 KiB)" in msg and "102400" in msg
    assert "x4 stages" in msg and "line" in msg
    assert err.value.memory == "shared memory" and err.value.needed == 131072


def test_accumulator_capacity_checked_and_unbounded_scope_not():
    m = bound(mm, dict(M=256, N=256, K=256), BM=128)
    with pytest.raises(dsl.CapacityError, match="accumulator memory overflow: needs 65536"):
        assign_memory(m, toy(acc=32 * 1024))
    assign_memory(bound(mm, dict(M=256, N=256, K=256), BM=128), toy())  # "regs" has no capacity: fine
