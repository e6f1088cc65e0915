"""The ``interpret`` target: executes Tile IR with PyTorch, the semantic reference of every kernel."""

from .machine import Interpreter, run_module

__all__ = ["Interpreter", "run_module"]
