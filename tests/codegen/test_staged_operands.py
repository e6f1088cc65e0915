"""A register tile that several gemms in a row read from shared memory is copied there once
(``codegen/tilelang_cuda/emit.py``, ``Emitter.staged``).

Regression: sparse decode's P (two BF16 parts) meets V's column groups in consecutive gemms (V4's
stored rows: the 448 nope channels, then the 64 rope channels), and each gemm copied P to shared
memory again: one more 64 x 64 write and the barriers around it, twice a block of rows."""

from __future__ import annotations

import re

import pytest

from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.kernels_spec.registry import load_all

CONFIG = {"BN": 64, "STAGES": 2, "SPLIT": 8, "BD": 128}


def _split_source(config: dict) -> str:
    t = get_target("sm90")
    spec = load_all()["sparse_mqa_decode_fp8_nope"]
    case = spec.model_shapes["v4/csa_r4_topk640/decode1"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    phases, knobs = specialize_phases(spec.kernel, sig, t, config, spec.constants_of(case))
    return t.generate(t.lower(phases[0], knobs), knobs).stages["tilelang"]


def _staged(source: str) -> tuple[list[str], int]:
    copies = re.findall(r"T\.copy\((\w+_frag), \1_smem\)", source)
    reads = len(re.findall(r"T\.gemm\(\w+_frag_smem,", source))
    return copies, reads


def test_each_p_part_is_copied_once_for_the_gemms_that_read_it():
    copies, reads = _staged(_split_source(CONFIG))
    # two loops (the window's slots, the compressed rows) x two parts, each read by two gemms
    assert reads == 8
    assert len(copies) == 4 and len(set(copies)) == 4, copies


@pytest.mark.parametrize("knob", ["gather_pipeline"])
def test_a_schedule_that_may_reorder_the_loop_keeps_a_copy_for_each_gemm(knob):
    copies, reads = _staged(_split_source({**CONFIG, knob: True}))
    assert len(copies) == reads == 8
