"""bind_shapes: specialise a module's symbolic sizes to the sizes of one call.

Before::

    grid (m < ceiling(M/128), n < ceiling(N/128)) {
      %a1 = load a[128*m, 64*k] -> bf16[128x64] operand
      %v9 = ew.mul(%buf1, 1.4427/D**0.5) -> f32[128xD] vector

After ``bind_shapes(module, {"M": 200, "N": 128, "K": 64, "D": 128})``::

    shapes {M=200, N=128, K=64, D=128}
    grid (m < 2, n < 1) {
      %a1 = load a[128*m, 64*k] -> bf16[128x64] operand
      %v9 = ew.mul(%buf1, 0.127517...) -> f32[128x128] vector

Every tile dimension must become an integer; index expressions keep only loop variables.
"""

from __future__ import annotations

import sympy

from ..dsl.errors import DslError
from ..dsl.ir import Module
from .rewrite import Rewriter


def bind_shapes(module: Module, shapes: dict[str, int]) -> Module:
    symbols = {s for p in module.params for d in p.shape for s in d.free_symbols}
    missing = sorted(str(s) for s in symbols if str(s) not in shapes)
    if missing:
        raise DslError(f"{module.name}: no size given for {', '.join(missing)}")
    subs = {s: sympy.Integer(shapes[str(s)]) for s in symbols}

    def expr(e):
        if not e.free_symbols & symbols:
            return e
        out = sympy.simplify(e.subs(subs))
        return sympy.Float(out) if out.is_number and not out.is_Integer and not out.is_infinite else out

    bound = Rewriter(expr).module(module, shapes={str(s): shapes[str(s)] for s in sorted(symbols, key=str)})
    for op in bound.walk():
        if op.result is not None:
            for d in op.result.type.shape:
                if not d.is_Integer:
                    raise DslError(f"tile dimension {d} of {op.name} is not a constant after binding "
                                   f"{shapes}", op.loc)
    return bound
