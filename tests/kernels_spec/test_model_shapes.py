"""The model shapes as data: the two models' dimensions, the cases each spec declares for them,
and the declarative random sweeps (``Spec.random_case``)."""

from __future__ import annotations

import random
import re

import pytest

from duotile.kernels_spec import load_all
from duotile.kernels_spec import model_shapes as ms
from duotile.kernels_spec.registry import Dim, OneOf

SPECS = load_all()
NAME = re.compile(r"^(v4|v41)/[a-z0-9_]+/[a-z0-9_]+$")


def test_model_dimensions_are_the_released_configs():
    v4, v41 = ms.V4_FLASH, ms.V41_FLASH
    assert (v4.hidden, v4.q_lora_rank, v4.experts, v4.moe_intermediate, v4.index_heads) == (4096, 1024, 256, 2048, 64)
    assert (v41.hidden, v41.q_lora_rank, v41.experts, v41.moe_intermediate, v41.index_heads) == (5120, 1280, 384,
                                                                                                 2304, 32)
    for m in (v4, v41):
        assert (m.heads, m.head_dim, m.rope_dim, m.window, m.o_groups, m.o_lora_rank) == (64, 512, 64, 128, 8, 1024)
        assert (m.index_head_dim, m.index_topk, m.vocab, m.hc_mult) == (128, 512, 129280, 4)
    assert v4.compress_ratios == (4, 128) and v41.compress_ratios == (2, 1)
    assert (v4.mhc_width, v41.mhc_width, v4.query_width) == (16384, 20480, 32768)
    assert v4.attention_rows == {"window": 128, "topk": 640, "hca1m": 8320}
    assert v41.attention_rows == {"window": 128, "topk": 640}  # no ratio-128 layers
    with pytest.raises(AttributeError):
        v4.hidden = 1  # frozen
    assert ms.model_named("v41") is v41 and ms.model_named("v4-flash") is v4
    with pytest.raises(KeyError, match="v4-flash"):
        ms.model_named("v5")


def test_dense_projections_have_the_model_md_shapes():
    g4, g41 = ms.dense_gemms(ms.V4_FLASH), ms.dense_gemms(ms.V41_FLASH)
    assert g4["wq_a"] == (1024, 4096, "f8e4m3") and g4["wq_b"] == (32768, 1024, "f8e4m3")
    assert g4["wkv"] == (512, 4096, "f8e4m3") and g4["wo_a"] == (1024, 4096, "f8e4m3")
    assert g4["wo_b"] == (4096, 8192, "f8e4m3") and g4["index_wq_b"] == (8192, 1024, "f8e4m3")
    assert g4["shared_w13"] == (4096, 4096, "f8e4m3") and g4["shared_w2"] == (4096, 2048, "f8e4m3")
    assert g4["compressor_csa"] == (2048, 4096, "bf16") and g4["router"] == (256, 4096, "bf16")
    assert g41["wq_a"] == (1280, 5120, "f8e4m3") and g41["wq_b"] == (32768, 1280, "f8e4m3")
    assert g41["wo_b"] == (5120, 8192, "f8e4m3") and g41["index_wq_b"] == (4096, 1280, "f8e4m3")
    assert g41["shared_w13"] == (4608, 5120, "f8e4m3") and g41["engram_proj"] == (25600, 6144, "f8e4m3")


# ops V4 does not have serve V4.1-Flash alone: Engram and the candidate pool (model.md 2.13), and
# attention over V4.1's FP8 window rows (model.md 3.4; V4's rows keep BF16 rope channels), and the
# Reindex layers' scoring of that pool alone
V41_ONLY = {"engram_hash", "engram_gate", "candidate_pool", "sparse_mqa_decode_fp8", "indexer_logits_pool"}
V4_ONLY = {"sparse_mqa_decode_fp8_nope"}  # V4's row format


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_spec_serves_both_models_with_named_tagged_cases(name):
    spec = SPECS[name]
    assert spec.model_shapes, f"{name} declares no model shapes"
    v4, v41 = spec.model_cases("v4"), spec.model_cases("v41-flash")
    assert (not v4 if name in V41_ONLY else v4) and (not v41 if name in V4_ONLY else v41)
    assert len(v4) + len(v41) == len(spec.model_shapes) == len(spec.model_cases())
    for key, case in spec.model_shapes.items():
        assert NAME.match(key), key
        assert case["model"] == {"v4": "v4-flash", "v41": "v41-flash"}[key.split("/")[0]], key
    for key, case in v4.items():
        assert key.startswith("v4/") and case["model"] == "v4-flash"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_model_shapes_bind_to_the_kernel(name):
    """Each case makes inputs the kernel's signature accepts, with the case's sizes."""
    spec = SPECS[name]
    for key, case in spec.model_shapes.items():
        sig = spec.kernel.bind(spec.meta_inputs(case))
        sizes = {k: v for k, v in case.items()  # a case's integers are sizes, but for the kernel's constants
                 if isinstance(v, int) and not isinstance(v, bool) and k not in spec.kernel.constants}
        assert {k: sig.shapes[k] for k in sizes} == sizes, key


def test_the_shapes_each_spec_serves():
    gemm, splitk, norm = SPECS["gemm"], SPECS["gemm_splitk"], SPECS["rmsnorm"]
    assert gemm.model_shapes["v41/wq_a/decode64"] == {"M": 64, "N": 1280, "K": 5120, "dtype": "f8e4m3",
                                                      "model": "v41-flash"}
    assert gemm.model_shapes["v4/wo_b/prefill4096"]["M"] == 4096
    assert gemm.model_shapes["v4/router/decode16"].get("dtype", "bf16") == "bf16"
    assert {c["M"] for c in gemm.model_shapes.values()} == {1, 16, 64, 4096}
    assert not any(k.startswith("v4/lm_head/prefill") for k in gemm.model_shapes)  # last token only
    assert {c["M"] for c in splitk.model_shapes.values()} == {1, 16}
    assert all("dtype" not in c for c in splitk.model_shapes.values())
    widths = {m: {c["D"] for c in norm.model_cases(m).values()} for m in ("v4", "v41")}
    assert widths == {"v4": {4096, 1024, 512, 128, 16384}, "v41": {5120, 1280, 512, 128, 20480}}
    assert {c["T"] for c in norm.model_shapes.values()} == {1, 16, 64, 4096}
    mqa = SPECS["mqa_decode"].model_shapes
    assert {(c["H"], c["D"]) for c in mqa.values()} == {(64, 512)}
    assert {c["R"] for c in mqa.values()} == {128, 640, 8320}
    assert {c["B"] for c in mqa.values()} == set(ms.DECODE_BATCHES)
    attn = SPECS["flash_attention"].model_shapes
    assert {c["S"] for c in attn.values() if c["D"] == 128} == set(ms.ATTENTION_LENGTHS)
    assert {bool(c.get("causal")) for c in attn.values() if c["D"] == 128} == {False, True}
    gather = SPECS["gather_rows"].model_shapes
    assert gather["v4/topk_rows_r4/decode64"] == {"R": 262144, "N": 64 * 512, "D": 512, "model": "v4-flash"}
    assert gather["v41/moe_permute/prefill4096"]["N"] == 6 * 4096


def test_build_cases_and_test_cases_are_unchanged_in_kind():
    for spec in SPECS.values():
        assert spec.cases and spec.build_cases
        assert not any("model" in c for c in (*spec.cases.values(), *spec.build_cases.values()))


def test_specs_name_no_target():
    """No spec case carries a per-target config, and no spec file names a target or a target knob."""
    import inspect
    import re

    from duotile.codegen.target import KNOB_NAMES

    for spec in SPECS.values():
        for case in (*spec.cases.values(), *spec.build_cases.values(), *spec.model_shapes.values()):
            assert "config_for" not in case and not set(case.get("config", {})) & KNOB_NAMES, (spec.name, case)
        text = inspect.getsource(inspect.getmodule(spec.kernel.fn))
        assert not re.search(r"\b(sm90|sm100|ascend950)\b", text), spec.name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_random_cases_are_seeded_and_within_the_sweep(name):
    spec = SPECS[name]
    a = [spec.random_case(random.Random(7)) for _ in range(3)]
    b = [spec.random_case(random.Random(7)) for _ in range(3)]
    assert a == b
    rng = random.Random(11)
    for large in (False, True):
        for _ in range(50):
            case = spec.random_case(rng, large)
            for key, entry in spec.sweep.items():
                if isinstance(entry, Dim):
                    hi = entry.large if large and entry.large else entry.hi
                    assert entry.lo <= case[key] <= hi and case[key] % entry.multiple == 0, (key, case)
                elif isinstance(entry, OneOf):
                    assert case[key] in entry.values
                elif key != "config":
                    assert case[key] == entry
            spec.kernel.bind(spec.meta_inputs(case))  # a valid call


def test_dim_draws_edges_powers_of_two_and_primes():
    rng = random.Random(0)
    d = Dim(1, 300)
    seen = [d.sample(rng) for _ in range(400)]
    assert {1, 300} <= set(seen) and {64, 128, 256} & set(seen)
    assert any(n > 100 and all(n % p for p in range(2, n)) for n in seen)  # a larger prime
    m8 = Dim(8, 96, multiple=8, large=1024)
    assert all(v % 8 == 0 and 8 <= v <= 96 for v in (m8.sample(rng) for _ in range(200)))
    assert max(m8.sample(rng, large=True) for _ in range(200)) > 96
    with pytest.raises(ValueError):
        Dim(3, 10, multiple=2)


def test_a_spec_without_a_sweep_says_so():
    import dataclasses

    bare = dataclasses.replace(SPECS["rmsnorm"], sweep={})
    with pytest.raises(ValueError, match="rmsnorm.*no sweep"):
        bare.random_case(random.Random(0))
