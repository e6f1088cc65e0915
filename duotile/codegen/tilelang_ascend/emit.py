"""The Ascend generator: bound, fused, memory-assigned Tile IR -> TileLang Ascend-dialect text.

One method per Tile IR op; every emitted statement ends with the spec line it came from.
Layout of the output::

    @T.prim_func
    def kernel(params...):
        with T.Kernel(CORES) as core:
            <every tile buffer, hoisted: T.alloc_l1 / T.alloc_l0c / T.alloc_shared>
            for tile in T.Persistent([tiles], CORES, core):
                <grid variables decomposed from the linear tile id>
                <body: T.copy, T.gemm, T.SimtVF { T.Parallel ... }, T.SimdVF { T.reduce_* } ...>
"""

from __future__ import annotations

import math
import os

import sympy

from ...dsl.ir import Block, Module, Op, Value
from . import snippets as S
from .emit_expr import ExprPrinter, const, index
from .ir_util import unsupported

SIMT_OPS = ("map", "gather")


class Emitter:
    def __init__(self, module: Module, knobs: dict):
        self.m = module
        self.knobs = knobs
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.idx: dict[str, str] = {}
        self.taken = {p.name for p in module.params} | {"T", "core", "tile", "CORES", "THREADS", "ENTRY"}
        self.params = {p.name: p for p in module.params}
        self.clear: dict[int, str] = {}
        self.simt_open = False

    # -- text ------------------------------------------------------------------------------
    def stmt(self, text: str, op: Op | None, depth: int) -> None:
        where = ""
        if op is not None and op.loc is not None:
            where = f"{os.path.basename(op.loc.file)}:{op.loc.line}"
        self.lines.append(f"{'    ' * depth}{text}" + (f"  # {where}" if where else ""))

    def name(self, v: Value) -> str:
        if v.id not in self.names:
            base = (v.hint or "v").replace("-", "_")
            cand, k = f"{base}_{v.id}", 1
            while cand in self.taken:
                cand, k = f"{base}_{v.id}_{k}", k + 1
            self.taken.add(cand)
            self.names[v.id] = cand
        return self.names[v.id]

    def var(self, sym) -> str:
        s = str(sym)
        if s not in self.idx:
            cand = f"i_{s}"
            while cand in self.taken:
                cand += "_"
            self.taken.add(cand)
            self.idx[s] = cand
        return self.idx[s]

    # -- module ----------------------------------------------------------------------------
    def generate(self) -> str:
        grid = self.m.grid
        src = os.path.basename(self.m.source_file) or "?"
        head = S.HEADER.format(source=src, cores=self.knobs["cores"], threads=self.knobs["threads"])
        params = ", ".join(S.PARAM.format(name=p.name, shape=_dims(p.shape),
                                          dtype=p.dtype.tilelang_name) for p in self.m.params)
        self.plan_clear_accum(self.m.body)
        self.stmt(S.PRIM_FUNC, None, 0)
        self.stmt(S.SIGNATURE.format(name=self.m.name, params=params), grid, 0)
        self.stmt(S.KERNEL, grid, 1)
        for op in self.m.walk():
            if op.result is not None:
                self.alloc(op, 2)
            if self.staged(op) and self.stage_name(op) not in self.taken:
                self.taken.add(self.stage_name(op))
                self.stmt(f"{self.stage_name(op)} = " + S.ALLOC["ub"].format(shape=_dims(self.stage_shape(op)),
                                                                           dtype=self.stage_value(op).type.dtype
                                                                           .tilelang_name), op, 2)
        extents = [int(e) for e in grid.attrs["extents"]]
        self.stmt(S.PERSISTENT.format(tiles=math.prod(extents)), grid, 2)
        stride = math.prod(extents)
        for v, e in zip(grid.attrs["vars"], extents):
            stride //= e
            expr = f"tile // {stride}" if stride > 1 else "tile"
            self.stmt(f"{self.var(v)} = {expr}" + (f" % {e}" if stride * e < math.prod(extents) else ""), grid, 3)
        self.block(grid.regions[0], 3)
        self.stmt("", None, 0)
        self.stmt(S.ENTRY.format(name=self.m.name), None, 0)
        return head + "\n\n" + "\n".join(self.lines).replace("\n\n\n", "\n\n") + "\n"

    def alloc(self, op: Op, depth: int) -> None:
        scope = op.attrs.get("scope")
        t = op.result.type
        if scope not in S.ALLOC:
            raise unsupported(f"no Ascend buffer for scope {scope!r} of {op.result!r}", op)
        shape = _dims(t.shape)
        self.stmt(f"{self.name(op.result)} = " + S.ALLOC[scope].format(shape=shape, dtype=t.dtype.tilelang_name),
                  op, depth)

    def block(self, block: Block, depth: int) -> None:
        for op in block.ops:
            simt = op.name in SIMT_OPS or (op.name == "alloc" and op.attrs["scope"] == "ub"
                                          and op.attrs.get("fill") is not None)
            if simt and not self.simt_open:
                self.stmt(S.SIMT, op, depth)
                self.simt_open = True
            elif not simt:
                self.simt_open = False
            inner = depth + 1 if simt else depth
            handler = getattr(self, "op_" + op.name, None)
            if handler is None:
                raise unsupported("op has no Ascend lowering", op)
            handler(op, inner)
        self.simt_open = False

    # -- control -----------------------------------------------------------------------------
    def op_scalar(self, op: Op, depth: int) -> None:
        raise unsupported("an index read from data (dsl.scalar) is not lowered for Ascend yet", op)

    def op_for(self, op: Op, depth: int) -> None:
        a = op.attrs
        if op.args:
            raise unsupported("a loop whose stop is read from a tensor is not lowered for Ascend yet", op)
        v = self.var(a["var"])
        start = sympy.sympify(a["start"])
        extent = index(sympy.simplify(sympy.sympify(a["extent"]) - start), self.idx)  # the trip count
        loop = v if start == 0 else f"{v}_rel"
        if a.get("at_most_once"):  # passes/mark_short_loops.py: TileLang would run the body unguarded
            self.stmt(f"if {extent} > 0:  # runs at most once", op, depth)
            self.stmt(f"{v} = {index(start, self.idx)}", op, depth + 1)
        elif a.get("stages"):
            self.stmt(S.PIPELINED.format(var=loop, extent=extent, stages=a["stages"]), op, depth)
        else:
            self.stmt(S.SERIAL.format(var=loop, extent=extent), op, depth)
        if start != 0 and not a.get("at_most_once"):
            self.stmt(f"{v} = {loop} + {index(start, self.idx)}", op, depth + 1)
        self.simt_open = False
        self.block(op.regions[0], depth + 1)
        self.simt_open = False

    # -- memory ------------------------------------------------------------------------------
    def region(self, op: Op, shape) -> str:
        """``x[b, h, o:o+64, 0:128]``: the global region of a load / store / gather."""
        p = self.params[op.attrs["tensor"]]
        offs = op.attrs["offsets"]
        lead = len(p.shape) - len(shape)
        parts = []
        for i, o in enumerate(offs):  # whole tiles only: check_whole_tiles refused ragged ones
            o_txt = index(o, self.idx)
            if i < lead:
                parts.append(o_txt)
                continue
            size = int(shape[i - lead])
            parts.append(f"{o_txt}:{o_txt} + {size}" if o_txt != "0" else f"0:{size}")
        return f"{p.name}[{', '.join(parts)}]"

    def op_load(self, op: Op, depth: int) -> None:
        src = self.region(op, op.attrs["shape"])
        tmpl = S.COPY_T if op.attrs.get("transpose") else _copy(op)
        if self.staged(op):
            self.stmt(tmpl.format(src=src, dst=self.stage_name(op)), op, depth)
            self.restage(op, depth, into_stage=False)
            return
        self.stmt(tmpl.format(src=src, dst=self.name(op.result)), op, depth)

    def op_store(self, op: Op, depth: int) -> None:
        v = op.args[0]
        if v.type.role.value == "operand":
            raise unsupported(f"storing {v!r}, an operand (L1) tile, to global memory", op)
        src = self.name(v)
        if self.staged(op):
            self.restage(op, depth, into_stage=True)
            src = self.stage_name(op)
        self.stmt(_copy(op).format(src=src, dst=self.region(op, op.attrs["shape"])), op, depth)

    def op_scatter(self, op: Op, depth: int) -> None:
        raise unsupported("a scatter store (rows named by an index tile) is not lowered for Ascend yet", op)

    # a dual copy needs regions of one rank: a 1-d split tile meets a global region of higher rank
    # (lse[b, h, rows]) through a UB stage of that rank, e.g. (1, 1, rows / 2)
    def staged(self, op: Op) -> bool:
        if not op.attrs.get("dual") or op.name not in ("load", "store"):
            return False
        return len(self.stage_value(op).type.shape) == 1 and len(self.params[op.attrs["tensor"]].shape) > 1

    @staticmethod
    def stage_value(op: Op) -> Value:
        return op.result if op.name == "load" else op.args[0]

    def stage_name(self, op: Op) -> str:
        return f"{self.name(self.stage_value(op))}_gm"

    def stage_shape(self, op: Op) -> tuple:
        lead = len(self.params[op.attrs["tensor"]].shape) - 1
        return (1,) * lead + tuple(int(d) for d in self.stage_value(op).type.shape)

    def restage(self, op: Op, depth: int, into_stage: bool) -> None:
        v, stage = self.name(self.stage_value(op)), self.stage_name(op)
        zeros = ", ".join(["0"] * (len(self.stage_shape(op)) - 1))
        n = int(self.stage_value(op).type.shape[0])
        self.stmt(S.SIMT, op, depth)
        self.stmt(S.PARALLEL.format(vars="r0", extents=n), op, depth + 1)
        dst, src = (f"{stage}[{zeros}, r0]", f"{v}[r0]") if into_stage else (f"{v}[r0]", f"{stage}[{zeros}, r0]")
        self.stmt(f"{dst} = {src}", op, depth + 2)

    def op_move(self, op: Op, depth: int) -> None:
        src, dst = op.args[0], op.result
        path = (src.type.role.value, dst.type.role.value)
        if path not in (("accumulator", "vector"), ("vector", "operand")):
            raise unsupported(f"no Ascend transfer from {path[0]} to {path[1]}", op)
        self.stmt(_copy(op).format(src=self.name(src), dst=self.name(dst)), op, depth)

    def op_alloc(self, op: Op, depth: int) -> None:
        fill, scope = op.attrs.get("fill"), op.attrs["scope"]
        if fill is None:
            return
        if scope == "ub":
            t = op.result.type
            ivars = [f"r{i}" for i in range(len(t.shape))]
            self.stmt(S.PARALLEL.format(vars=", ".join(ivars), extents=", ".join(str(int(d)) for d in t.shape)),
                      op, depth)
            self.stmt(f"{self.name(op.result)}[{', '.join(ivars)}] = {const(fill, t.dtype)}", op, depth + 1)
        elif scope == "l0c" and fill == 0.0:
            return  # zeroed by its first gemm (plan_clear_accum)
        else:
            raise unsupported(f"a {scope} buffer cannot be filled with {fill}; only vector (UB) buffers can "
                              "be initialised, and accumulators only to zero by their first gemm", op)

    def op_gather(self, op: Op, depth: int) -> None:
        t = op.result.type
        idx_v = op.args[0]
        axis = op.attrs["axis"]
        p = self.params[op.attrs["tensor"]]
        lead = len(p.shape) - len(t.shape)
        tile_axis = axis - lead
        ivars = [f"r{i}" for i in range(len(t.shape))]
        self.region(op, t.shape)  # checks the non-gathered dims
        self.stmt(S.PARALLEL.format(vars=", ".join(ivars), extents=", ".join(str(int(d)) for d in t.shape)),
                  op, depth)
        ii = [ivars[tile_axis] if int(d) != 1 else "0" for d in idx_v.type.shape]
        row = f"{self.name(idx_v)}[{', '.join(ii)}]"
        subs = []
        for i, o in enumerate(op.attrs["offsets"]):
            if i == axis:
                subs.append(S.GATHER_ROW.format(idx=row, last=int(p.shape[axis]) - 1))
            elif i < lead:
                subs.append(index(o, self.idx))
            else:
                subs.append(f"{index(o, self.idx)} + {ivars[i - lead]}")
        ok = f"(({row} >= 0) and ({row} < {int(p.shape[axis])}))"
        other = const(op.attrs.get("other", 0.0), t.dtype)
        self.stmt(f"{self.name(op.result)}[{', '.join(ivars)}] = T.if_then_else({ok}, {p.name}[{', '.join(subs)}], "
                  f"{other})", op, depth + 1)

    # -- compute -----------------------------------------------------------------------------
    def op_map(self, op: Op, depth: int) -> None:
        out = op.attrs.get("into") or op.result
        t = out.type
        for a in op.args:
            if a.type.role.value != "vector":
                raise unsupported(f"vector work reads {a!r} ({a.type.role.value}) with no transfer to UB", op)
        printer = ExprPrinter([self.name(a) for a in op.args], self.idx)
        ivars = tuple(f"r{i}" for i in range(len(t.shape)))
        expr = op.attrs["expr"]
        text = printer(expr, ivars, t.dtype)
        if expr.dtype != t.dtype:
            text = f'T.cast({text}, "{t.dtype.tilelang_name}")'
        self.stmt(S.PARALLEL.format(vars=", ".join(ivars), extents=", ".join(str(int(d)) for d in t.shape)),
                  op, depth)
        self.stmt(f"{self.name(out)}[{', '.join(ivars)}] = {text}", op, depth + 1)

    def op_reduce(self, op: Op, depth: int) -> None:
        src = op.args[0]
        if not src.type.dtype.is_float:  # TileLang's SIMD reduce starts from a float immediate
            raise unsupported(f"reduce.{op.attrs['fn']} of a {src.type.dtype} tile has no Ascend lowering "
                              "(TileLang Ascend reduces float tiles only)", op)
        extent, width = int(src.type.shape[op.attrs["axis"]]), max(1, src.type.dtype.bits // 8)
        if (extent * width) % 256:
            raise unsupported(f"reduce.{op.attrs['fn']} over {extent} {src.type.dtype} elements: TileLang Ascend "
                              f"reduces whole 256-byte VRegs ({256 // width} elements)", op)
        if len(src.type.shape) < 2:
            raise unsupported("a reduction of a 1-d tile (to a single value) is not lowered for Ascend; "
                              "reduce a [1, N] tile along axis 1", op)
        self.stmt(S.SIMD, op, depth)
        self.stmt(S.REDUCE.format(fn=op.attrs["fn"], src=self.name(src), dst=self.name(op.result),
                                  dim=op.attrs["axis"]), op, depth + 1)

    def op_gemm(self, op: Op, depth: int) -> None:
        a, b, acc = op.args
        if op.attrs["transpose_a"] or not op.attrs["transpose_b"]:
            raise unsupported("L1 gemm is NT only; run nt_operands first", op)
        if acc.type.role.value != "accumulator" or a.type.role.value != "operand" or b.type.role.value != "operand":
            raise unsupported("gemm needs L1 operands and an L0C accumulator", op)
        clear = self.clear.get(id(op), "False")
        self.stmt(S.GEMM.format(a=self.name(a), b=self.name(b), acc=self.name(acc), clear=clear), op, depth)

    # -- analysis ----------------------------------------------------------------------------
    def plan_clear_accum(self, block: Block) -> None:
        """A zero-filled L0C buffer is cleared by its first gemm: ``clear_accum=True`` when that
        gemm follows in the same block, ``(k == start)`` when it sits in a loop that follows."""
        for i, op in enumerate(block.ops):
            for r in op.regions:
                self.plan_clear_accum(r)
            if op.name != "alloc" or op.attrs.get("scope") != "l0c" or op.attrs.get("fill") is None:
                continue
            acc = op.result
            first = self._first_touch(block.ops[i + 1:], acc)
            if first is None:
                continue
            user, loop = first
            if user.name != "gemm" or user.args[2] is not acc:
                raise unsupported(f"accumulator {acc!r} is read or written by {user.name} before any gemm; "
                                  "L0C is zeroed by its first gemm only", user)
            if loop is None:
                self.clear[id(user)] = "True"
            else:
                v = self.var(loop.attrs["var"])
                start = sympy.sympify(loop.attrs["start"])
                for sym in start.free_symbols:  # grid variables are named here before the grid is emitted
                    self.var(sym)
                self.clear[id(user)] = f"({v} == {index(start, self.idx)})"

    @staticmethod
    def _first_touch(ops: list[Op], acc: Value):
        for op in ops:
            if op.name == "for":
                for inner in op.regions[0].ops:
                    if any(v is acc for v in inner.values()) or inner.attrs.get("into") is acc:
                        return inner, op
                    if inner.regions and any(acc in o.values() for o in inner.regions[0].walk()):
                        return inner, op
            elif any(v is acc for v in op.values()) or op.attrs.get("into") is acc:
                return op, None
        return None


def _copy(op: Op) -> str:
    """A copy, or with ``vector_split`` (split_vector_rows.py) a dual copy: each AIV its half."""
    return S.DUAL_COPY if op.attrs.get("dual") else S.COPY


def _dims(shape) -> str:
    dims = [str(int(d)) for d in shape]
    return ", ".join(dims) + ("," if len(dims) == 1 else "")


def generate_source(module: Module, knobs: dict) -> str:
    return Emitter(module, knobs).generate()
