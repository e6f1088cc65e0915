"""Software pipelining of a gather loop on sm90 (the ``gather_pipeline`` knob).

A pipelined loop whose rows arrive by a gather into shared memory -- sparse decode's blocks of
rows named by an index list -- is not pipelined by TileLang 0.1.15's own schedule: a masked
cp.async gather (``T.if_then_else``, ``parallel_prefer_async``) followed by work before its gemm
comes out with every copy awaited where it is issued (``cp_async_wait<0>``), one global-memory
latency a block (``scripts/tilelang_pipeline_probe.py`` shows the forms). With an explicit
``T.Pipelined(order=, stage=)`` it is: block n + 1's copies are issued before block n's are
awaited (``cp_async_wait<k>``, k > 0), each gathered tile in ``stages`` shared-memory copies.

The schedule puts in stage 0 each gather into shared memory, every other load into shared memory,
and the ops the gathers' index tiles are computed by; everything else is stage 1, in the order
written. TileLang keeps a copy a stage of each shared buffer written in stage 0 and read in
stage 1; a register tile has one copy, so a loop where one crosses from stage 0 to stage 1 (or
where a stage-0 op reads what the iteration's stage 1 computes, a value carried across
iterations) gets no schedule and stays as it is. ``passes/prefetch_loads.py`` does not move such a
loop's loads (the pipeline reads ahead itself). ``capacity.py`` counts each stage-0 shared tile
``stages`` times.
"""

from __future__ import annotations

from ...dsl.ir import Op


def has_gather(loop: Op) -> bool:
    """Whether a pipelined loop's body gathers (at its top level): the loops this schedule is for."""
    return bool(loop.attrs.get("stages")) and any(op.name == "gather" for op in loop.regions[0].ops)


def stage_zero(body: list[Op], scope: dict[int, str]) -> set[int] | None:
    """Indices of the body's ops that run a stage ahead, or None where the loop has no gather into
    shared memory or cannot be split (the module docstring)."""
    made = {op.result.id: i for i, op in enumerate(body) if op.result is not None}
    first = {i for i, op in enumerate(body)
             if op.name in ("gather", "load") and op.result is not None and scope.get(op.result.id) == "shared"}
    if not any(body[i].name == "gather" for i in first):
        return None
    ahead, todo = set(), sorted(first)
    while todo:  # the gathers' index tiles back to what the body computes them from
        i = todo.pop()
        if i in ahead:
            continue
        ahead.add(i)
        for a in body[i].values():
            if a.id in made and made[a.id] < i:
                todo.append(made[a.id])
            elif a.id in made:  # read before it is written: carried from the last iteration
                return None
    written_later = {op.attrs["into"].id for i, op in enumerate(body)
                     if i not in ahead and op.name == "map" and op.attrs.get("into") is not None}
    for i in ahead:
        if any(a.id in written_later for a in body[i].values()):
            return None  # a buffer stage 1 rewrites each iteration
        if body[i].name == "map" and body[i].attrs.get("into") is not None:
            return None  # stage 0 rewriting a buffer: one copy for two iterations
    crossing = {body[i].result.id for i in ahead if body[i].result is not None}
    for i, op in enumerate(body):
        if i not in ahead and any(a.id in crossing and scope.get(a.id) != "shared" for a in op.values()):
            return None
    return ahead


def schedule(body: list[Op], scope: dict[int, str]) -> dict[int, tuple[int, int]] | None:
    """op index -> (stage, order) for ``overlap.annotation``, or None (no schedule)."""
    ahead = stage_zero(body, scope)
    if ahead is None:
        return None
    return {i: (0 if i in ahead else 1, i) for i in range(len(body))}
