"""A persistent grid on sm90 (knob ``persistent``, with ``warp_specialize="manual"``).

Instead of one block per output tile, a fixed number of blocks (one per SM by default) walk the
tiles: block ``cta`` takes tiles ``cta``, ``cta + G``, ``cta + 2G`` ... . What this buys is the
seam between tiles: the producer warp group does not stop at the end of a tile, so the next
tile's first loads (and, for attention, its Q tile) arrive while the consumers still run the
previous tile's epilogue, and no block launch sits between two tiles.

What the manual schedule needs for it (``manual_ws.py``):

* ring slots and phases count iterations across tiles: each role keeps ``ring_base``, the
  iterations of the tiles it has finished, and adds it to the loop variable;
* a tile loaded before the pipelined loop (attention's Q) gets an ``empty`` barrier too, with a
  phase that flips every tile, and the consumers free it once the loop's gemms are complete;
* the tile's grid coordinates are decoded from its linear number, innermost grid axis fastest;
  with ``raster`` (panels of that many rows of the two innermost axes, for L2 reuse) the
  rasterisation is done here, since TileLang's ``T.use_swizzle`` remaps block indices.

``persistent=True`` launches ``min(tiles, SMs)`` blocks; an integer launches that many (tests use
it to put several tiles, and so several ring rounds, in one block).

With ``cluster=2`` the blocks run in clusters of two (``T.ClusterKernel``) that walk pairs of
tiles, neighbours along the grid's second-innermost axis (a gemm's row blocks): rank ``r`` of a
cluster takes row ``2 * p + r`` of pair ``p``. A tile the pair shares (one whose offsets do not
name that axis: a gemm's B tile) is loaded once by rank 0 and multicast by TMA into both blocks'
shared memory (``manual_ws.py`` frees its slots in both), so L2 serves it once for two tiles.
"""

from __future__ import annotations

import math

import sympy

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Module, Op
from .exprs import index

BASE = "ring_base[0]"  # iterations of the tiles this role has finished (a register per thread)


def tile_loop(grid: Op, knobs: dict, sms: int) -> TileLoop | None:
    """The loop over tiles a ``persistent`` knob asks for; None when the grid is not persistent.
    True launches ``min(tiles, sms)`` blocks, an integer that many (at most one per tile)."""
    p = knobs.get("persistent")
    if not p:
        return None
    return TileLoop(grid, sms if p is True else int(p), int(knobs.get("raster", 0) or 0),
                    int(knobs.get("cluster", 1) or 1))


class TileLoop:
    """Emits the persistent loop over tiles around one role's body, and the grid decode."""

    def __init__(self, grid: Op, blocks: int, raster: int, cluster: int = 1):
        self.vars = [str(v) for v in grid.attrs["vars"]]
        self.extents = [int(x) for x in grid.attrs["extents"]]
        self.cluster = cluster
        if cluster > 1:  # the loop walks pairs of tiles: the pair axis counts pairs
            self.extents[-2] //= cluster
        self.tiles = math.prod(self.extents)
        self.ctas, self.raster = min(self.tiles, blocks // cluster), max(raster // cluster, 1) if raster else 0
        self.rounds = -(-self.tiles // self.ctas)

    @property
    def pair_var(self) -> str | None:
        """The grid variable a cluster's blocks differ in (None without clusters)."""
        return self.vars[-2] if self.cluster > 1 else None

    def head(self, threads: int) -> str:
        if self.cluster > 1:
            return (f"with T.ClusterKernel({self.ctas * self.cluster}, cluster_dims={self.cluster}, "
                    f"threads={threads}) as (cta,):")
        return f"with T.Kernel({self.ctas}, threads={threads}) as (cta,):"

    def open(self, src) -> None:
        """Start the loop (caller indents twice: the loop and the bounds check)."""
        me = f"cta // {self.cluster}" if self.cluster > 1 else "cta"
        src.line(f"for tile_round in T.serial({self.rounds}):")
        src.line(f"    tile_id = {me} + tile_round * {self.ctas}")
        src.line(f"    if tile_id < {self.tiles}:")

    def decode(self, src) -> None:
        """Bind the grid variables from ``tile_id`` (with clusters: from the pair's number)."""
        names, ext = self.vars, self.extents
        if self.raster and len(names) >= 2 and ext[-2] > 1:
            p, rows, cols = self.raster, ext[-2], ext[-1]
            src.line(f"panel_row = tile_id % {rows * cols} // {p * cols} * {p}")
            src.line(f"panel_rows = T.min({p}, {rows} - panel_row)")
            src.line(f"in_panel = tile_id % {rows * cols} - panel_row * {cols}")
            src.line(f"{names[-2]} = {self._mine('panel_row + in_panel % panel_rows')}")
            src.line(f"{names[-1]} = in_panel // panel_rows")
            inner, outer = rows * cols, names[:-2]
        else:
            src.line(f"{names[-1]} = tile_id % {ext[-1]}")
            inner, outer = ext[-1], names[:-1]
        for k in range(len(outer) - 1, -1, -1):
            span = f" % {ext[k]}" if k else ""
            at = f"tile_id // {inner}{span}"
            src.line(f"{outer[k]} = {self._mine(at) if outer[k] == self.pair_var else at}")
            inner *= ext[k]

    def _mine(self, pair_index: str) -> str:
        """This block's row of the pair at ``pair_index`` (itself without clusters)."""
        if self.cluster == 1:
            return pair_index
        return f"({pair_index}) * {self.cluster} + cta % {self.cluster}"

    @staticmethod
    def advance(src, loop: Op) -> None:
        """After a tile: count its iterations of the pipelined ``loop`` into the ring base."""
        n = index(sympy.Max(sympy.expand(loop.attrs["extent"] - loop.attrs["start"]), 0))
        src.line(f"{BASE} = {BASE} + {n}")


def check_persistent(module: Module, arch_name: str, knobs: dict, ws_mode: str, has_tmem: bool) -> None:
    """``persistent`` is a schedule of duotile's own warp specialisation: refused without it."""
    check_cluster(module, arch_name, knobs)
    p = knobs.get("persistent")
    if not p:
        return
    if p is not True and int(p) < 0:
        raise UnsupportedError(f"{arch_name}: persistent={p}: a block count must be positive", module.grid.loc)
    if has_tmem or ws_mode != "manual":
        raise UnsupportedError(f"{arch_name}: persistent needs warp_specialize=manual on sm90 "
                               f"(got warp_specialize={ws_mode}; config {module.config})", module.grid.loc)


def shares(load: Op, pair_var: str) -> bool:
    """A load the two blocks of a cluster read alike: its offsets do not name the pair axis."""
    return all(pair_var not in {str(x) for x in sympy.sympify(o).free_symbols} for o in load.attrs["offsets"])


def check_cluster(module: Module, arch_name: str, knobs: dict) -> None:
    """``cluster=2`` pairs persistent blocks; refused where it cannot pair them or share a tile."""
    c = int(knobs.get("cluster", 1) or 1)
    if c == 1:
        return
    grid, loc = module.grid, module.grid.loc
    why = None
    p = knobs.get("persistent")
    if c != 2:
        why = "clusters of 2 blocks only"
    elif not p:
        why = "it is a schedule of the persistent grid (persistent=true, warp_specialize=manual)"
    elif p is not True and int(p) % 2:
        why = f"an even block count (persistent={p})"
    elif len(grid.attrs["extents"]) < 2 or int(grid.attrs["extents"][-2]) % 2:
        why = "a grid whose second-innermost axis has an even extent (pairs of row blocks)"
    else:
        pair = str(grid.attrs["vars"][-2])
        loops = [op for op in grid.regions[0].ops if op.name == "for" and op.attrs.get("stages")]
        loads = [o for lp in loops for o in lp.regions[0].ops if o.name == "load"]
        if not any(shares(o, pair) for o in loads):
            why = f"a tile loaded in the pipelined loop that both blocks of a pair read (none is free of {pair})"
    if why:
        raise UnsupportedError(f"{arch_name}: cluster={c} needs {why} (config {module.config})", loc)
