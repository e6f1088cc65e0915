import torch

from duotile.kernels_spec import registry
from duotile.passes.autotune.constraints import Constraints, parse_relation


def gemm_constraints(target, m=8192, n=8192, k=8192, relations=()):
    spec = registry.get("gemm")
    inputs = {"a": torch.empty(m, k, dtype=torch.bfloat16), "b": torch.empty(n, k, dtype=torch.bfloat16),
              "c": torch.empty(m, n, dtype=torch.bfloat16)}
    return Constraints(spec.kernel, spec.kernel.bind(inputs), target, relations=relations)


def test_shared_memory_overflow_on_sm90_is_pruned_with_its_reason():
    c = gemm_constraints("sm90")
    ok = c.check({"BM": 128, "BN": 128, "BK": 64, "STAGES": 3})
    assert ok.ok and ok.usage["shared memory"] == 3 * (128 * 64 + 128 * 64) * 2
    bad = c.check({"BM": 256, "BN": 256, "BK": 128, "STAGES": 5})
    assert not bad.ok
    assert any(r.startswith("shared memory: needs 640.0 KiB > capacity 227.0 KiB") for r in bad.reasons)


def test_registers_limit_accumulators_on_sm90_but_tmem_holds_them_on_sm100():
    cfg = {"BM": 256, "BN": 256, "BK": 32, "STAGES": 2}
    sm90 = gemm_constraints("sm90").check(cfg)
    assert not sm90.ok and any("registers per thread" in r for r in sm90.reasons)
    sm100 = gemm_constraints("sm100").check(cfg)
    assert sm100.usage["tensor memory"] == 2 * 256  # 256 rows -> 2 x 128 lanes, 256 columns each
    assert sm100.ok


def test_ascend_memories_are_checked_separately():
    c = gemm_constraints("ascend950")
    v = c.check({"BM": 256, "BN": 256, "BK": 128, "STAGES": 5})
    assert not v.ok
    assert any(r.startswith("L1: needs") for r in v.reasons)   # 5 x 128 KiB of operands
    assert any(r.startswith("L0A: needs 64.0") for r in v.reasons) is False  # 256x128 bf16 = 64 KiB fits
    assert v.usage["L0C"] == 256 * 256 * 4
    assert c.check({"BM": 128, "BN": 128, "BK": 64, "STAGES": 2}).ok


def test_waste_and_user_relations():
    c = gemm_constraints("sm90", m=64, n=8192, k=8192, relations=["Mod(K, BK) == 0", "BM * BN <= 16384"])
    v = c.check({"BM": 256, "BN": 128, "BK": 64, "STAGES": 2})
    assert not v.ok
    assert any("tile extent 256 over M=64 exceeds its power-of-two bucket 64" in r for r in v.reasons)
    assert "violates BM * BN <= 16384" in v.reasons
    assert c.check({"BM": 64, "BN": 128, "BK": 64, "STAGES": 2}).ok


def test_mma_atom_divisibility():
    spec = registry.get("gemm")
    inputs = {"a": torch.empty(64, 64, dtype=torch.float8_e4m3fn), "b": torch.empty(64, 64, dtype=torch.float8_e4m3fn),
              "c": torch.empty(64, 64, dtype=torch.bfloat16)}
    c = Constraints(spec.kernel, spec.kernel.bind(inputs), "sm90")
    assert c.check({"BM": 64, "BN": 64, "BK": 32, "STAGES": 2}).ok  # 32 fp8 = 32 bytes of K


def test_relation_parser_reports_missing_names():
    import pytest

    from duotile.dsl.errors import DslError

    holds = parse_relation("Mod(K, BK) == 0")
    assert holds({"K": 128, "BK": 64}) and not holds({"K": 100, "BK": 64})
    with pytest.raises(DslError, match="no value for BK"):
        holds({"K": 128})


def test_the_targets_own_capacity_model_has_the_last_word(monkeypatch):
    """Regression: the estimator passed configs that the ascend950 pipeline then rejected at build
    time (seen in a compile-only sweep); now the target's check runs before anything compiles."""
    from duotile.codegen.target import get_target
    from duotile.dsl.errors import CapacityError

    spec = registry.get("rmsnorm")
    sig = spec.kernel.bind(spec.meta_inputs({"T": 64, "D": 512}))
    target = get_target("interpret")

    def refuse(module, knobs):
        raise CapacityError("interpret", "L0C", 600 * 1024, 256 * 1024)

    monkeypatch.setattr(target, "lower", refuse)
    verdict = Constraints(spec.kernel, sig, "interpret").check({"ROWS": 1})
    assert not verdict.ok
    assert any("L0C: needs 600.0 KiB > capacity 256.0 KiB" in r for r in verdict.reasons)


def test_one_trace_per_config_serves_the_estimator_and_the_targets_check(monkeypatch):
    from duotile.codegen.target import get_target
    from duotile.passes.autotune import constraints

    monkeypatch.setattr(constraints, "_TRACES", {})  # the process's traces: none yet
    monkeypatch.setattr(constraints, "_SYMBOLIC", {})
    c = gemm_constraints("sm90")
    calls = {"trace": 0, "lower": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(c.kernel, "trace", counting("trace", c.kernel.trace))
    target = get_target("sm90")
    monkeypatch.setattr(target, "lower", counting("lower", target.lower))
    assert c.check({"BM": 128, "BN": 128, "BK": 64, "STAGES": 3}).ok  # estimator, then the target's check
    assert calls == {"trace": 1, "lower": 1}
    assert not c.check({"BM": 256, "BN": 256, "BK": 128, "STAGES": 5}).ok  # pruned by the estimator
    assert calls == {"trace": 2, "lower": 1}
    # a neighbour that moves a target knob alone reuses the trace; the target still lowers it
    assert c.check({"BM": 128, "BN": 128, "BK": 64, "STAGES": 3, "threads": 128}).ok
    assert calls == {"trace": 2, "lower": 2}


def test_targets_checking_one_call_share_its_traces(monkeypatch):
    """The trace of a tile config does not depend on the target: a shape's searches on sm90, sm100
    and ascend950 trace each tile config once between them."""
    from duotile.passes.autotune import constraints

    monkeypatch.setattr(constraints, "_TRACES", {})
    monkeypatch.setattr(constraints, "_SYMBOLIC", {})
    first, second = gemm_constraints("sm90"), gemm_constraints("sm100")
    calls = []
    real = first.kernel.trace
    monkeypatch.setattr(first.kernel, "trace", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tiles = {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3}
    assert first.check(tiles, full=False).ok and second.check(tiles, full=False).ok
    assert len(calls) == 1
    assert second.check({**tiles, "BN": 64}, full=False).ok and len(calls) == 2  # other tiles: a trace of their own


def test_a_shared_trace_is_not_changed_by_the_targets_lowering():
    """The target's check lowers phases bound anew: the fused phases the estimator reads stay as
    traced, so a second config with the same tiles is judged on the same modules as the first."""
    from duotile.dsl.printer import format_module

    c = gemm_constraints("sm90")
    base = {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3}
    assert c.check(base).ok
    (phases, _), = c._traced.values()
    before = [format_module(p) for p in phases]
    assert c.check({**base, "threads": 128}).ok and c.law({**base, "threads": 512}) == []
    assert [format_module(p) for p in phases] == before


def test_sm90_registers_count_the_tiles_live_together_not_the_sum_of_two_peaks():
    # regression: the quick filter added the accumulator peak (scores + output) to the vector peak
    # (the exponentials, which take the scores' registers once those die), and pruned attention
    # 128x192 at "291 registers"; it builds without spills and was the fastest config measured
    spec = registry.get("flash_attention")
    case = spec.build_cases["d128"]
    c = Constraints(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90", spec.constants_of(case))
    manual = {"BM": 128, "STAGES": 2, "warp_specialize": "manual", "overlap": True}
    wide = c.check({**manual, "BN": 192})
    assert wide.ok, wide.reasons
    # scores 128x192 and the output 128x128 in fp32 over 256 threads, plus three row vectors (max, sum,
    # rescale: 3 x 128 fp32 over 256 threads, rounded up) and the fixed allowance of 32
    assert wide.usage["registers per thread"] == (128 * 192 + 128 * 128) // 256 + 3 + 32
    one_group = c.check({**manual, "BN": 192, "threads": 128})  # one warp group holding it all
    assert not one_group.ok and any("registers per thread" in r for r in one_group.reasons)


def test_the_waste_floor_is_the_targets_least_tile_and_a_warp_without_a_gemm():
    # sm100's 64-row tcgen05 form takes only N multiples of 64: a 128-row tile over 3 key rows is
    # its least tile, not waste (a 2-head indexer call of a small model had no config that lowered)
    spec = registry.get("indexer_logits")
    case = {"B": 1, "H": 2, "L": 3, "D": 128, "RATIO": 4}
    sig = spec.kernel.bind(spec.meta_inputs(case))
    on = {t: Constraints(spec.kernel, sig, t, spec.constants_of(case)) for t in ("sm90", "sm100")}
    cfg = {"BN": 128, "NB": 1, "STAGES": 2}
    assert on["sm100"].check(cfg, full=False).ok
    assert any("tile extent 128 over L=3" in r for r in on["sm90"].check(cfg, full=False).reasons)
    # a kernel with no gemm: a 64-wide tile over 16 channels is waste (floor 32)
    spec = registry.get("compressor_decode")
    case = {"B": 20, "form": "hca", "D": 16, "P": 8}
    cons = Constraints(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90", spec.constants_of(case))
    assert any("tile extent 64 over" in r for r in cons.check({"BD": 64}, full=False).reasons)
    assert cons.check({"BD": 32}, full=False).ok


def test_the_config_searches_of_a_specs_shapes_share_one_symbolic_trace(monkeypatch):
    """A trace does not depend on the sizes: the searches at each model shape trace a tile config
    once, then bind each shape's sizes to a copy (the kept trace never changes)."""
    from duotile.passes.autotune import constraints

    spec = registry.get("gemm")
    monkeypatch.setattr(constraints, "_SYMBOLIC", {})
    calls = []
    trace = spec.kernel.trace
    monkeypatch.setattr(spec.kernel, "trace", lambda *a: calls.append(a) or trace(*a))
    config = {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3, "SPLIT": 1}
    bound = []
    for shape in ("v41/wq_b/prefill4096", "v41/wo_b/prefill4096", "v41/shared_w13/prefill4096"):
        case = spec.model_cases()[shape]
        cons = Constraints(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90")
        bound.append(cons.bound(config))
    assert len(calls) == 1
    assert [m.shapes["N"] for m in bound] == [32768, 5120, 4608]
    assert all(not d.is_Integer for p in constraints._SYMBOLIC.popitem()[1][1].params for d in p.shape[1:])
