"""Every global-memory access of a kernel as TileLang lowered it, proven inside its tensor.

The generators guard what ``tile_bounds`` cannot prove inside, and TileLang's lowering adds tests of
its own to the copies it expands (``tl.LegalizeSafeMemoryAccess``). A slip in either is silent on a
GPU: a read past a tensor returns whatever lies there (twice the GPU sweep's fenced inputs found
one: ``gemm_blockscaled``'s one-element scale reads, ``unit_axes.py`` and ``emit._element_conds``).
This check runs on the code the GPU runs, independently of the rules that placed the guards: the
module as it stands before TileLang flattens its buffers (``tl.FlattenBuffer``, each tensor still
indexed by its own dimensions, every copy expanded to loads and stores), captured by a pass
instrument while the build lowers it (``Capture``).

For each load and store of a kernel parameter, each index is proven inside ``[0, extent)`` by TVM's
arithmetic analyzer, under:

* the ranges of the launch's block and thread indices and of every enclosing loop;
* the conditions of the enclosing ``if`` statements and ``if_then_else`` arms (and the left side of
  an ``and`` for its right side);
* what each one-element register or local tile holds where it is read (the grid decode's ``m``, ``g``; a
  persistent kernel's tile, stored at the top of each iteration), followed through the code in
  order: a loop forgets the registers its body stores, an ``if`` those either branch stores. A
  register stored from memory (a routed row's expert, a gathered row's number) stays unknown: put
  in place of its reads inside every test around them, such loads made TVM's analyzer take minutes
  to enter the tests of one routed kernel;
* every dynamic size at least 1.

A vector access is checked at its first and last lanes. An index that still reads memory (a
gathered row's number, an expert read from a table, a register whose value is not known there) is the
spec's promise, not the generator's: it is counted (``data``) and not proven; so is an index whose
proof TVM's analyzer cannot carry out (it raises on an int32 overflow in its own arithmetic). TMA copies address
their tensors through descriptors whose bounds the hardware applies, and are not loads here; an
address taken for an asynchronous copy (``cp.async``) is checked at the element it starts from.
Everything else that cannot be proven is an ``Access`` the build refuses with
``UnguardedAccessError``: the tensor, the dimension, the index and the guards around it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

FLATTEN = "tl.FlattenBuffer"  # the pass before which the module is checked


@dataclass(frozen=True)
class Access:
    """An access not proven inside: ``kind`` is 'read' or 'write'."""

    kind: str
    tensor: str
    dim: int
    index: str
    extent: str
    guards: tuple[str, ...]

    def __str__(self) -> str:
        under = " and ".join(f"({g})" for g in self.guards) or "no test"
        return (f"{self.kind} of `{self.tensor}` at dimension {self.dim} (extent {self.extent}), index "
                f"{self.index}, under {under}")


@dataclass
class Report:
    """What the check found in one kernel: accesses proven inside, those indexed by data, and the rest."""

    proven: int = 0
    data: int = 0
    unproven: list[Access] = field(default_factory=list)
    seconds: float = 0.0  # what the check took (inside the lowering's time)


def capture():
    """A TVM pass instrument keeping the module as it enters ``FLATTEN`` (``.module``, None until
    then); pass it in the ``PassContext`` of ``tilelang.lower``."""
    from tilelang import tvm

    @tvm.instrument.pass_instrument
    class Capture:
        def __init__(self):
            self.module = None

        def run_before_pass(self, mod, info):
            if info.name == FLATTEN and self.module is None:
                self.module = mod

    return Capture()


def check_module(mod) -> Report:
    """The report of every function of a captured module, added together."""
    out, t0 = Report(), time.perf_counter()
    for func in mod.functions.values():
        one = _Walk(func).run()
        out.proven, out.data = out.proven + one.proven, out.data + one.data
        out.unproven += one.unproven
    out.seconds = time.perf_counter() - t0
    return out


class _Walk:
    def __init__(self, func):
        from tilelang import tvm

        self.tirx, self.ir, self.sf = tvm.tirx, tvm.ir, tvm.tirx.stmt_functor
        self.an = tvm.arith.Analyzer()
        self.func, self.report, self.guards = func, Report(), []
        self.params = {b.data: b for b in func.buffer_map.values()}
        self.known: dict = {}  # a one-element register's data -> what it holds here, reading no memory

    def run(self) -> Report:
        sizes = {v for b in self.params.values() for d in b.shape for v in self._nodes(d, self.tirx.Var)}
        with ExitStack() as scope:
            for v in sizes:
                scope.enter_context(self.an.constraint_scope(v >= 1))
            self.stmt(self.func.body)
        return self.report

    def _nodes(self, e, kind) -> list:
        """The nodes of type ``kind`` inside ``e``."""
        out = []
        self.sf.post_order_visit(e, lambda n: out.append(n) if isinstance(n, kind) else None)
        return out

    def _reads_memory(self, e) -> bool:
        return bool(self._nodes(e, self.tirx.BufferLoad))

    def value(self, e):
        """``e`` with each read of a register whose value is known here replaced by that value."""
        def put(n):
            return self.known.get(n.buffer.data) if _one_element(n.buffer) else None

        if not self.known:
            return e
        return self.sf.ir_transform(self.tirx.Evaluate(e), None, put, ["tirx.BufferLoad"]).value

    def forget_stored_in(self, *stmts) -> None:
        """Registers stored anywhere in ``stmts`` hold values not known from here on."""
        def stored(n):
            if isinstance(n, self.tirx.BufferStore):
                self.known.pop(n.buffer.data, None)

        for s in stmts:
            if s is not None and self.known:  # nothing known, nothing to forget: no walk
                self.sf.post_order_visit(s, stored)

    @contextmanager
    def given(self, cond):
        self.guards.append(cond)
        with self.an.constraint_scope(self.value(cond)):
            yield
        self.guards.pop()

    def stmt(self, s) -> None:
        T = self.tirx
        if isinstance(s, T.SeqStmt):
            for x in s.seq:
                self.stmt(x)
        elif isinstance(s, T.For):  # an iteration may begin with the registers the last one stored
            self.exprs(s.min, s.extent)
            self.an.bind(s.loop_var, self.ir.Range.from_min_extent(s.min, s.extent))
            self.forget_stored_in(s.body)
            self.stmt(s.body)
            self.forget_stored_in(s.body)
        elif isinstance(s, T.AttrStmt):
            if s.attr_key == "thread_extent":
                self.an.bind(s.node.var, self.ir.Range.from_min_extent(0, s.value))
            self.stmt(s.body)
        elif isinstance(s, T.IfThenElse):  # after it, a register either branch stored is not known
            self.expr(s.condition)
            before = dict(self.known)
            with self.given(s.condition):
                self.stmt(s.then_case)
            self.known = dict(before)
            if s.else_case is not None:
                with self.given(T.Not(s.condition)):
                    self.stmt(s.else_case)
            self.known = before
            self.forget_stored_in(s.then_case, s.else_case)
        elif isinstance(s, T.BufferStore):
            self.access(s.buffer, s.indices, "write")
            self.exprs(*s.indices, s.value)
            register = s.buffer.scope() in ("local.var", "local") and _one_element(s.buffer)
            held = self.value(s.value) if register else None  # no rewrite of what other stores write
            if held is not None and not self._reads_memory(held):
                self.known[s.buffer.data] = held
            else:  # a wider view of a register's memory, or a value read from memory: the register is
                self.known.pop(s.buffer.data, None)  # unknown, its reads counted with the data-indexed
        elif isinstance(s, T.Bind):
            self.expr(s.value)
            self.an.bind(s.var, self.value(s.value))
        elif isinstance(s, T.While):
            self.forget_stored_in(s.body)
            self.expr(s.condition)
            with self.given(s.condition):
                self.stmt(s.body)
            self.forget_stored_in(s.body)
        elif isinstance(s, (T.Evaluate, T.AssertStmt)):
            self.expr(s.value if isinstance(s, T.Evaluate) else s.condition)
        elif getattr(s, "body", None) is not None:
            self.stmt(s.body)

    def exprs(self, *es) -> None:
        for e in es:
            self.expr(e)

    def expr(self, e) -> None:
        T = self.tirx
        if isinstance(e, T.BufferLoad):
            self.access(e.buffer, e.indices, "read")
            self.exprs(*e.indices)
        elif isinstance(e, T.Call) and getattr(e.op, "name", "") == "tirx.if_then_else":
            self.branches(*e.args)
        elif isinstance(e, T.Select):
            self.branches(e.condition, e.true_value, e.false_value)
        elif isinstance(e, T.Call):
            self.exprs(*e.args)
        elif isinstance(e, (T.And, T.Or)):  # short-circuit: the right side runs where the left allows
            self.expr(e.a)
            with self.given(e.a if isinstance(e, T.And) else T.Not(e.a)):
                self.expr(e.b)
        elif isinstance(e, T.Let):
            self.expr(e.value)
            self.an.bind(e.var, self.value(e.value))
            self.expr(e.body)
        elif isinstance(e, (T.Cast, T.Broadcast)):
            self.expr(e.value)
        elif isinstance(e, T.Not):
            self.expr(e.a)
        elif isinstance(e, T.Ramp):
            self.exprs(e.base, e.stride)
        elif isinstance(e, T.Shuffle):
            self.exprs(*e.vectors)
        elif hasattr(e, "a") and hasattr(e, "b"):
            self.exprs(e.a, e.b)

    def branches(self, cond, then, other) -> None:
        self.expr(cond)
        with self.given(cond):
            self.expr(then)
        with self.given(self.tirx.Not(cond)):
            self.expr(other)

    def access(self, buf, indices, kind: str) -> None:
        if buf.data not in self.params:
            return
        for dim, (index, extent) in enumerate(zip(indices, buf.shape)):
            i = self.value(index)
            lo, hi = (i.base, i.base + i.stride * (i.lanes - 1)) if isinstance(i, self.tirx.Ramp) else (i, i)
            try:
                inside = self.an.can_prove(lo >= 0) and self.an.can_prove(hi < extent)
            except Exception:  # noqa: BLE001 - TVM's arithmetic overflowing int32 (topk's 2^31 key bias)
                self.report.data += 1  # not proven, and not refused: counted with the data-indexed
                continue
            if inside:
                self.report.proven += 1
                continue
            if self._reads_memory(i):  # an index read from memory: the spec's promise
                self.report.data += 1
                continue
            self.report.unproven.append(Access(kind, str(buf.name), dim, str(self.an.simplify(i)), str(extent),
                                               tuple(str(g) for g in self.guards)))


def check_lowered_bounds(target: str, artifact, report: Report | None) -> None:
    """Refuse ``artifact`` where its lowered code has an access not proven inside (``report``);
    record the counts in its meta (``bounds``) and its time (``timings["bounds_check"]``) otherwise."""
    from ...dsl.errors import UnguardedAccessError
    from ..target import tensor_line

    if report is None:
        return
    artifact.meta["bounds"] = {"proven": report.proven, "data": report.data}
    artifact.timings["bounds_check"] = report.seconds
    if report.unproven:
        loc = tensor_line(artifact.stages.get("tilelang", ""), report.unproven[0].tensor)
        raise UnguardedAccessError(target, artifact.kernel, artifact.config, report.unproven, loc)


def _one_element(buffer) -> bool:
    """A register: a buffer of one element (a view of the same data with more is not one)."""
    return all(getattr(d, "value", None) == 1 for d in buffer.shape)
