"""The interpreter's compute ops: gemms, reductions, elementwise ops and fused maps over tiles with
a leading program axis; what depends on torch's layout of a batch runs program by program."""

from __future__ import annotations

import torch

from ...dsl.errors import DslError
from ...dsl.expr import Node
from ...dsl.ir import Op
from ...dsl.ops import E2M1_MAGNITUDES, MXFP4_BLOCK, NVFP4_BLOCK
from .machine import Interpreter, handles, lift, programs_of


def _each(t: torch.Tensor, p: int) -> torch.Tensor:
    """Program p's tile, contiguous (the layout a program alone has)."""
    return (t[p] if t.shape[0] > 1 else t[0]).contiguous()


@handles("gemm")
def _gemm(it: Interpreter, op: Op):
    a, b, acc = (it.get(v) for v in op.args)
    for p in range(acc.shape[0]):  # program by program: torch's blocking of a batch may differ from one
        if it.active is not None and not bool(it.active[p]):
            continue
        x, y = _each(a, p).float(), _each(b, p).float()
        acc[p] += (x.t() if op.attrs["transpose_a"] else x) @ (y.t() if op.attrs["transpose_b"] else y)


@handles("reduce")
def _reduce(it: Interpreter, op: Op):
    x = it.get(op.args[0])
    axis, fn = op.attrs["axis"], op.attrs["fn"]
    shape = [int(d) for d in op.result.type.shape]
    if fn == "sum" and x.dtype.is_floating_point:  # the order of a float sum: program by program
        out = torch.stack([_each(x, p).sum(axis, dtype=x.dtype) for p in range(x.shape[0])])
    else:
        out = {"sum": lambda: x.sum(axis + 1, dtype=x.dtype), "max": lambda: x.amax(axis + 1),
               "min": lambda: x.amin(axis + 1)}[fn]()
    it.put(op.result, out.reshape(programs_of(out), *shape))


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    q = torch.floor_divide(a, torch.where(zero, torch.ones_like(b), b))  # torch raises on an integer 0
    return torch.where(zero, torch.zeros_like(q), q)


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    r = torch.remainder(a, torch.where(zero, torch.ones_like(b), b))
    return torch.where(zero, torch.broadcast_to(a, r.shape), r)


def _per_program(fn):
    """``fn`` applied to each program's tile alone: the transcendental functions' vector and
    scalar paths may differ in the last bit, so where an element falls in a batch must not matter."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return fn(t)
        return torch.stack([fn(_each(t, p)) for p in range(t.shape[0])])

    return apply


_EW = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "floordiv": _floordiv, "mod": _mod,
    "max": torch.maximum, "min": torch.minimum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not,
    "neg": torch.neg, "abs": torch.abs, "exp": _per_program(torch.exp), "exp2": _per_program(torch.exp2),
    "log": _per_program(torch.log), "log2": _per_program(torch.log2), "sqrt": torch.sqrt,
    "rsqrt": _per_program(torch.rsqrt), "sigmoid": _per_program(torch.sigmoid),
    "bitand": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor,
    "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift,
}


_CONSTS: dict[tuple, torch.Tensor] = {}


def constant(x, dtype, device) -> torch.Tensor:
    """A 0-d tensor of ``x``, made once per value (by its repr: -0.0 is not 0.0), dtype and device.
    Never written: every op reading it makes a new tensor."""
    key = (repr(x), dtype, device)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) > 65536:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.tensor(x, dtype=dtype, device=device)
    return t


def _as_tensor(x, dtype, device):
    return x if isinstance(x, torch.Tensor) else constant(x, dtype, device)


def _to(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def apply_ew(fn: str, args: list, dtype: torch.dtype, device) -> torch.Tensor:
    if fn == "where":
        c, a, b = args
        return _to(torch.where(c, _as_tensor(a, dtype, device), _as_tensor(b, dtype, device)), dtype)
    if fn == "splat":
        return _to(torch.as_tensor(args[0], device=device), dtype)
    if fn == "bitcast":  # the same bits, another type of the width
        return args[0].contiguous().view(dtype)
    tensors = [_as_tensor(a, dtype if not isinstance(a, bool) else torch.bool, device) for a in args]
    if fn in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
        return _EW[fn](*tensors)
    return _to(_EW[fn](*[_to(t, dtype) for t in tensors]), dtype)


def _shaped(out, t) -> torch.Tensor:
    """An op's result at its type's shape, with the program axis (P or 1)."""
    rank = len(t.shape)
    out = _to(lift(out, rank), t.dtype.torch)
    return torch.broadcast_to(out, [programs_of(out), *[int(d) for d in t.shape]])


@handles("ew")
def _ew(it: Interpreter, op: Op):
    t = op.result.type
    rank = len(t.shape)
    args = [lift(it.get(a, rank), rank) for a in op.args]
    out = apply_ew(op.attrs["fn"], args, t.dtype.torch, it.device)
    it.put(op.result, _shaped(out, t).clone())


@handles("cast")
def _cast(it: Interpreter, op: Op):
    it.put(op.result, _to(it.get(op.args[0]), op.attrs["dtype"].torch))


@handles("iota")
def _iota(it: Interpreter, op: Op):
    n = int(op.result.type.shape[0])
    it.put(op.result, torch.arange(n, dtype=torch.int32, device=it.device).view(1, n))


@handles("expand")
def _expand(it: Interpreter, op: Op):
    x = it.get(op.args[0])
    it.put(op.result, lift(x, len(op.result.type.shape) - 1).unsqueeze(op.attrs["axis"] + 1))


def _ue8m0_scales(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes (int32) as their float32 scales 2^(code - 127), NaN for code 255."""
    scale = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes - 127)
    return torch.where(codes == 255, torch.nan, scale)


def _codes(it: Interpreter, op: Op) -> torch.Tensor:
    """The op's codes (int32): ``count`` columns a row from column ``first`` (an index, one a
    program where it depends on the grid) of its codes tile."""
    codes = it.get(op.args[1]).to(torch.int32)
    count, first = int(op.attrs["count"]), it.scalar(op.attrs["first"])
    last = int(first.max()) if isinstance(first, torch.Tensor) else int(first)
    if last + count > codes.shape[-1] or (int(first.min()) if isinstance(first, torch.Tensor) else last) < 0:
        raise DslError(f"{op.name} reads codes {last} .. {last + count - 1} of a row, past its "
                       f"{codes.shape[-1]}-column codes tile (first = {op.attrs['first']})", op.loc)
    if not isinstance(first, torch.Tensor):
        return codes[..., first:first + count]
    first = first.to(codes.device)
    codes = codes.expand(first.numel(), *codes.shape[1:])  # a tile the same in every program: one row
    cols = first.view(-1, *([1] * (codes.dim() - 1))) + torch.arange(count, device=codes.device)
    return torch.gather(codes, -1, cols.expand(*codes.shape[:-1], count))


@handles("mxfp4")
def _mxfp4(it: Interpreter, op: Op):
    """e2m1 codes two a byte (element 2j in byte j's low nibble) times 2^(code - 127) of their
    MXFP4_BLOCK-value block, in float32 (exact: two significant bits times a power of two) rounded
    to bf16."""
    packed, codes = it.get(op.args[0]).to(torch.int32), _codes(it, op)
    nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=it.device)
    values = torch.where(nibbles >= 8, -table[nibbles & 7], table[nibbles & 7])
    it.put(op.result, (values * _ue8m0_scales(codes).repeat_interleave(MXFP4_BLOCK, dim=-1)).to(torch.bfloat16))


@handles("nvfp4")
def _nvfp4(it: Interpreter, op: Op):
    """e2m1 codes two a byte (element 2j in byte j's low nibble) times the E4M3 scale of their
    16-value block, in float32 (exact) rounded to bf16 (exact too: at most six significant bits)."""
    packed = it.get(op.args[0]).to(torch.int32)
    nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=it.device)
    values = torch.where(nibbles >= 8, -table[nibbles & 7], table[nibbles & 7])
    scales = it.get(op.args[1]).float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    it.put(op.result, (values * scales).to(torch.bfloat16))


@handles("mxfp8")
def _mxfp8(it: Interpreter, op: Op):
    """e4m3 values times 2^(code - 127) of their block (C / G columns a code), the product in
    float32, rounded to bf16; NaN for code 255."""
    values, codes = it.get(op.args[0]).float(), _codes(it, op)
    scale = _ue8m0_scales(codes).repeat_interleave(values.shape[-1] // codes.shape[-1], dim=-1)
    it.put(op.result, (values * scale).to(torch.bfloat16))


@handles("cumsum")
def _cumsum(it: Interpreter, op: Op):
    x = it.get(op.args[0]).to(torch.int64)
    out = torch.cumsum(x, dim=-1)
    if op.attrs["exclusive"]:
        out = out - x
    it.put(op.result, out.to(torch.int32))


@handles("map")
def _map(it: Interpreter, op: Op):
    inputs = [it.get(a) for a in op.args]
    out = _eval(it, op.attrs["expr"], inputs)
    into = op.attrs.get("into")
    if into is not None:
        it.overwrite(it.get(into), out)
    else:
        it.put(op.result, _shaped(out, op.result.type).clone())


def _eval(it: Interpreter, node: Node, inputs: list) -> torch.Tensor:
    return _compiled_node(node)(it, inputs)


def _compiled_node(node: Node):
    """A closure computing ``node`` from a map's inputs (each with its program axis, lifted to the
    node's rank), made once and kept on the node: walking the tree at every evaluation (its
    kinds, dtypes and child lists) was a third of the interpreter's own time on the tiny models'
    generations."""
    fn = node.__dict__.get("_interpret")
    if fn is not None:
        return fn
    dtype, kind, attr, rank = node.dtype.torch, node.kind, node.attr, len(node.shape)
    if kind == "arg":
        def fn(it, inputs):
            return lift(inputs[attr], rank)
    elif kind == "const":
        def fn(it, inputs):
            return constant(attr, dtype, it.device)
    elif kind == "scalar":
        def fn(it, inputs):
            s = it.scalar(attr)
            return _to(s, dtype).view(-1, *([1] * rank)) if isinstance(s, torch.Tensor) else constant(s, dtype,
                                                                                                      it.device)
    elif kind == "iota":
        n = int(node.shape[0])

        def fn(it, inputs):
            return torch.arange(n, dtype=torch.int32, device=it.device).view(1, n)
    else:
        kids = [_compiled_node(c) for c in node.children]
        if kind == "expand":
            child_rank = len(node.children[0].shape)

            def fn(it, inputs):
                x = kids[0](it, inputs)
                return x if x.dim() == 0 else lift(x, child_rank).unsqueeze(attr + 1)
        elif kind == "cast":
            to = attr.torch

            def fn(it, inputs):
                return _to(kids[0](it, inputs), to)
        else:
            def fn(it, inputs):
                return apply_ew(kind, [lift(k(it, inputs), rank) for k in kids], dtype, it.device)
    object.__setattr__(node, "_interpret", fn)  # a frozen dataclass: the cache is not a field
    return fn
