"""Level 4: every kernel's sm90 build runs on the H200 and matches its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs

from .fences import Fenced

pytestmark = pytest.mark.gpu
CASES = [(n, c) for n, s in sorted(load_all().items()) for c in s.cases]


@pytest.mark.parametrize("name,case_name", CASES)
def test_sm90_matches_reference(name, case_name):
    spec = load_all()[name]
    case = spec.cases[case_name]
    fenced = Fenced(spec.make_inputs(case, torch.device("cuda"), seed=3))  # a stray read meets NaN
    inputs = fenced.inputs
    kernel = codegen.compile(spec.kernel, "sm90", config=spec.config_of(case), constants=spec.constants_of(case))
    kernel(**inputs)
    torch.cuda.synchronize()
    assert fenced.breaches() == []
    check_outputs(spec, case, inputs, spec.run_reference(inputs, case))


@pytest.mark.parametrize("name", ["rmsnorm", "gather_rows", "gemm_splitk", "mqa_decode"])
def test_sm90_batch_invariance_bitwise(name):
    """Decode-path kernels: a row's result is bitwise the same whatever the batch around it."""
    spec = load_all()[name]
    case = dict(spec.cases[next(iter(spec.cases))])
    batch_dim = spec.kernel.batch_dim
    big = {**case, batch_dim: 97}
    inputs = spec.make_inputs(big, torch.device("cuda"), seed=4)
    kernel = codegen.compile(spec.kernel, "sm90", config=spec.config_of(case, "sm90") or None)  # split: 4 ranges
    kernel(**inputs)
    full = {o: inputs[o].clone() for o in spec.outputs}
    for rows in (1, 2, 5, 16):
        sub = {k: (v[:rows] if _batched(spec, k, batch_dim) else v) for k, v in inputs.items()}
        sub = {k: (torch.empty_like(v) if k in spec.outputs else v) for k, v in sub.items()}
        kernel(**sub)
        for o in spec.outputs:
            assert torch.equal(sub[o], full[o][:rows]), (name, rows, o)


def _batched(spec, tensor, batch_dim):
    dims = spec.kernel.tensors[tensor].dims
    return len(dims) > 0 and dims[0] == batch_dim
