"""FP8 promotion on sm90 (knob ``fp8_promote_k``).

Hopper's fp8 wgmma accumulates with a narrowed mantissa, so the K loop runs into a step fragment
that is added into the fp32 accumulator every ``fp8_promote_k`` elements of K (and on the last
step) -- DeepGEMM's promotion. The interval is whole K steps, never longer than asked: with a K
tile of 128, 128 adds every step and 512 every fourth.

Two forms:

* ``synchronous`` (TileLang's schedules, and duotile's manual one outside a GEMM mainloop): the
  gemm is waited for, then added;
* ``overlapped`` (the manual schedule's in-flight mainloop): two step fragments take turns, one
  promotion group each. The gemm of group g goes into fragment g % 2 and stays in flight; once the
  first gemm of group g is issued and the one before it is complete (``wait_wgmma(1)``), group
  g - 1's fragment is added while the tensor cores work on group g. The mainloop is unrolled over
  two groups so that which fragment is read is fixed in the code: with a fragment chosen at run
  time ptxas cannot tell the in-flight one from the complete one and serialises every wgmma
  (warning C7514). The mainloop places the adds (``manual_ws._promoted_in_flight``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dsl.ir import Op
from .exprs import index


def every(op: Op, knobs: dict, loop: Op | None = None) -> int | None:
    """K steps per promotion group for an fp8 gemm under ``fp8_promote_k`` in ``loop``; None when
    it is not promoted (not fp8, the knob is 0, or the accumulator is made inside ``loop``'s
    body: a fresh sum of one step, which the kernel itself scales or adds each iteration, as a
    block-scaled gemm does; promoting it would add it only every few steps and never clear it)."""
    if op.name != "gemm" or op.args[0].type.dtype.bits != 8 or not knobs.get("fp8_promote_k"):
        return None
    if loop is not None and any(o.result is op.args[2] for o in loop.regions[0].walk()):
        return None
    k_tile = int(op.args[0].type.shape[0 if op.attrs["transpose_a"] else 1])
    return max(1, int(knobs["fp8_promote_k"]) // k_tile)


@dataclass
class Promotion:
    """A promotion's step fragments and its add (overlapped: two fragments, whose adds the manual
    mainloop places; synchronous: one, named twice)."""
    acc: str
    steps: tuple[str, str]
    shape: str
    loc: object

    def add(self, src, slot: int) -> None:
        """acc += step fragment ``slot`` (a Python int: ptxas must see which fragment is read
        while the other one's wgmma is in flight, or it serialises every wgmma)."""
        src.line(f"for i0, i1 in T.Parallel({self.shape}):", self.loc)
        src.line(f"    {self.acc}[i0, i1] = {self.acc}[i0, i1] + {self.steps[slot]}[i0, i1]", self.loc)


def promoted_gemm(e, op: Op, a_buf: str, b_buf: str, policy: str) -> Promotion | None:
    """Emit an fp8 gemm with promotion. With ``e.promotion_slot`` set (the manual mainloop,
    unrolled over two groups) the gemm goes into that step fragment and stays in flight; the
    ``Promotion`` returned lets the mainloop place the adds. Otherwise the synchronous form."""
    acc = op.args[2]
    loop = e.loop_stack[-1]
    n_every = every(op, e.knobs, loop)
    k, start, stop = loop.attrs["var"], loop.attrs["start"], loop.attrs["extent"]
    shape = ", ".join(str(int(d)) for d in acc.type.shape)
    rel = f"({index(k - start)})"
    first = "True" if n_every == 1 else f"{rel} % {n_every} == 0"
    tail = f"transpose_A={op.attrs['transpose_a']}, transpose_B={op.attrs['transpose_b']}{policy}, clear_accum={first}"
    if e.async_gemm and e.promotion_slot is not None:
        steps = (f"{e.name(acc)}_step0", f"{e.name(acc)}_step1")
        for s in steps:
            e.src.decl(f'{s} = T.alloc_fragment(({shape},), "float32")')
        e.src.line(f"T.wgmma_gemm({a_buf}, {b_buf}, {steps[e.promotion_slot]}, {tail})", op.loc)
        return Promotion(e.name(acc), steps, shape, op.loc)
    part = f"{e.name(acc)}_step"
    e.src.decl(f'{part} = T.alloc_fragment(({shape},), "float32")')
    e.src.line(f"T.gemm({a_buf}, {b_buf}, {part}, {tail})", op.loc)
    synchronous = Promotion(e.name(acc), (part, part), shape, op.loc)
    if n_every == 1:
        synchronous.add(e.src, 0)
        return None
    e.src.line(f"if T.Or({rel} % {n_every} == {n_every - 1}, {k} == {index(stop - 1)}):", op.loc)
    with e.src.indent():
        synchronous.add(e.src, 0)
    return None
