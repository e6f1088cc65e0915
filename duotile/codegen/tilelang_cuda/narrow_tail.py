"""Narrow gemms for the last block of a ragged key loop under the two-gemm rotation (sm90).

Attention over S = 4096 keys in 192-key blocks runs 22 iterations, and only 64 keys of the last
block exist: TMA fills the other 128 rows of its K and V tiles with zeros, and a third of that
iteration's tensor work (3% of the kernel) multiplies them. Here the last iteration's gemms
cover only the rows that exist, with the same results:

* gemm1 (``S = Q K^T``) writes the first ``width`` columns into a narrower fragment, which is
  copied into the full accumulator once complete; the other columns are set to zero, what the
  wide gemm computes from zero rows of K;
* gemm2 (``O += P V``) reads the first ``width`` columns of P (copied into a narrower fragment:
  TileLang infers one layout per fragment) and the first ``width`` rows of V; the rows it skips
  are zeros and would add exact zeros.

It applies when both gemms read ring tiles whose rows run along the loop (K as gemm1's
transposed B, V as gemm2's B), the last block's extent is static and a multiple of the wgmma K
step (16), and gemm1 starts its accumulator afresh each iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ...dsl.ir import Op

K_STEP = 16  # bf16 wgmma: the K extent of one instruction, and a multiple of its N step (8)


@dataclass
class NarrowTail:
    width: int  # rows of the last block that exist
    block: int  # rows of a full block
    acc: str  # gemm1's narrow accumulator
    probs: str  # gemm2's narrow A operand

    def gemm1(self, ws, g1: Op):
        """Issue the last iteration's gemm1 into the narrow accumulator."""
        e = ws.e  # A is not a ring tile (plan), B is
        a, b = e.name(g1.args[0]), ws.operand(g1.args[1].id, self.width)
        e.src.line(f"T.wgmma_gemm({a}, {b}, {self.acc}, transpose_A={g1.attrs['transpose_a']}, "
                   f"transpose_B=True{e.policy(g1.args[2])}, clear_accum=True)", g1.loc)

    def widen(self, ws, g1: Op):
        """Once gemm1 is complete: its columns into the full accumulator, zeros after them."""
        src, full = ws.e.src, ws.e.name(g1.args[2])
        rows = int(g1.args[2].type.shape[0])
        src.line(f"for i0, i1 in T.Parallel({rows}, {self.width}):")
        src.line(f"    {full}[i0, i1] = {self.acc}[i0, i1]")
        src.line(f"for i0, i1 in T.Parallel({rows}, {self.block - self.width}):")
        src.line(f"    {full}[i0, i1 + {self.width}] = T.float32(0)")

    def gemm2(self, ws, g2: Op):
        """Issue the last gemm2 on the rows that exist."""
        e = ws.e
        p, b = e.name(g2.args[0]), ws.operand(g2.args[1].id, self.width)
        rows = int(g2.args[0].type.shape[0])
        e.src.line(f"for i0, i1 in T.Parallel({rows}, {self.width}):")
        e.src.line(f"    {self.probs}[i0, i1] = {p}[i0, i1]")
        e.src.line(f"T.wgmma_gemm({self.probs}, {b}, {e.name(g2.args[2])}, transpose_A=False, "
                   f"transpose_B=False{e.policy(g2.args[2])})", g2.loc)


def plan(ws, g1: Op, g2: Op) -> NarrowTail | None:
    """The narrowing of the last iteration, or None where it does not apply (module docstring)."""
    e = ws.e
    if not (ws.hi.is_Integer and sympy.sympify(ws.lo).is_Integer) or ws.hi - ws.lo < 2:
        return None
    k, v = ws.rings.get(g1.args[1].id), ws.rings.get(g2.args[1].id)
    if k is None or v is None or g1.args[0].id in ws.rings or g2.args[0].id in ws.rings:
        return None
    if not g1.attrs["transpose_b"] or g2.attrs["transpose_a"] or g2.attrs["transpose_b"]:
        return None
    if e.plan.clear_by_gemm.get(id(g1)) != "True" or e.plan.scope[g2.args[0].id] != "fragment":
        return None
    if any(a.type.dtype.bits != 16 for g in (g1, g2) for a in g.args[:2]):
        return None
    widths = {_last_rows(ws, r.op) for r in (k, v)}
    if len(widths) != 1 or None in widths:
        return None
    width, block = widths.pop()
    if not 0 < width < block or width % K_STEP:
        return None
    if int(g1.args[2].type.shape[1]) != block or int(g2.args[0].type.shape[1]) != block:
        return None
    acc, probs = f"{e.name(g1.args[2])}_tail", f"{e.name(g2.args[0])}_tail"
    rows = int(g1.args[2].type.shape[0])
    e.src.decl(f'{acc} = T.alloc_fragment(({rows}, {width},), "float32")')
    e.src.decl(f'{probs} = T.alloc_fragment(({rows}, {width},), "{g2.args[0].type.dtype.tilelang_name}")')
    return NarrowTail(width, block, acc, probs)


def _last_rows(ws, load: Op) -> tuple[int, int] | None:
    """(rows that exist, rows of the tile) for ``load`` in the loop's last iteration; None when
    its row offset there is not static."""
    p = ws.e.m.param(load.attrs["tensor"])
    shape = load.attrs["shape"]
    axis = len(p.shape) - len(shape)  # the tile's first (row) axis in the tensor
    start = sympy.sympify(load.attrs["offsets"][axis]).subs({ws.loop.attrs["var"]: ws.hi - 1})
    if not start.is_Integer:
        return None
    block = int(shape[0])
    return min(block, int(p.shape[axis]) - int(start)), block
