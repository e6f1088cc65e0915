"""mark_short_loops: loops that run at most once at every grid point are marked, and the CUDA
and Ascend generators guard them instead of emitting a loop TileLang would run unconditionally."""

from __future__ import annotations

import dataclasses

import sympy

from duotile.codegen.driver import generate_case
from duotile.codegen.tilelang_ascend.emit_expr import index as ascend_index
from duotile.kernels_spec.registry import get
from duotile.passes.mark_short_loops import max_trips

s = sympy.Symbol("s")


def test_max_trips_over_the_grid():
    ten_over_16 = (sympy.floor(s * 10 / 16), sympy.floor((s + 1) * 10 / 16))
    assert max_trips(*ten_over_16, {s: 16}) == 1
    assert max_trips(sympy.floor(s * 130 / 16), sympy.floor((s + 1) * 130 / 16), {s: 16}) == 9
    assert max_trips(s, s + 1, {s: 16}) == 1
    assert max_trips(0, 7, {}) == 7
    assert max_trips(0, sympy.Symbol("R"), {s: 16}) is None  # a size the grid does not bind


def _loop_lines(target, rows, config):
    """The loop lines of mqa_decode built for a static row count (its rows are dynamic by default)."""
    spec = get("mqa_decode")
    spec = dataclasses.replace(spec, kernel=dataclasses.replace(spec.kernel, dynamic=()))
    case = {"B": 2, "H": 64, "R": rows, "D": 512 if target == "sm90" else 128}
    src = generate_case(spec, case, target, config=config, use_tuned=False)[0].stages["tilelang"]
    return [line.strip() for line in src.splitlines() if "runs at most once" in line or "Pipelined" in line]


def test_cuda_guards_a_split_whose_ranges_hold_zero_or_one_block():
    # 640 rows = 10 blocks of 64 over 16 ranges: TileLang ran every empty range's block anyway
    lines = _loop_lines("sm90", 640, {"SPLIT": 16, "BN": 64})
    assert len(lines) == 1 and lines[0].startswith("if ") and lines[0].split("#")[0].rstrip().endswith("> 0:")
    # 8,320 rows: 8 or 9 blocks a range, an ordinary pipelined loop
    assert any("T.Pipelined" in line for line in _loop_lines("sm90", 8320, {"SPLIT": 16, "BN": 64}))


def test_ascend_guards_it_too():
    lines = _loop_lines("ascend950", 640, {"SPLIT": 16, "BN": 64, "STAGES": 1})
    assert len(lines) == 1 and "runs at most once" in lines[0]


def test_ascend_index_keeps_a_negated_floor_whole():
    e = sympy.floor((5 * s + 5) / 8) - sympy.floor(5 * s / 8)
    text = ascend_index(e, {"s": "s"})
    assert [eval(text, {"s": v}) for v in range(16)] == [int(e.subs(s, v)) for v in range(16)]
