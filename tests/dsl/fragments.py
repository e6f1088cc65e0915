"""Kernels made from a line of DSL text, for tests of what the DSL refuses at a spec line: the
text is compiled as the file ``fragment.py``, its statement at line 3."""

from __future__ import annotations

from duotile import dsl


def store_kernel(params: str, expr: str) -> dsl.KernelDef:
    """``def k(<params>)`` whose one grid point stores ``expr`` at ``out[0, 0]`` (line 3)."""
    src = f"def k({params}):\n    for _ in dsl.grid(1):\n        dsl.store(out[0, 0], {expr})\n"
    scope = {"dsl": dsl}
    exec(compile(src, "fragment.py", "exec"), scope)  # noqa: S102
    return dsl.kernel(scope["k"])
