"""A table of per-op handlers: how each target registers what it does for each Tile IR op."""

from __future__ import annotations

from collections.abc import Callable


class OpHandlers(dict):
    """``HANDLERS = OpHandlers()``; ``@HANDLERS.on("load") def _load(state, op): ...``."""

    def on(self, name: str) -> Callable:
        def deco(fn):
            if name in self:
                raise ValueError(f"two handlers for op {name!r}")
            self[name] = fn
            return fn

        return deco
