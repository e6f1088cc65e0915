"""check_batch_invariance: a decode-path kernel must reduce in an order the batch size cannot change.

A kernel declared ``@dsl.kernel(batch_dim="T")`` promises that a row's result is bitwise the
same whatever the batch size. The pass finds every reduction in the traced (unbound) Tile IR:

- ``reduce`` ops (the reduced axis),
- ``gemm`` ops (the contraction axis, K),
- loop-carried accumulations: a ``for`` whose body writes (``assign`` / ``gemm``) a buffer
  allocated outside it -- the loop is a split of a reduction, e.g. a gemm's K-loop,

and asks of each: does it walk the batch dimension (its axis comes from a tensor dimension
named ``T``, or its loop indexes ``T``), or does its extent or split mention ``T``? Such a
reduction changes its order with the batch size. It then re-traces the kernel with each other
value of each tunable: a tunable that changes such a reduction's extent or split is named in
the error. Reductions over other dimensions may depend on tunables freely: the tuning cache
keys batch-invariant kernels without the batch dimension, so one config serves every batch
size, and ``require_batch_free`` rejects tuning results that differ by batch size. A kernel that
buckets its batch dimension instead (a config per power-of-two bucket) may hold only order-free
reductions (max, min): its rows then cannot depend on the config at all.

The IR is not changed. Before and after (accepted; ``ROWS`` only changes which rows a program
takes, the reduction over ``D`` keeps extent ``D``)::

    kernel rmsnorm(x: tensor<T x D x bf16>, ...)
      grid (t < T) {
        %x4 = load x[t, 0] -> bf16[1xD] vector
        %v7 = reduce.sum(%v6) axis=1 -> f32[1] vector        # reduces D: fine

Rejected (the reduced axis is the batch dimension, split by the tunable ``BT``)::

    grid (d < ceiling(D/8)) {
      %buf0 = alloc() fill=0.0 -> f32[8] vector
      for t < ceiling(T/BT) {
        %x1 = load x[BT*t, 8*d] -> f32[BTx8] vector
        %v2 = reduce.sum(%x1) axis=0 -> f32[8] vector

    DslError: test_x.py:31 `acc[:] = acc + dsl.load(...).sum(axis=0)`: colsum is batch-invariant
    in T, but tunable 'BT' changes the split of a reduce.sum over T (extent BT) ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import DslError
from ..dsl.ir import Block, Module, Op, Value
from ..dsl.kernel import KernelDef


@dataclass
class Reduction:
    op: Op
    kind: str  # "reduce.sum", "gemm", "loop"
    dims: set[str]  # tensor dimensions the reduction walks
    extent: Any  # sympy: the reduced extent (tile extent, or loop trip count)
    slot: tuple = ()  # identity across re-traces: (kind, source line, ordinal)
    tunables: list[str] = field(default_factory=list)

    def signature(self) -> str:
        start = self.op.attrs.get("start", 0) if self.kind == "loop" else 0
        return f"{self.extent}|{start}"


def _dim_names(module: Module, tensor: str) -> list[str]:
    return [str(d) for d in module.param(tensor).dims]


def _provenance(module: Module) -> dict[int, list[set[str]]]:
    """For every value, per axis, the tensor dimensions that axis runs over."""
    prov: dict[int, list[set[str]]] = {}

    def get(v) -> list[set[str]]:
        return prov.get(v.id, [set() for _ in v.type.shape]) if isinstance(v, Value) else []

    for _ in range(2):  # a second sweep carries what buffers learned from their writes
        for op in module.walk():
            r = op.result
            if op.name in ("load", "gather"):
                names = _dim_names(module, op.attrs["tensor"])
                rank = len(op.attrs["shape"])
                prov[r.id] = [{n} for n in names[len(names) - rank:]]
            elif op.name == "expand":
                axes = [set(s) for s in get(op.args[0])]
                axes.insert(op.attrs["axis"], set())
                prov[r.id] = axes
            elif op.name == "reduce":
                axes = get(op.args[0])
                prov[r.id] = [s for i, s in enumerate(axes) if i != op.attrs["axis"]] or [set()]
            elif op.name in ("ew", "cast") and r is not None:
                out = [set() for _ in r.type.shape]
                for a in op.values():
                    if len(a.type.shape) == len(out):
                        for i, s in enumerate(get(a)):
                            if a.type.shape[i] != 1 or r.type.shape[i] == 1:
                                out[i] |= s
                prov[r.id] = out
            elif op.name == "assign":
                dst, src = op.args
                base = get(dst)
                for i, s in enumerate(get(src)):
                    if i < len(base):
                        base[i] = base[i] | s
                prov[dst.id] = base
            elif op.name == "gemm":
                a, b, acc = op.args
                pa, pb = get(a), get(b)
                m = pa[1] if op.attrs.get("transpose_a") else pa[0]
                n = pb[0] if op.attrs.get("transpose_b") else pb[1]
                base = get(acc)
                prov[acc.id] = [base[0] | m, base[1] | n]
            elif r is not None and r.id not in prov:
                prov[r.id] = [set() for _ in r.type.shape]
    return prov


def find_reductions(module: Module) -> list[Reduction]:
    prov = _provenance(module)
    out: list[Reduction] = []
    counts: dict[tuple, int] = {}

    def add(red: Reduction):
        line = red.op.loc.line if red.op.loc else 0
        key = (red.kind, line)
        counts[key] = counts.get(key, 0) + 1
        red.slot = (red.kind, line, counts[key])
        out.append(red)

    def visit(block: Block, defined_outside: set[int]):
        defined_here = set(defined_outside)
        for op in block.ops:
            if op.name == "reduce":
                x = op.args[0]
                axis = op.attrs["axis"]
                add(Reduction(op, f"reduce.{op.attrs['fn']}", set(prov.get(x.id, [set()] * 8)[axis]),
                              x.type.shape[axis]))
            elif op.name == "gemm":
                a = op.args[0]
                k_axis = 0 if op.attrs.get("transpose_a") else 1
                add(Reduction(op, "gemm", set(prov.get(a.id, [set(), set()])[k_axis]), a.type.shape[k_axis]))
            elif op.name == "for":
                body = op.regions[0]
                carried = {v.id for o in body.walk() for v in o.writes() if v.id in defined_here}
                if carried:
                    var = str(op.attrs["var"])
                    dims = set()
                    for o in body.walk():
                        if o.name in ("load", "gather"):
                            names = _dim_names(module, o.attrs["tensor"])
                            for name, off in zip(names, o.attrs["offsets"]):
                                if var in {str(s) for s in getattr(off, "free_symbols", ())}:
                                    dims.add(name)
                    add(Reduction(op, "loop", dims, op.attrs["extent"]))
            if op.result is not None:
                defined_here.add(op.result.id)
            for r in op.regions:
                visit(r, defined_here)

    visit(module.body, set())
    return out


def _mentions(expr, name: str) -> bool:
    return name in {str(s) for s in getattr(expr, "free_symbols", ())}


def check_batch_invariance(kernel: KernelDef, dtypes: dict | None = None, present: dict | None = None,
                           constants: dict | None = None, config: dict | None = None) -> Module:
    """Trace ``kernel`` and reject reductions whose order can change with its batch dimension."""
    module = kernel.trace(dtypes, present, config, constants)
    batch = kernel.batch_dim
    if batch is None:
        return module
    reductions = find_reductions(module)
    if batch in kernel.bucketed:
        _require_order_free(kernel, reductions)
    risky = [r for r in reductions if batch in r.dims or _mentions(r.extent, batch)
             or (r.kind == "loop" and _mentions(r.op.attrs.get("start"), batch))]
    if not risky:
        return module
    base = {r.slot: r.signature() for r in reductions}
    for name, space in kernel.tunables.items():
        current = kernel.resolve_config(config)[name]
        for value in space.values():
            if value == current:
                continue
            try:
                alt = kernel.trace(dtypes, present, {**(config or {}), name: value}, constants)
            except DslError:
                continue
            alt_sig = {r.slot: r.signature() for r in find_reductions(alt)}
            for r in risky:
                if alt_sig.get(r.slot) != base[r.slot] and name not in r.tunables:
                    r.tunables.append(name)
    r = risky[0]
    how = (f"walks the batch dimension {batch}" if batch in r.dims
           else f"has an extent that depends on the batch dimension {batch} ({r.extent})")
    what = "the split of a loop-carried reduction" if r.kind == "loop" else f"the {r.kind} reduction"
    if r.tunables:
        names = ", ".join(repr(t) for t in r.tunables)
        msg = (f"{kernel.name} is batch-invariant in {batch}, but tunable {names} changes {what} that "
               f"{how} (extent {r.extent}): its reduction order would change with the batch size. "
               f"Reduce over a non-batch dimension, or make the split independent of {batch}.")
    else:
        msg = (f"{kernel.name} is batch-invariant in {batch}, but {what} {how}: a row's result would "
               f"depend on the batch size.")
    raise DslError(msg, r.op.loc)


ORDER_FREE = ("reduce.max", "reduce.min")  # exact in any order and any split


def _require_order_free(kernel: KernelDef, reductions: list[Reduction]) -> None:
    """A kernel that buckets its batch dimension (``bucketed=("T",)``: a config per power-of-two
    bucket of the batch, so that prefill chunks get larger tiles than decode steps) computes a row
    under another config at another batch size. Its rows stay bitwise the same only if no result
    depends on the config: every reduction must be a max or a min (a sum's order follows the tile
    and thread layout, which its tunables set)."""
    for r in reductions:
        if r.kind not in ORDER_FREE:
            raise DslError(f"{kernel.name} buckets its batch dimension {kernel.batch_dim} (a config per bucket), "
                           f"so its rows must not depend on the config, but it has a {r.kind} reduction, whose "
                           "order its tunables can change: only max / min reductions are order-free. Leave "
                           f"{kernel.batch_dim} dynamic without a bucket.", r.op.loc)


def require_batch_free(kernel: KernelDef, tuned: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """``tuned`` maps shape tuples ((name, size), ...) to configs; a batch-invariant kernel must
    have one config for every batch size. Returns that config."""
    if kernel.batch_dim is None or not tuned:
        return next(iter(tuned.values()), {})
    by_rest: dict[tuple, tuple[tuple, dict]] = {}
    for shapes, cfg in tuned.items():
        rest = tuple((k, v) for k, v in shapes if k != kernel.batch_dim)
        if rest in by_rest and by_rest[rest][1] != cfg:
            other = by_rest[rest][0]
            raise DslError(f"{kernel.name} is batch-invariant in {kernel.batch_dim}, but its tuned config "
                           f"differs between {dict(other)} ({by_rest[rest][1]}) and {dict(shapes)} ({cfg})")
        by_rest[rest] = (shapes, cfg)
    return next(iter(tuned.values()))
