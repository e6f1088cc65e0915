"""The measured batch-invariance check (``kernels_spec/invariance.py``) on the interpreter: every
row-wise spec passes it at its smallest test case, and it catches a call that writes nothing and
one whose rows depend on the batch. The GPU test's cases cover every such spec's decode shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.invariance import NOT_ROW_WISE, batch_axes, check_rows
from tests.gpu.test_decode_batch_invariance import CASES

SPECS = load_all()
ROW_WISE = sorted(n for n, s in SPECS.items() if s.kernel.batch_dim is not None and n not in NOT_ROW_WISE)
CPU = torch.device("cpu")


def _smallest(spec) -> dict:
    case = min(spec.cases.values(), key=lambda c: sum(v for v in c.values() if isinstance(v, int)))
    return dict(case)


@pytest.mark.parametrize("name", ROW_WISE)
def test_every_row_wise_spec_is_batch_invariant_on_the_interpreter(name):
    spec = SPECS[name]
    case = _smallest(spec)
    kernel = codegen.compile(spec.kernel, "interpret", config=spec.config_of(case) or None,
                             constants=spec.constants_of(case))
    case.pop("config", None)
    lines = check_rows(spec, case, kernel, CPU, seed=5, batches=(2, 5))
    assert len(lines) == 2 and all("alone == in batches of 2, 5" in line for line in lines)


def test_a_call_that_writes_nothing_fails_the_reference_check():
    spec = SPECS["rmsnorm"]
    with pytest.raises(AssertionError, match="alone is not its reference"):
        check_rows(spec, {"T": 7, "D": 96}, lambda **inputs: None, CPU, seed=3, batches=(2, 5))


def test_a_row_that_depends_on_the_batch_is_named():
    spec = SPECS["rmsnorm"]
    kernel = codegen.compile(spec.kernel, "interpret")

    def skewed(**inputs):  # right alone, off by a hundredth in any larger batch
        kernel(**inputs)
        inputs["y"] += 1e-2 * (inputs["x"].shape[0] > 1)

    with pytest.raises(AssertionError, match=r"row 0 of seed 3 alone differs from it at place \d+ of a batch of 2"):
        check_rows(spec, {"T": 7, "D": 96}, skewed, CPU, seed=3, batches=(2, 5))


def test_the_axes_are_the_kernels_batch_dimension():
    assert batch_axes(SPECS["gemm_blockscaled"]) == {"a": 1, "a_scale": 1, "c": 1}  # column-major activations
    assert set(batch_axes(SPECS["moe_combine"])) == {"where", "shared_out", "weights", "out"}  # not the row pool
    with pytest.raises(ValueError, match="declares no batch_dim"):
        batch_axes(SPECS["flash_attention"])
    with pytest.raises(ValueError, match="not row-wise"):
        check_rows(SPECS["moe_gemm_mxfp4"], {}, None, CPU, seed=0)


def test_a_key_stack_a_query_goes_with_its_query():
    """Regression: ``indexer_logits_pool`` reads key stack b for query b, but its stacks' axis is
    named KS (one stack may serve every query: SHARED), so the check left them in place and a query
    moved to place 1 of a batch scored stack 1: a mismatch at every model shape on the GPU (first at
    a 64K context: one column of 16,384), which the kernel did not cause. The spec now says the
    stacks go with the batch (``Spec.batched_with``), unless one stack serves all."""
    spec = SPECS["indexer_logits_pool"]
    assert batch_axes(spec, {"SHARED": False})["k"] == 0 and "k" not in batch_axes(spec, {"SHARED": True})
    case = {**spec.model_shapes["v41/r1_ctx64k/decode1"], "L": 4096, "KB": 128}
    kernel = codegen.compile(spec.kernel, "interpret", constants=spec.constants_of(case))
    assert check_rows(spec, case, kernel, CPU, seed=11, batches=(2,))[0] == "row 0: alone == in batches of 2"
    moved = replace(spec, batched_with=None)  # the stacks left in place: the check fails, and says where
    with pytest.raises(AssertionError, match=r"row 0 of seed 11 alone differs from it at place 1 of a batch of 2"):
        check_rows(moved, case, kernel, CPU, seed=11, batches=(2,))


def test_the_gpu_test_covers_every_row_wise_spec_at_each_decode_family():
    covered = {(n, f) for n, f, _ in CASES}
    for name in ROW_WISE:
        labels = [lbl.rsplit("/", 1) for lbl in SPECS[name].model_shapes]
        families = {family for family, last in labels if last.startswith("decode")}
        assert families == {f for n, f in covered if n == name}, name
    assert all("config" not in case and "config_for" not in case for _, _, case in CASES)
