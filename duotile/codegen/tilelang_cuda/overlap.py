"""Software pipelining of a two-gemm loop on sm90 (the ``overlap`` knob, FA3's schedule).

When a pipelined loop holds two gemms and the second one's operands are computed (by vector
work) from the first one's accumulator -- attention's S = Q K^T, softmax, O += P V -- the vector
work of iteration k can overlap the tensor cores if the second gemm, and the vector ops that
rewrite its accumulator, run one iteration behind:

    iteration k:  gemm1(k) | rescale(k-1), gemm2(k-1) | softmax(k)      (loads: the TMA producer)

This module computes TileLang's ``T.Pipelined(order=, stage=)`` annotation for that
schedule from the loop body's ops. Any kernel with that dependence shape gets it; a loop without
it gets none. The statements are counted as the emitter wrote them.
"""

from __future__ import annotations

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Module, Op


def _sources(ops: list[Op]) -> dict[int, set[int]]:
    """Value id -> ids of the values (and buffers) it is computed from, within the loop body."""
    src: dict[int, set[int]] = {}
    for op in ops:
        if op.result is not None:
            src[op.result.id] = {op.result.id}.union(*(src.get(a.id, {a.id}) for a in op.values()))
    return src


def schedule(body: list[Op]) -> dict[int, tuple[int, int]] | None:
    """op index -> (stage, order), or None when the loop does not have the two-gemm shape."""
    gemms = [i for i, op in enumerate(body) if op.name == "gemm"]
    if len(gemms) < 2:
        return None
    g1, g2 = gemms[0], gemms[-1]
    acc1, acc2 = body[g1].args[2].id, body[g2].args[2].id
    src = _sources(body)
    operands = body[g2].args[:2]
    if not any(acc1 in src.get(v.id, set()) for v in operands):
        return None
    late = {g2} | {i for i, op in enumerate(body)
                   if op.name == "map" and op.attrs.get("into") is not None and op.attrs["into"].id == acc2}
    if any(i < g1 for i in late):
        return None
    plan: dict[int, tuple[int, int]] = {}
    order = 0
    for i, op in enumerate(body):  # loads are the producer's: no stage, no order
        if op.name in ("load", "gather"):
            plan[i] = (-1, -1)
    for i in range(g1 + 1):
        if i not in plan:
            plan[i], order = (0, order), order + 1
    for i in sorted(late):
        plan[i], order = (1, order), order + 1
    for i in range(g1 + 1, len(body)):
        if i not in plan:
            plan[i], order = (0, order), order + 1
    return plan


def annotation(plan: dict[int, tuple[int, int]], statements: dict[int, int]) -> str:
    """The keyword arguments for T.Pipelined, one entry per top-level statement of the body
    (TileLang 0.1.15 has no ``group=``); ``statements``: op index -> statements it emitted."""
    orders, stages, next_order = [], [], 0
    by_order = sorted((plan[i][1], i) for i in statements if statements[i] and plan[i][1] >= 0)
    first_order = {}
    for _, i in by_order:  # renumber so that every statement has its own order
        first_order[i], next_order = next_order, next_order + statements[i]
    for i in sorted(statements):
        stage, order = plan[i]
        for k in range(statements[i]):
            orders.append(-1 if order < 0 else first_order[i] + k)
            stages.append(stage)
    return f"order={orders}, stage={stages}"


def check_overlap(module: Module, arch_name: str, knobs: dict, ws_mode: str) -> None:
    """``overlap`` reorders a pipelined loop for a producer warp group; with ``warp_specialize``
    off TileLang 0.1.15 rejects the order late ("Two statements in the same order")."""
    if not knobs.get("overlap") or ws_mode != "off":
        return
    for op in module.walk():
        if op.name == "for" and op.attrs.get("stages") and schedule(op.regions[0].ops) is not None:
            raise UnsupportedError(f"{arch_name}: overlap=True needs warp_specialize auto or manual, not off "
                                   f"(config {module.config})", op.loc)
