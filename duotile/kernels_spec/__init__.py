"""The V4.1-Flash kernels, written once in the DSL, each beside its PyTorch reference."""

from .registry import REGISTRY, Spec, get, load_all

__all__ = ["REGISTRY", "Spec", "get", "load_all"]
