"""The autotuner's memoised and short-cut paths give exactly what the plain computation gives."""

from __future__ import annotations

import pytest
import sympy
import torch

from duotile.dsl.printer import format_module
from duotile.kernels_spec import registry


def test_kernel_hash_is_the_hash_of_a_fresh_trace(monkeypatch):
    import hashlib
    import json

    from duotile.dsl.printer import canonical_text
    from duotile.passes.autotune import cache

    def fresh(kernel, dtypes=None, present=None, constants=None):  # kernel_hash as it was, no memo
        text = canonical_text(kernel.trace(dtypes, present, None, constants))
        spaces = {k: [type(s).__name__, s.values(), repr(s.default)] for k, s in kernel.tunables.items()}
        return hashlib.sha256((text + json.dumps(spaces, sort_keys=True, default=str)).encode()).hexdigest()[:16]

    monkeypatch.setattr(cache, "_TEXTS", {})
    for name in ("gemm", "gemm_blockscaled", "rmsnorm", "mqa_decode"):
        spec = registry.get(name)
        for case in list(spec.cases.values())[:3]:
            sig = spec.kernel.bind(spec.meta_inputs(case))
            args = (sig.dtypes, sig.present, spec.constants_of(case))
            assert cache.kernel_hash(spec.kernel, *args) == fresh(spec.kernel, *args)  # made
            assert cache.kernel_hash(spec.kernel, *args) == fresh(spec.kernel, *args)  # kept
    gemm = registry.get("gemm").kernel
    bf16 = gemm.bind({"a": torch.empty(8, 8, dtype=torch.bfloat16), "b": torch.empty(8, 8, dtype=torch.bfloat16),
                      "c": torch.empty(8, 8, dtype=torch.bfloat16)})
    fp8 = gemm.bind({"a": torch.empty(8, 8, dtype=torch.float8_e4m3fn),
                     "b": torch.empty(8, 8, dtype=torch.float8_e4m3fn), "c": torch.empty(8, 8, dtype=torch.bfloat16)})
    assert cache.kernel_hash(gemm, bf16.dtypes) != cache.kernel_hash(gemm, fp8.dtypes)  # keyed by the call


def test_a_tuning_file_read_again_has_the_same_entries_and_damage_is_still_found(tmp_path, monkeypatch):
    import json

    from duotile.passes.autotune import cache

    monkeypatch.setattr(cache, "_VERIFIED", set())
    shipped = cache.TuningCache(cache.SHIPPED, read_only=True)  # checked in full, then by its bytes
    again = cache.TuningCache(cache.SHIPPED, read_only=True)
    plain = json.loads(cache.SHIPPED.read_bytes())["entries"]
    assert shipped.entries == again.entries == again._base == plain and not again.problems
    again.entries[next(iter(again.entries))]["config"]["x"] = 1  # each reader's entries are its own
    assert shipped.entries == plain and again._base == plain

    path = tmp_path / "tuning.json"
    path.write_bytes(cache.SHIPPED.read_bytes().replace(b'"BK": 128', b'"BK": 64', 1))
    with pytest.warns(UserWarning, match="checksum mismatch"):  # other bytes: checked, the checksum fails
        bad = cache.TuningCache(path, read_only=True)
    assert bad.entries == {} and any("checksum mismatch" in p for p in bad.problems)


def test_a_limit_of_integers_is_judged_as_sympy_judges_it():
    from duotile.passes.autotune.usage import Limit

    x = sympy.Symbol("x", positive=True)
    for needed, capacity in [(1, 2), (2, 2), (3, 2), (sympy.Integer(5), 4), (4, sympy.Integer(5)),
                             (sympy.Integer(0), sympy.Integer(0)), (sympy.Rational(5, 2), 2), (2.5, 3)]:
        assert Limit("m", needed, capacity).ok() == bool(sympy.Le(needed, capacity)), (needed, capacity)
    assert Limit("m", x + 1, x + 2).ok()  # symbolic: sympy decides


def test_the_fused_phases_of_a_shared_trace_are_those_of_a_copy(monkeypatch):
    """Each phase of the symbolic trace is bound on its own and fused as it comes: the fused phases
    are those of fusing a fresh copy of each phase of the bound module, and the kept symbolic trace
    is untouched."""
    from duotile.passes.autotune import constraints
    from duotile.passes.fuse_elementwise import fuse_elementwise
    from duotile.passes.rewrite import Rewriter
    from duotile.passes.split_phases import split_phases

    monkeypatch.setattr(constraints, "_TRACES", {})
    for name, case_name in (("gemm_splitk", None), ("rmsnorm", None)):
        spec = registry.get(name)
        case = next(iter(spec.cases.values())) if case_name is None else spec.cases[case_name]
        cons = constraints.Constraints(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90",
                                       spec.constants_of(case))
        config = cons.kernel.resolve_config(None)
        symbolic = format_module(cons._symbolic(config))
        phases, _ = constraints._shared_trace(cons, (), config)
        fresh = cons.bound(config)
        want = [format_module(fuse_elementwise(Rewriter().module(p))) for p in split_phases(fresh)]
        assert [format_module(p) for p in phases] == want and len(want) == (2 if name == "gemm_splitk" else 1)
        assert format_module(cons._symbolic(config)) == symbolic


def test_numbers_and_plain_attrs_take_the_short_paths_unchanged():
    from duotile.passes.autotune.cost_model import _num
    from duotile.passes.rewrite import map_expr

    x = sympy.Symbol("x")
    for e in (sympy.Integer(5), sympy.Rational(7, 2), sympy.Float(2.5), 3, 1.5):
        assert _num(e, {x: 1}) == float(sympy.sympify(e).subs({x: 1}))
    assert _num(x + 1, {x: 2}) == 3.0
    attrs = {"a": 1, "b": "s", "c": None, "d": True, "e": 2.0, "f": (x, [x + 1, 4], {"g": x})}
    got = map_expr(attrs, lambda e: e.subs(x, 3))
    assert got == {"a": 1, "b": "s", "c": None, "d": True, "e": 2.0, "f": (3, [4, 4], {"g": 3})}


def test_binding_each_phase_is_binding_then_splitting():
    """``bind_phases`` binds each phase of the unbound trace on its own: the same modules, names and
    phase numbers as ``split_phases(bind_shapes(...))``, the trace untouched, and a single phase is
    a new module too."""
    from duotile.passes.autotune.constraints import bind_phases
    from duotile.passes.bind_shapes import bind_shapes
    from duotile.passes.split_phases import split_phases

    for name in ("gemm_splitk", "rmsnorm"):
        spec = registry.get(name)
        case = next(iter(spec.cases.values()))
        sig = spec.kernel.bind(spec.meta_inputs(case))
        trace = spec.kernel.trace(sig.dtypes, sig.present, None, spec.constants_of(case))
        before = format_module(trace)
        got, want = bind_phases(trace, sig.shapes), split_phases(bind_shapes(trace, sig.shapes))
        assert [format_module(p) for p in got] == [format_module(p) for p in want]
        assert [(p.name, p.phase, p.shapes, p.params) for p in got] == [(p.name, p.phase, p.shapes, p.params)
                                                                         for p in want]
        assert len(got) == (2 if name == "gemm_splitk" else 1) and all(p is not trace for p in got)
        assert format_module(trace) == before


def test_a_kept_number_is_kept_by_its_expression_and_env():
    from duotile.passes.autotune.cost_model import _num

    x, y = sympy.Symbol("x"), sympy.Symbol("y")
    for _ in range(2):
        assert _num(x + 1, {x: 2.0}) == 3.0 and _num(x + 1, {x: 5.0}) == 6.0
        assert _num(x + y, {x: 1.0, y: 2.0}) == 3.0 and _num(x + y, {x: 1.0, y: 7.0}) == 8.0
