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

The consumer loop takes one of four forms, chosen from the loop body's ops:

* two dependent gemms (attention; ``overlap.schedule``) with ``overlap`` on: FA3's rotation.
  Iteration n issues gemm1(n) and then gemm2(n-1), waits for gemm1 only, runs the vector work of
  n while gemm2 is in flight, and waits for gemm2 right before the first op that rewrites its
  operands or accumulator. The first iteration is peeled (no gemm2 yet) and gemm2 of the last
  runs after the loop. With two consumer warp groups, named barriers make them take turns at
  issuing (ping-pong), so one group's softmax overlaps the other's gemms;
* gemms only (a GEMM mainloop): each gemm stays in flight until the next one is issued
  (``wait_wgmma(1)``), and then frees the previous iteration's slots;
* gemms into fresh partials, each scaled and added after it (a block-scaled GEMM): each partial's
  work runs while the next gemm is in flight (``partials_in_flight.py``);
* anything else: each gemm is waited for at once (the fp8 promotion add reads it).

Under the rotation the producer loads the tiles only gemm2 reads (attention's V) one iteration
behind the others, FA3's order, and a mask that only the last iteration needs (a ragged tail) is
folded out of the iterations before it. With the ``persistent`` knob both roles walk the output
tiles in a loop (``persistent.py``): ring phases continue across tiles, and the producer loads
the next tile while the consumers run the previous one's epilogue. Under the rotation a tile
loaded before the loop that only gemm1 reads (attention's Q) is freed as soon as the last
iteration's gemm1 is complete, so its next load also hides under the last gemm2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import sympy

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Op
from ...passes.fold_bounds import fold_node, grid_env, interval
from . import narrow_tail, overlap, partials_in_flight, persistent, promote_fp8
from .exprs import index
from .partials_in_flight import _touched
from .persistent import BASE, TileLoop

PRODUCER_THREADS = 128
PRODUCER_REGS = 24
REGS_PER_SM = 64 * 1024
PINGPONG_BARRIERS = (8, 9)  # named barrier ids; TileLang's own syncs use the low ids


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

    base: str = ""  # persistent grids: the iterations of the tiles finished before (persistent.BASE)
    multicast: bool = False  # cluster=2: rank 0 loads it into both blocks of the pair (persistent.py)

    def _rel(self, it: str, start: str) -> str:
        rel = it if start == "0" else f"({it} - {start})"
        return f"({self.base} + {rel})" if self.base else rel

    def slot(self, it: str, start: str) -> str:
        return f"{self._rel(it, start)} % {self.slots}"

    def phase(self, it: str, start: str) -> str:
        return f"({self._rel(it, start)} // {self.slots}) % 2"


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
        scalar = next((o for o in e.m.walk() if o.name == "scalar"), None)
        if scalar is not None:  # the producer's TMA offsets would read a scalar it never assigned
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual takes offsets of sizes and loop "
                                   "variables, not a scalar read from data (use auto)", scalar.loc)
        if self.loop.args:  # its producer and consumers count the ring's steps from static bounds
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual needs a pipelined loop whose end is a "
                                   "size, not a stop read from data (use auto)", self.loop.loc)
        if self.loop.attrs.get("at_most_once"):  # a ring over one step pipelines nothing
            raise UnsupportedError(f"{e.arch.name}: warp_specialize=manual needs a pipelined loop that can run "
                                   "more than once; this one runs at most once at every grid point (use auto)",
                                   self.loop.loc)
        self.pre, self.post = ops[:loops[0]], ops[loops[0] + 1:]
        self.body = self.loop.regions[0].ops
        self.lo, self.hi = self.loop.attrs["start"], self.loop.attrs["extent"]
        self.start, self.stop = index(self.lo), index(self.hi)
        stages = int(self.loop.attrs["stages"])
        e.ring_slots.update({op.result.id: stages for op in self.body if self._shared_load(op)})
        self.once = {op.result.id: e.name(op.result) for op in self.pre if self._shared_load(op)}
        self.rings = {op.result.id: Ring(op, e.name(op.result), stages) for op in self.body if self._shared_load(op)}
        self._check()
        self.gemms = [op for op in self.body if op.name == "gemm"]
        for op in self.gemms:
            for v in op.args[:2]:
                if v.id in self.rings:
                    self.rings[v.id].readers.append(op)
        self.unroll = 0  # fp8 promotion overlapped: K steps the mainloop is unrolled by (_form)
        self.partials = None  # gemms into fresh partials: the chain (partials_in_flight.segments)
        self.form = self._form()
        self.pingpong = self.threads == 256
        self.tiles = persistent.tile_loop(e.m.grid, e.knobs, e.arch.sms)  # None: one block a tile
        self.early_once = self._early_once()

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
    def emit(self) -> str | None:
        """Write both roles; returns the kernel's launch head when the grid is persistent."""
        e, src = self.e, self.e.src
        for name in self.once.values():
            src.decl(f"{name}_full = T.alloc_barrier({PRODUCER_THREADS})")
            if self.tiles:
                src.decl(f"{name}_empty = T.alloc_barrier({self.threads})")
        pair = self.tiles.pair_var if self.tiles else None
        for r in self.rings.values():
            r.multicast = pair is not None and persistent.shares(r.op, pair)
            src.decl(f"{r.name}_full = T.alloc_barrier([{PRODUCER_THREADS}] * {r.slots})")
            if r.multicast:  # freed by one lane of every consumer warp of both blocks
                src.decl(f"{r.name}_empty = T.alloc_cluster_barrier([{2 * self.threads // 32}] * {r.slots})")
            else:
                src.decl(f"{r.name}_empty = T.alloc_barrier([{self.threads}] * {r.slots})")
            r.base = BASE if self.tiles else ""
        if self.tiles:
            src.decl(f'{BASE.split("[")[0]} = T.alloc_local((1,), "int32")')
            self.tiles.declare(src)
        e.ws = self
        src.line("tx = T.get_thread_binding()")
        src.line(f"if tx >= {self.threads}:  # producer warp group: TMA loads")
        with src.indent():
            src.line(f"T.dec_max_nreg({PRODUCER_REGS})")
            with self._each_tile():
                self._producer()
        src.line("else:  # consumer warp groups")
        with src.indent():
            src.line(f"T.inc_max_nreg({consumer_regs(self.threads)})")
            if self.form == "rotated" and self.pingpong:
                src.line("if tx // 128 == 1:  # warp group 0 issues first")
                src.line(f"    T.named_barrier_arrive({PINGPONG_BARRIERS[0]}, 256)")
            with self._each_tile():
                e.block(self.pre)
                self._consumer_loop()
                self._free_once(before_post=True)
                e.block(self.post)
                self._free_once(before_post=False)
            if e.knobs.get("tma_store"):
                src.line("T.tma_store_wait()  # no exit while the TMA engine reads the output buffer")
        if pair is not None:
            src.line("T.cluster_sync()  # no block exits while its pair may still multicast into it")
        e.ws = None
        return self.tiles.head(self.threads + PRODUCER_THREADS) if self.tiles else None

    @contextlib.contextmanager
    def _each_tile(self):
        """The role's body, once (one block a tile) or in the persistent loop over tiles."""
        src = self.e.src
        if not self.tiles:
            yield
            return
        src.line(f"{BASE} = 0")
        self.tiles.open(src)
        with src.indent(), src.indent():
            self.tiles.decode(src)
            yield
            TileLoop.advance(src, self.loop)

    def _once_phase(self) -> str:
        return "tile_round % 2" if self.tiles else "0"

    def _early_once(self) -> bool:
        """Persistent and rotated, with gemm1 the only reader of the tiles loaded before the loop:
        those are freed in the last iteration, right after its gemm1 is complete."""
        if not self.tiles or not self.once or self.form != "rotated":
            return False
        readers = [op for op in self.body + self.post if _touched(op) & set(self.once)]
        return readers == [self.gemms[0]]

    def _free_once_early(self, lo, hi):
        """In a consumer loop over [lo, hi): in the iteration that issues gemm1 last, once gemm1 is
        complete (``early_once``); nothing in a loop that cannot hold it, no test in one that is it."""
        last = self.hi - 1
        if not self.early_once or (last - sympy.sympify(hi)).is_nonnegative:
            return
        with self._guard(f"{self.it} == {index(last)}", sympy.simplify(sympy.sympify(lo) - last) != 0):
            self._arrive_once()

    def _arrive_once(self):
        for name in self.once.values():
            self.e.src.line(f"T.barrier_arrive({name}_empty)")

    def _free_once(self, before_post: bool):
        """Persistent grids: free the tiles loaded before the loop for the next tile's producer,
        once nothing of this tile reads them (after the post-loop ops if those read them); when
        the last iteration frees them (``early_once``), only a loop that did not run does it here."""
        if not self.tiles or not self.once:
            return
        if self.early_once:
            if before_post and not (self.hi - self.lo).is_positive:
                with self._guard(f"{self.stop} <= {self.start}", True):
                    self._arrive_once()
            return
        read_after = any(_touched(op) & set(self.once) for op in self.post)
        if before_post != read_after:
            self._arrive_once()

    def _producer(self):
        e, src = self.e, self.e.src
        for op in self.pre:
            if op.result is not None and op.result.id in self.once:
                name = self.once[op.result.id]
                if self.tiles:
                    src.line(f"T.barrier_wait({name}_empty, {self._once_phase()} ^ 1)")
                src.line(f"T.tma_copy({e.global_region(op)}, {name}, barrier={name}_full)", op.loc)
                src.line(f"T.barrier_arrive({name}_full)")
        # under the rotation the rings only gemm2 reads are loaded one iteration behind the others
        # (FA3's order): their slots free up an iteration later, and waiting on them must not hold
        # back the next iteration's gemm1 tiles
        late = [r for r in self.rings.values() if self.form == "rotated" and r.readers == [self.gemms[-1]]]
        early = [r for r in self.rings.values() if r not in late]
        var = self.loop.attrs["var"]
        src.line(f"for {var} in T.serial({self.start}, {self.stop}):", self.loop.loc)
        with src.indent():
            for r in early:
                self._load(r, var)
            if late:
                src.line(f"if {var} > {self.start}:")
                with src.indent():
                    for r in late:
                        self._load(r, var - 1)
        if late:
            with self._guard_nonempty():
                for r in late:
                    self._load(r, self.hi - 1)

    def _load(self, r: Ring, it):
        """The producer's TMA load of ring ``r`` for iteration ``it`` (a sympy index)."""
        e, src, var = self.e, self.e.src, self.loop.attrs["var"]
        at = index(it)
        slot, phase = r.slot(at, self.start), r.phase(at, self.start)
        src.line(f"T.barrier_wait({r.name}_empty[{slot}], {phase} ^ 1)")
        mask = ", cluster_mask=0b11" if r.multicast else ""
        src.line(f"T.tma_copy({e.global_region(r.op, {var: it})}, {r.name}[{slot}, :, :], "
                 f"barrier={r.name}_full[{slot}]{mask})", r.op.loc)
        src.line(f"T.barrier_arrive({r.name}_full[{slot}])")

    # consumer side: loads become waits, gemm operands ring slots (the emitter asks these)
    def load_wait(self, op: Op) -> bool:
        """Emit the consumer's side of load ``op``; False when the producer does not load it."""
        vid = op.result.id
        if vid in self.once:
            self.e.src.line(f"T.barrier_wait({self.once[vid]}_full, {self._once_phase()})", op.loc)
            return True
        return vid in self.rings  # waited for at the gemm that reads it

    def operand(self, vid: int, rows: int | None = None) -> str | None:
        """A ring tile's slot in this iteration (its first ``rows`` rows if given); None if not a ring."""
        r = self.rings.get(vid)
        return None if r is None else f"{r.name}[{r.slot(self.it, self.start)}, {f'0:{rows}' if rows else ':'}, :]"

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
        src = self.e.src
        for r in self.rings.values():
            if not r.readers or r.readers[-1] is not gemm:
                continue
            slot = f"{r.name}_empty[{r.slot(it, self.start)}]"
            if r.multicast:  # rank 0 refills the slot in both blocks: both must have freed it
                src.line("if tx % 32 == 0:")
                src.line(f"    T.mbarrier_arrive({slot}, 0)")
                src.line(f"    T.mbarrier_arrive({slot}, 1)")
            else:
                src.line(f"T.barrier_arrive({slot})")

    def _issue(self, gemm: Op):
        self._wait_full(gemm)
        self.e.async_gemm = True
        self.e.block([gemm])
        self.e.async_gemm = False

    def _form(self) -> str:
        """The consumer loop's form: "rotated", "in_flight", "partials" or "synchronous" (module
        docstring)."""
        two_gemm = self.e.knobs.get("overlap") and overlap.schedule(self.body) is not None
        gemm_ids = {v.id for g in self.gemms for v in g.args}  # what vector work must not touch
        if two_gemm and self._rotatable(self.gemms[0], self.gemms[-1]):
            return "rotated"
        if all(op.name in ("gemm", "load") or not _touched(op) & gemm_ids for op in self.body):
            promoted = {promote_fp8.every(g, self.e.knobs, self.loop) for g in self.gemms} - {None}
            if not promoted:
                return "in_flight"
            if len(promoted) == 1 and len(self.gemms) == 1:
                n, every = sympy.sympify(self.hi - self.lo), promoted.pop()
                # two promotion groups per unrolled iteration, one per step fragment: the first is
                # added under the second's gemms, the second at the iteration's end (more groups
                # per iteration made ptxas spill on 128x128 tiles)
                if n.is_Integer and int(n) % (2 * every) == 0:
                    self.unroll = 2 * every
                    return "in_flight"
        self.partials = partials_in_flight.segments(self.body, self.gemms)
        return "partials" if self.partials else "synchronous"

    def _consumer_loop(self):
        self.it, self.waited = str(self.loop.attrs["var"]), set()
        if self.form == "rotated":
            self._rotated(self.gemms[0], self.gemms[-1])
        elif self.form == "in_flight":
            self._in_flight()
        elif self.form == "partials":
            partials_in_flight.emit(self, self.partials)
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
        if self.unroll:
            self._promoted_in_flight()
        else:
            with self._loop(self.start, self.stop):
                self._in_flight_step()
                src.line(f"if {var} > {self.start}:")
                with src.indent():
                    for g in self.gemms:
                        self._release(g, f"({var} - 1)")
            src.line("T.wait_wgmma(0)")
        if self.tiles:  # the next tile's loads go into the last slots too
            with self._guard_nonempty():
                for g in self.gemms:
                    self._release(g, index(self.hi - 1))

    def _in_flight_step(self):
        """One K step: its gemms issued, then the previous step's gemms complete (``wait_wgmma(1)``)."""
        for op in self.body:
            if op.name != "gemm":
                self.e.block([op])
                continue
            self._issue(op)
        self.e.src.line("T.wait_wgmma(1)")  # every gemm of the previous iteration is complete

    def _promoted_in_flight(self):
        """The fp8 mainloop with overlapped promotion (``promote_fp8``), unrolled by ``self.unroll``
        K steps: promotion groups alternate between the two step fragments, and each group is added
        once the next group's first gemm is issued and it is complete, so the add runs under that
        gemm. Every unrolled iteration ends with all its gemms complete and the last group added:
        ptxas serialises every wgmma if a fragment is read in a later iteration than the gemm that
        wrote it was issued in (warning C7514), and each step is a one-trip loop under the loop
        variable so that the fragment a gemm writes is fixed in the code."""
        src, var, u = self.e.src, self.it, self.unroll
        every = u // 2  # K steps per promotion group (_form unrolls by two groups)
        n = int(sympy.sympify(self.hi - self.lo))
        src.line(f"for {var}_unrolled in T.serial({n // u}):", self.loop.loc)
        with src.indent():
            for j in range(u):
                at = f"{var}_unrolled * {u} + {j}" + ("" if self.start == "0" else f" + {self.start}")
                slot = (j // every) % 2
                with self._loop(at, f"{at} + 1"):
                    self.e.promotions, self.e.promotion_slot = [], slot
                    self._in_flight_step()
                    self.e.promotion_slot = None
                    if j and j % every == 0:  # a group opens: the one before it is complete
                        for p in self.e.promotions:
                            p.add(src, 1 - slot)
                    with self._guard(f"{var}_unrolled > 0", j == 0):
                        for g in self.gemms:
                            self._release(g, f"({var} - 1)")
            src.line("T.wait_wgmma(0)")
            for p in self.e.promotions:  # the iteration's last group
                p.add(src, ((u - 1) // every) % 2)

    @contextlib.contextmanager
    def _guard(self, cond: str, needed: bool):
        """Emit the body under ``if cond:`` when ``needed``, else as it is."""
        if not needed:
            yield
            return
        self.e.src.line(f"if {cond}:")
        with self.e.src.indent():
            yield

    def _guard_nonempty(self):
        """Emit the body only when the pipelined loop ran at least once."""
        return self._guard(f"{self.stop} > {self.start}", not (self.hi - self.lo).is_positive)

    # -- the two-gemm rotation ----------------------------------------------------------------------
    def _rotatable(self, g1: Op, g2: Op) -> bool:
        """gemm2 can move one iteration later: it is the body's last op (nothing in the iteration
        reads its result) and it does not clear its accumulator on a condition of the loop index."""
        clear = self.e.plan.clear_by_gemm.get(id(g2))
        return clear in (None, "True") and g1 is not g2 and self.body[-1] is g2

    def _rotated(self, g1: Op, g2: Op):
        src = self.e.src
        late_ids = {g2.args[2].id} | {v.id for v in g2.args[:2]}
        i1 = self.body.index(g1)
        rest = [op for op in self.body[i1 + 1:] if op is not g2]
        # the first op that rewrites gemm2's operands or accumulator, or reads the accumulator
        hazard = next((k for k, op in enumerate(rest)
                       if op.written_ids() & late_ids or g2.args[2].id in _touched(op)), len(rest))
        a, b = PINGPONG_BARRIERS  # warp group 1's first arrive is before the loop over tiles (emit)
        turn = (f"T.sync_threads({a} + tx // 128, 256)", f"T.named_barrier_arrive({b} - tx // 128, 256)") \
            if self.pingpong else None
        before = [op for op in self.body[:i1] if not self._shared_load(op)]  # the producer loads those
        # iteration start: gemm1 alone
        first_hi = sympy.Min(self.lo + 1, self.hi)
        with self._loop(self.start, index(first_hi)):
            first = self._folded(before + rest, self.lo, self.lo)
            self.e.block([first.get(id(op), op) for op in before])
            self._wait_full(g1)
            self._turn(turn, 0)
            self._issue(g1)
            self._turn(turn, 1)
            src.line("T.wait_wgmma(0)")
            self._release(g1)
            self._free_once_early(self.lo, first_hi)
            self.e.block([first.get(id(op), op) for op in rest])
        # the steady state; where the masks only bite in the last iteration (a ragged tail), the
        # iterations before it run without them; where the last block is ragged and static, its
        # gemms cover only the rows that exist (narrow_tail.py)
        last = self.hi - 1
        inner = self._folded(before + rest, self.lo + 1, last - 1) if self.hi.is_Integer else {}
        tail = narrow_tail.plan(self, g1, g2)
        split = [(self.lo + 1, last, inner), (last, self.hi, {})] if inner or tail else [(self.lo + 1, self.hi, {})]
        for lo, hi, ops in split:
            if (sympy.sympify(hi) - lo).is_nonpositive:
                continue  # two iterations: nothing between the first and the last
            with self._loop(index(lo), index(hi)):
                self._steady(g1, g2, [ops.get(id(op), op) for op in before],
                             [ops.get(id(op), op) for op in rest], hazard, turn, (lo, hi),
                             tail if hi == self.hi else None)
        # gemm2 of the last iteration
        with self._loop(index(sympy.Max(self.hi - 1, self.lo)), self.stop):
            if tail:
                self._wait_full(g2)
                tail.gemm2(self, g2)
            else:
                self._issue(g2)
            src.line("T.wait_wgmma(0)")
            self._release(g2)

    def _steady(self, g1: Op, g2: Op, before: list[Op], rest: list[Op], hazard: int, turn, span, tail=None):
        """One steady-state iteration of the loop over ``span``: gemm1(n) and gemm2(n-1) in flight, the
        vector work of n under gemm2, and the wait for gemm2 right before the first op that needs it
        complete; ``tail``: the last iteration's gemm1 is narrowed (``narrow_tail``)."""
        src, var = self.e.src, self.it
        self.e.block(before)
        self._wait_full(g1)
        self._turn(turn, 0)
        if tail:
            tail.gemm1(self, g1)
        else:
            self._issue(g1)
        self.it = f"({var} - 1)"
        self._issue(g2)
        self.it = var
        self._turn(turn, 1)
        src.line("T.wait_wgmma(1)")
        self._release(g1)
        self._free_once_early(*span)
        if tail:
            tail.widen(self, g1)
        self.e.block(rest[:hazard])
        src.line("T.wait_wgmma(0)")
        self._release(g2, f"({var} - 1)")
        self.e.block(rest[hazard:])

    def _folded(self, ops: list[Op], lo, hi) -> dict[int, Op]:
        """Copies of the ``map`` ops whose masks ``fold_bounds`` can decide when the loop variable
        stays in [lo, hi] (id of the op -> copy); empty when none changes or the range is unknown.
        Bounds that vary over the grid count at their extremes: the variable's range is taken from
        the least ``lo`` to the greatest ``hi`` of any tile."""
        env = grid_env(self.e.m.grid)
        span = interval(sympy.sympify(lo), env), interval(sympy.sympify(hi), env)
        if None in span or span[0][0] > span[1][1]:
            return {}
        env[self.loop.attrs["var"]] = (span[0][0], span[1][1])
        out = {}
        for op in ops:
            if op.name == "map":
                expr = fold_node(op.attrs["expr"], env)
                if expr is not op.attrs["expr"]:
                    out[id(op)] = Op(op.name, op.args, {**op.attrs, "expr": expr}, op.result, op.regions, op.loc)
        return out

    def _turn(self, turn, which: int):
        if turn is not None:
            self.e.src.line(turn[which])
