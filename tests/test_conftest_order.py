"""The suite's test order (tests/conftest.py longest_first): each xdist half holds about half of
the known seconds, longest first; the halves have equal counts; a module-scoped fixture's tests
stay together in their order; nothing is lost or repeated."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import GC_THRESHOLDS, longest_first


def _item(nodeid: str, scope: str = "function"):
    defs = [SimpleNamespace(scope=scope)]
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs={"f": defs}))


def test_halves_balance_the_known_seconds_longest_first():
    items = [_item(f"t.py::q{i}") for i in range(6)] + [_item("t.py::a"), _item("t.py::b"), _item("t.py::c")]
    seconds = {"t.py::a": 10.0, "t.py::b": 6.0, "t.py::c": 5.0}
    order = longest_first(items, seconds)
    ids = [i.nodeid for i in order]
    assert sorted(ids) == sorted(i.nodeid for i in items)
    first, second = ids[:len(ids) // 2 + len(ids) % 2], ids[len(ids) // 2 + len(ids) % 2:]
    assert first[0] == "t.py::a" and second[:2] == ["t.py::b", "t.py::c"]  # 10 against 6 + 5
    assert abs(len(first) - len(second)) <= 1
    for half in (first, second):  # the quick tests last, in their collection order
        quick = [i for i in half if i.startswith("t.py::q")]
        assert quick == sorted(quick) and half[-len(quick):] == quick


def test_a_module_fixtures_tests_stay_together_in_order():
    mod = [_item(f"m.py::t[{i}]", "module") for i in range(4)]
    items = [mod[0], _item("t.py::x"), mod[1], mod[2], _item("t.py::y"), mod[3]]
    ids = [i.nodeid for i in longest_first(items, {"m.py::t[2]": 3.0, "t.py::y": 2.0})]
    at = ids.index("m.py::t[0]")
    assert ids[at:at + 4] == [f"m.py::t[{i}]" for i in range(4)] and at == 0


def test_the_collector_thresholds_are_set_in_this_process():
    import gc

    assert gc.get_threshold() == GC_THRESHOLDS
