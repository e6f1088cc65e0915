"""Typed tunable spaces. Every kind knows its default, a random sample, its neighbours and a
numeric encoding, so every search strategy works on every kernel.

    BM: dsl.Tunable = dsl.choice(64, 128, 256)
    STAGES: dsl.Tunable = dsl.int_range(1, 4, default=2)

A config may set a tunable only to a value its space accepts (``Space.check``): the searched
values, matched by value and type (``True`` is not ``1``), and for a space declared with
``also=`` the values that predicate admits beyond them (a block count, an older spelling), which
are never searched. Anything else is a ``ConfigValueError`` that lists the allowed values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import DslError


class ConfigValueError(DslError, ValueError):
    """A config names a value (or a parameter) outside what a kernel and target declare."""


def same_value(a: Any, b: Any) -> bool:
    """Equal and of one kind: ``True`` is not ``1`` and ``64.0`` is not ``64`` here."""
    return a == b and type(a) is type(b)


@dataclass
class Space:
    """One tunable's domain. ``name`` is set when the kernel is declared."""

    name: str = field(default="", init=False)

    def values(self) -> list[Any]:
        raise NotImplementedError

    @property
    def default(self) -> Any:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values())

    def neighbours(self, value: Any) -> list[Any]:
        """Values one step away (adjacent in the ordered domain)."""
        vals = self.values()
        i = vals.index(value)
        return [vals[j] for j in (i - 1, i + 1) if 0 <= j < len(vals)]

    def encode(self, value: Any) -> float:
        """A number in [0, 1] for models and plots."""
        vals = self.values()
        return vals.index(value) / max(1, len(vals) - 1)

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one of the searched values."""
        return any(same_value(value, v) for v in self.values())

    # what a config may set beyond the searched values: ``(predicate, what it admits in words)``
    also: tuple[Callable[[Any], bool], str] | None = field(default=None, kw_only=True)

    def accepts(self, value: Any) -> bool:
        """Whether a config may set this value: a searched one, or one ``also`` admits."""
        if self.contains(value):
            return True
        try:
            return bool(self.also and self.also[0](value))
        except Exception:  # noqa: BLE001 - a predicate that cannot judge a value refuses it
            return False

    def allowed(self) -> str:
        """The accepted values in words, for an error message."""
        return f"one of {self.values()}" + (f", or {self.also[1]}" if self.also else "")

    def check(self, name: str, value: Any, where: str = "") -> None:
        """Refuse a value this space does not accept, naming the allowed ones."""
        if not self.accepts(value):
            raise ConfigValueError(f"{where}{name}={value!r} is not allowed: {name} takes {self.allowed()}")

    def __len__(self) -> int:
        return len(self.values())


@dataclass
class Choice(Space):
    options: tuple = ()
    default_value: Any = None

    def __post_init__(self):
        if not self.options:
            raise ValueError("choice() needs at least one option")
        if self.default_value is not None and self.default_value not in self.options:
            raise ValueError(f"default {self.default_value!r} is not among {self.options!r}")

    def values(self):
        return list(self.options)

    @property
    def default(self):
        return self.options[0] if self.default_value is None else self.default_value

    def _ordered(self) -> list:
        """Numbers in numeric order (options are often written default-first, e.g. 256, 128, 512),
        anything else as written."""
        numeric = all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in self.options)
        return sorted(self.options) if numeric else list(self.options)

    def neighbours(self, value):
        vals = self._ordered()
        i = vals.index(value)
        return [vals[j] for j in (i - 1, i + 1) if 0 <= j < len(vals)]

    def encode(self, value):
        vals = self._ordered()
        return vals.index(value) / max(1, len(vals) - 1)


@dataclass
class Pow2(Space):
    lo: int = 1
    hi: int = 1
    default_value: int | None = None

    def __post_init__(self):
        for v in (self.lo, self.hi):
            if v < 1 or v & (v - 1):
                raise ValueError(f"pow2 bounds must be powers of two, got {v}")
        if self.lo > self.hi:
            raise ValueError(f"pow2 range is empty: {self.lo} > {self.hi}")

    def values(self):
        return [1 << e for e in range(int(math.log2(self.lo)), int(math.log2(self.hi)) + 1)]

    @property
    def default(self):
        return self.default_value if self.default_value is not None else self.values()[len(self) // 2]

    def encode(self, value):
        span = math.log2(self.hi) - math.log2(self.lo)
        return (math.log2(value) - math.log2(self.lo)) / span if span else 0.0


@dataclass
class Boolean(Space):
    default_value: bool = False

    def values(self):
        return [False, True]

    @property
    def default(self):
        return self.default_value

    def neighbours(self, value):
        return [not value]


@dataclass
class Enum(Space):
    """Unordered named options (e.g. a warp-specialisation policy)."""

    options: tuple[str, ...] = ()
    default_value: str | None = None

    def values(self):
        return list(self.options)

    @property
    def default(self):
        return self.default_value or self.options[0]

    def neighbours(self, value):
        return [v for v in self.options if v != value]


@dataclass
class IntRange(Space):
    lo: int = 0
    hi: int = 0
    step: int = 1
    default_value: int | None = None

    def values(self):
        return list(range(self.lo, self.hi + 1, self.step))

    @property
    def default(self):
        return self.lo if self.default_value is None else self.default_value

    def encode(self, value):
        return (value - self.lo) / max(1, self.hi - self.lo)


def is_power_of_two(v: Any) -> bool:
    """An int of 1, 2, 4, ...: the ``also=`` predicate of tile sizes that tests may set smaller."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


SMALLER_POW2 = (is_power_of_two, "a smaller power of two (tests)")  # ``choice(..., also=SMALLER_POW2)``


def choice(*options, default=None, also: tuple[Callable[[Any], bool], str] | None = None) -> Choice:
    """``also=(predicate, words)``: values a config may set beyond ``options`` (never searched)."""
    return Choice(options=tuple(options), default_value=default, also=also)


def pow2(lo: int, hi: int, default: int | None = None) -> Pow2:
    return Pow2(lo=lo, hi=hi, default_value=default)


def boolean(default: bool = False) -> Boolean:
    return Boolean(default_value=default)


def enum(*options: str, default: str | None = None) -> Enum:
    return Enum(options=tuple(options), default_value=default)


def int_range(lo: int, hi: int, step: int = 1, default: int | None = None) -> IntRange:
    return IntRange(lo=lo, hi=hi, step=step, default_value=default)
