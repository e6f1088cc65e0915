"""Hand-scheduled warp specialisation on sm90 (knob ``warp_specialize="manual"``).

TileLang's own producer warp group (``"auto"``) cannot keep a wgmma in flight past the next
statement: its scheduler gives up on gemms with a delayed wait. This lowering writes the roles
out instead:

* one producer warp group (128 threads, registers lowered to 24) issues every shared-memory load
  with TMA: the tiles loaded before the pipelined loop once, each tile loaded in the loop into a
  ring of ``stages`` slots, guarded by a ``full`` and an ``empty`` mbarrier per slot;
* the consumer warp groups (the ``threads`` knob; registers raised) wait on ``full``, run the
  loop body with asynchronous wgmma (``T.wgmma_gemm`` + ``T.wait_wgmma``) and arrive on ``empty``
  once the gemms reading a slot are complete.

The consumer loop takes one of three forms, chosen from the loop body's ops:

* two dependent gemms (attention; ``overlap.schedule``) with ``overlap`` on: FA3's rotation.
  Iteration n issues gemm1(n) and then gemm2(n-1), waits for gemm1 only, runs the vector work of
  n while gemm2 is in flight, and waits for gemm2 right before the first op that rewrites its
  operands or accumulator. The first iteration is peeled (no gemm2 yet) and gemm2 of the last
  runs after the loop. With two consumer warp groups, named barriers make them take turns at
  issuing (ping-pong), so one group's softmax overlaps the other's gemms;
* gemms only (a GEMM mainloop): each gemm stays in flight until the next one is issued
  (``wait_wgmma(1)``), and then frees the previous iteration's slots;
* anything else: each gemm is waited for at once (the fp8 promotion add reads it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import sympy

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Op
from . import overlap
from .exprs import index

PRODUCER_THREADS = 128
PRODUCER_REGS = 24
REGS_PER_SM = 64 * 1024
PINGPONG_BARRIERS = (8, 9)  # named barrier ids; TileLang's own syncs use the low ids


def _touched(op: Op) -> set[int]:
    """Ids of the values ``op`` reads or writes."""
    return op.written_ids() | {a.id for a in op.values()}


def consumer_regs(threads: int) -> int:
    """The register count the consumers raise to. The block's register pool is fixed at launch:
    what ptxas gives every thread of the block (the most its launch bounds allow, in steps of 8,
    at most 255). ``setmaxnreg.inc`` waits until the pool can serve it, so asking for more than
    the producer's release leaves would hang the block; this is what is left, in steps of 8, at
    most 240."""
    total = threads + PRODUCER_THREADS
    pool = min(255, REGS_PER_SM // total) // 8 * 8 * total
    return min(240, (pool - PRODUCER_THREADS * PRODUCER_REGS) // threads // 8 * 8)


@dataclass
class Ring:
    """A tile loaded in the pipelined loop: ``slots`` buffers, with their full / empty barriers."""
    op: Op
    name: str
    slots: int
    readers: list[Op] = field(default_factory=list)  # the gemms reading it

    def slot(self, it: str, start: str) -> str:
        return f"({it} - {start}) % {self.slots}" if start != "0" else f"{it} % {self.slots}"

    def phase(self, it: str, start: str) -> str:
        rel = f"({it} - {start})" if start != "0" else it
        return f"({rel} // {self.slots}) % 2"


class ManualWarpSpecialization:
    """Emits the producer and consumer branches of one kernel body through the emitter ``e``."""

    def __init__(self, e, ops: list[Op]):
        self.e = e
        self.threads = int(e.knobs["threads"])
        loops = [i for i, op in enumerate(ops) if op.name == "for" and op.attrs.get("stages")]
        if len(loops) != 1 or any(o.name == "for" for o in ops[loops[0]].regions[0].walk() if o is not ops[loops[0]]):
            where = ops[loops[1]].loc if len(loops) > 1 else (ops[0].loc if ops else None)
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual needs exactly one pipelined loop, "
                                   "not nested, in the kernel body", where)
        self.loop = ops[loops[0]]
        self.pre, self.post = ops[:loops[0]], ops[loops[0] + 1:]
        self.body = self.loop.regions[0].ops
        self.lo, self.hi = self.loop.attrs["start"], self.loop.attrs["extent"]
        self.start, self.stop = index(self.lo), index(self.hi)
        stages = int(self.loop.attrs["stages"])
        e.ring_slots.update({op.result.id: stages for op in self.body if self._shared_load(op)})
        self.once = {op.result.id: f"{e.name(op.result)}_full" for op in self.pre if self._shared_load(op)}
        self.rings = {op.result.id: Ring(op, e.name(op.result), stages) for op in self.body if self._shared_load(op)}
        self._check()
        self.gemms = [op for op in self.body if op.name == "gemm"]
        for op in self.gemms:
            for v in op.args[:2]:
                if v.id in self.rings:
                    self.rings[v.id].readers.append(op)

    # -- checks -------------------------------------------------------------------------------------
    def _shared_load(self, op: Op) -> bool:
        return op.name == "load" and self.e.plan.scope[op.result.id] == "shared"

    def _check(self):
        e = self.e
        if e.plan.staged:
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual: a fragment copied to shared memory "
                                   "for a gemm is not supported (only the producer writes shared memory)",
                                   self.loop.loc)
        for op in self.post:
            if self._shared_load(op):
                raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual: a shared-memory tile loaded after "
                                       "the pipelined loop is not supported", op.loc)
        for op in [*self.pre, *self.body, *self.post]:
            if op.name == "gather" or (self._shared_load(op) and op.attrs["other"] != 0.0):
                raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual loads tiles with TMA only; "
                                       "a masked load or a gather into shared memory is not supported", op.loc)
        shared = set(self.rings)
        for op in self.body:
            if op.name != "gemm" and any(a.id in shared for a in op.values()):
                raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual: only gemms may read a tile "
                                       "loaded in the pipelined loop", op.loc)
        if self.threads % 128:
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual needs whole warp groups of consumers, "
                                   f"got threads={self.threads}", self.loop.loc)

    # -- emission ---------------------------------------------------------------------------------
    def emit(self):
        e, src = self.e, self.e.src
        for bar in self.once.values():
            src.decl(f"{bar} = T.alloc_barrier({PRODUCER_THREADS})")
        for r in self.rings.values():
            src.decl(f"{r.name}_full = T.alloc_barrier([{PRODUCER_THREADS}] * {r.slots})")
            src.decl(f"{r.name}_empty = T.alloc_barrier([{self.threads}] * {r.slots})")
        e.ws = self
        src.line("tx = T.get_thread_binding()")
        src.line(f"if tx >= {self.threads}:  # producer warp group: TMA loads")
        with src.indent():
            self._producer()
        src.line("else:  # consumer warp groups")
        with src.indent():
            src.line(f"T.inc_max_nreg({consumer_regs(self.threads)})")
            e.block(self.pre)
            self._consumer_loop()
            e.block(self.post)
        e.ws = None

    def _producer(self):
        e, src = self.e, self.e.src
        src.line(f"T.dec_max_nreg({PRODUCER_REGS})")
        for op in self.pre:
            if op.result is not None and op.result.id in self.once:
                bar = self.once[op.result.id]
                src.line(f"T.tma_copy({e.global_region(op)}, {e.name(op.result)}, barrier={bar})", op.loc)
                src.line(f"T.barrier_arrive({bar})")
        var = self.loop.attrs["var"]
        src.line(f"for {var} in T.serial({self.start}, {self.stop}):", self.loop.loc)
        with src.indent():
            for r in self.rings.values():
                slot, phase = r.slot(str(var), self.start), r.phase(str(var), self.start)
                src.line(f"T.barrier_wait({r.name}_empty[{slot}], {phase} ^ 1)")
                src.line(f"T.tma_copy({e.global_region(r.op)}, {r.name}[{slot}, :, :], "
                         f"barrier={r.name}_full[{slot}])", r.op.loc)
                src.line(f"T.barrier_arrive({r.name}_full[{slot}])")

    # consumer side: loads become waits, gemm operands ring slots (the emitter asks these)
    def load_wait(self, op: Op) -> bool:
        """Emit the consumer's side of load ``op``; False when the producer does not load it."""
        vid = op.result.id
        if vid in self.once:
            self.e.src.line(f"T.barrier_wait({self.once[vid]}, 0)", op.loc)
            return True
        return vid in self.rings  # waited for at the gemm that reads it

    def operand(self, vid: int) -> str | None:
        r = self.rings.get(vid)
        return None if r is None else f"{r.name}[{r.slot(self.it, self.start)}, :, :]"

    def _wait_full(self, gemm: Op):
        for v in gemm.args[:2]:
            r = self.rings.get(v.id)
            if r is not None and (v.id, self.it) not in self.waited:
                self.waited.add((v.id, self.it))
                self.e.src.line(f"T.barrier_wait({r.name}_full[{r.slot(self.it, self.start)}], "
                                f"{r.phase(self.it, self.start)})")

    def _release(self, gemm: Op, it: str | None = None):
        """Arrive on the empty barrier of every ring whose last reader is ``gemm``."""
        it = it or self.it
        for r in self.rings.values():
            if r.readers and r.readers[-1] is gemm:
                self.e.src.line(f"T.barrier_arrive({r.name}_empty[{r.slot(it, self.start)}])")

    def _issue(self, gemm: Op):
        self._wait_full(gemm)
        self.e.async_gemm = True
        self.e.block([gemm])
        self.e.async_gemm = False

    def _consumer_loop(self):
        self.it, self.waited = str(self.loop.attrs["var"]), set()
        two_gemm = self.e.knobs.get("overlap") and overlap.schedule(self.body) is not None
        gemm_ids = {v.id for g in self.gemms for v in g.args}  # what vector work must not touch
        if two_gemm and self._rotatable(self.gemms[0], self.gemms[-1]):
            self._rotated(self.gemms[0], self.gemms[-1])
        elif all(op.name in ("gemm", "load") or not _touched(op) & gemm_ids for op in self.body):
            self._in_flight()
        else:
            self._synchronous()

    @contextlib.contextmanager
    def _loop(self, lo: str, hi: str):
        """One consumer loop over (part of) the pipelined loop's range, under its variable."""
        self.waited = set()
        self.e.src.line(f"for {self.it} in T.serial({lo}, {hi}):", self.loop.loc)
        self.e.loop_stack.append(self.loop)
        try:
            with self.e.src.indent():
                yield
        finally:
            self.e.loop_stack.pop()

    def _synchronous(self):
        with self._loop(self.start, self.stop):
            for op in self.body:
                if op.name == "gemm":
                    self._wait_full(op)
                    self.e.block([op])
                    self._release(op)
                else:
                    self.e.block([op])

    def _in_flight(self):
        src, var = self.e.src, self.it
        with self._loop(self.start, self.stop):
            for op in self.body:
                if op.name != "gemm":
                    self.e.block([op])
                    continue
                self._issue(op)
            src.line("T.wait_wgmma(1)")  # every gemm of the previous iteration is complete
            src.line(f"if {var} > {self.start}:")
            with src.indent():
                for g in self.gemms:
                    self._release(g, f"({var} - 1)")
        src.line("T.wait_wgmma(0)")  # the last slots are not released: nothing loads into them again

    # -- the two-gemm rotation ----------------------------------------------------------------------
    def _rotatable(self, g1: Op, g2: Op) -> bool:
        """gemm2 can move one iteration later: it is the body's last op (nothing in the iteration
        reads its result) and it does not clear its accumulator on a condition of the loop index."""
        clear = self.e.plan.clear_by_gemm.get(id(g2))
        return clear in (None, "True") and g1 is not g2 and self.body[-1] is g2

    def _rotated(self, g1: Op, g2: Op):
        src, var = self.e.src, self.it
        pingpong = self.threads == 256
        late_ids = {g2.args[2].id} | {v.id for v in g2.args[:2]}
        i1 = self.body.index(g1)
        rest = [op for op in self.body[i1 + 1:] if op is not g2]
        # the first op that rewrites gemm2's operands or accumulator, or reads the accumulator
        hazard = next((k for k, op in enumerate(rest)
                       if op.written_ids() & late_ids or g2.args[2].id in _touched(op)), len(rest))
        if pingpong:
            a, b = PINGPONG_BARRIERS
            src.line("if tx // 128 == 1:  # warp group 0 issues first")
            src.line(f"    T.named_barrier_arrive({a}, 256)")
        turn = (f"T.sync_threads({a} + tx // 128, 256)", f"T.named_barrier_arrive({b} - tx // 128, 256)") \
            if pingpong else None
        before = [op for op in self.body[:i1] if op.name != "load"]
        # iteration start: gemm1 alone
        with self._loop(self.start, index(sympy.Min(self.lo + 1, self.hi))):
            self.e.block(before)
            self._wait_full(g1)
            self._turn(turn, 0)
            self._issue(g1)
            self._turn(turn, 1)
            src.line("T.wait_wgmma(0)")
            self._release(g1)
            self.e.block(rest)
        with self._loop(index(self.lo + 1), self.stop):
            self.e.block(before)
            self._wait_full(g1)
            self._turn(turn, 0)
            self._issue(g1)
            self.it = f"({var} - 1)"
            self._issue(g2)
            self.it = var
            self._turn(turn, 1)
            src.line("T.wait_wgmma(1)")
            self._release(g1)
            self.e.block(rest[:hazard])
            src.line("T.wait_wgmma(0)")
            self._release(g2, f"({var} - 1)")
            self.e.block(rest[hazard:])
        # gemm2 of the last iteration
        with self._loop(index(sympy.Max(self.hi - 1, self.lo)), self.stop):
            self._issue(g2)
            src.line("T.wait_wgmma(0)")
            self._release(g2)

    def _turn(self, turn, which: int):
        if turn is not None:
            self.e.src.line(turn[which])
