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

Every tile dimension must become an integer; index expressions keep only loop variables and
the dynamic sizes: ``bind_shapes(module, {"D": 4096}, dynamic=("T",))`` writes ``T`` as the
symbol ``n_T`` everywhere (grid extents, bounds, masks), and one build serves every ``T``.
"""

from __future__ import annotations

import sympy

from ..dsl.errors import DslError
from ..dsl.ir import Module, dynamic_symbol
from .rewrite import Rewriter

_SIMPLIFIED: dict = {}  # sympy.simplify by expression: configs and shapes repeat the dynamic ones
_SIMPLIFIED_MAX = 50_000


def _simplify(e):
    out = _SIMPLIFIED.get(e)
    if out is None:
        if len(_SIMPLIFIED) >= _SIMPLIFIED_MAX:
            _SIMPLIFIED.clear()
        out = _SIMPLIFIED[e] = sympy.simplify(e)
    return out


def bind_shapes(module: Module, shapes: dict[str, int], dynamic: tuple[str, ...] = ()) -> Module:
    """Sizes in ``dynamic`` stay symbolic (as ``dynamic_symbol(name)``); every other size must be given."""
    symbols = {s for p in module.params for d in p.shape for s in d.free_symbols}
    # a size only optional tensors carry is unknown where the call leaves them out: the kernel
    # reads no such tensor, and a target that declares every parameter declares it with size 1
    required = {s for p in module.params if not p.optional for d in p.shape for s in d.free_symbols}
    absent = {s for s in symbols if s not in required and str(s) not in shapes and str(s) not in dynamic}
    symbols -= absent
    missing = sorted(str(s) for s in symbols if str(s) not in shapes and str(s) not in dynamic)
    if missing:
        raise DslError(f"{module.name}: no size given for {', '.join(missing)}")
    subs = {s: (dynamic_symbol(str(s)) if str(s) in dynamic else sympy.Integer(shapes[str(s)])) for s in symbols}
    subs.update({s: sympy.Integer(1) for s in absent})
    symbols |= absent

    seen: dict = {}  # a module repeats its offsets and extents: each expression is bound once

    def expr(e):
        if e in seen:
            return seen[e]
        if not e.free_symbols & symbols:
            return e
        out = e.xreplace(subs)  # sizes for symbols; sympy evaluates what becomes numeric (subs: 20% slower)
        if not out.is_number:  # simplify is the slow part, and a number is already simple
            out = _simplify(out)
        seen[e] = out = sympy.Float(out) if out.is_number and not out.is_Integer and not out.is_infinite else out
        return out

    static = {str(s): shapes[str(s)] for s in sorted(symbols - absent, key=str) if str(s) not in dynamic}
    left = tuple(sorted(str(s) for s in symbols if str(s) in dynamic))
    bound = Rewriter(expr).module(module, shapes=static, dynamic=left)
    for op in bound.walk():
        if op.result is not None:
            for d in op.result.type.shape:
                if not d.is_Integer:
                    why = (f"it depends on the dynamic size(s) {', '.join(left)}: a tile's shape must be a constant"
                           if d.free_symbols & {dynamic_symbol(n) for n in left} else f"after binding {shapes}")
                    raise DslError(f"tile dimension {d} of {op.name} is not a constant: {why}", op.loc)
    return bound
