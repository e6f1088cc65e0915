"""duotile: one tile DSL, lowered to NVIDIA SM90 / SM100 and Huawei Ascend 950."""

__version__ = "0.1.0"
