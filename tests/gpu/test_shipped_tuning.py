"""On the GPU the shipped tuning table was measured on, builds pick its configs up."""

from __future__ import annotations

import pytest
import torch

from duotile.codegen.driver import build_case
from duotile.codegen.target import get_target
from duotile.kernels_spec import load_all
from duotile.passes.autotune.cache import SHIPPED, TuningCache

pytestmark = pytest.mark.gpu


def test_shipped_table_configs_are_used_where_they_were_measured():
    entries = TuningCache(SHIPPED, read_only=True).entries.values()
    here = {"device": torch.cuda.get_device_name(), "toolchain": get_target("sm90").toolchain()}
    mine = [e for e in entries if e["key"]["device"] == here["device"] and e["key"]["toolchain"] == here["toolchain"]]
    if not mine:
        pytest.skip(f"the shipped table holds no entry for {here}")
    spec = load_all()["gemm"]
    r = build_case(spec, "bf16_8192", spec.build_cases["bf16_8192"], "sm90")
    assert r.ok, r.error
    assert r.artifact.meta["config_source"] == "tuned"
