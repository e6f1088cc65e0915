"""Per-sequence tensors kept as views of one stack (runtime/stacked.py)."""

from __future__ import annotations

import torch

from duotile.runtime.cache import Rows, append_each
from duotile.runtime.stacked import stack_of, stacked


def test_views_of_a_stack_in_order_are_passed_as_they_are_and_any_other_order_is_restacked():
    parts = [torch.full((3, 2), float(i)) for i in range(4)]
    assert stack_of(parts) is None
    base, views = stacked(parts)
    assert views is not None and base.shape == (4, 3, 2) and all(torch.equal(v, p) for v, p in zip(views, parts))
    again, none = stacked(views)
    assert none is None and again is base
    views[2].fill_(9.0)  # a sequence writes its own rows: the stack sees them, the others do not change
    assert (base[2] == 9).all() and (base[1] == 1).all()
    swapped, new = stacked([views[1], views[0], views[2], views[3]])
    assert new is not None and swapped is not base and torch.equal(swapped[0], base[1])
    assert stacked(views[:3])[1] is not None  # a part of the batch is not the stack


def test_rows_of_different_lengths_are_padded_with_zeros_and_grow_by_doubling():
    stores = [Rows(2, torch.float32, "cpu") for _ in range(3)]
    for i, s in enumerate(stores):
        s.append(torch.full((i + 1, 2), float(i + 1)))
    for step in range(20):
        append_each(stores, torch.full((2, 2), float(step)), [1, 0, 1], stack=True)
    base = stack_of([s.data for s in stores])
    assert base is not None and base.shape[1] == 32  # 16 rows to start, doubled once
    assert [s.n for s in stores] == [21, 2, 23]
    assert torch.equal(stores[0].view[1:], torch.arange(20.0)[:, None].expand(20, 2))
    assert torch.equal(stores[1].view, torch.full((2, 2), 2.0)) and (base[1, 2:] == 0).all()
    assert torch.equal(stores[2].view[:3], torch.full((3, 2), 3.0))
