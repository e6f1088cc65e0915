"""The sparse attention kernels' FP8 output (``decode_fp8_out``): wo_a's input, the kernel's own output
quantised as ``quantize`` quantises it, written group-major as ``gemm_blockscaled`` reads its A."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.kernels_spec import get
from duotile.kernels_spec.compare import mismatch
from duotile.kernels_spec.decode_fp8_out import group_major

CPU = torch.device("cpu")
CASES = [("sparse_mqa_decode", "fp8_out_split3"), ("sparse_mqa_decode", "fp8_out_rope_straddle"),
         ("sparse_mqa_decode", "fp8_out_one_phase_rope"), ("sparse_mqa_decode_fp8", "fp8_out_rope"),
         ("sparse_mqa_decode_fp8", "fp8_out_one_phase"), ("sparse_mqa_decode_fp8_nope", "fp8_out_rope"),
         ("sparse_mqa_decode_fp8_nope", "fp8_out_one_phase"), ("sparse_mqa_prefill", "fp8_out_rope"),
         ("sparse_mqa_prefill", "fp8_out_rope_straddle")]


def _run(spec, case, seed=3, **changed):
    inputs = {**spec.make_inputs(case, CPU, seed), **changed}
    codegen.compile(spec.kernel, "interpret", config=spec.config_of(case), constants=spec.constants_of(case))(**inputs)
    return inputs


@pytest.mark.parametrize("name, case_name", CASES)
def test_the_fp8_rows_are_the_quantize_kernel_on_the_kernels_own_output(name, case_name):
    """The bits of the ``quantize`` kernel (not only its reference) run on ``o`` laid out group-major."""
    spec = get(name)
    case = spec.cases[case_name]
    out = _run(spec, case)
    assert mismatch(spec, case, out, spec.run_reference(out, case)) is None
    rows = group_major(out["o"], case["GROUPS"]).contiguous()
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows.shape[0], rows.shape[1] // case["QBLOCK"], dtype=torch.uint8)
    codegen.compile(get("quantize").kernel, "interpret", constants={"BLOCK": case["QBLOCK"]})(x=rows, q=q, scale=scale)
    assert torch.equal(out["o_q"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out["o_qs"], scale)


def test_group_major_rows_are_heads_of_a_group_then_queries():
    """Row (g B + b) HG + i is head g HG + i of query b: [G, B, HG D] as a GEMM's group-major A."""
    o = torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 8, 2)  # B 3, H 8, D 2
    rows = group_major(o, 4)  # 4 groups of 2 heads
    b, g, i = 2, 3, 1
    assert torch.equal(rows[(g * 3 + b) * 2 + i], o[b, g * 2 + i])
    assert torch.equal(rows.view(4, 3, 4)[g, b], o[b, g * 2:(g + 1) * 2].flatten())


def test_a_wrong_fp8_byte_or_code_is_caught():
    """The check of a derived output can fail: one byte of the rows, or one code, changed."""
    spec = get("sparse_mqa_decode")
    case = spec.cases["fp8_out_split3"]
    out = _run(spec, case)
    ref = spec.run_reference(out, case)
    for name in ("o_q", "o_qs"):
        bad = dict(out)
        bad[name] = out[name].clone()
        bad[name].view(torch.uint8)[5, 3] ^= 1
        assert f"sparse_mqa_decode/{name} differs in 1/" in mismatch(spec, case, bad, ref)


def test_misshapen_fp8_outputs_are_refused():
    spec = get("sparse_mqa_decode")
    case = spec.cases["fp8_out_split3"]
    inputs = spec.make_inputs(case, CPU, 3)
    with pytest.raises(dsl.DslError, match="give o_q and o_qs together"):
        _run(spec, case, o_qs=None)
    with pytest.raises(dsl.DslError, match="o_q must have a row per query and head"):
        _run(spec, case, o_q=inputs["o_q"][:-64].contiguous(), o_qs=inputs["o_qs"][:-64].contiguous())
    with pytest.raises(dsl.DslError, match="H must be a multiple of GROUPS"):
        kernel = codegen.compile(spec.kernel, "interpret", config=spec.config_of(case),
                                 constants={**spec.constants_of(case), "GROUPS": 5})
        kernel(**inputs)
