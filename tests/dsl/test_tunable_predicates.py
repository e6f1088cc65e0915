"""``dsl.SMALLER_POW2``: the ``also=`` of tile sizes a test may set below the searched ones (topk's
CHUNK, the candidate pool's widths), once two private copies in the specs."""

from __future__ import annotations

from duotile import dsl


def test_a_power_of_two_is_admitted_and_nothing_else():
    space = dsl.choice(64, 128, also=dsl.SMALLER_POW2)
    assert [v for v in (1, 2, 16, 64, 256) if space.accepts(v)] == [1, 2, 16, 64, 256]
    assert not any(space.accepts(v) for v in (0, 3, 48, -4, True, 2.0, "64"))
    assert "a smaller power of two" in space.allowed()
