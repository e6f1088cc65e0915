"""Shapes of the seeded GPU sweep where the config a user gets (no config given) once had no
build on sm90. Each is generated here at that config, so the refusal cannot come back unseen:

* causal attention over 90 and 122 rows: the shipped table's config for longer rows hand-splits
  the warps of a pipelined loop that, at one key block, runs at most once, and that split refused
  it. Such a loop now keeps the default schedule (``phase_knobs``);
* top-k with K = 33: its K-wide lists were register tiles of 16 x 33 over 256 threads; they are
  padded to a power of two now."""

from __future__ import annotations

import pytest
import torch

from duotile.codegen.driver import generate_case
from duotile.kernels_spec import load_all

pytest.importorskip("tilelang")
SPECS = load_all()


@pytest.mark.parametrize("name,case", [
    ("flash_attention", {"B": 1, "H": 3, "S": 90, "D": 128, "causal": True}),
    ("flash_attention", {"B": 2, "H": 1, "S": 122, "D": 128, "causal": True}),
    ("topk", {"B": 2, "L": 1, "K": 33, "values": "dup_max", "visible": 5}),
    ("topk", {"B": 39, "L": 235166, "K": 33, "values": "extreme", "visible": "mixed"}),
])
def test_the_users_config_generates_sm90_source(name, case):
    arts = generate_case(SPECS[name], case, "sm90")
    assert arts and all("T.Kernel(" in a.stages["tilelang"] or "T.ClusterKernel(" in a.stages["tilelang"]
                        for a in arts)


def test_a_loop_that_runs_once_keeps_the_default_schedule_and_a_longer_one_the_chosen():
    spec, case = SPECS["flash_attention"], {"B": 1, "H": 3, "S": 90, "D": 128, "causal": True}

    def source(config, **over):
        return generate_case(spec, {**case, **over}, "sm90", config=config)[0].stages["tilelang"]

    manual = {"warp_specialize": "manual"}
    assert source(manual) == source({"warp_specialize": "auto"})  # one key block: nothing to pipeline
    assert "producer warp group" in source(manual, S=1024)  # eight: the hand split


def test_topk_at_an_odd_k_matches_on_the_interpreter():
    from duotile import codegen
    from duotile.kernels_spec.compare import check_outputs

    spec = SPECS["topk"]
    case = spec.cases["odd_k33"]
    inputs = spec.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(spec.kernel, "interpret", constants=spec.constants_of(case))(**inputs)
    check_outputs(spec, case, inputs, spec.run_reference(inputs, case))
