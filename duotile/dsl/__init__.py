"""The duotile tile language.

    from duotile import dsl

    @dsl.kernel
    def scale(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32], *,
              BN: dsl.Tunable = dsl.choice(16, 32)):
        for i in dsl.grid(dsl.cdiv(x.N, BN)):
            t = dsl.load(x[i * BN, 0], (BN, x.D))
            dsl.store(y[i * BN, 0], t * 2.0)
"""

from .dtypes import DType, bf16, bool_, f8e4m3, f16, f32, i32, i64, u8
from .errors import CallError, CapacityError, DslError, SourceLoc, UnsupportedError
from .ir import Module, Role
from .kernel import Const, KernelDef, OptionalTensor, Tensor, Tunable, kernel
from .ops import (
    arange,
    bitcast,
    cdiv,
    cumsum,
    empty,
    exp,
    exp2,
    full,
    gemm,
    grid,
    load,
    log,
    log2,
    maximum,
    minimum,
    mxfp4_values,
    mxfp8_values,
    next_pow2,
    nvfp4_values,
    pipelined,
    range,
    require,
    rsqrt,
    scalar,
    sigmoid,
    sqrt,
    store,
    where,
    workspace,
    zeros,
)
from .tunables import SMALLER_POW2, boolean, choice, enum, int_range, is_power_of_two, pow2

__all__ = [
    "DType", "bf16", "bool_", "f8e4m3", "f16", "f32", "i32", "i64", "u8",
    "CallError", "CapacityError", "DslError", "SourceLoc", "UnsupportedError",
    "Module", "Role", "Const", "KernelDef", "OptionalTensor", "Tensor", "Tunable", "kernel",
    "arange", "bitcast", "cdiv", "cumsum", "empty", "exp", "exp2", "full", "gemm", "grid", "load", "log", "log2",
    "maximum", "minimum", "mxfp4_values", "mxfp8_values", "next_pow2", "nvfp4_values", "pipelined", "range",
    "require", "rsqrt", "scalar", "sigmoid", "sqrt",
    "store", "where", "workspace", "zeros",
    "SMALLER_POW2", "boolean", "choice", "enum", "int_range", "is_power_of_two", "pow2",
]
