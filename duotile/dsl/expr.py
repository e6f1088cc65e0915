"""Expression trees inside a fused ``map`` op: one elementwise computation over a tile.

Leaves read the map's inputs (``arg``), immediates (``const``), index expressions of loop
variables (``scalar``) or the element's own position (``iota``). Every node carries its
shape, so a generator can tell which loop index each leaf uses: a size-1 dimension
broadcasts, an ``expand`` node drops one index for its child.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import DType


@dataclass(frozen=True)
class Node:
    kind: str  # arg | const | scalar | iota | expand | cast | an elementwise fn (add, exp2, where...)
    shape: tuple  # of ints (or sympy before binding)
    dtype: DType
    children: tuple[Node, ...] = ()
    attr: Any = None  # arg: input index; const: float; scalar: sympy expr; iota/expand: axis; cast: dtype

    def __str__(self) -> str:
        if self.kind == "arg":
            return f"${self.attr}"
        if self.kind in ("const", "scalar"):
            return str(self.attr)
        if self.kind == "iota":
            return f"iota{self.attr}"
        inner = ", ".join(str(c) for c in self.children)
        if self.kind == "expand":
            return f"expand{self.attr}({inner})"
        if self.kind == "cast":
            return f"{self.attr.name}({inner})"
        return f"{self.kind}({inner})"

    def leaves(self):
        if not self.children:
            yield self
        for c in self.children:
            yield from c.leaves()


def child_index(node: Node, child: Node, index: tuple) -> tuple:
    """Indices into ``child`` for an element of ``node`` at ``index`` (one entry per dim).

    Broadcast dimensions (size 1 in the child, larger in the node) read entry 0, marked None.
    """
    if node.kind == "expand":
        return index[: node.attr] + index[node.attr + 1:]
    return tuple(None if (c == 1 and n != 1) else i for c, n, i in zip(child.shape, node.shape, index))
