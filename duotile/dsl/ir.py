"""The Tile IR: a small typed SSA form over tiles, with mutable buffers and regions.

A kernel is a ``Module``: tensor parameters, then one ``grid`` op whose region holds the
per-program body, or several grids run one after another (phases: a split reduction and its
combine), which may share global scratch declared with ``dsl.workspace``. Ops are generic
(``Op(name, args, attrs, result, regions)``); each op name has a type rule in
``duotile.dsl.opdefs`` and handlers in every target. Index math is sympy.

Text form (``print(module)``)::

    kernel gemm(a: tensor<M x K x bf16>, b: tensor<N x K x bf16>, c: tensor<M x N x bf16>)
      config {BM=128, BN=128, BK=64, STAGES=3}
      grid (pid_m < ceiling(M/128), pid_n < ceiling(N/128)) {
        %0 = alloc f32[128x128] accumulator fill=0.0     # gemm.py:21
        for k < ceiling(K/64) pipelined(stages=3) {
          %1 = load a[128*pid_m, 64*k] -> bf16[128x64] operand
          ...
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import sympy

from .dtypes import DType
from .errors import SourceLoc

Expr = sympy.Expr


class Role(enum.Enum):
    """What a tile is for; each target maps a role to a memory scope."""

    OPERAND = "operand"  # feeds a gemm: shared memory (CUDA), L1 (Ascend)
    ACCUMULATOR = "accumulator"  # gemm output: registers / TMEM (CUDA), L0C (Ascend)
    VECTOR = "vector"  # elementwise work: registers (CUDA), UB (Ascend)

    @classmethod
    def parse(cls, role: str | Role) -> Role:
        if isinstance(role, Role):
            return role
        try:
            return cls(role)
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown memory role {role!r}; expected one of {names}") from None


@dataclass(frozen=True)
class TileType:
    shape: tuple[Expr, ...]
    dtype: DType
    role: Role

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.dtype.name}[{dims}] {self.role.value}"

    def numel(self) -> Expr:
        return sympy.Mul(*self.shape)


_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """An SSA tile value; ``mutable`` ones are buffers that ``assign`` and ``gemm`` write."""

    type: TileType
    mutable: bool = False
    hint: str = ""
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"%{self.hint or 'v'}{self.id}"


@dataclass(frozen=True)
class TensorParam:
    name: str
    shape: tuple[Expr, ...]
    dtype: DType
    optional: bool = False
    dims: tuple[str | int, ...] = ()  # the declared names ("M", "K"); kept when sizes are bound
    workspace: bool = False  # scratch in global memory that the call allocates (dsl.workspace)

    def __str__(self) -> str:
        dims = " x ".join(str(d) for d in self.shape)
        return f"{self.name}: {'workspace' if self.workspace else 'tensor'}<{dims} x {self.dtype.name}>"


@dataclass(eq=False)
class Op:
    name: str
    args: tuple[Any, ...] = ()  # Values, or sympy / float immediates for elementwise ops
    attrs: dict[str, Any] = field(default_factory=dict)
    result: Value | None = None
    regions: list[Block] = field(default_factory=list)
    loc: SourceLoc | None = None

    def values(self) -> list[Value]:
        return [a for a in self.args if isinstance(a, Value)]

    def writes(self) -> list[Value]:
        """The buffers this op itself writes (nested regions not included)."""
        if self.name == "assign":
            return [self.args[0]]
        if self.name == "gemm":
            return [self.args[2]]
        into = self.attrs.get("into")
        return [into] if isinstance(into, Value) else []

    def gemm_mnk(self) -> tuple[Expr, Expr, Expr]:
        """A gemm's M, N and K, its operands' transposes taken into account."""
        a, b, _ = self.args
        m, k = (a.type.shape[1], a.type.shape[0]) if self.attrs["transpose_a"] else a.type.shape
        n = b.type.shape[0] if self.attrs["transpose_b"] else b.type.shape[1]
        return m, n, k

    def written_ids(self) -> set[int]:
        """Ids of the buffers this op or any op in its regions writes."""
        return {v.id for o in self.walk() for v in o.writes()}

    def walk(self):
        """This op, then every op in its regions."""
        yield self
        for region in self.regions:
            yield from region.walk()


@dataclass(eq=False)
class Block:
    ops: list[Op] = field(default_factory=list)

    def walk(self):
        """Every op, depth first, parents before their bodies."""
        for op in self.ops:
            yield op
            for region in op.regions:
                yield from region.walk()


@dataclass(eq=False)
class Module:
    name: str
    params: list[TensorParam]
    body: Block
    config: dict[str, Any] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, int] = field(default_factory=dict)  # filled by bind_shapes
    dynamic: tuple[str, ...] = ()  # sizes left symbolic by bind_shapes (as the symbols dynamic_symbol names)
    batch_dim: str | None = None
    source_file: str = ""
    phase: int | None = None  # which phase of a multi-phase kernel this module is (split_phases)
    # dsl.require's conditions on sizes: (condition, message, spec line), checked by bind_shapes
    requires: list[tuple[Any, str, Any]] = field(default_factory=list)

    def param(self, name: str) -> TensorParam:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def walk(self):
        return self.body.walk()

    @property
    def grid(self) -> Op:
        """The launch grid of a single-phase module (``passes.split_phases`` gives one module a
        phase)."""
        if len(self.body.ops) != 1:
            raise ValueError(f"{self.name} has {len(self.body.ops)} phases; split them first (split_phases)")
        return self.body.ops[0]

    @property
    def workspaces(self) -> list[TensorParam]:
        return [p for p in self.params if p.workspace]

    def dynamic_places(self) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
        """For each dynamic size (its symbol, ``n_R``), the (tensor, axis) places that give it, in
        parameter order with the tensors that are never optional first (a size only an optional
        tensor carries has only such places). Compare symbols once here, not per call: printing
        them cost ~25 us a symbol, ~100 us a call of sparse decode with compressed rows."""
        want = [str(dynamic_symbol(n)) for n in self.dynamic]
        places: dict[str, list[tuple[str, int]]] = {sym: [] for sym in want}
        for p in sorted((p for p in self.params if not p.workspace), key=lambda p: p.optional):
            for axis, d in enumerate(p.shape):
                if d.is_Symbol and str(d) in places:
                    places[str(d)].append((p.name, axis))
        return tuple((sym, tuple(at)) for sym, at in places.items())

    def dynamic_sizes(self, tensors: dict, places=None) -> dict[str, int]:
        """The value of each dynamic size symbol (``n_R``) in a call, read off the tensors' shapes at
        ``places`` (``dynamic_places()``; a caller that calls often finds them once)."""
        sizes: dict[str, int] = {}
        for sym, at in self.dynamic_places() if places is None else places:
            for name, axis in at:
                t = tensors.get(name)
                if t is not None:
                    sizes[sym] = int(t.shape[axis])
                    break
            else:
                raise ValueError(f"{self.name}: no tensor gives the dynamic size {sym} (its tensors: "
                                 f"{', '.join(n for n, _ in at) or 'none'})")
        return sizes

    def workspace_shape(self, p: TensorParam, sizes: dict[str, int]) -> tuple[int, ...]:
        """A workspace's shape at a call's dynamic sizes."""
        return tuple(int(sympy.sympify(d).subs({sympy.Symbol(k, integer=True, positive=True): v
                                                 for k, v in sizes.items()})) for d in p.shape)

    def __str__(self) -> str:
        from .printer import format_module

        return format_module(self)


def dynamic_symbol(name: str) -> sympy.Symbol:
    """The symbol a dynamic size ``name`` is written as once shapes are bound: ``n_R`` for ``R``,
    a name no generated source uses for anything else (``T`` is TileLang's module there)."""
    return sympy.Symbol(f"n_{name}", integer=True, positive=True)
