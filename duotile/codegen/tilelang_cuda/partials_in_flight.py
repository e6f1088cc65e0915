"""The manual mainloop of gemms into fresh partial sums (``warp_specialize="manual"`` on sm90).

A block-scaled GEMM runs one gemm per scale block into a partial made in the loop body, then
scales that partial and adds it into the accumulator (``gemm_blockscaled``'s promotion). Waited for
at once, every gemm leaves the tensor cores idle while the CUDA cores scale and add. Here each
gemm stays in flight while the previous one's partial is promoted:

    issue gemm 0
    issue gemm 1;  the work of partial 0 that does not read it (scale loads and decodes);
                   wait for gemm 0 (``wait_wgmma(1)``); the rest (scale and add)
    ...
    the last gemm's work, after ``wait_wgmma(0)``

So a K step of J gemms hides J - 1 promotions under a gemm (V4.1's 32-wide blocks at a 128-wide
K step: three of four); the last promotion of a step is not hidden. Each partial is its own
fragment, fixed in the code, so ptxas can tell the gemm in flight from the one complete (a
fragment chosen at run time serialises every wgmma, warning C7514).

The form applies where the loop body is such a chain (``segments``): each gemm's accumulator is
made in the body and read only by the ops between it and the next gemm; those ops leave the next
gemm's values alone; and the ops the next gemm needs (its loads, its partial's allocation) can be
issued before them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dsl.ir import Op


def _touched(op: Op) -> set[int]:
    """Ids of the values ``op`` reads or writes."""
    return op.written_ids() | {a.id for a in op.values()}


def _made(op: Op) -> set[int]:
    """Ids of the values ``op`` writes or makes."""
    return op.written_ids() | ({op.result.id} if op.result is not None else set())


@dataclass
class Segment:
    """One gemm of the chain: the ops it needs (``prep``, emitted before it), the work of its
    partial that does not read it (``early``, under the next gemm) and the rest (``late``)."""
    prep: list[Op]
    gemm: Op
    early: list[Op]
    late: list[Op]


def _producers(gemm: Op, ops: list[Op]) -> list[Op]:
    """The ops of ``ops`` whose values ``gemm`` needs, directly or through one another."""
    needed = {v.id for v in gemm.values()}
    picked = []
    for op in reversed(ops):
        if _made(op) & needed:
            picked.append(op)
            needed |= {v.id for v in op.values()}
    return picked[::-1]


def _independent(first: list[Op], then: list[Op]) -> bool:
    """Whether ``then`` can run before ``first``: neither writes what the other touches."""
    return not any(_made(p) & _touched(q) or _made(q) & (_touched(p) | _made(p)) for p in then for q in first)


def segments(body: list[Op], gemms: list[Op]) -> list[Segment] | None:
    """The loop body as a chain of gemms into fresh partials, or None where it is not one."""
    if not gemms:
        return None
    made_here = {op.result.id for op in body if op.result is not None}
    at = [body.index(g) for g in gemms]
    out, pending = [], body[:at[0]]  # the first gemm's prep: everything before it
    for j, g in enumerate(gemms):
        part = g.args[2].id
        if part not in made_here:
            return None  # an accumulator carried across iterations: the in-flight forms
        mid = body[at[j] + 1:at[j + 1] if j + 1 < len(gemms) else len(body)]
        nxt = gemms[j + 1] if j + 1 < len(gemms) else None
        prep_next = _producers(nxt, mid) if nxt is not None else []
        work = [op for op in mid if all(op is not p for p in prep_next)]
        readers = [i for i, op in enumerate(work) if part in _touched(op)]
        if not readers or not _independent(work, prep_next):
            return None
        if nxt is not None and any(_touched(op) & {v.id for v in nxt.args} for op in work):
            return None  # the next gemm's operands or partial are touched while it is in flight
        elsewhere = [op for op in body if op is not g and all(op is not w for w in work)
                     and part in _touched(op) and (op.result is None or op.result.id != part)]
        if elsewhere:
            return None  # the partial is read after the next gemm is issued
        out.append(Segment(pending, g, work[:readers[0]], work[readers[0]:]))
        pending = prep_next
    return out


def emit(ws, segs: list[Segment]) -> None:
    """The consumer loop: each gemm issued, then the previous partial's work under it (module
    docstring). ``ws`` is the ``ManualWarpSpecialization`` whose loop this is."""
    e = ws.e
    with ws._loop(ws.start, ws.stop):
        for j, seg in enumerate(segs):
            e.block(seg.prep)
            ws._issue(seg.gemm)
            if j:
                _finish(ws, segs[j - 1], in_flight=1)
        _finish(ws, segs[-1], in_flight=0)


def _finish(ws, seg: Segment, in_flight: int) -> None:
    """A partial's work: what does not read it, the wait for its gemm (``in_flight`` gemms left
    running), the release of the ring slots it read, and the rest."""
    ws.e.block(seg.early)
    ws.e.src.line(f"T.wait_wgmma({in_flight})")
    ws._release(seg.gemm)
    ws.e.block(seg.late)
