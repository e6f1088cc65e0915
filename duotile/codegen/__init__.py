"""Code generators, one package per target, and the shared build / cache layer.

    from duotile import codegen
    k = codegen.compile(kernels_spec.get("gemm").kernel, target="interpret")
    k(a=a, b=b, c=c)
"""

from .compile import CompiledKernel, compile, specialize
from .target import Artifact, Target, get_target, target_names

__all__ = ["Artifact", "CompiledKernel", "Target", "compile", "get_target", "specialize", "target_names"]
