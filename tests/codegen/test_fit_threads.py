"""A CUDA kernel without a gemm gets a block its tiles fill when nothing chose its ``threads``
(``codegen/tilelang_cuda/fit_threads.py``, applied by ``choose_config.ranked_configs``): V4.1's
SwiGLU quantiser, a 16 x 32 tile a trip, runs on 64 threads with 16-byte loads instead of 256
threads holding two elements each; a config that names ``threads`` keeps it, a gemm keeps its
warp groups, and a value the target refuses falls back to the next larger one."""

from __future__ import annotations

import re

import pytest

from duotile import codegen
from duotile.codegen import choose_config
from duotile.codegen.driver import _specialize
from duotile.codegen.tilelang_cuda import fit_threads
from duotile.kernels_spec.registry import load_all

SPECS = load_all()
V41_SWIGLU = "v41/experts_i2304/prefill4096"


def _phases(name: str, shape: str, config: dict | None = None):
    spec = SPECS[name]
    phases, knobs, source, _ = _specialize(spec, spec.model_shapes[shape], "sm90", config, True)
    return phases, knobs, source


def test_a_small_tile_gets_a_small_block_and_a_full_one_keeps_256():
    phases, _, _ = _phases("swiglu_quant", V41_SWIGLU, {"ROWS": 16, "BLOCKS": 16, "threads": 256})
    assert fit_threads.largest_tile(phases) == 16 * 32
    assert fit_threads.thread_choices(phases, 256) == [64, 128]
    phases, _, _ = _phases("swiglu_quant", "v4/experts_i2048/prefill4096", {"ROWS": 16, "BLOCKS": 8, "threads": 256})
    assert fit_threads.largest_tile(phases) == 16 * 128
    assert fit_threads.thread_choices(phases, 256) == []


def test_a_fixed_launch_the_default_block_runs_in_one_wave_keeps_it():
    """V4.1's SwiGLU at 64 decode tokens (384 routed rows, a bucket of its own): 864 programs of an
    8 x 32 tile, one wave of 256-thread blocks on 132 SMs, ran slower on one warp each (measured,
    fit_threads.py); its prefill bucket and a dynamic build (kv_round) take the fitted block."""
    _, knobs, source = _phases("swiglu_quant", "v41/experts_i2304/decode64")
    assert (source, knobs["threads"]) == ("model", 256)
    phases, _, _ = _phases("swiglu_quant", "v41/experts_i2304/decode64", {"ROWS": 8, "BLOCKS": 4, "threads": 256})
    assert fit_threads.thread_choices(phases, 256) == [32, 64, 128]  # a dynamic build's answer
    assert fit_threads.thread_choices(phases, 256, programs=864, resident_threads=132 * 2048) == []
    assert fit_threads.thread_choices(phases, 256, programs=1057, resident_threads=132 * 2048) == [32, 64, 128]
    _, knobs, _ = _phases("kv_round", "v41/window_fp8_32_d512/decode1")
    assert knobs["threads"] == 32


def test_a_gemm_keeps_its_warp_groups():
    phases, _, _ = _phases("gemm", "v41/shared_w2/decode64")
    assert fit_threads.largest_tile(phases) is None
    assert fit_threads.thread_choices(phases, 256) == []


def test_the_config_a_user_gets_fits_and_a_named_threads_is_kept():
    _, knobs, source = _phases("swiglu_quant", V41_SWIGLU)
    assert (source, knobs["threads"]) == ("model", 64)
    _, knobs, _ = _phases("swiglu_quant", V41_SWIGLU, {"threads": 256})
    assert knobs["threads"] == 256
    # the generated code: one 16-byte load of BF16 a thread, where 256 threads load 4 bytes
    spec = SPECS["swiglu_quant"]
    case = spec.model_shapes[V41_SWIGLU]
    k = codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case))
    cuda = k.artifacts(**spec.meta_inputs(case))[0].stages["cuda"]
    assert "__launch_bounds__(64, 1)" in cuda
    assert re.search(r"\*\(uint4\*\)\(h \+", cuda)


def test_a_refused_value_falls_back_to_the_next(monkeypatch):
    """hc_pre's 4 x 24 mix over 64 threads is refused by the target (a 96-element tile does not
    split over two warps); the rule then takes 128."""
    spec = SPECS["hc_pre"]
    shape = next(s for s in spec.model_shapes if s.endswith("decode64"))
    monkeypatch.setattr(fit_threads, "thread_choices", lambda *args: [64, 128])
    choose_config._CHOICES.clear()
    try:
        _, knobs, source = _phases("hc_pre", shape)
    finally:
        choose_config._CHOICES.clear()
    assert (source, knobs["threads"]) == ("model", 128)


@pytest.mark.parametrize("most, expected", [(512, [64, 128]), (2048, []), (8, [32, 64, 128]), (1024, [128])])
def test_the_rule_on_tile_sizes(monkeypatch, most, expected):
    monkeypatch.setattr(fit_threads, "largest_tile", lambda phases: most)
    assert fit_threads.thread_choices([], 256) == expected


class _Target:
    def fitted_knobs(self, phases, programs):
        assert programs is None  # the calls below serve a dynamic batch
        return [{"threads": 64}, {"threads": 128}]


class _Calls:
    """A call's checks: every config accepted but those with a refused ``threads``."""

    def __init__(self, refused=()):
        from types import SimpleNamespace

        self.refused = refused
        self.sig = SimpleNamespace(dynamic=("T",), bucketed=())

    def check(self, config, full=True):
        from types import SimpleNamespace

        return SimpleNamespace(ok=config["threads"] not in self.refused, phases=[])


def test_fitting_keeps_a_choice_already_fitted_and_skips_refused_values():
    best = {"ROWS": 4, "threads": 256}
    assert choose_config._fitted(_Target(), [_Calls()], best) == [{"ROWS": 4, "threads": 64}]
    assert choose_config._fitted(_Target(), [_Calls(), _Calls(refused=(64,))], best) == [{"ROWS": 4, "threads": 128}]
    assert choose_config._fitted(_Target(), [_Calls(refused=(64, 128))], best) == []
    # a search that moves knobs (a modelled target) chose the fitted block already: kept, not moved on
    assert choose_config._fitted(_Target(), [_Calls()], {"ROWS": 4, "threads": 64}) == []
