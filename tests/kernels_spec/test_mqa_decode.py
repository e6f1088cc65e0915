"""Split-KV decode attention: ranges combined by their log-sum-exp in a fixed order, empty
ranges weighing nothing, rows independent of the batch; Ascend loads the shared K = V tile a
second time, transposed, for the P K gemm, and fits head dim 512 only with vector_split."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.codegen.compile import build_phases, specialize_phases
from duotile.codegen.driver import build_case
from duotile.codegen.target import get_target
from duotile.kernels_spec import get

SPEC = get("mqa_decode")
CASE = {"B": 4, "H": 64, "R": 100, "D": 64}
SMALL = {"BN": 32, "STAGES": 1}


def _call(x: dict, config: dict) -> torch.Tensor:
    o = torch.zeros_like(x["o"])
    codegen.compile(SPEC.kernel, "interpret", config=config)(q=x["q"], kv=x["kv"], o=o)
    return o


def test_every_split_count_matches_the_reference():
    x = SPEC.make_inputs(CASE, torch.device("cpu"), 2)
    ref = SPEC.run_reference(x, CASE)["o"].float()
    bound = SPEC.allowed_error(CASE, "o", ref, x)
    for split in (1, 2, 4, 8, 16, 32):  # 4 row blocks: 8 and more ranges leave some empty
        o = _call(x, {**SMALL, "SPLIT": split})
        assert bool(((o.float() - ref).abs() <= bound).all()), split


def test_a_sequence_gets_the_same_bits_whatever_the_batch():
    x = SPEC.make_inputs(CASE, torch.device("cpu"), 3)
    cfg = {**SMALL, "SPLIT": 4}
    full = _call(x, cfg)
    for b in (1, 3):
        sub = {"q": x["q"][:b].contiguous(), "kv": x["kv"][:b].contiguous(), "o": x["o"][:b]}
        assert torch.equal(_call(sub, cfg), full[:b]), b


def test_ascend_loads_the_shared_rows_twice_once_transposed():
    """Regression for nt_operands: a tile that one gemm reads as-is and another transposed was
    refused; it now gets a second, transposed load for the gemm that needs it."""
    pytest.importorskip("tilelang")
    case = {"B": 2, "H": 64, "R": 256, "D": 128}
    sig = SPEC.kernel.bind(SPEC.meta_inputs(case))
    phases, knobs = specialize_phases(SPEC.kernel, sig, "ascend950", {"BN": 64, "SPLIT": 4, "STAGES": 1})
    p0, p1 = build_phases(SPEC.kernel, phases, get_target("ascend950"), knobs)
    loads = [line.strip() for line in p0.stages["tilelang"].splitlines() if "T.copy(kv[" in line]
    assert len(loads) == 2 and "transpose=True" in loads[1] and "transpose" not in loads[0]
    assert "ascend_gemm_l1" in p0.stages["ascend"] and "ascend_gemm_l1" not in p1.stages["ascend"]


def test_head_dim_512_on_ascend_fits_only_halved_between_the_vector_cores():
    pytest.importorskip("tilelang")
    case = SPEC.build_cases["hca_1m"]
    r = build_case(SPEC, "hca_1m", case, "ascend950")  # the starting table's: unsplit, vector_split
    assert r.ok, r.error
    assert r.artifact.meta["config_source"] == "starting" and r.module.config["SPLIT"] == 1
    cfg = {"SPLIT": 1, "STAGES": 2, "vector_split": False}
    whole = build_case(SPEC, "hca_1m", case, "ascend950", config=cfg)
    assert not whole.ok and whole.rejected and "UB (unified buffer) overflow" in whole.error
