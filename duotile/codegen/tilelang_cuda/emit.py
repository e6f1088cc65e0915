"""Emit TileLang (CUDA dialect) source for a bound, fused Tile IR module.

The emitter walks the IR once. Buffers are declared at the top of the kernel (TileLang wants
allocations outside loops); every statement carries the spec line it came from as a comment.
Each op kind has one small handler; what lives where is decided beforehand in ``plan.py``.
"""

from __future__ import annotations

import sympy

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Module, Op, Value
from ...dsl.ops import MXFP4_BLOCK, NVFP4_BLOCK
from ...passes.fold_bounds import grid_env, interval
from ..handlers import OpHandlers
from ..tile_bounds import inside, read_from_data, variable_bounds
from . import gather_pipeline, overlap, tma_store, unit_axes, unrolled_loads
from .arch import Arch
from .block_scaled import code_column
from .block_scaled import emit_gemm as emit_block_scaled_gemm
from .device_helpers import SCAN, with_needs
from .exprs import ElementPrinter, index, literal
from .linear_grid import linear_head, needs_linear_grid
from .manual_ws import PRODUCER_THREADS, ManualWarpSpecialization
from .plan import Plan, make_plan, product_tile
from .promote_fp8 import every, promoted_gemm
from .source import Source

HANDLERS = OpHandlers()
handles = HANDLERS.on


class Emitter:
    def __init__(self, module: Module, arch: Arch, knobs: dict):
        self.m, self.arch, self.knobs = module, arch, knobs
        self.plan: Plan = make_plan(module, arch, int(knobs.get("threads", 128)), bool(knobs.get("gather_pipeline")))
        self.deferred: dict[int, Op] = {}  # map ops written by the store that reads them (plan.store_direct)
        self.src = Source()
        self.names: dict[int, str] = {}
        self.dirty: set[int] = set()  # TMEM accumulators written since their last drain
        self.loop_stack: list[Op] = []
        self.barriers = 0
        self.ws: ManualWarpSpecialization | None = None  # warp_specialize=manual: the role split
        self.ring_slots: dict[int, int] = {}  # value id -> slots, for tiles loaded into a ring
        self.async_gemm = False  # emit T.wgmma_gemm (no wait): the manual schedule places the waits
        self.promotions: list = []  # overlapped fp8 promotions whose adds the manual mainloop places
        self.promotion_slot: int | None = None  # the step fragment an overlapped fp8 gemm goes into
        # shared copies of register gemm operands still current: gemms in a row that read one tile
        # (P against each column group of V) copy it once; any other op, or a schedule that may
        # reorder a loop's statements, ends that
        self.staged: dict[str, int] = {}
        self.reuse_staged = not (knobs.get("overlap") or knobs.get("gather_pipeline"))

    # -- names and declarations -----------------------------------------------------------------
    def name(self, v: Value) -> str:
        if v.id not in self.names:
            base = {"shared": "smem", "fragment": "frag", "tmem": "tmem", "local": "local"}[self.plan.scope[v.id]]
            self.names[v.id] = f"{v.hint or 't'}{len(self.names)}_{base}"
            self.declare(v, self.names[v.id], self.plan.scope[v.id])
        return self.names[v.id]

    def declare(self, v: Value, name: str, scope: str):
        dims = [str(int(d)) for d in v.type.shape]
        if v.id in self.ring_slots:
            dims.insert(0, str(self.ring_slots[v.id]))
        shape = "(" + ", ".join(dims) + ",)"
        dt = "float8_e4m3" if v.id in self.plan.raw else v.type.dtype.tilelang_name  # block_scaled.py
        alloc = {"shared": "T.alloc_shared", "fragment": "T.alloc_fragment", "tmem": "T.alloc_tmem",
                 "local": "T.alloc_local"}[scope]
        self.src.decl(f'{name} = {alloc}({shape}, "{dt}")')
        if scope == "tmem":
            self.src.decl(f'{name}_frag = T.alloc_fragment({shape}, "{dt}")')

    def readable(self, v: Value, op: Op) -> str:
        """The buffer holding ``v`` for vector work: TMEM is drained into its fragment first."""
        name = self.name(v)
        if self.plan.scope[v.id] != "tmem":
            return name
        if v.id in self.dirty:
            self.src.line(f"T.copy({name}, {name}_frag)", op.loc)
            self.dirty.discard(v.id)
        return f"{name}_frag"

    def global_region(self, op: Op, subs: dict | None = None) -> str:
        """The global tile a ``load`` op reads, as a TileLang region (``subs``: index variables
        replaced, e.g. a loop variable by the iteration the load is issued for)."""
        p = self.m.param(op.attrs["tensor"])
        offsets = [sympy.sympify(o).subs(subs) for o in op.attrs["offsets"]] if subs else op.attrs["offsets"]
        return region(p.name, offsets, op.attrs["shape"], len(p.shape))

    def policy(self, acc: Value) -> str:
        """The gemm argument that splits an accumulator's rows over the warp groups, if it does."""
        if acc.id in self.plan.col_split:
            return ", policy=T.GemmWarpPolicy.FullCol"
        full = acc.id in self.plan.full_row or self.knobs.get("full_row")
        return ", policy=T.GemmWarpPolicy.FullRow" if full else ""

    def new_barrier(self) -> str:
        self.barriers += 1
        name = f"mbar{self.barriers}"
        self.src.decl(f"{name} = T.alloc_barrier(1)")
        return name

    # -- walking ----------------------------------------------------------------------------------
    def block(self, ops):
        for op in ops:
            handler = HANDLERS.get(op.name)
            if handler is None:
                raise UnsupportedError(f"{self.arch.name}: no lowering for op {op.name}", op.loc)
            if op.name != "gemm":  # before: a loop's body must not reuse a copy made before the loop;
                self.staged.clear()  # after: what follows a loop must not reuse one made in its body
            handler(self, op)
            if op.name != "gemm":
                self.staged.clear()

    def parity(self) -> str:
        """The phase of a barrier used once per iteration of the enclosing loops."""
        lin = sympy.Integer(0)
        for loop in self.loop_stack:
            lin = lin * (loop.attrs["extent"] - loop.attrs["start"]) + loop.attrs["var"] - loop.attrs["start"]
        return f"{index(sympy.expand(lin))} % 2"


def emit_module(module: Module, arch: Arch, knobs: dict) -> str:
    e = Emitter(module, arch, knobs)
    grid = module.grid
    names = [str(v) for v in grid.attrs["vars"]][::-1]
    extents = [index(x) for x in grid.attrs["extents"]][::-1]
    if len(names) > 3:
        raise UnsupportedError(f"{arch.name}: grids have at most 3 axes, got {len(names)}", grid.loc)
    mode = ws_mode(knobs)
    threads = int(knobs["threads"])
    persistent_head = None
    if mode == "manual" and not arch.has_tmem:
        persistent_head = ManualWarpSpecialization(e, grid.regions[0].ops).emit()
        threads += PRODUCER_THREADS
    else:
        e.block(grid.regions[0].ops)
    params = ", ".join(f'{p.name}: T.Tensor(({", ".join(index(d) for d in p.shape)},), "{p.dtype.tilelang_name}")'
                       for p in module.params if p.name in present_params(module))
    swizzle = int(knobs.get("raster", 0) or 0)
    targets = ", ".join(names) + ("," if len(names) == 1 else "")
    head = [f"with T.Kernel({', '.join(extents)}, threads={threads}) as ({targets}):"]
    if persistent_head is None and not swizzle and needs_linear_grid(grid.attrs["extents"]):
        head = linear_head([str(v) for v in grid.attrs["vars"]], grid.attrs["extents"], threads)
    if persistent_head is not None:  # the tile loop decodes (and rasterises) the grid itself
        head, swizzle = [persistent_head], 0
    configs = {"tl.disable_warp_specialized": True} if mode == "off" else {}
    if knobs.get("ftz"):
        configs["tl.device_compile_flags"] = ["--ftz=true"]
    return e.src.render(module, arch.name, params, head, swizzle, configs)


def ws_mode(knobs: dict) -> str:
    """The ``warp_specialize`` knob: "auto" (TileLang's producer warp group), "manual"
    (``manual_ws.py``) or "off"; the booleans of older tuning tables mean auto / off."""
    mode = knobs.get("warp_specialize", "auto")
    return {True: "auto", False: "off"}.get(mode, mode) if isinstance(mode, bool) else str(mode)


def present_params(module: Module) -> set[str]:
    """Parameters the kernel takes: all but optional tensors the call left out."""
    used = {op.attrs["tensor"] for op in module.walk() if "tensor" in op.attrs}
    return {p.name for p in module.params if p.name in used or not p.optional}


# -- handlers ---------------------------------------------------------------------------------------
@handles("for")
def _for(e: Emitter, op: Op):
    a = op.attrs
    start, stop = index(a["start"]), index(a["extent"])
    if op.args:
        stop = f"T.min({stop}, {_data_stop(e, op)})"
    if a.get("at_most_once"):
        return _run_at_most_once(e, op, start, stop)
    head = len(e.src.body)
    if a.get("stages"):
        e.src.line(f"for {a['var']} in T.Pipelined({start}, {stop}, num_stages={a['stages']}):", op.loc)
    elif unrolled_loads.unrolls(op, e.plan.scope):
        e.src.line(f"for {a['var']} in T.unroll({start}, {stop}):", op.loc)
    else:
        e.src.line(f"for {a['var']} in T.serial({start}, {stop}):", op.loc)
    e.loop_stack.append(op)
    with e.src.indent():
        spans = [_emit_counting(e, o) for o in op.regions[0].ops]
    e.loop_stack.pop()
    plan = overlap.schedule(op.regions[0].ops) if a.get("stages") and e.knobs.get("overlap") else None
    if plan is None and e.knobs.get("gather_pipeline") and gather_pipeline.has_gather(op):
        plan = gather_pipeline.schedule(op.regions[0].ops, e.plan.scope)
    if plan is not None and not e.arch.has_tmem:
        statements = dict(enumerate(spans))
        e.src.body[head] = e.src.body[head].replace(
            f"num_stages={a['stages']})", f"num_stages={a['stages']}, {overlap.annotation(plan, statements)})")


@handles("scalar")
def _scalar(e: Emitter, op: Op):
    """An index symbol read from data (``dsl.scalar``): a scalar every thread holds, assigned where
    the spec reads it; index expressions then name it like a loop variable."""
    e.src.decl(f'{op.attrs["var"]} = T.alloc_var("int32")')
    e.src.line(f"{op.attrs['var']} = {_held(e, op, op.args[0])}", op.loc)


def _held(e: Emitter, op: Op, v) -> str:
    """The value of a one-element tile every thread holds, as an int32 expression."""
    if e.plan.scope.get(v.id) not in ("local", "fragment"):
        raise UnsupportedError(f"{e.arch.name}: {op.name} reads a one-element value every thread must hold "
                               "(loaded, or maps of such values and of reductions)", op.loc)
    value = f"{e.name(v)}[0]"
    return value if v.type.dtype.name == "i32" else f'T.cast({value}, "int32")'


def _data_stop(e: Emitter, op: Op) -> str:
    """A scalar holding a loop's stop read from data (its one-element tile, which every thread holds:
    ``plan.py``), assigned right before the loop. A ``T.alloc_var``, not the tile itself: TileLang's
    warp specialisation copies a local buffer into its producer and then finds the loop's bound
    changed under it."""
    var = f"{op.attrs['var']}_stop"
    e.src.decl(f'{var} = T.alloc_var("int32")')
    e.src.line(f"{var} = {_held(e, op, op.args[0])}", op.loc)
    return var


def _run_at_most_once(e: Emitter, op: Op, start: str, stop: str):
    """A loop that never runs twice (passes/mark_short_loops.py): a guard and one binding of its
    variable, since TileLang would run such a loop's body once even where it should not run. The
    guard tests the trip count: TileLang 0.1.15 fails ("Divide by zero") on some ``lo < hi`` forms."""
    trips = index(sympy.sympify(op.attrs["extent"]) - sympy.sympify(op.attrs["start"]))
    if op.args:  # with a stop read from data: its own count, the scalar less the start
        trips = f"{stop} - ({start})"
    e.src.line(f"if {trips} > 0:  # runs at most once", op.loc)
    e.loop_stack.append(op)
    with e.src.indent():
        e.src.line(f"{op.attrs['var']} = {start}", op.loc)
        e.block(op.regions[0].ops)
    e.loop_stack.pop()


def _emit_counting(e: Emitter, op: Op) -> int:
    """Emit one op of a loop body; return how many top-level statements of the body it wrote."""
    before = len(e.src.body)
    pad = "    " * e.src.depth
    e.block([op])
    return sum(1 for line in e.src.body[before:] if line.startswith(pad) and not line.startswith(pad + " "))


@handles("alloc")
def _alloc(e: Emitter, op: Op):
    v, fill = op.result, op.attrs["fill"]
    name, scope = e.name(v), e.plan.scope[op.result.id]
    form = e.plan.skip_fill.get(v.id)
    if fill is None:
        return
    if scope == "tmem":
        if form is None:
            raise UnsupportedError(f"{e.arch.name}: a TMEM accumulator must be zeroed by its first gemm "
                                   "(zero-fill it right before that gemm or the loop holding it)", op.loc)
        return
    if form == "same":  # the gemm right after clears it
        return
    if fill == 0.0:
        e.src.line(f"T.clear({name})", op.loc)
    else:
        e.src.line(f"T.fill({name}, {literal(fill, v.type.dtype)})", op.loc)


def region(tensor: str, offsets, shape, ndim: int) -> str:
    lead = ndim - len(shape)
    parts = []
    for d, off in enumerate(offsets):
        o = index(off)
        if d < lead:
            parts.append(o)
        else:
            n = int(shape[d - lead])
            parts.append(f"{o}:{o} + {n}" if o != "0" else f"0:{n}")
    return f"{tensor}[{', '.join(parts)}]"


def _element_conds(e: Emitter, offsets, sizes, lead: int) -> list[str]:
    """The bounds tests of one element at ``offsets`` (``lead``: the leading point axes the tile
    does not span). A tile axis is tested unless it has size 1 and its index is proven inside
    (``tile_bounds.inside``); a point axis unless its index is proven inside. An axis of size 1 is
    no exception: a K block past the last one of a single-block tensor (K < BLOCK) is index 1, 2,
    ... there, and a test skipped for it read the bytes after the tensor."""
    env = variable_bounds(e.m, e.loop_stack)
    axes = list(enumerate(zip(offsets, sizes)))
    conds = [f"{index(off)} < {index(size)}" for d, (off, size) in axes[lead:]
             if size != 1 or not inside(off, 1, size, env)]
    for d, (off, size) in axes:
        if d < lead:
            conds += _point_conds(e, off, size, env)
        elif read_from_data(off):
            conds.append(f"{index(off)} >= 0")
    return conds


def _point_conds(e: Emitter, off, size, env: dict | None = None) -> list[str]:
    """The conditions of a leading (point) index that may fall outside its axis: one read from data,
    or one built of grid and loop variables that ``tile_bounds.inside`` does not prove inside (a
    K block of a step past the last one, say). A variable alone stays inside by construction.
    ``env``: ``variable_bounds`` of the emitter's loops, where the caller has them."""
    if read_from_data(off):
        return [f"{index(off)} >= 0", f"{index(off)} < {index(size)}"]
    if inside(off, 1, size, env if env is not None else variable_bounds(e.m, e.loop_stack)):
        return []
    return [f"{index(off)} < {index(size)}"]


def _in_bounds(e: Emitter, op: Op, loop_vars: list[str], static: bool = False) -> tuple[str, list[str]]:
    """A bounds condition and the element's global indices for a tile at ``op``'s corner;
    ``static``: without the conditions the grid's extents already decide (``fold_bounds``)."""
    p = e.m.param(op.attrs["tensor"])
    shape, offsets = op.attrs["shape"], op.attrs["offsets"]
    lead = len(p.shape) - len(shape)
    env = grid_env(e.m.grid) if static else {}
    conds, idx = [], []
    for d, off in enumerate(offsets):
        o = index(off)
        g = o if d < lead else (loop_vars[d - lead] if o == "0" and static else f"{o} + {loop_vars[d - lead]}")
        idx.append(g)
        if d < lead:
            conds += _point_conds(e, off, p.shape[d])
            continue
        span = interval(sympy.sympify(off), env) if static else None
        size = p.shape[d]  # a dynamic size is never proven
        if span is None or not size.is_Integer or span[1] + int(shape[d - lead]) > int(size):
            conds.append(f"{g} < {index(size)}")
        if read_from_data(off):
            conds.append(f"{g} >= 0")
    return " and ".join(conds) or "True", idx


@handles("load")
def _load(e: Emitter, op: Op):
    v = op.result
    name = e.name(v)
    shape = op.attrs["shape"]
    if e.ws is not None and e.ws.load_wait(op):
        return
    if e.plan.scope[v.id] == "local":  # one element, read by every thread (plan.py)
        p = e.m.param(op.attrs["tensor"])
        idx = [index(o) for o in op.attrs["offsets"]]
        read = f"{p.name}[{', '.join(idx)}]"
        conds = _element_conds(e, op.attrs["offsets"], p.shape, len(p.shape) - len(shape))
        if conds:
            read = f"T.if_then_else({_tl_and(' and '.join(conds))}, {read}, {literal(op.attrs['other'], v.type.dtype)})"
        e.src.line(f"{name}[{', '.join(['0'] * len(shape))}] = {read}", op.loc)
        return
    if op.attrs["other"] == 0.0 and not unit_axes.unguarded(e, op):
        e.src.line(f"T.copy({e.global_region(op)}, {name})", op.loc)
        return
    lv, cond, at = _element_loop(e, op)  # guarded element by element (unit_axes.py)
    other = literal(op.attrs["other"], v.type.dtype)
    e.src.line(f"    {name}[{lv}] = T.if_then_else({cond}, {at}, {other})", op.loc)


def _element_loop(e: Emitter, op: Op) -> tuple[str, str, str]:
    """The head of a parallel loop over the elements of ``op``'s global tile: (its index variables,
    the condition that an element lies inside the tensor, the element in the tensor)."""
    lv = [f"i{d}" for d in range(len(op.attrs["shape"]))]
    cond, idx = _in_bounds(e, op, lv)
    e.src.line(f"for {', '.join(lv)} in T.Parallel({', '.join(str(int(d)) for d in op.attrs['shape'])}):", op.loc)
    return ", ".join(lv), _tl_and(cond), f"{e.m.param(op.attrs['tensor']).name}[{', '.join(idx)}]"


def _tl_and(cond: str) -> str:
    parts = cond.split(" and ")
    out = f"({parts[0]})"
    for p in parts[1:]:
        out = f"T.And({out}, ({p}))"
    return out


@handles("gather")
def _gather(e: Emitter, op: Op):
    v, rows = op.result, op.args[0]
    name, idx_buf = e.name(v), e.readable(rows, op)
    p = e.m.param(op.attrs["tensor"])
    shape, axis = op.attrs["shape"], op.attrs["axis"]
    lead = len(p.shape) - len(shape)
    lv = [f"i{d}" for d in range(len(shape))]
    if e.plan.scope[rows.id] == "local":  # one index every thread holds (plan.py)
        row = f"{idx_buf}[{', '.join('0' for _ in rows.type.shape)}]"
    elif len(rows.type.shape) == 1:
        row = f"{idx_buf}[{lv[axis - lead]}]"
    else:  # an (N, 1) or a (1, N) index tile: its N indices run along the axis that is not 1
        row = f"{idx_buf}[0, {lv[axis - lead]}]" if int(rows.type.shape[0]) == 1 else f"{idx_buf}[{lv[axis - lead]}, 0]"
    conds, gidx = [f"{row} >= 0", f"{row} < {index(p.shape[axis])}"], []
    for d, off in enumerate(op.attrs["offsets"]):
        if d == axis:
            gidx.append(row)
        elif d < lead:
            gidx.append(index(off))
            conds += _point_conds(e, off, p.shape[d])
        else:
            gidx.append(f"{index(off)} + {lv[d - lead]}")
            conds.append(f"{gidx[-1]} < {index(p.shape[d])}")
            if read_from_data(off):
                conds.append(f"{gidx[-1]} >= 0")
    other = literal(op.attrs["other"], v.type.dtype)
    if not v.type.dtype.is_float and v.type.dtype.bits < 32:  # typed as the tile: an i32 literal kept
        other = f'T.cast({other}, "{v.type.dtype.tilelang_name}")'  # u8 rows out of cp.async (byte selects)
    # into shared memory: cp.async, a dead row zero-filled, every copy issued before one wait
    # (plain loads of rows named by an index are serialised by the compiler: 16 a thread took
    # about 11 us a 64-row block of sparse decode on an H200, the loads' latency end to end)
    hint = ', annotations={"parallel_prefer_async": True}' if e.plan.scope[v.id] == "shared" else ""
    e.src.line(f"for {', '.join(lv)} in T.Parallel({', '.join(str(int(d)) for d in shape)}{hint}):", op.loc)
    e.src.line(f"    {name}[{', '.join(lv)}] = T.if_then_else({_tl_and(' and '.join(conds))}, "
               f"{p.name}[{', '.join(gidx)}], {other})", op.loc)


def _shared_inputs(e: Emitter, op: Op, what: str, names: tuple[str, ...]) -> None:
    for name, v in zip(names, op.args):
        if e.plan.scope.get(v.id) != "shared":
            raise UnsupportedError(f"{e.arch.name}: {what} reads its {name} from shared memory: pass a "
                                   "tile made by dsl.load", op.loc)


@handles("mxfp4")
def _mxfp4(e: Emitter, op: Op):
    """``dsl.mxfp4_values``: eight bf16 values a call of the device helper
    (``device_helpers.MXFP4_X8``), four packed bytes read from shared memory and sixteen bytes
    written into the shared result; for a block-scaled gemm (``block_scaled.py``) sixteen e4m3
    bytes a call of ``MXFP4_E4M3_X16``, unscaled. The loop over (rows, eighths or sixteenths)
    spreads over every thread (no register tile in it)."""
    packed, codes = op.args
    _shared_inputs(e, op, "dsl.mxfp4_values", ("packed codes", "scale codes"))
    raw = op.result.id in e.plan.raw
    _helpers(e, "MXFP4_E4M3_X16" if raw else "MXFP4_X8")
    rows, cols = (int(d) for d in op.result.type.shape)
    src, dst, scales = e.name(packed), e.name(op.result), e.name(codes)
    # Pointers TileLang could see (T.access_ptr) made it put a barrier before every call, eight a
    # 128-wide step: hence T.address_of and the two barriers of _helper_loop.
    if raw:
        _helper_loop(e, op, rows, cols // 16, f'"duotile_mxfp4x16_e4m3", T.address_of({src}[i0, 8 * i1]), '
                                              f"T.address_of({dst}[i0, 16 * i1])")
    else:
        code = f'T.cast({scales}[i0, {code_column(op, f"i1 // {MXFP4_BLOCK // 8}")}], "int32")'
        _helper_loop(e, op, rows, cols // 8, f'"duotile_mxfp4x8_bf16", T.address_of({src}[i0, 4 * i1]), '
                                             f"T.address_of({dst}[i0, 8 * i1]), {code}")


@handles("cumsum")
def _cumsum(e: Emitter, op: Op):
    """``dsl.cumsum`` of a row: the device helper ``SCAN`` run by every thread in two calls (each
    thread a contiguous segment of the row, its warp's shuffle scan, the warps' totals through
    shared memory), between barriers: TileLang does not see the helper's reads and writes."""
    (x,) = op.args
    shape = [int(d) for d in x.type.shape]
    if any(d != 1 for d in shape[:-1]):
        raise UnsupportedError(f"{e.arch.name}: dsl.cumsum of a {tuple(shape)} tile: one row at a time (leading "
                               "dimensions of 1)", op.loc)
    threads, width = int(e.knobs.get("threads", 128)), shape[-1]
    src = e.name(x)
    if e.plan.scope.get(x.id) != "shared":  # the helper reads the row from shared memory
        staged = f"{src}_row"
        e.src.decl(f'{staged} = T.alloc_shared(({", ".join(map(str, shape))},), "int32")')
        e.src.line(f"T.copy({src}, {staged})", op.loc)
        src = staged
    e.src.helper("SCAN", SCAN)
    e.src.decl(f'scan_part = T.alloc_shared(({threads},), "int32")')
    e.src.decl(f'scan_warps = T.alloc_shared(({max(1, threads // 32)},), "int32")')
    at = ", ".join("0" for _ in shape)
    seg = -(-width // threads)
    e.src.line("T.sync_threads()", op.loc)
    e.src.line(f'T.call_extern("handle", "duotile_scan_sums", T.address_of({src}[{at}]), T.address_of(scan_part[0]), '
               f"T.address_of(scan_warps[0]), T.get_thread_binding(), {seg}, {width})", op.loc)
    e.src.line("T.sync_threads()", op.loc)
    e.src.line(f'T.call_extern("handle", "duotile_scan_write", T.address_of({src}[{at}]), '
               f"T.address_of(scan_part[0]), T.address_of(scan_warps[0]), T.address_of({e.name(op.result)}[{at}]), "
               f"T.get_thread_binding(), {seg}, {width}, {int(op.attrs['exclusive'])})", op.loc)
    e.src.line("T.sync_threads()", op.loc)


@handles("mxfp8")
def _mxfp8(e: Emitter, op: Op):
    """``dsl.mxfp8_values``: eight e4m3 values a call of the device helper
    (``device_helpers.MXFP8_X8``), eight bytes read from shared memory, times their block's
    2^(code - 127) and rounded to bf16, sixteen bytes written into the shared result (a block of 8
    or more values a code; a smaller one, each value by the loop of ``_mxfp8_loop``). For a
    block-scaled gemm nothing: the loaded e4m3 tile is the operand (``block_scaled.py``)."""
    values, codes = op.args
    _shared_inputs(e, op, "dsl.mxfp8_values", ("values", "scale codes"))
    if op.result.id in e.plan.raw:
        e.names[op.result.id] = e.name(values)
        return
    rows, cols = (int(d) for d in op.result.type.shape)
    block = cols // int(op.attrs["count"])
    if block % 8:
        _mxfp8_loop(e, op, rows, cols, block)
        return
    _helpers(e, "MXFP8_X8")
    src, dst = e.name(values), e.name(op.result)
    code = f'T.cast({e.name(codes)}[i0, {code_column(op, f"i1 // {block // 8}")}], "int32")'
    _helper_loop(e, op, rows, cols // 8, f'"duotile_mxfp8x8_bf16", T.address_of({src}[i0, 8 * i1]), '
                                         f"T.address_of({dst}[i0, 8 * i1]), {code}")


def _mxfp8_loop(e: Emitter, op: Op, rows: int, cols: int, block: int) -> None:
    """Each value times its block's 2^(code - 127) in fp32 (the code's float bits; 255 is NaN, 0 the
    subnormal 2^-127), rounded to bf16."""
    values, codes = op.args
    code = f'T.cast({e.name(codes)}[i0, {code_column(op, f"i1 // {block}")}], "int32")'
    bits = f"T.if_then_else({code} == 255, 2143289344, T.if_then_else({code} == 0, 4194304, T.shift_left({code}, 23)))"
    e.src.line(f"for i0, i1 in T.Parallel({rows}, {cols}):", op.loc)
    e.src.line(f'    {e.name(op.result)}[i0, i1] = T.cast(T.cast({e.name(values)}[i0, i1], "float32") * '
               f'T.reinterpret({bits}, "float32"), "bfloat16")', op.loc)


@handles("nvfp4")
def _nvfp4(e: Emitter, op: Op):
    """``dsl.nvfp4_values``: eight values a call of the device helper (``device_helpers.NVFP4_X8``):
    four packed bytes and the block's E4M3 scale byte read from shared memory, sixteen bytes of
    bf16 (each e2m1 value times the scale, exact) written into the shared result."""
    packed, scales = op.args
    _shared_inputs(e, op, "dsl.nvfp4_values", ("packed codes", "scales"))
    _helpers(e, "NVFP4_X8")
    rows, cols = (int(d) for d in op.result.type.shape)
    src, dst, sc = e.name(packed), e.name(op.result), e.name(scales)
    _helper_loop(e, op, rows, cols // 8, f'"duotile_nvfp4x8_bf16", T.address_of({src}[i0, 4 * i1]), '
                                         f"T.address_of({dst}[i0, 8 * i1]), "
                                         f"T.address_of({sc}[i0, i1 // {NVFP4_BLOCK // 8}])")


def _helpers(e: Emitter, name: str) -> None:
    for n, text in with_needs(name):
        e.src.helper(n, text)


def _helper_loop(e: Emitter, op: Op, rows: int, calls: int, args: str) -> None:
    """A value op's helper called over (rows, calls) by every thread, between two barriers: its
    reads and writes through pointers are opaque to TileLang's barrier planning (a gemm may still
    read the tile the last trip wrote; every value is written before anything reads it)."""
    e.src.line("T.sync_threads()", op.loc)
    e.src.line(f"for i0, i1 in T.Parallel({rows}, {calls}):", op.loc)
    e.src.line(f'    T.call_extern("handle", {args})', op.loc)
    e.src.line("T.sync_threads()", op.loc)


@handles("store")
def _store(e: Emitter, op: Op):
    v = op.args[0]
    if v.id in e.deferred:  # the map's elements go straight to global memory, in bounds
        lv = [f"i{d}" for d in range(len(op.attrs["shape"]))]
        cond, idx = _in_bounds(e, op, lv, static=True)
        _map(e, e.deferred.pop(v.id), store=(cond, f"{e.m.param(op.attrs['tensor']).name}[{', '.join(idx)}]"))
        return
    src = e.readable(v, op)
    p = e.m.param(op.attrs["tensor"])
    if e.knobs.get("tma_store") and e.ws is not None and len(op.attrs["shape"]) == 2:
        tma_store.emit(e, op, src, p.name, [index(o) for o in op.attrs["offsets"]], int(e.knobs["threads"]))
        return
    if unit_axes.unguarded(e, op):  # T.copy would not keep the tile's one-wide axes inside (unit_axes.py)
        lv, cond, at = _element_loop(e, op)
        e.src.line(f"    if {cond}:", op.loc)
        e.src.line(f"        {at} = {src}[{lv}]", op.loc)
        return
    e.src.line(f"T.copy({src}, {region(p.name, op.attrs['offsets'], op.attrs['shape'], len(p.shape))})", op.loc)


@handles("scatter")
def _scatter(e: Emitter, op: Op):
    """Each element to the row its index names, guarded: a row index < 0 or >= the size, or an
    element past the tensor along another axis, is not written."""
    v, rows = op.args
    src, idx_buf = e.readable(v, op), e.readable(rows, op)
    p = e.m.param(op.attrs["tensor"])
    shape, axis = op.attrs["shape"], op.attrs["axis"]
    lead = len(p.shape) - len(shape)
    lv = [f"i{d}" for d in range(len(shape))]
    row = f"{idx_buf}[{', '.join(lv[axis - lead] if int(d) != 1 else '0' for d in rows.type.shape)}]"
    conds, gidx = [f"{row} >= 0", f"{row} < {index(p.shape[axis])}"], []
    for d, off in enumerate(op.attrs["offsets"]):
        if d == axis:
            gidx.append(row)
        elif d < lead:
            gidx.append(index(off))
            conds += _point_conds(e, off, p.shape[d])
        else:
            gidx.append(f"{index(off)} + {lv[d - lead]}")
            conds.append(f"{gidx[-1]} < {index(p.shape[d])}")
            if read_from_data(off):
                conds.append(f"{gidx[-1]} >= 0")
    e.src.line(f"for {', '.join(lv)} in T.Parallel({', '.join(str(int(d)) for d in shape)}):", op.loc)
    e.src.line(f"    if {_tl_and(' and '.join(conds))}:", op.loc)
    e.src.line(f"        {p.name}[{', '.join(gidx)}] = {src}[{', '.join(lv)}]", op.loc)


@handles("reduce")
def _reduce(e: Emitter, op: Op):
    src = e.readable(op.args[0], op)
    dst = e.name(op.result)
    fn = {"sum": "T.reduce_sum", "max": "T.reduce_max", "min": "T.reduce_min"}[op.attrs["fn"]]
    padded = e.plan.reduce_pad.get(id(op))
    if padded is not None:
        src = _padded_source(e, op, src, padded)
    if id(op) not in e.plan.relayout:
        e.src.line(f"{fn}({src}, {dst}, dim={op.attrs['axis']}, clear=True)", op.loc)
        return
    # laid out anew (plan.relayout): reduced into a fragment of its own, read back through shared memory
    v = op.result
    dims = ", ".join(str(int(d)) for d in v.type.shape)
    e.src.decl(f'{dst}_red = T.alloc_fragment(({dims},), "{v.type.dtype.tilelang_name}")')
    e.src.decl(f'{dst}_smem = T.alloc_shared(({dims},), "{v.type.dtype.tilelang_name}")')
    e.src.line(f"{fn}({src}, {dst}_red, dim={op.attrs['axis']}, clear=True)", op.loc)
    e.src.line(f"T.copy({dst}_red, {dst}_smem)", op.loc)
    e.src.line(f"T.copy({dst}_smem, {dst})", op.loc)


def _padded_source(e: Emitter, op: Op, src: str, padded: tuple[int, ...]) -> str:
    """A shared-memory copy of a reduction's source, padded along the reduced axis with the
    reduction's identity (``plan.reduce_padding``: a tile whose elements do not divide the threads)."""
    v, axis = op.args[0], op.attrs["axis"]
    shape = [int(d) for d in v.type.shape]
    stage = f"{e.name(op.result)}_src_smem"
    dims = ", ".join(map(str, padded))
    e.src.decl(f'{stage} = T.alloc_shared(({dims},), "{v.type.dtype.tilelang_name}")')
    lv = [f"i{d}" for d in range(len(shape))]
    tail = [str(p - s) if d == axis else str(p) for d, (p, s) in enumerate(zip(padded, shape))]
    at = [f"{shape[axis]} + {x}" if d == axis else x for d, x in enumerate(lv)]
    e.src.line(f"for {', '.join(lv)} in T.Parallel({', '.join(tail)}):", op.loc)
    e.src.line(f"    {stage}[{', '.join(at)}] = {_identity(op.attrs['fn'], v.type.dtype)}", op.loc)
    e.src.line(f"T.copy({src}, {stage}[{', '.join(f'0:{n}' for n in shape)}])", op.loc)
    return stage


def _identity(fn: str, dtype) -> str:
    """The element a reduction of ``fn`` leaves unchanged, as TileLang source."""
    if fn == "sum":
        return literal(0.0, dtype)
    if dtype.is_float:
        return literal(float("-inf") if fn == "max" else float("inf"), dtype)
    if dtype.name == "i1":  # bool
        low, high = 0, 1
    elif dtype.name.startswith("u"):
        low, high = 0, (1 << dtype.bits) - 1
    else:
        low, high = -(1 << (dtype.bits - 1)), (1 << (dtype.bits - 1)) - 1
    return literal(low if fn == "max" else high, dtype)


@handles("map")
def _map(e: Emitter, op: Op, store: tuple[str, str] | None = None):
    """``store``: (bounds condition, element of global memory) where a store writes the elements
    straight out (``_store``, plan.store_direct)."""
    into = op.attrs.get("into")
    out = into if into is not None else op.result
    if store is None and op.result is not None and op.result.id in e.plan.store_direct:
        e.deferred[op.result.id] = op
        return
    shape = [int(d) for d in out.type.shape]
    local = store is None and into is None and e.plan.scope[out.id] == "local"
    lv = tuple("0" if local else f"i{d}" for d in range(len(shape)))
    cond, dst = store or ("True", (e.readable(out, op) if into is not None else e.name(out)) + f"[{', '.join(lv)}]")
    bufs = [e.readable(a, op) for a in op.args]

    def read(k, idx):
        vshape = op.args[k].type.shape
        idx = tuple("0" if (i is None or int(d) == 1) else i for i, d in zip(idx, vshape))
        return f"{bufs[k]}[{', '.join(idx)}]"

    root = op.attrs["expr"]
    root_idx = tuple(None if (int(r) == 1 and s != 1) else i for r, s, i in zip(root.shape, shape, lv)) \
        if len(root.shape) == len(shape) else lv
    text = ElementPrinter(read, lv).expr(root, root_idx)
    if local:  # one element every thread computes (plan.py): no parallel loop
        e.src.line(f"{dst} = {text}", op.loc)
        return
    e.src.line(f"for {', '.join(lv)} in T.Parallel({', '.join(map(str, shape))}):", op.loc)
    if cond == "True":
        e.src.line(f"    {dst} = {text}", op.loc)
    else:
        e.src.line(f"    if {_tl_and(cond)}:", op.loc)
        e.src.line(f"        {dst} = {text}", op.loc)
    if into is not None and e.plan.scope[into.id] == "tmem":
        e.src.line(f"T.copy({e.readable(out, op)}, {e.name(into)})", op.loc)


@handles("gemm")
def _gemm(e: Emitter, op: Op):
    a, b, acc = op.args
    ta, tb = op.attrs["transpose_a"], op.attrs["transpose_b"]
    a_buf, b_buf = _operand(e, a, op), _operand(e, b, op)
    policy = e.policy(acc)
    clear = e.plan.clear_by_gemm.get(id(op))
    scope = e.plan.scope[acc.id]
    if not e.arch.has_tmem:
        if e.loop_stack and every(op, e.knobs, e.loop_stack[-1]) is not None:
            promotion = promoted_gemm(e, op, a_buf, b_buf, policy)
            if promotion is not None:
                e.promotions.append(promotion)
            return
        clear_arg = f", clear_accum={clear}" if clear else ""
        fn = "T.wgmma_gemm" if e.async_gemm else "T.gemm"
        e.src.line(f"{fn}({a_buf}, {b_buf}, {e.name(acc)}, transpose_A={ta}, transpose_B={tb}"
                   f"{policy}{clear_arg})", op.loc)
        return
    if id(op) in e.plan.block_scaled:
        emit_block_scaled_gemm(e, op, e.plan.block_scaled[id(op)], e.name(acc), clear or "False")
        e.dirty.add(acc.id)
        return
    if scope == "tmem":
        _tcgen05(e, op, a_buf, b_buf, e.name(acc), clear or "False", ta, tb)
        e.dirty.add(acc.id)
        return
    # a fragment accumulator that vector work rewrites: multiply into a fresh TMEM tile, add it in;
    # accumulators of one shape share the tile (plan.product_tile), used one gemm at a time
    tmp = product_tile(acc)
    shape = "(" + ", ".join(str(int(d)) for d in acc.type.shape) + ",)"
    if tmp not in e.src.declared:
        e.src.decl(f'{tmp} = T.alloc_tmem({shape}, "float32")')
        e.src.decl(f'{tmp}_frag = T.alloc_fragment({shape}, "float32")')
    _tcgen05(e, op, a_buf, b_buf, tmp, "True", ta, tb)
    e.src.line(f"T.copy({tmp}, {tmp}_frag)", op.loc)
    dims = [f"i{d}" for d in range(2)]
    e.src.line(f"for {', '.join(dims)} in T.Parallel({shape[1:-2]}):", op.loc)
    e.src.line(f"    {e.name(acc)}[i0, i1] = {e.name(acc)}[i0, i1] + {tmp}_frag[i0, i1]", op.loc)


def _tcgen05(e: Emitter, op: Op, a: str, b: str, acc: str, clear: str, ta: bool, tb: bool):
    bar = e.new_barrier()
    e.src.line(f"T.gemm({a}, {b}, {acc}, transpose_A={ta}, transpose_B={tb}, mbar={bar}, clear_accum={clear})",
               op.loc)
    e.src.line(f"T.mbarrier_wait_parity({bar}, {e.parity()})", op.loc)


def _operand(e: Emitter, v: Value, op: Op) -> str:
    """A gemm operand's buffer; fragments that must come from shared memory are copied there."""
    ring = e.ws.operand(v.id) if e.ws is not None else None
    if ring is not None:
        return ring
    if v.id not in e.plan.staged:
        return e.readable(v, op) if e.plan.scope[v.id] == "tmem" else e.name(v)
    src = e.name(v)
    stage = f"{src}_smem"
    if stage not in e.src.declared:
        shape = "(" + ", ".join(str(int(d)) for d in v.type.shape) + ",)"
        e.src.decl(f'{stage} = T.alloc_shared({shape}, "{v.type.dtype.tilelang_name}")')
    if e.staged.get(stage) == v.id:
        return stage  # copied for the gemm just before, which read the same tile
    e.src.line(f"T.copy({src}, {stage})", op.loc)
    if e.reuse_staged:
        e.staged[stage] = v.id
    return stage
