"""Every kernel spec on the interpreter at seeded random shapes from its declared sweep (small,
ragged and prime sizes; random tunables where the sweep names them) against its reference.

A case is drawn from ``random.Random(seed)`` with seed ``BASE * 1000 + i``; BASE is 0 unless
``DUOTILE_SWEEP_SEED`` sets it, so a failure replays with the seed its message names."""

from __future__ import annotations

import os
import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs

BASE = int(os.environ.get("DUOTILE_SWEEP_SEED", "0"))
PER_SPEC = 12
SPECS = load_all()
DRAWS = [(name, BASE * 1000 + i) for name in sorted(SPECS) for i in range(PER_SPEC)]


def drawn(name: str, seed: int) -> dict:
    return SPECS[name].random_case(random.Random(seed))


def check_case(spec, case, seed, target="interpret", config=None):
    """Run ``spec`` at ``case`` and compare with the reference; a failure names the spec, the case,
    the config and the seed."""
    cfg = spec.config_of(case, target) if config is None else config
    where = f"{spec.name} at {case} (config {cfg or 'default'}, seed {seed})"
    inputs = spec.make_inputs(case, torch.device("cpu"), seed)
    try:
        kernel = codegen.compile(spec.kernel, target, config=cfg, constants=spec.constants_of(case))
        kernel(**inputs)
        check_outputs(spec, case, inputs, spec.run_reference(inputs, case))
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None
    except Exception as err:
        raise AssertionError(f"{where}: {type(err).__name__}: {err}") from err


def test_sweep_seed_is_printed(capsys):
    print(f"random shape sweep: DUOTILE_SWEEP_SEED={BASE}, seeds {BASE * 1000}..{BASE * 1000 + PER_SPEC - 1}")
    assert str(BASE) in capsys.readouterr().out


@pytest.mark.parametrize("name,seed", DRAWS, ids=[f"{n}-seed{s}" for n, s in DRAWS])
def test_random_shape_matches_reference(name, seed):
    check_case(SPECS[name], drawn(name, seed), seed)


def test_each_spec_draws_distinct_cases():
    for name in SPECS:
        cases = {repr(sorted(drawn(name, s).items())) for n, s in DRAWS if n == name}
        assert len(cases) >= PER_SPEC // 2, f"{name}: the sweep draws few distinct cases: {cases}"


def test_a_wrong_result_fails_naming_spec_case_config_and_seed(monkeypatch):
    spec = SPECS["rmsnorm"]
    case = {"T": 3, "D": 37}
    broken = lambda x, weight, EPS=1e-6: {"y": (x.float() * 1.5).to(x.dtype)}
    monkeypatch.setattr(spec, "reference", broken)
    with pytest.raises(AssertionError, match=r"rmsnorm at \{'T': 3, 'D': 37\} \(config default, seed 5\): "
                                             r"rmsnorm/y: \d+/111 elements off"):
        check_case(spec, case, 5)
