"""The shipped tuning table (duotile/tuned/tuning.json) is current, checked on the CPU: each entry's
key is the key this checkout computes for the entry's case (an edited kernel, whose IR hash moves,
would otherwise leave its entry silently unused), each config generates for its target, and one
entry of each schedule (kernel, target, dtypes, target knobs), its largest tiles, builds without
spilling registers. The GPU side, that builds on the H200 pick the entries up, is
tests/gpu/test_shipped_tuning.py."""

from __future__ import annotations

import pytest

from duotile.codegen.driver import build_case
from duotile.kernels_spec import load_all
from duotile.passes.autotune.cache import SHIPPED, TuningCache, make_key

ENTRIES = sorted(TuningCache(SHIPPED, read_only=True).entries.values(),
                 key=lambda e: (e["key"]["kernel"], e["key"]["target"], repr(sorted(e["case"].items()))))


def _id(entry) -> str:
    key = entry["key"]
    dtype = entry["case"].get("dtype", "")
    return f"{key['kernel']}-{key['target']}-{key['device']}" + (f"-{dtype}" if dtype else "")


def test_the_shipped_table_is_trusted_and_not_empty():
    table = TuningCache(SHIPPED, read_only=True)
    assert not table.problems and len(table.entries) >= 4


def _schedule(entry) -> tuple:
    """What an entry's build depends on beyond tile sizes: its kernel, target, dtypes and target knobs."""
    spec = load_all()[entry["key"]["kernel"]]
    knobs = {k: v for k, v in entry["config"].items() if k not in spec.kernel.tunables}
    return (entry["key"]["kernel"], entry["key"]["target"], repr(sorted(entry["key"]["dtypes"].items())),
            repr(sorted(knobs.items())))


# a full build (TileLang and nvcc, a cubin checked for spills) of one entry of each schedule: the
# largest tiles of it, where registers run out first; every other entry is generated (below)
def _largest_of_each_schedule(entries) -> list:
    tiles = lambda e: sum(int(v) for k, v in e["config"].items() if k.startswith("B") and isinstance(v, int))
    best = {}
    for e in entries:
        if _schedule(e) not in best or tiles(e) > tiles(best[_schedule(e)]):
            best[_schedule(e)] = e
    return list(best.values())


BUILT = _largest_of_each_schedule(ENTRIES)


def _check_key(entry):
    key = entry["key"]
    spec = load_all()[key["kernel"]]
    case = entry["case"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    mine = make_key(spec.kernel, key["target"], sig.shapes, key["device"], key["toolchain"], sig.dtypes,
                    sig.present, spec.constants_of(case))
    assert mine == key, "stale entry: re-tune the kernel (its trace or constants changed)"
    return spec, case


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(e) for e in ENTRIES])
def test_shipped_entry_matches_this_checkout_and_generates(entry):
    from duotile.codegen.driver import generate_case

    spec, case = _check_key(entry)
    arts = generate_case(spec, case, entry["key"]["target"], config=entry["config"], use_tuned=False)
    assert arts and all("T.Kernel(" in a.stages["tilelang"] or "T.ClusterKernel(" in a.stages["tilelang"]
                        for a in arts)


def test_every_schedule_of_the_table_has_a_built_entry():
    assert {_schedule(e) for e in BUILT} == {_schedule(e) for e in ENTRIES} and len(BUILT) < len(ENTRIES)


@pytest.mark.parametrize("entry", BUILT, ids=[_id(e) for e in BUILT])
def test_shipped_entry_builds_without_spilling(entry):
    spec, case = _check_key(entry)
    r = build_case(spec, "shipped", case, entry["key"]["target"], config=entry["config"], use_tuned=False)
    assert r.ok, r.error
    for a in r.artifacts:
        if "ptxas" in a.meta:
            assert a.meta["ptxas"]["spill_stores"] == 0
