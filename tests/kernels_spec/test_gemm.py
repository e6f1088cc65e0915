"""gemm's fp32 result: the accumulator as it is, not rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import get

SPEC = get("gemm")


@pytest.mark.parametrize("case_name", ["bf16_f32out", "bf16_f32out_split4"])
def test_an_fp32_result_is_the_fp32_sum_not_a_bf16_rounding(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    kernel = codegen.compile(SPEC.kernel, "interpret", config=case.get("config"))
    kernel(**inputs)
    c, a, b = inputs["c"], inputs["a"].double(), inputs["b"].double()
    exact = a @ b.T
    bound = case["K"] * 2.0 ** -24 * (a.abs() @ b.abs().T)  # fp32 sums of exact products, any order
    assert c.dtype == torch.float32 and bool(((c.double() - exact).abs() <= bound).all())
    rounded = exact.to(torch.bfloat16).double()
    assert bool(((rounded - exact).abs() > bound).any())  # a bf16 result would not pass


def test_the_shipped_bf16_and_fp8_entries_still_key_this_kernel():
    """The result's dtype is the output's: a bf16-result call traces the IR it did before fp32
    results existed, so the shipped tuning (keyed by that IR's hash) still applies."""
    import json
    from pathlib import Path

    import duotile
    from duotile import dsl
    from duotile.passes.autotune.cache import kernel_hash

    table = json.loads((Path(duotile.__file__).parent / "tuned" / "tuning.json").read_text())
    keys = [e["key"] for e in table["entries"].values() if e["key"]["kernel"] == "gemm"]
    assert keys
    for key in keys:
        dtypes = {n: getattr(dsl, v) for n, v in key["dtypes"].items()}
        hashes = {kernel_hash(SPEC.kernel, dtypes, present, key["constants"])
                  for present in (None, dict.fromkeys(dtypes, True))}
        assert key["kernel_hash"] in hashes, key["dtypes"]
