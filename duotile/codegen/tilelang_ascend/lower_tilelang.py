"""Running TileLang's Ascend lowering on a generated source file (no bisheng: C++ source only)."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path

from ...dsl.errors import CapacityError

LINE_DIRECTIVE = re.compile(r"^\s*#line .*\n", re.MULTILINE)
CAPACITY = re.compile(r'scope "(?P<scope>[\w.]+)" capacity (?P<cap>\d+) is insufficient for minimum buffer usage '
                      r"(?P<need>\d+)")


def tilelang_version() -> str:
    try:
        from importlib.metadata import version

        return version("tilelang")
    except Exception:  # noqa: BLE001 - not installed: the target still generates source
        return "missing"


def lower_file(path: Path) -> tuple[str, float]:
    """Import ``path`` (TileLang parses kernels with inspect, so it must be a real file), lower
    its ``ENTRY`` prim_func for target "ascend" and return (C++ source, seconds)."""
    import tilelang
    from tvm.target import Target

    name = f"duotile_ascend_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        t0 = time.perf_counter()
        target = Target("ascend")
        with tilelang.transform.PassContext(opt_level=3), target:
            try:
                src = tilelang.lower(mod.ENTRY, target=target, enable_device_compile=False).kernel_source
            except Exception as err:  # noqa: BLE001 - TileLang's own capacity check, second line of defence
                m = CAPACITY.search(str(err))
                if m is None:
                    raise
                raise CapacityError("ascend950", f"{m['scope']} (TileLang's buffer plan)", int(m["need"]),
                                    int(m["cap"]), "TileLang reuses less than duotile's liveness model") from None
    finally:
        sys.modules.pop(name, None)
    return LINE_DIRECTIVE.sub("", src), time.perf_counter() - t0
