"""The config space of one kernel on one target: the kernel's tunables plus the target's knobs.

    space = ConfigSpace.from_kernel(gemm, "sm90").pin(STAGES=3)
    space.default()            # {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3, ...knobs}
    space.sample(rng)          # one random config
    space.neighbours(config)   # configs one step away in one parameter
    space.encode(config)       # [0..1] per parameter, for models and plots
    space.size, list(space.enumerate())

Every parameter is a typed ``dsl.tunables.Space``, so nothing here switches on a parameter's
name or on a target: strategies see only this interface.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...dsl.errors import DslError
from ...dsl.kernel import KernelDef
from ...dsl.tunables import Boolean, ConfigValueError, Space

Config = dict[str, Any]


def config_key(config: Config) -> tuple:
    """A hashable, order-independent identity of a config."""
    return tuple(sorted((k, repr(v)) for k, v in config.items()))


def parse_value(space: Space, text: str, name: str = "") -> Any:
    """The value of ``space`` whose text is ``text`` (what ``--pin NAME=VALUE`` gives)."""
    if isinstance(space, Boolean):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
    for v in space.values():
        if str(v) == text.strip():
            return v
    literal = _literal(text.strip())
    if literal is not None and space.accepts(literal):  # beyond the searched values (a block count)
        return literal
    raise ConfigValueError(f"{name or space.name or 'parameter'}={text!r} is not allowed: it takes "
                           f"{space.allowed()}")


def _literal(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower())


@dataclass
class ConfigSpace:
    params: dict[str, Space]
    owners: dict[str, str] = field(default_factory=dict)  # name -> "kernel" | "target"
    pinned: dict[str, Any] = field(default_factory=dict)
    start: dict[str, Any] = field(default_factory=dict)  # replaces defaults: where a search begins

    @classmethod
    def from_kernel(cls, kernel: KernelDef, target=None, pinned: dict[str, Any] | None = None,
                    module=None) -> ConfigSpace:
        """The kernel's tunables plus ``get_target(target).knobs`` (a name or a Target); given the
        traced ``module``, only the knobs that can change its code (``Target.knobs_for``)."""
        params: dict[str, Space] = dict(kernel.tunables)
        owners = {k: "kernel" for k in params}
        if target is not None:
            from ...codegen.target import get_target

            tgt = get_target(target) if isinstance(target, str) else target
            knobs = tgt.knobs_for(module) if module is not None else tgt.knobs
            for k, s in knobs.items():
                if k in params:
                    raise DslError(f"kernel {kernel.name!r} tunable {k!r} clashes with a knob of target "
                                   f"{tgt.name!r}; rename the tunable")
                params[k], owners[k] = s, "target"
        space = cls(params, owners)
        return space.pin(**pinned) if pinned else space

    # -- pinning ------------------------------------------------------------------------------
    def pin(self, **values) -> ConfigSpace:
        """A copy with some parameters fixed; string values are parsed (CLI ``--pin BM=64``)."""
        pinned = dict(self.pinned)
        for name, value in values.items():
            if name not in self.params:
                raise DslError(f"cannot pin {name!r}: the space has {', '.join(self.params) or 'no parameters'}")
            space = self.params[name]
            if isinstance(value, str) and not space.accepts(value):
                try:
                    value = parse_value(space, value, name)
                except ConfigValueError:
                    raise ConfigValueError(f"cannot pin {name}={value!r}: not {space.allowed()}") from None
            if not space.accepts(value):
                raise ConfigValueError(f"cannot pin {name}={value!r}: not {space.allowed()}")
            pinned[name] = value
        return ConfigSpace(dict(self.params), dict(self.owners), pinned, dict(self.start))

    def starting_at(self, config: Config) -> ConfigSpace:
        """A copy whose default is ``config`` where it names a parameter of this space (a build
        case's own config: what is built without tuning, so what tuning must beat)."""
        start = {k: v for k, v in config.items() if k in self.params and self.params[k].contains(v)}
        return ConfigSpace(dict(self.params), dict(self.owners), dict(self.pinned), start)

    @property
    def free(self) -> list[str]:
        return [k for k in self.params if k not in self.pinned]

    # -- the interface strategies use ---------------------------------------------------------
    def default(self) -> Config:
        return {k: self.pinned.get(k, self.start.get(k, s.default)) for k, s in self.params.items()}

    def sample(self, rng: random.Random) -> Config:
        return {k: self.pinned[k] if k in self.pinned else s.sample(rng) for k, s in self.params.items()}

    def neighbours(self, config: Config) -> list[Config]:
        """Configs that differ from ``config`` in one free parameter by one step of its space."""
        out = []
        for k in self.free:
            for v in self.params[k].neighbours(config[k]):
                out.append({**config, k: v})
        return out

    def encode(self, config: Config) -> list[float]:
        # a value pinned beyond the searched ones (a block count) sits at the end of its axis
        return [s.encode(config[k]) if s.contains(config[k]) else 1.0 for k, s in self.params.items()]

    def enumerate(self) -> Iterator[Config]:
        names = list(self.params)
        domains = [[self.pinned[k]] if k in self.pinned else self.params[k].values() for k in names]
        for combo in itertools.product(*domains):
            yield dict(zip(names, combo))

    @property
    def size(self) -> int:
        return math.prod(1 if k in self.pinned else len(s) for k, s in self.params.items())

    def contains(self, config: Config) -> bool:
        return (set(config) == set(self.params)
                and all(self.params[k].contains(v) for k, v in config.items())
                and all(config[k] == v for k, v in self.pinned.items()))

    def split(self, config: Config) -> tuple[Config, Config]:
        """(kernel tunables, target knobs) of a config."""
        kern = {k: v for k, v in config.items() if self.owners.get(k, "kernel") == "kernel"}
        return kern, {k: v for k, v in config.items() if self.owners.get(k) == "target"}

    def describe(self) -> str:
        rows = []
        for k, s in self.params.items():
            state = f"pinned={self.pinned[k]!r}" if k in self.pinned else f"default={s.default!r}"
            rows.append(f"{k:<14} {type(s).__name__:<9} {self.owners.get(k, 'kernel'):<7} {s.values()}  {state}")
        return "\n".join(rows)
