"""Level 2 of the ladder: every kernel spec on the interpreter matches its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs

CASES = [(name, case) for name, spec in sorted(load_all().items()) for case in spec.cases]


@pytest.mark.parametrize("name,case_name", CASES)
def test_interpreter_matches_reference(name, case_name):
    spec = load_all()[name]
    case = spec.cases[case_name]
    inputs = spec.make_inputs(case, torch.device("cpu"), seed=1)
    kernel = codegen.compile(spec.kernel, "interpret", config=spec.config_of(case),
                             constants=spec.constants_of(case))
    kernel(**inputs)
    check_outputs(spec, case, inputs, spec.run_reference(inputs, case))


@pytest.mark.parametrize("config", [{"BM": 64, "BN": 64, "BK": 32, "STAGES": 2}, {"BM": 256, "BN": 64, "BK": 128}])
def test_gemm_result_does_not_depend_on_tiles(config):
    """Pinned configs: the same ragged problem under different tilings gives the reference."""
    spec = load_all()["gemm"]
    case = {"M": 100, "N": 72, "K": 160}
    inputs = spec.make_inputs(case, torch.device("cpu"), seed=2)
    codegen.compile(spec.kernel, "interpret", config=config)(**inputs)
    check_outputs(spec, case, inputs, spec.run_reference(inputs, case))


def test_gather_rows_empty_slots_are_zero_rows():
    spec = load_all()["gather_rows"]
    table = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1
    idx = torch.tensor([2, -1, 0, 4, 3], dtype=torch.int32)
    out = torch.full((5, 3), -7.0)
    codegen.compile(spec.kernel, "interpret", config={"BN": 16, "BD": 128})(table=table, idx=idx, out=out)
    expected = torch.stack([table[2], torch.zeros(3), table[0], torch.zeros(3), table[3]])
    assert torch.equal(out, expected)
