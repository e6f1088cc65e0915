"""Index expressions with powers. sympy rewrites some modular expressions into powers of an
integer symbol (``Mod(64*x, 128)`` becomes ``64*Mod(x**2, 2)``, x^2 and x having one parity), so
a block-scaled GEMM whose BN is not a multiple of its scale block, on a linear grid, once failed
to lower with "index expression (Mod(gn, 15))**2 has no TileLang form"."""

from __future__ import annotations

import pytest
import sympy

from duotile.codegen.tilelang_ascend.emit_expr import index as ascend_index
from duotile.codegen.tilelang_cuda.exprs import index as cuda_index

GN = sympy.Symbol("gn", integer=True, nonnegative=True)
EXPRS = [sympy.Mod(sympy.Mod(GN, 15) * bn, 128) for bn in (64, 96, 192)] + [GN**3 + 2 * GN**2]


@pytest.mark.parametrize("e", EXPRS, ids=str)
@pytest.mark.parametrize("printer", ["cuda", "ascend"])
def test_a_power_prints_as_a_product_with_the_same_value(e, printer):
    assert any(p.is_Pow for p in sympy.preorder_traversal(e))  # the case the printers must meet
    text = cuda_index(e) if printer == "cuda" else ascend_index(e, {"gn": "gn"})
    assert "**" not in text
    for gn in range(0, 200, 7):
        assert eval(text, {"gn": gn}) == int(e.subs(GN, gn)), (text, gn)


def test_the_block_scaled_gemm_case_generates_sm90_source():
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import generate_case
    from duotile.kernels_spec import load_all

    spec = load_all()["gemm_blockscaled"]
    case = {"G": 2, "M": 1855, "N": 2736, "K": 5200, "BLOCK": 128, "scales": "spread", "zero_rows": True}
    arts = generate_case(spec, case, "sm90")  # the config a user gets
    assert arts and all("**" not in a.stages["tilelang"] for a in arts)
