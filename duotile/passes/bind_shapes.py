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
# bound expressions by substitution, then by expression: the config searches bind every tile config
# of a call to the same sizes, and most of a module's offsets and extents recur from one to the next
_BOUND: dict[frozenset, dict] = {}
_BOUND_MAX = 64  # substitutions kept (each a call's sizes)
_BOUND_EXPRS_MAX = 50_000  # expressions kept per substitution


def _simplify(e):
    out = _SIMPLIFIED.get(e)
    if out is None:
        if len(_SIMPLIFIED) >= _SIMPLIFIED_MAX:
            _SIMPLIFIED.clear()
        out = _SIMPLIFIED[e] = sympy.simplify(e)
    return out


def _bound_exprs(subs: dict) -> dict:
    """The kept bound expressions of one substitution (a fresh table for a new one)."""
    key = frozenset(subs.items())
    seen = _BOUND.get(key)
    if seen is None or len(seen) >= _BOUND_EXPRS_MAX:
        if len(_BOUND) >= _BOUND_MAX:
            _BOUND.clear()
        seen = _BOUND[key] = {}
    return seen


def _bind(e, subs: dict, symbols: set):
    """``e`` with the sizes of ``subs`` put in, simplified; a number where it becomes one."""
    if not e.free_symbols & symbols:
        return e
    out = e.xreplace(subs)  # sizes for symbols; sympy evaluates what becomes numeric (subs: 20% slower)
    if not out.is_number:  # simplify is the slow part, and a number is already simple
        out = _simplify(out)
    return sympy.Float(out) if out.is_number and not out.is_Integer and not out.is_infinite else out


def bind_shapes(module: Module, shapes: dict[str, int], dynamic: tuple[str, ...] = ()) -> Module:
    """Sizes in ``dynamic`` stay symbolic (as ``dynamic_symbol(name)``); every other size must be given."""
    names = {s: str(s) for p in module.params for d in p.shape for s in d.free_symbols}  # each printed once
    symbols = set(names)
    # a size only optional tensors carry is unknown where the call leaves them out: the kernel
    # reads no such tensor, and a target that declares every parameter declares it with size 1
    required = {s for p in module.params if not p.optional for d in p.shape for s in d.free_symbols}
    absent = {s for s in symbols if s not in required and names[s] not in shapes and names[s] not in dynamic}
    symbols -= absent
    missing = sorted(names[s] for s in symbols if names[s] not in shapes and names[s] not in dynamic)
    if missing:
        raise DslError(f"{module.name}: no size given for {', '.join(missing)}")
    subs = {s: (dynamic_symbol(names[s]) if names[s] in dynamic else sympy.Integer(shapes[names[s]]))
            for s in symbols}
    subs.update({s: sympy.Integer(1) for s in absent})
    symbols |= absent

    seen = _bound_exprs(subs)  # each expression is bound once for these sizes

    def expr(e):
        if e.is_Number:  # most tile dimensions: nothing to bind
            return e
        out = seen.get(e)
        if out is None:
            out = seen[e] = _bind(e, subs, symbols)
        return out

    static = {names[s]: shapes[names[s]] for s in sorted(symbols - absent, key=names.get) if names[s] not in dynamic}
    left = tuple(sorted(names[s] for s in symbols if names[s] in dynamic))
    bound = Rewriter(expr).module(module, shapes=static, dynamic=left)
    _check_requires(bound, shapes)
    for op in bound.walk():
        if op.result is not None:
            for d in op.result.type.shape:
                if not d.is_Integer:
                    why = (f"it depends on the dynamic size(s) {', '.join(left)}: a tile's shape must be a constant"
                           if d.free_symbols & {dynamic_symbol(n) for n in left} else f"after binding {shapes}")
                    raise DslError(f"tile dimension {d} of {op.name} is not a constant: {why}", op.loc)
    return bound


def check_dynamic_requires(module: Module, shapes: dict[str, int]) -> None:
    """The conditions ``bind_shapes`` left, those on dynamic sizes, at one call's sizes (``shapes``
    by size name): a build serves every value of its dynamic sizes, so each new call shape is
    checked here, at the call, as a static one is at the build."""
    for cond, message, loc in module.requires:
        if not getattr(cond, "free_symbols", None):
            continue
        subs = {dynamic_symbol(name): sympy.Integer(size) for name, size in shapes.items()}
        if cond.xreplace(subs) in (sympy.false, False):
            raise DslError(f"{module.name}: {message} (sizes {shapes})", loc)


def _check_requires(module: Module, shapes: dict[str, int]) -> None:
    """``dsl.require``'s conditions at these sizes: one that is false is the call's error, at its
    spec line; one that still holds a dynamic size is left (the sizes a build serves are not known)."""
    for cond, message, loc in module.requires:
        if cond in (sympy.false, False):
            raise DslError(f"{module.name}: {message} (sizes {shapes})", loc)
