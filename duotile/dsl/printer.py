"""The text form of the Tile IR (what ``duotile show --stage ir`` prints)."""

from __future__ import annotations

import re

from .ir import Block, Module, Op, Value


def format_arg(arg) -> str:
    return repr(arg) if isinstance(arg, Value) else str(arg)


def _format_attrs(op: Op) -> str:
    skip = {"into", "tensor", "offsets", "shape", "role", "var", "vars", "extent", "extents", "fn", "expr"}
    parts = [f"{k}={v}" for k, v in op.attrs.items() if k not in skip and v is not None]
    return " " + " ".join(parts) if parts else ""


def format_op(op: Op) -> str:
    a = op.attrs
    lhs = f"{op.result!r} = " if op.result is not None else ""
    if op.name == "grid":
        axes = ", ".join(f"{v} < {e}" for v, e in zip(a["vars"], a["extents"]))
        return f"grid ({axes})"
    if op.name == "for":
        kind = f" pipelined(stages={a['stages']})" if a.get("stages") else ""
        start = a.get("start", 0)
        low = f"{start} <= " if start != 0 else ""
        end = f"min({a['extent']}, {format_arg(op.args[0])})" if op.args else a["extent"]
        return f"for {low}{a['var']} < {end}{kind}"
    args = ", ".join(format_arg(x) for x in op.args)
    if op.name in ("load", "store", "gather", "scatter"):
        offs = ", ".join(str(o) for o in a["offsets"])
        tail = f" -> {op.result.type}" if op.result is not None else ""
        idx = f" by {args}" if op.name == "gather" else (f" <- {args}" if op.name == "store" else "")
        if op.name == "scatter":  # args: the tile, then the index tile
            idx = f" by {format_arg(op.args[1])} <- {format_arg(op.args[0])}"
        extra = _format_attrs(op)
        return f"{lhs}{op.name} {a['tensor']}[{offs}]{idx}{tail}{extra}"
    if op.name == "scalar":  # an index symbol read from data
        return f"{a['var']} = scalar({format_arg(op.args[0])})"
    if op.name == "map":
        tail = f"into {a['into']!r}" if a.get("into") is not None else f"-> {op.result.type}"
        return f"{lhs}map({args}) {{ {a['expr']} }} {tail}"
    fn = f".{a['fn']}" if "fn" in a else ""
    tail = f" -> {op.result.type}" if op.result is not None else ""
    return f"{lhs}{op.name}{fn}({args}){_format_attrs(op)}{tail}"


def format_block(block: Block, indent: int, with_loc: bool) -> list[str]:
    lines = []
    pad = "  " * indent
    for op in block.ops:
        text = pad + format_op(op)
        if with_loc and op.loc is not None and not op.regions:
            text = f"{text:<72}  # line {op.loc.line}"
        if op.regions:
            lines.append(text + " {")
            for region in op.regions:
                lines.extend(format_block(region, indent + 1, with_loc))
            lines.append(pad + "}")
        else:
            lines.append(text)
    return lines


def format_module(module: Module, with_loc: bool = True) -> str:
    params = ", ".join(str(p) for p in module.params)
    head = [f"kernel {module.name}({params})"]
    if module.constants:
        head.append("  constants {" + ", ".join(f"{k}={v}" for k, v in module.constants.items()) + "}")
    if module.config:
        head.append("  config {" + ", ".join(f"{k}={v}" for k, v in module.config.items()) + "}")
    if module.shapes:
        head.append("  shapes {" + ", ".join(f"{k}={v}" for k, v in module.shapes.items()) + "}")
    if module.dynamic:
        head.append("  dynamic {" + ", ".join(f"{k} as n_{k}" for k in module.dynamic) + "}")
    return "\n".join(head + format_block(module.body, 1, with_loc)) + "\n"


def canonical_text(module: Module) -> str:
    """The module's text without source lines and with values numbered by first appearance:
    equal for equal IR in any process (value ids come from a global counter)."""
    names: dict[str, str] = {}
    return re.sub(r"%\w+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"),
                  format_module(module, with_loc=False))
