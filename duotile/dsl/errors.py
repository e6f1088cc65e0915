"""Errors of the tile language. A DslError names the kernel's source line when it has one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLoc:
    """Where in a kernel spec an op was written."""

    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        short = self.file.rsplit("/", 2)
        where = "/".join(short[-2:]) if len(short) > 1 else self.file
        return f"{where}:{self.line}" + (f"  `{self.text.strip()}`" if self.text else "")


class DslError(Exception):
    """A kernel is wrong: bad op arguments, bad shapes, unsupported op for a target."""

    def __init__(self, message: str, loc: SourceLoc | None = None):
        self.loc = loc
        super().__init__(f"{loc}: {message}" if loc else message)


class CallError(DslError):
    """A compiled kernel was called with tensors that do not match its signature."""


class CapacityError(DslError):
    """A config needs more of some target memory than the target has."""

    def __init__(self, target: str, memory: str, needed: int, capacity: int, detail: str = "",
                 loc: SourceLoc | None = None):
        self.target, self.memory, self.needed, self.capacity = target, memory, needed, capacity
        msg = (f"{target}: {memory} overflow: needs {needed} bytes ({needed / 1024:.1f} KiB), "
               f"capacity {capacity} bytes ({capacity / 1024:.1f} KiB)")
        super().__init__(msg + (f"; {detail}" if detail else ""), loc)


class UnsupportedError(DslError):
    """An op or a config is not supported by a target."""


class LoweringError(DslError):
    """A target's toolchain failed on code duotile generated: a generator or toolchain limit, not a
    fault of the kernel. The message names the kernel, its config and how to print the source."""

    def __init__(self, target: str, toolchain: str, kernel: str, config: dict, cause: Exception,
                 loc: SourceLoc | None = None, buffer: str = ""):
        first = (str(cause).strip().splitlines() or [""])[0][:400]
        where = f" at buffer `{buffer}`, generated for this spec line" if buffer else ""
        super().__init__(f"{target}: {toolchain} could not lower the generated {kernel}{where} (config {config}); "
                         f"print the source with `duotile show {kernel} --target {target} --stage tilelang` and "
                         f"the same --config: {type(cause).__name__}: {first}", loc)


class UnguardedAccessError(DslError):
    """The code a target's toolchain lowered from a generated kernel may read or write a tensor
    past its end: an access neither guarded nor proven inside (``lowered_bounds.py``). A generator
    fault, refused rather than run."""

    def __init__(self, target: str, kernel: str, config: dict, accesses: list, loc: SourceLoc | None = None):
        self.target, self.kernel, self.accesses = target, kernel, list(accesses)
        more = f" (and {len(accesses) - 1} more)" if len(accesses) > 1 else ""
        super().__init__(f"{target}: the generated {kernel} (config {config}) may run past a tensor: "
                         f"{accesses[0]}{more}, neither guarded nor proven inside as lowered; print the "
                         f"source with `duotile show {kernel} --target {target} --stage tilelang` and the same "
                         f"--config", loc)
