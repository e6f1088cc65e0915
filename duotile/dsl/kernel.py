"""``@dsl.kernel``: declare a kernel's tensors, constants and tunables, and trace it to Tile IR."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import sympy

from . import builder
from .dtypes import DType, DTypeSet, from_torch
from .errors import CallError, DslError, SourceLoc
from .ir import Module, TensorParam
from .tile import TensorRef
from .tunables import Space


@dataclass(frozen=True)
class TensorSpec:
    dims: tuple[str | int, ...]
    dtype: DType | DTypeSet
    optional: bool = False

    def dtypes(self) -> tuple[DType, ...]:
        return self.dtype.options if isinstance(self.dtype, DTypeSet) else (self.dtype,)


def _tensor_spec(spec, optional: bool) -> TensorSpec:
    spec = spec if isinstance(spec, tuple) else (spec,)
    *dims, dtype = spec
    if not isinstance(dtype, (DType, DTypeSet)):
        raise TypeError(f"the last item of Tensor[...] must be a dtype, got {dtype!r}")
    for d in dims:
        if not (isinstance(d, int) or (isinstance(d, str) and d.isidentifier())):
            raise TypeError(f"tensor dimensions are names or ints, got {d!r}")
    return TensorSpec(tuple(dims), dtype, optional)


class Tensor:
    """``dsl.Tensor["M", "K", dsl.bf16]``: a tensor parameter with named symbolic dimensions."""

    def __class_getitem__(cls, spec) -> TensorSpec:
        return _tensor_spec(spec, optional=False)


class OptionalTensor:
    """``dsl.OptionalTensor["N", dsl.f32] = None``: a tensor the caller may leave out."""

    def __class_getitem__(cls, spec) -> TensorSpec:
        return _tensor_spec(spec, optional=True)


class Const:
    """Annotation of a compile-time constant: ``CAUSAL: dsl.Const = False``."""


class Tunable:
    """Annotation of a tunable: ``BM: dsl.Tunable = dsl.choice(64, 128)``."""


@dataclass
class Signature:
    """What a call binds: dtypes of each tensor, which optionals are present, symbol sizes, and
    which of those sizes the kernel leaves dynamic (one build serves every value of them)."""

    dtypes: dict[str, DType]
    present: dict[str, bool]
    shapes: dict[str, int]
    dynamic: tuple[str, ...] = ()
    bucketed: tuple[str, ...] = ()  # dynamic sizes whose power-of-two bucket still picks the build

    @property
    def static_shapes(self) -> dict[str, int]:
        """The sizes a build is specialised to: every size but the dynamic ones."""
        return {k: v for k, v in self.shapes.items() if k not in self.dynamic}

    def key(self) -> tuple:
        """What tells two builds apart: neither a dynamic size nor, for a bucketed one, more than
        its bucket (the power of two at or above it) is part of it."""
        buckets = tuple(sorted((d, bucket(self.shapes[d])) for d in self.bucketed if d in self.dynamic))
        return (tuple(sorted((k, v.name) for k, v in self.dtypes.items())),
                tuple(sorted(self.present.items())), tuple(sorted(self.static_shapes.items())),
                tuple(sorted(self.dynamic)), buckets)

    def with_static(self, names) -> Signature:
        """The same call with ``names`` specialised statically (no longer dynamic)."""
        return Signature(self.dtypes, self.present, self.shapes, tuple(d for d in self.dynamic if d not in names),
                         tuple(d for d in self.bucketed if d not in names))


def bucket(size: int) -> int:
    """The shape bucket of a size: the power of two at or above it."""
    return 1 << max(0, int(size) - 1).bit_length()


@dataclass
class KernelDef:
    fn: Any
    name: str
    tensors: dict[str, TensorSpec]
    constants: dict[str, Any]
    tunables: dict[str, Space]
    batch_dim: str | None = None
    source_file: str = ""
    source_line: int = 0
    dynamic: tuple[str, ...] = ()  # sizes one build serves every value of (``@dsl.kernel(dynamic=...)``)
    bucketed: tuple[str, ...] = ()  # of those, the ones a build and its config serve one bucket of
    padded: tuple[tuple[str, float], ...] = ()  # (size, fill): a call's inputs padded to the size's bucket
    _source_hash: str = field(default="", repr=False)

    # -- configuration ------------------------------------------------------------------------
    def default_config(self) -> dict[str, Any]:
        return {k: s.default for k, s in self.tunables.items()}

    def resolve_config(self, config: dict[str, Any] | None) -> dict[str, Any]:
        return self._override(self.default_config(), config, "tunable")

    def resolve_constants(self, constants: dict[str, Any] | None) -> dict[str, Any]:
        return self._override(dict(self.constants), constants, "constant")

    def _override(self, defaults: dict[str, Any], given: dict[str, Any] | None, kind: str) -> dict[str, Any]:
        unknown = [k for k in (given or {}) if k not in defaults]
        if unknown:
            raise DslError(f"kernel {self.name!r} has no {kind} {unknown[0]!r}; it has "
                           f"{', '.join(defaults) or 'none'}")
        return {**defaults, **(given or {})}

    @property
    def source_hash(self) -> str:
        if not self._source_hash:
            self._source_hash = hashlib.sha256(inspect.getsource(self.fn).encode()).hexdigest()[:16]
        return self._source_hash

    @property
    def loc(self) -> SourceLoc:
        return SourceLoc(self.source_file, self.source_line, f"def {self.name}(...)")

    # -- binding a call -----------------------------------------------------------------------
    def bind(self, args: dict[str, Any]) -> Signature:
        """Match torch tensors (by parameter name) against the declared shapes and dtypes."""
        dtypes, present, shapes, origin = {}, {}, {}, {}
        for name, spec in self.tensors.items():
            t = args.get(name)
            present[name] = t is not None
            if t is None:
                if not spec.optional:
                    raise CallError(f"{self.name}: missing tensor argument {name!r}")
                dtypes[name] = spec.dtypes()[0]
                continue
            if not hasattr(t, "shape") or not hasattr(t, "dtype"):
                raise CallError(f"{self.name}: argument {name!r} must be a tensor, got {type(t).__name__}")
            dtypes[name] = self._bind_dtype(name, spec, t)
            if len(t.shape) != len(spec.dims):
                raise CallError(f"{self.name}: argument {name!r} has {len(t.shape)} dimensions "
                                f"{tuple(t.shape)}, expected {len(spec.dims)} ({', '.join(map(str, spec.dims))})")
            for dim, size in zip(spec.dims, t.shape):
                self._bind_dim(name, dim, int(size), shapes, origin)
        return Signature(dtypes, present, shapes, tuple(d for d in self.dynamic if d in shapes),
                         tuple(d for d in self.bucketed if d in shapes))

    def _bind_dtype(self, name: str, spec: TensorSpec, t) -> DType:
        try:
            got = from_torch(t.dtype)
        except TypeError as err:
            raise CallError(f"{self.name}: argument {name!r}: {err}") from None
        if got not in spec.dtypes():
            want = " or ".join(d.name for d in spec.dtypes())
            raise CallError(f"{self.name}: argument {name!r} has dtype {got.name}, expected {want}")
        return got

    def _bind_dim(self, name, dim, size, shapes, origin):
        if isinstance(dim, int):
            if size != dim:
                raise CallError(f"{self.name}: argument {name!r} must have size {dim} where it has {size}")
        elif dim in shapes and shapes[dim] != size:
            raise CallError(f"{self.name}: argument {name!r} has {dim}={size}, but argument "
                            f"{origin[dim]!r} bound {dim}={shapes[dim]}")
        else:
            shapes.setdefault(dim, size)
            origin.setdefault(dim, name)

    # -- tracing -------------------------------------------------------------------------------
    def trace(self, dtypes: dict[str, DType] | None = None, present: dict[str, bool] | None = None,
              config: dict[str, Any] | None = None, constants: dict[str, Any] | None = None) -> Module:
        """Run the body with proxies and return its Tile IR (shapes still symbolic)."""
        cfg, consts = self.resolve_config(config), self.resolve_constants(constants)
        params, refs = [], {}
        for name, spec in self.tensors.items():
            dtype = (dtypes or {}).get(name, spec.dtypes()[0])
            shape = tuple(sympy.Integer(d) if isinstance(d, int) else
                          sympy.Symbol(d, integer=True, positive=True) for d in spec.dims)
            p = TensorParam(name, shape, dtype, spec.optional, spec.dims)
            params.append(p)
            is_present = (present or {}).get(name, not spec.optional)
            refs[name] = TensorRef(p, spec.dims) if is_present else None
        with builder.tracing(self.fn.__code__) as b:
            b.tensor_names.update(self.tensors)
            self.fn(**refs, **consts, **cfg)
        if not b.root.ops:
            raise DslError(f"kernel {self.name!r} must start with `for ... in dsl.grid(...)`", self.loc)
        stray = next((op for op in b.root.ops if op.name != "grid"), None)
        if stray is not None:
            raise DslError(f"kernel {self.name!r}: `{stray.name}` outside dsl.grid; every tile op belongs "
                           "to a grid", stray.loc)
        return Module(self.name, params + b.workspaces, b.root, config=cfg, constants=consts,
                      batch_dim=self.batch_dim, source_file=self.source_file, requires=b.requires)


def kernel(fn=None, *, batch_dim: str | None = None, dynamic: tuple[str, ...] | list[str] = (),
           bucketed: tuple[str, ...] | list[str] = (), padded: dict[str, float] | None = None):
    """Declare a tile kernel. ``batch_dim`` names the batch dimension of a decode-path kernel;
    ``dynamic`` names the sizes that stay symbolic in a build (token counts, decode rows, the
    batch), so that one build serves every value of them. A tile's shape cannot depend on one.
    ``bucketed`` sizes are dynamic too, but their power-of-two bucket still chooses the config
    and so the build (a gemm's token count: decode rows and prefill chunks want other tiles):
    at most one build per bucket. ``padded`` sizes stay static (tiles may depend on them), and a
    call's tensors are padded along them to the power-of-two bucket with the given fill, one the
    kernel must treat as absent (top-k's -inf scores): one build per bucket for a size that grows
    during a generation. Only tensors the kernel reads may carry a padded size."""

    def wrap(f) -> KernelDef:
        sig = inspect.signature(f, eval_str=True)
        tensors, constants, tunables = {}, {}, {}
        for p in sig.parameters.values():
            ann = p.annotation
            if isinstance(ann, TensorSpec):
                tensors[p.name] = ann
            elif ann is Tunable:
                if not isinstance(p.default, Space):
                    raise DslError(f"tunable {p.name!r} needs a space default, e.g. dsl.choice(64, 128)")
                p.default.name = p.name
                tunables[p.name] = p.default
            elif ann is Const:
                if p.default is inspect.Parameter.empty:
                    raise DslError(f"constant {p.name!r} needs a default value")
                constants[p.name] = p.default
            else:
                raise DslError(f"parameter {p.name!r} of kernel {f.__name__!r} needs an annotation: "
                               "dsl.Tensor[...], dsl.OptionalTensor[...], dsl.Const or dsl.Tunable")
        if batch_dim is not None and not any(batch_dim in s.dims for s in tensors.values()):
            raise DslError(f"batch_dim {batch_dim!r} is not a dimension of any tensor of {f.__name__!r}")
        dims = {d for s in tensors.values() for d in s.dims if isinstance(d, str)}
        for what, names in (("dynamic", dynamic), ("bucketed", bucketed)):
            bad = [d for d in names if d not in dims]
            if isinstance(names, str) or bad:
                raise DslError(f"{what} {bad[0] if bad else names!r} of {f.__name__!r} is not a dimension of any "
                               f"of its tensors ({what} takes a tuple of names; dimensions: {', '.join(sorted(dims))})")
        pads = dict(padded or {})
        bad = [d for d in pads if d not in dims or d in dynamic or d in bucketed]
        if bad:
            raise DslError(f"padded size {bad[0]!r} of {f.__name__!r} must be a static dimension of its tensors "
                           f"(not dynamic or bucketed; dimensions: {', '.join(sorted(dims))})")
        code = f.__code__
        return KernelDef(f, f.__name__, tensors, constants, tunables, batch_dim, code.co_filename,
                         code.co_firstlineno, tuple(dict.fromkeys((*dynamic, *bucketed))), tuple(bucketed),
                         tuple(pads.items()))

    return wrap(fn) if fn is not None else wrap
