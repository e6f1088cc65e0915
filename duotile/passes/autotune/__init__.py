"""Autotuning passes: typed config spaces, sympy constraints, generic search, verified
candidates, a cost model for targets without hardware, and a persistent tuning cache."""

from .cache import TuningCache, best_config
from .constraints import Constraints
from .space import ConfigSpace
from .strategies import BUDGETS, search
from .usage import estimate_usage

__all__ = ["BUDGETS", "ConfigSpace", "Constraints", "TuningCache", "best_config", "estimate_usage", "search"]
