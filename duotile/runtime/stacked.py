"""Per-sequence cache tensors kept as views of one stacked tensor, so that a decode step reads and
writes every sequence's rows in one launch.

Each sequence owns its tensors (a window ring, compressed rows, a compressor's banks): a step of B
sequences asks for their stack [B, ...]. ``stack_of`` returns the tensor they are consecutive views
of, in the step's order, if there is one; otherwise ``restack`` copies them into a new stack (the
rows padded with zeros to a common length) and each sequence's tensor becomes a view of it. A decode
loop over the same requests thus stacks once and then passes its stacks as they are; a request
joining or leaving costs one copy of the step's tensors. Nothing is shared between sequences: a
view is written only through its own sequence's rows.
"""

from __future__ import annotations

import torch


def stack_of(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor [B, ...] whose index i is ``parts[i]`` (a view of it), or None."""
    base = parts[0]._base
    if base is None or base.shape[0] != len(parts) or base.dim() != parts[0].dim() + 1:
        return None
    for i, p in enumerate(parts):
        if p._base is not base or p.shape != base.shape[1:] or p.storage_offset() != i * base.stride(0):
            return None
    return base


def restack(parts: list[torch.Tensor], rows: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``parts`` copied into a new [B, rows, ...] tensor (``rows`` at least each part's first size;
    the longest by default), zeros past each part's rows; and its views, one a part."""
    rows = max(p.shape[0] for p in parts) if rows is None else rows
    if all(p.shape[0] == rows for p in parts):
        base = torch.stack(parts)
    else:
        base = parts[0].new_zeros(len(parts), rows, *parts[0].shape[1:])
        for i, p in enumerate(parts):
            base[i, : p.shape[0]] = p
    return base, list(base.unbind(0))


def stacked(parts: list[torch.Tensor], rows: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """``(stack, None)`` where ``parts`` already are its views (and hold ``rows``, if given), else
    ``restack``'s ``(stack, views)``: the caller makes each sequence's tensor its view."""
    base = stack_of(parts)
    if base is not None and (rows is None or base.shape[1] >= rows):
        return base, None
    return restack(parts, rows)


def stack_attr(owners: list, name: str) -> torch.Tensor:
    """The stack of each owner's tensor ``name`` (``stacked``); where it is new, each owner's
    tensor becomes its view."""
    base, views = stacked([getattr(o, name) for o in owners])
    for o, v in zip(owners, views or []):
        setattr(o, name, v)
    return base
