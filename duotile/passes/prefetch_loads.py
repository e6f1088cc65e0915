"""prefetch_loads: read a pipelined loop's small register tiles one iteration ahead.

A pipelined loop's operand tiles go through the target's pipeline (shared-memory rings on CUDA),
but a plain register tile loaded in the loop (a block-scaled gemm's scale codes, a tile table's
entries) is read where it stands: on sm90 the load follows the iteration's gemm wait, and its
latency (about half a microsecond from L2) is spent once a K step, as long as the step's gemm
itself at 128 x 256 x 128 fp8. This pass issues each such load for the next iteration at the top
of the current one, into a buffer the next iteration reads, so its latency hides under the
iteration's work::

    for k < 8 pipelined(stages=3) {
      ... gemm ...
      %s = load a_scale[g, 64*m, k] -> u8[64x1] vector
      ... reads %s ...
    }

becomes::

    %next = alloc() -> u8[64x1] vector
    %s0 = load a_scale[g, 64*m, 0] -> u8[64x1] vector
    assign(%next, %s0)
    for k < 8 pipelined(stages=3) {
      %s1 = load a_scale[g, 64*m, k + 1] -> u8[64x1] vector
      ... gemm ...
      ... reads %next ...
      assign(%next, %s1)
    }

The last iteration reads one step past the loop's end: a load's out-of-range elements read
``other``, and nothing reads that buffer after the loop. A load is moved only where that is the
same computation: directly in the loop's body (not in a nested loop), at offsets of sizes, grid
and outer loop variables and this loop's variable (no data scalar defined in the loop), from a
tensor nothing in the loop writes, as a register tile (an operand tile is the target's pipeline's)
of at most ``MAX_BYTES``: each one moved holds two copies live across the iteration. A loop moves its
loads only where their two copies fit ``MAX_REGISTERS`` a thread together (a one-element tile, which
every thread holds, costs a register; a tile over the threads, its share at 128 threads), else none:
on an H200 (``benchmarks/results/bench_prefetch_loads.md``) V4's block-scaled GEMM, three loads a K
step, ran 1.08-1.15x faster, and V4.1's, 36 loads a step (a scale code per 32-wide block), 1.2-1.8x
slower.

Run by the CUDA targets before their fusing passes; the interpreter runs the module as written
(the tests run both forms on it and compare).
"""

from __future__ import annotations

import sympy

from ..dsl.ir import Block, Module, Op, Role, Value
from .rewrite import substitute

MAX_BYTES = 4096  # a moved tile's bytes over the block (two copies live: 64 B a thread at 128 threads)
MAX_REGISTERS = 16  # a thread's registers for a loop's moved tiles, both copies
FEWEST_THREADS = 128  # a tile's share of a thread is counted at the fewest threads a block runs


def prefetch_loads(module: Module, skip=None) -> Module:
    """``skip(loop)``, where given, names pipelined loops left as they are (a target that pipelines
    their loads itself)."""
    loops = [(block, op) for block in _blocks(module.body) for op in block.ops
             if op.name == "for" and op.attrs.get("stages") and not (skip and skip(op))]
    for block, loop in loops:
        _prefetch(block, loop)
    return module


def _blocks(block: Block):
    """``block`` and every block nested in it."""
    yield block
    for op in block.ops:
        for region in op.regions:
            yield from _blocks(region)


def movable_loads(loop: Op) -> list[Op]:
    """The top-level ops of ``loop``'s body that may be read one iteration ahead."""
    body = loop.regions[0]
    defined = {o.attrs["var"] for o in body.walk() if o.name in ("scalar", "for")}
    written = {o.attrs.get("tensor") for o in body.walk() if o.name in ("store", "scatter")}
    return [op for op in body.ops if _movable(op, defined, written)]


def _movable(op: Op, defined: set, written: set) -> bool:
    if op.name != "load" or op.result is None or op.result.type.role is not Role.VECTOR:
        return False
    t = op.result.type
    if not t.numel().is_Integer or int(t.numel()) * t.dtype.bits // 8 > MAX_BYTES:
        return False
    used = set().union(*(sympy.sympify(x).free_symbols for x in op.attrs["offsets"]))
    return not used & defined and op.attrs["tensor"] not in written


def registers(t) -> int:
    """A thread's 32-bit registers for one copy of tile type ``t``."""
    n = int(t.numel())
    words = max(1, t.dtype.bits // 32)
    return words if n == 1 else -(-n * words // FEWEST_THREADS)


def _prefetch(parent: Block, loop: Op) -> None:
    body = loop.regions[0]
    var, start = loop.attrs["var"], sympy.sympify(loop.attrs["start"])
    moved = movable_loads(loop)
    if not moved or 2 * sum(registers(op.result.type) for op in moved) > MAX_REGISTERS:
        return
    at = next(i for i, o in enumerate(parent.ops) if o is loop)
    head, top, tail = [], [], []
    for op in moved:
        t = op.result.type
        nxt = Value(t, mutable=True, hint=f"{op.result.hint or 'v'}_next")
        first = Value(t, hint=op.result.hint)
        ahead = Value(t, hint=op.result.hint)
        head += [Op("alloc", attrs={"fill": None}, result=nxt, loc=op.loc),
                 _shifted(op, var, start, first), Op("assign", args=(nxt, first), loc=op.loc)]
        top.append(_shifted(op, var, var + 1, ahead))
        tail.append(Op("assign", args=(nxt, ahead), loc=op.loc))
        body.ops.remove(op)
        for o in body.ops:
            substitute(o, op.result, nxt)
    body.ops[:0] = top
    body.ops.extend(tail)
    parent.ops[at:at] = head


def _shifted(op: Op, var: sympy.Symbol, value, result: Value) -> Op:
    """``op`` (a load) with the loop variable replaced by ``value``, into ``result``."""
    offsets = tuple(sympy.sympify(x).subs(var, value) for x in op.attrs["offsets"])
    return Op("load", (), {**op.attrs, "offsets": offsets}, result, [], op.loc)
