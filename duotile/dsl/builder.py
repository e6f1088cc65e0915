"""The tracing context: where ops go while a kernel body runs, and which line wrote them."""

from __future__ import annotations

import contextlib
import linecache
import sys
import sysconfig
import threading
import types

from .errors import DslError, SourceLoc
from .ir import Block, Op, Value

_state = threading.local()  # tracing is per thread: builds run in a thread pool


class Builder:
    """Collects ops into nested blocks while a kernel function is being traced."""

    def __init__(self, code: types.CodeType):
        self.code = code
        self.root = Block()
        self.stack: list[Block] = [self.root]
        self.tensor_names: set[str] = set()  # the kernel's tensors, then its workspaces
        self.workspaces: list = []  # TensorParams declared by dsl.workspace, in order
        self.requires: list = []  # dsl.require's (condition, message, spec line) on sizes

    def loc(self) -> SourceLoc | None:
        """The spec line that is running now: between the op and the kernel function, the
        innermost frame outside the DSL's modules and the standard library (a helper the kernel
        called, wherever it lives, such as gemm's K-range loop that gemm_splitk calls too), else
        the kernel function's own line; so an error names the load, not the helper's call."""
        frame = sys._getframe(1)
        helper = None
        while frame is not None:
            if frame.f_code is self.code:
                return _loc_of(helper or frame)
            name = frame.f_code.co_filename
            if helper is None and not name.startswith((_DSL_DIR, _STDLIB)):
                helper = frame
            frame = frame.f_back
        return _loc_of(helper) if helper is not None else None

    def emit(self, op: Op) -> Value | None:
        if op.loc is None:
            op.loc = self.loc()
        self.stack[-1].ops.append(op)
        return op.result

    @contextlib.contextmanager
    def region(self, op: Op):
        """Emit ``op`` and trace what runs inside the ``with`` into its body."""
        body = Block()
        op.regions.append(body)
        self.emit(op)
        self.stack.append(body)
        try:
            yield body
        finally:
            self.stack.pop()


_DSL_DIR = __file__.rsplit("/", 1)[0]
_STDLIB = sysconfig.get_paths()["stdlib"]  # contextlib's frames sit between a `with` op and the kernel


def _loc_of(frame) -> SourceLoc:
    file, line = frame.f_code.co_filename, frame.f_lineno
    return SourceLoc(file, line, linecache.getline(file, line))


def _get() -> Builder | None:
    return getattr(_state, "builder", None)


def current() -> Builder:
    _current = _get()
    if _current is None:
        raise DslError("tile ops can only be used inside a @dsl.kernel function while it is traced")
    return _current


@contextlib.contextmanager
def tracing(code: types.CodeType):
    outer = _get()
    _state.builder = Builder(code)
    try:
        yield _state.builder
    finally:
        _state.builder = outer


def error(message: str) -> DslError:
    """A DslError located at the kernel line being traced (if any)."""
    b = _get()
    return DslError(message, b.loc() if b else None)
