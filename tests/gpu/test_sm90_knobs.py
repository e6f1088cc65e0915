"""sm90 target knobs that change the generated schedule still give the reference's results."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs

pytestmark = pytest.mark.gpu

KNOBS = [
    ("gemm", "bf16_ragged", {"warp_specialize": "off"}),  # every warp loads (cp.async), no producer group
    ("gemm", "bf16_ragged", {"warp_specialize": False}),  # the same, as older tuning tables spell it
    # duotile's producer / consumer roles: TMA ring with mbarriers, wgmma kept in flight
    ("gemm", "bf16_ragged", {"warp_specialize": "manual"}),
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "threads": 512}),  # 4 consumer groups, 112 registers
    ("gemm", "fp8_scaled", {"warp_specialize": "manual", "fp8_promote_k": 128, "BK": 128, "BN": 128}),
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True}),  # rotation + ping-pong
    ("flash_attention", "d128_ragged", {"warp_specialize": "manual", "overlap": True}),
    ("flash_attention", "d128_causal", {"warp_specialize": "manual", "overlap": False}),
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "BM": 64, "threads": 128}),
    ("gemm", "fp8_scaled", {"fp8_promote_k": 256, "BK": 128, "BN": 128}),  # promotion every other step
    ("gemm", "fp8_scaled", {"fp8_promote_k": 0}),  # never promoted: still within the accumulation bound
    # 128x192 tiles (the fp8 build default): N 256 leaves a 64-column last tile
    ("gemm", "fp8_scaled", {"fp8_promote_k": 256, "BK": 128, "BN": 192}),
    ("gemm", "fp8_scaled", {"fp8_promote_k": 0, "BK": 128, "BN": 192, "warp_specialize": "manual",
                            "persistent": 1}),
    ("flash_attention", "d128_ragged", {"overlap": True}),  # FA3 schedule with a masked tail block
    ("flash_attention", "d128_causal", {"overlap": True, "STAGES": 1}),
    # persistent grids: a few blocks walk every tile, so ring phases run on across tiles
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "persistent": 1}),
    ("flash_attention", "d128_causal", {"warp_specialize": "manual", "overlap": True, "persistent": 1}),
    ("flash_attention", "d128_ragged", {"warp_specialize": "manual", "overlap": True, "persistent": 3}),
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "BM": 64, "threads": 128,
                                 "persistent": 3}),
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "persistent": 1, "raster": 8}),
    ("gemm", "fp8_scaled", {"warp_specialize": "manual", "persistent": 1, "fp8_promote_k": 128, "BK": 128,
                            "BN": 128}),
    ("gemm", "bf16_scaled", {"warp_specialize": "manual", "persistent": True, "BM": 64, "BN": 64}),
    # a ragged tail: the steady loop runs unmasked, the last key block masked
    ("flash_attention", "d128_tail", {"warp_specialize": "manual", "overlap": True, "BN": 64, "persistent": 1}),
    # S 256 in 176- and 192-key blocks: the last block's gemms cover its 80 / 64 keys (narrow_tail.py)
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "BN": 176}),
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "BN": 192, "persistent": 1}),
    # clusters of two persistent blocks sharing the B tile by TMA multicast (persistent.py): one
    # cluster walking every pair of tiles (ring phases and the pair's barriers across tiles), a
    # ragged last row block, panels; and one cluster per pair
    ("gemm", "fp8_scaled", {"warp_specialize": "manual", "persistent": 2, "cluster": 2, "fp8_promote_k": 0,
                            "BK": 128, "BN": 128}),
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "persistent": 2, "cluster": 2, "BM": 64, "BN": 64,
                             "raster": 8}),
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "persistent": True, "cluster": 2, "BM": 64, "BN": 64}),
    ("gemm", "bf16_128", {"warp_specialize": "manual", "persistent": 2, "cluster": 2, "BN": 64}),  # pairs share A
    # attention: pairs of query blocks share K and V (rotation + ping-pong; a narrowed ragged last block)
    ("flash_attention", "d128", {"warp_specialize": "manual", "overlap": True, "persistent": 2, "cluster": 2}),
    ("flash_attention", "d128_tail", {"warp_specialize": "manual", "overlap": True, "BN": 64, "persistent": True,
                                      "cluster": 2}),
    # the output through shared memory and TMA stores (tma_store.py): ragged edge tiles (the TMA
    # engine clips them), several tiles a block, with clusters
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "persistent": 2, "BM": 64, "BN": 64, "tma_store": True}),
    ("gemm", "bf16_ragged", {"warp_specialize": "manual", "tma_store": True}),
    ("gemm", "fp8_scaled", {"warp_specialize": "manual", "persistent": 2, "cluster": 2, "fp8_promote_k": 0,
                            "BK": 128, "BN": 128, "tma_store": True}),
    # 64-row tiles over two warp groups: split by columns, row reductions across the groups through
    # shared memory, P staged for the second gemm, stores written from the expression (plan.py);
    # head dim 512 at 256 threads, where 128 threads spill
    ("mqa_decode", "split4", {"threads": 256}),
    ("mqa_decode", "empty_ranges", {"threads": 256}),
    ("mqa_decode", "one_phase", {"threads": 256}),
    ("flash_attention", "d512", {"threads": 256}),
    ("flash_attention", "d512_causal", {"threads": 256}),  # a ragged last row block: guarded stores
    ("flash_attention", "d128", {"BM": 64, "threads": 256}),
    # split-K in two launches: a K range per block (its loop starts past 0), then the combine phase,
    # which keeps TileLang's default schedule (phase_knobs)
    ("gemm_splitk", "ragged", {"warp_specialize": "manual"}),
    ("gemm_splitk", "split4", {"warp_specialize": "manual", "persistent": 1}),
]


def _id(entry) -> str:
    name, case, knobs = entry
    return f"{name}-{case}-" + ",".join(f"{k}={v}" for k, v in knobs.items())


@pytest.mark.parametrize("name,case_name,knobs", KNOBS, ids=[_id(k) for k in KNOBS])
def test_sm90_knob_matches_reference(name, case_name, knobs):
    spec = load_all()[name]
    case = spec.cases[case_name]
    inputs = spec.make_inputs(case, torch.device("cuda"), seed=5)
    config = {**spec.config_of(case), **knobs}
    kernel = codegen.compile(spec.kernel, "sm90", config=config, constants=spec.constants_of(case))
    kernel(**inputs)
    torch.cuda.synchronize()
    check_outputs(spec, case, inputs, spec.run_reference(inputs, case))
