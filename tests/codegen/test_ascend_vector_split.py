"""ascend950 ``vector_split``: the two AIVs of a cube core each take half the rows of the vector
tiles (split_vector_rows.py). Checked by TileLang's Ascend lowering and our capacity model; no
NPU exists here, so nothing is run."""

from __future__ import annotations

import re

import pytest

from duotile.codegen.target import get_target
from duotile.dsl.errors import CapacityError, UnsupportedError
from duotile.passes.autotune.cost_model import Machine, estimate

from .test_ascend import build, specialise

pytest.importorskip("tilelang")
SPLIT = {"vector_split": True}


def _ub_shapes(text: str) -> dict[str, tuple]:
    return {m.group(1): tuple(int(x) for x in m.group(2).split(",") if x.strip())
            for m in re.finditer(r"(\w+) = T\.alloc_shared\(\(([\d, ]+)\)", text)}


def test_attention_splits_the_cube_results_rows_between_the_aivs():
    art = build("flash_attention", "d128", knobs=SPLIT)  # BM = BN = 64
    tl = art.stages["tilelang"]
    dual = re.findall(r"T\.dual_copy\((\w+), ([^)]*\]|\w+)\)", tl)
    assert len(dual) == 5  # scores L0C->UB, P UB->L1, P V L0C->UB, o and lse to GM
    ub = _ub_shapes(tl)
    assert all(shape[0] == 32 for name, shape in ub.items() if not name.endswith("_gm"))  # half of 64 rows
    assert ub[next(n for n in ub if n.endswith("_gm"))] == (1, 1, 32)  # lse's 1-d half, staged at GM rank
    assert "T.copy(" in tl  # loads of q, k, v stay whole: the cube reads them
    assert "__mix__(1, 2)" in art.stages["ascend"]


def test_the_split_lets_128x128_attention_fit_ub():
    # without the split, 128x128 needs 257 KiB of UB (216 available); each AIV's half fits
    with pytest.raises(CapacityError, match="UB"):
        specialise("flash_attention", "d128", {"BM": 128, "BN": 128})
    art = build("flash_attention", "d128", {"BM": 128, "BN": 128}, knobs=SPLIT)
    assert "T.dual_copy(" in art.stages["tilelang"] and "__mix__(1, 2)" in art.stages["ascend"]


def test_gemm_epilogue_splits_row_scales_not_column_scales():
    _, (module, _) = specialise("gemm", "fp8_8192", knobs=SPLIT)
    loads = {op.attrs["tensor"]: op for op in module.walk()
             if op.name == "load" and op.attrs["tensor"].endswith("scale")}
    bm, bn = int(loads["a_scale"].attrs["shape"][0]), int(loads["b_scale"].attrs["shape"][0])
    assert int(loads["a_scale"].result.type.shape[0]) == bm // 2 and loads["a_scale"].attrs.get("dual")
    assert int(loads["b_scale"].result.type.shape[0]) == bn and not loads["b_scale"].attrs.get("dual")
    build("gemm", "fp8_8192", knobs=SPLIT)  # and TileLang lowers it


def test_refusals_name_the_reason_and_line():
    # causal attention reads the row index as a value: an AIV does not know which half it holds
    with pytest.raises(UnsupportedError, match=r"flash_attention\.py:\d+.*row index used as a value"):
        specialise("flash_attention", "d128_causal", knobs=SPLIT)
    # no cube work: dual_copy has nothing to split, and the knob is not in rmsnorm's tuning space
    with pytest.raises(UnsupportedError, match="needs a kernel with cube work"):
        specialise("rmsnorm", "hidden", knobs=SPLIT)
    spec, (module, _) = specialise("rmsnorm", "hidden")
    assert "vector_split" not in get_target("ascend950").knobs_for(module)


def test_cost_model_charges_each_aiv_its_copy_of_the_vector_work():
    _, (whole, kn) = specialise("flash_attention", "d128")
    _, (half, kn2) = specialise("flash_attention", "d128", knobs=SPLIT)
    m = get_target("ascend950").machine
    vector_bound = Machine(**{**m.__dict__, "vector_flops": m.vector_flops / 1000})
    t_whole, t_half = estimate(whole, vector_bound, kn).time_ms, estimate(half, vector_bound, kn2).time_ms
    assert m.vector_copies == 2 and t_half < 0.6 * t_whole  # half the rows per AIV: about half the time
