import pytest

from duotile import dsl
from duotile.dsl.errors import DslError
from duotile.passes.check_batch_invariance import check_batch_invariance, find_reductions, require_batch_free


@dsl.kernel(batch_dim="T")
def row_sumsq(x: dsl.Tensor["T", "D", dsl.f32], y: dsl.Tensor["T", dsl.f32], *,
              ROWS: dsl.Tunable = dsl.choice(1, 2, 4), BD: dsl.Tunable = dsl.choice(64, 128)):
    for t in dsl.grid(dsl.cdiv(x.T, ROWS)):
        acc = dsl.zeros((ROWS,), dsl.f32)
        for k in dsl.range(dsl.cdiv(x.D, BD)):
            xt = dsl.load(x[t * ROWS, k * BD], (ROWS, BD))
            acc[:] = acc + (xt * xt).sum(axis=1)
        dsl.store(y[t * ROWS], acc)


@dsl.kernel(batch_dim="T")
def col_sum(x: dsl.Tensor["T", "D", dsl.f32], y: dsl.Tensor["D", dsl.f32], *,
            BT: dsl.Tunable = dsl.choice(2, 4), BD: dsl.Tunable = dsl.choice(8, 16)):
    for d in dsl.grid(dsl.cdiv(x.D, BD)):
        acc = dsl.zeros((BD,), dsl.f32)
        for t in dsl.range(dsl.cdiv(x.T, BT)):
            acc[:] = acc + dsl.load(x[t * BT, d * BD], (BT, BD)).sum(axis=0)  # REJECT-HERE
        dsl.store(y[d * BD], acc)


@dsl.kernel(batch_dim="T")
def batch_split_matmul(x: dsl.Tensor["T", "K", dsl.bf16], w: dsl.Tensor["N", "K", dsl.bf16],
                       y: dsl.Tensor["T", "N", dsl.f32], *,
                       BN: dsl.Tunable = dsl.choice(64, 128), BK: dsl.Tunable = dsl.choice(32, 64)):
    # the K chunk grows with the batch (a split-K chosen from the batch size): not invariant
    chunk = BK * dsl.minimum(x.T, 4)
    for n in dsl.grid(dsl.cdiv(w.N, BN)):
        acc = dsl.zeros((x.T, BN), dsl.f32, role="accumulator")
        for k in dsl.range(dsl.cdiv(x.K, chunk)):
            a = dsl.load(x[0, k * chunk], (x.T, chunk), role="operand")
            b = dsl.load(w[n * BN, k * chunk], (BN, chunk), role="operand")
            dsl.gemm(a, b, acc, transpose_b=True)  # GEMM-HERE
        dsl.store(y[0, n * BN], acc)


def _line(fn, marker):
    import inspect

    src, start = inspect.getsourcelines(fn.fn)
    return start + next(i for i, s in enumerate(src) if marker in s)


def test_row_reduction_with_tunables_is_accepted():
    module = check_batch_invariance(row_sumsq)
    kinds = {(r.kind, frozenset(r.dims)) for r in find_reductions(module)}
    assert ("reduce.sum", frozenset({"D"})) in kinds and ("loop", frozenset({"D"})) in kinds


def test_reduction_over_the_batch_split_by_a_tunable_is_rejected():
    with pytest.raises(DslError) as err:
        check_batch_invariance(col_sum)
    msg = str(err.value)
    assert "tunable 'BT'" in msg and "batch dimension T" in msg and "'BD'" not in msg
    # named at the loop that splits the reduction over T (or the sum over T inside it)
    assert err.value.loc.line in (_line(col_sum, "for t in"), _line(col_sum, "REJECT-HERE"))


def test_gemm_k_split_that_depends_on_the_batch_is_rejected():
    with pytest.raises(DslError) as err:
        check_batch_invariance(batch_split_matmul)
    assert "tunable 'BK'" in str(err.value) and "'BN'" not in str(err.value)
    assert err.value.loc.line in (_line(batch_split_matmul, "GEMM-HERE"), _line(batch_split_matmul, "for k in"))


def test_kernels_without_a_batch_dim_are_not_checked():
    from duotile.kernels_spec import registry

    assert check_batch_invariance(registry.get("gemm").kernel).name == "gemm"
    assert check_batch_invariance(registry.get("rmsnorm").kernel).batch_dim == "T"


def test_tuned_config_may_not_depend_on_the_batch_size():
    same = {(("D", 64), ("T", 1)): {"ROWS": 2}, (("D", 64), ("T", 64)): {"ROWS": 2}}
    assert require_batch_free(row_sumsq, same) == {"ROWS": 2}
    with pytest.raises(DslError, match="differs between"):
        require_batch_free(row_sumsq, {(("D", 64), ("T", 1)): {"ROWS": 1}, (("D", 64), ("T", 64)): {"ROWS": 4}})


def test_compiling_a_batch_dependent_reduction_fails_before_codegen():
    """The pass sits in every target's pipeline (codegen.specialize), not only in the tuner."""
    import torch

    from duotile import codegen

    k = codegen.compile(col_sum, "interpret")
    with pytest.raises(DslError, match="batch-invariant in T"):
        k(x=torch.zeros(8, 4), y=torch.zeros(4))
