"""gemm_f32: an FP32 GEMM on BF16 tensor cores from a hi / lo split of each FP32 operand. Within the
bound derived in the spec, and far below what a BF16 GEMM of the same operands leaves."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import get
from duotile.kernels_spec.gemm_f32 import PARTS, error_bound, split_error

SPEC = get("gemm_f32")


def _run(case, seed=1):
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case))(**inputs)
    return inputs


def _bf16_gemm(a, b, case):
    """The plain BF16 GEMM (``gemm``, FP32 result) of the operands rounded to BF16."""
    c = torch.empty(a.shape[0], b.shape[0])
    codegen.compile(get("gemm").kernel, "interpret", config=case.get("config"))(
        a=a.to(torch.bfloat16), b=b.to(torch.bfloat16), c=c)
    return c


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_within_the_derived_bound_and_far_below_a_bf16_gemm(case_name):
    case = SPEC.cases[case_name]
    inputs = _run(case)
    a, b, c = inputs["a"], inputs["b"], inputs["c"]
    want = SPEC.run_reference(inputs, case)["c"]
    allowed = SPEC.allowed_error(case, "c", want, inputs)
    assert c.dtype == torch.float32 and bool(((c - want).abs() <= allowed).all())
    exact = a.double() @ b.double().T
    err = (c.double() - exact).abs().max()
    plain = _bf16_gemm(a, b, case)
    plain_err = (plain.double() - exact).abs().max()
    assert err * 100 < plain_err, (float(err), float(plain_err))  # measured: 400 to 700 times smaller
    assert bool(((plain - want).abs() > allowed).any())  # a BF16 GEMM's result would not pass


def test_each_split_operand_adds_its_lo_terms():
    """Left unsplit, an FP32 operand is its BF16 rounding: the result is then the BF16 GEMM's, not
    within the bound. Split, each operand's lo terms bring the error down (FP32 x FP32 is checked
    above); a BF16 operand's own values are exact, so against an FP32 one the result is within the
    bound of one split operand."""
    case = {"M": 40, "N": 48, "K": 192}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), 4)
    a, b = inputs["a"], inputs["b"]
    exact = a.double() @ b.double().T
    kernel = codegen.compile(SPEC.kernel, "interpret")
    errors = {}
    for a_in, b_in, name in ((a.to(torch.bfloat16), b, "a_rounded"), (a, b.to(torch.bfloat16), "b_rounded")):
        c = torch.empty(40, 48)
        kernel(a=a_in, b=b_in, c=c)
        errors[name] = (c.double() - exact).abs()
        # exact for its own operands: within the one-split bound of (a_in, b_in)
        own = a_in.double() @ b_in.double().T
        assert bool(((c.double() - own).abs() <= error_bound(a_in, b_in, a_in.dtype == torch.float32,
                                                           b_in.dtype == torch.float32)).all())
    c = torch.empty(40, 48)
    kernel(a=a, b=b, c=c)
    both = float((c.double() - exact).abs().max())
    worst = {name: float(e.max()) for name, e in errors.items()}
    assert all(both * 30 < e for e in worst.values()), (both, worst)


def test_the_split_error_bound_is_met_and_not_far_above_what_the_split_leaves():
    """The dropped terms (the part products with i + j > 2, and the remainders), measured per product
    over random FP32 pairs (exact in float64): within ``split_error`` and, with both split, no more
    than 8 times below it."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(1 << 16, generator=g) for _ in range(2))

    def parts(v):
        out, rest = [], v.double()
        for _ in range(PARTS):
            out.append(rest.float().to(torch.bfloat16).double())
            rest = rest - out[-1]
        return out

    xp, yp = parts(x), parts(y)
    exact = x.double() * y.double()
    kept = sum(xp[i] * yp[j] for i in range(PARTS) for j in range(PARTS) if i + j < PARTS)
    share = ((exact - kept).abs() / exact.abs()).max()
    assert split_error(True, True) / 8 < share <= split_error(True, True)
    # x kept whole (BF16): three parts of 8 bits hold y's 24, so nothing is left (the bound, u^3, allows one
    # part's rounding more than happens)
    one = ((exact - sum(x.double() * p for p in yp)).abs() / exact.abs()).max()
    assert one <= split_error(False, True) and split_error(False, False) == 0
    assert split_error(True, True) < 5 * 2.0 ** -24  # what FP32 itself leaves, near enough


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("case_name,gemms,phases", [("f32_4096", 6, 1), ("bf16_a_decode", 3, 2)])
def test_generates_for_cuda_with_a_gemm_per_split_term(target, case_name, gemms, phases):
    """Both CUDA targets lower the split with their ordinary BF16 MMA: six gemms a K step for two
    FP32 operands, three where the activation is BF16 (the runtime's form; at one row K is split in
    ranges, a second phase adding them)."""
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import generate_case

    arts = generate_case(SPEC, SPEC.build_cases[case_name], target)
    assert len(arts) == phases
    src = arts[0].stages["tilelang"]
    assert src.count("T.gemm(") == gemms and "T.Pipelined(" in src
    split = 2 if case_name == "f32_4096" else 1
    assert src.count('"bfloat16")  # gemm_f32.py') == PARTS * split  # each FP32 operand's parts
