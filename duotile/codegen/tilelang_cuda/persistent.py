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
tiles, neighbours along one of the grid's two innermost axes (``pair_axis``: the one whose pairs
share the most bytes a step; a gemm's row blocks, attention's query blocks): rank ``r`` of a
cluster takes index ``2 * p + r`` of pair ``p``. A tile the pair shares (one whose offsets do not
name that axis: a gemm's B tile, attention's K and V) is loaded once by rank 0 and multicast by
TMA into both blocks' shared memory (``manual_ws.py`` frees its slots in both), so L2 serves it
once for two tiles. Both blocks must then walk the same loop: its trip count may not depend on
the pair axis (causal attention's does).
"""

from __future__ import annotations

import math

import sympy

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Module, Op
from .exprs import atom, count_div, count_mod, index

BASE = "ring_base[0]"  # iterations of the tiles this role has finished (a register per thread)


def tile_loop(grid: Op, knobs: dict, sms: int) -> TileLoop | None:
    """The loop over tiles a ``persistent`` knob asks for; None when the grid is not persistent.
    True launches ``min(tiles, sms)`` blocks, an integer that many (at most one per tile)."""
    p = knobs.get("persistent")
    if not p:
        return None
    cluster = int(knobs.get("cluster", 1) or 1)
    return TileLoop(grid, sms if p is True else int(p), int(knobs.get("raster", 0) or 0), cluster,
                    pair_axis(grid) if cluster > 1 else None)


class TileLoop:
    """Emits the persistent loop over tiles around one role's body, and the grid decode."""

    def __init__(self, grid: Op, blocks: int, raster: int, cluster: int = 1, pair: int | None = None):
        self.vars = [str(v) for v in grid.attrs["vars"]]
        # extents are integers, or expressions of dynamic sizes (then so are tiles, blocks, rounds)
        self.extents = [sympy.sympify(x) for x in grid.attrs["extents"]]
        self.cluster, self.pair = cluster, pair
        if cluster > 1:  # the loop walks pairs of tiles: the pair axis counts pairs (check_cluster: even)
            self.extents[pair] = self.extents[pair] / cluster
        self.tiles = sympy.Mul(*self.extents)
        # a raster panel spans rows of the second-innermost axis: in pairs when clusters pair that axis
        panel_rows = max(raster // cluster, 1) if raster and cluster > 1 and pair == -2 else raster
        self.ctas, self.raster = sympy.Min(self.tiles, blocks // cluster), panel_rows
        self.rounds = sympy.ceiling(self.tiles / self.ctas)

    @property
    def dynamic(self) -> bool:
        """Whether the tile count depends on a dynamic size: the decode then divides by it."""
        return not sympy.sympify(self.tiles).is_Integer

    def declare(self, src) -> None:
        """Where the decode divides by a dynamic size, the grid variables are registers
        (``T.alloc_var``), assigned once a tile: TileLang inlines a bound expression into every
        use, and the producer recomputed the decode's divisions for each TMA copy of the K loop."""
        if self.dynamic:
            for name in self.vars:
                src.decl(f'{name} = T.alloc_var("int32")')

    @property
    def pair_var(self) -> str | None:
        """The grid variable a cluster's blocks differ in (None without clusters)."""
        return self.vars[self.pair] if self.cluster > 1 else None

    def head(self, threads: int) -> str:
        if self.cluster > 1:
            return (f"with T.ClusterKernel({index(self.ctas * self.cluster)}, cluster_dims={self.cluster}, "
                    f"threads={threads}) as (cta,):")
        return f"with T.Kernel({index(self.ctas)}, threads={threads}) as (cta,):"

    def open(self, src) -> None:
        """Start the loop (caller indents twice: the loop and the bounds check)."""
        me = f"cta // {self.cluster}" if self.cluster > 1 else "cta"
        src.line(f"for tile_round in T.serial({index(self.rounds)}):")
        src.line(f"    tile_id = {me} + tile_round * {atom(self.ctas)}")
        src.line(f"    if tile_id < {index(self.tiles)}:")

    def decode(self, src) -> None:
        """Bind the grid variables from ``tile_id`` (with clusters: from the pair's number)."""
        names, ext = self.vars, self.extents  # counts: decoded with count_div / count_mod
        if self.raster and len(names) >= 2 and self.extents[-2] != 1:
            p = self.raster
            area = count_mod("tile_id", ext[-2] * ext[-1])
            src.line(f"panel_row = {count_div(area, p * ext[-1])} * {p}")
            src.line(f"panel_rows = T.min({p}, {atom(ext[-2])} - panel_row)")
            src.line(f"in_panel = {area} - panel_row * {atom(ext[-1])}")
            src.line(f"{names[-2]} = {self._mine(names[-2], 'panel_row + ' + count_mod('in_panel', 'panel_rows'))}")
            src.line(f"{names[-1]} = {self._mine(names[-1], count_div('in_panel', 'panel_rows'))}")
            inner, outer = self.extents[-2] * self.extents[-1], names[:-2]
        else:
            src.line(f"{names[-1]} = {self._mine(names[-1], count_mod('tile_id', ext[-1]))}")
            inner, outer = self.extents[-1], names[:-1]
        for k in range(len(outer) - 1, -1, -1):
            at = count_div("tile_id", inner)
            src.line(f"{outer[k]} = {self._mine(outer[k], count_mod(at, ext[k]) if k else at)}")
            inner *= self.extents[k]

    def _mine(self, var: str, at: str) -> str:
        """Grid variable ``var`` decoded as ``at``; on the pair axis, this block's index of the pair."""
        if var != self.pair_var:
            return at
        return f"({at}) * {self.cluster} + cta % {self.cluster}"

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


def _pipelined(grid: Op) -> list[Op]:
    return [op for op in grid.regions[0].ops if op.name == "for" and op.attrs.get("stages")]


def _shared_loads(grid: Op, axis: int) -> list[Op]:
    """The pipelined loop's loads that both blocks of a pair along grid ``axis`` would read."""
    var = str(grid.attrs["vars"][axis])
    return [o for lp in _pipelined(grid) for o in lp.regions[0].ops if o.name == "load" and shares(o, var)]


def _pair_axes(grid: Op) -> list[int]:
    return [-2, -1] if len(grid.attrs["vars"]) >= 2 else [-1]


def shareable(grid: Op) -> bool:
    """Some pipelined load is free of one of the two innermost grid axes (shapes may be unbound)."""
    return any(_shared_loads(grid, a) for a in _pair_axes(grid))


def pair_axis(grid: Op) -> int | None:
    """The grid axis clusters pair blocks along: of the two innermost, the one whose pairs share
    the most bytes a step (the second-innermost on a tie); None when no pipelined load can be shared."""
    def shared_bytes(axis: int) -> int:
        return sum(math.prod(int(d) for d in o.attrs["shape"]) * o.result.type.dtype.bits // 8
                   for o in _shared_loads(grid, axis))

    best = max(_pair_axes(grid), key=shared_bytes)
    return best if shared_bytes(best) else None


def check_cluster(module: Module, arch_name: str, knobs: dict) -> None:
    """``cluster=2`` pairs persistent blocks; refused where it cannot pair them or share a tile."""
    c = int(knobs.get("cluster", 1) or 1)
    if c == 1:
        return
    grid, loc = module.grid, module.grid.loc
    p, axis = knobs.get("persistent"), pair_axis(grid)
    why = None
    if c != 2:
        why = "clusters of 2 blocks only"
    elif not p:
        why = "it is a schedule of the persistent grid (persistent=true, warp_specialize=manual)"
    elif p is not True and int(p) % 2:
        why = f"an even block count (persistent={p})"
    elif axis is None:
        why = "a tile loaded in the pipelined loop that both blocks of a pair read (none is free of a grid axis)"
    elif not sympy.sympify(grid.attrs["extents"][axis]).is_Integer:
        why = (f"a static extent on the grid axis it pairs ({grid.attrs['vars'][axis]}: "
               f"{grid.attrs['extents'][axis]} depends on a dynamic size)")
    elif int(grid.attrs["extents"][axis]) % 2:
        why = f"an even extent on the grid axis it pairs ({grid.attrs['vars'][axis]}: {grid.attrs['extents'][axis]})"
    else:
        var = str(grid.attrs["vars"][axis])
        lp = _pipelined(grid)[0]
        bounds = {str(x) for e in (lp.attrs["start"], lp.attrs["extent"]) for x in sympy.sympify(e).free_symbols}
        if var in bounds:
            why = f"one trip count for both blocks of a pair (the pipelined loop's bounds depend on {var})"
    if why:
        raise UnsupportedError(f"{arch_name}: cluster={c} needs {why} (config {module.config})", loc)
