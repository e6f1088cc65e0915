"""The shipped tuning table (duotile/tuned/tuning.json) is current, checked on the CPU: each entry's
key is the key this checkout computes for the entry's case (an edited kernel, whose IR hash moves,
would otherwise leave its entry silently unused), and each config builds for its target without
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


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(e) for e in ENTRIES])
def test_shipped_entry_matches_this_checkout_and_builds(entry):
    key = entry["key"]
    spec = load_all()[key["kernel"]]
    case = entry["case"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    mine = make_key(spec.kernel, key["target"], sig.shapes, key["device"], key["toolchain"], sig.dtypes,
                    sig.present, spec.constants_of(case))
    assert mine == key, "stale entry: re-tune the kernel (its trace or constants changed)"
    r = build_case(spec, "shipped", case, key["target"], config=entry["config"], use_tuned=False)
    assert r.ok, r.error
    for a in r.artifacts:
        if "ptxas" in a.meta:
            assert a.meta["ptxas"]["spill_stores"] == 0
