"""Element types of the tile language, with their PyTorch and TileLang names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_TORCH: dict[str, torch.dtype] = {n: getattr(torch, n) for n in dir(torch)
                                  if isinstance(getattr(torch, n), torch.dtype)}


@dataclass(frozen=True)
class DType:
    """One element type. ``name`` is the short name used in the Tile IR text."""

    name: str
    bits: int
    torch_name: str
    tilelang_name: str
    is_float: bool

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self.torch_name]

    @property
    def nbytes(self) -> float:
        return self.bits / 8

    def __or__(self, other: DType | DTypeSet) -> DTypeSet:
        return DTypeSet((self,)) | other

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class DTypeSet:
    """The dtypes a tensor parameter accepts (``dsl.bf16 | dsl.f8e4m3``); bound at a call."""

    options: tuple[DType, ...]

    def __or__(self, other: DType | DTypeSet) -> DTypeSet:
        extra = other.options if isinstance(other, DTypeSet) else (other,)
        return DTypeSet(self.options + tuple(d for d in extra if d not in self.options))

    def __repr__(self) -> str:
        return "|".join(d.name for d in self.options)


bool_ = DType("i1", 8, "bool", "bool", False)
u8 = DType("u8", 8, "uint8", "uint8", False)
i32 = DType("i32", 32, "int32", "int32", False)
i64 = DType("i64", 64, "int64", "int64", False)
f8e4m3 = DType("f8e4m3", 8, "float8_e4m3fn", "float8_e4m3", True)
f16 = DType("f16", 16, "float16", "float16", True)
bf16 = DType("bf16", 16, "bfloat16", "bfloat16", True)
f32 = DType("f32", 32, "float32", "float32", True)

ALL = (bool_, u8, i32, i64, f8e4m3, f16, bf16, f32)
BY_NAME = {d.name: d for d in ALL}
_BY_TORCH = {d.torch: d for d in ALL}


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no duotile equivalent") from None


def promote(a: DType, b: DType) -> DType:
    """Result type of a binary op: the wider float wins; ints give way to floats."""
    if a == b:
        return a
    if a.is_float != b.is_float:
        return a if a.is_float else b
    if a.is_float:
        order = (f8e4m3, f16, bf16, f32)
        return max(a, b, key=order.index)
    return a if a.bits >= b.bits else b
