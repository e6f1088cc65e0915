"""The config a call gets with none given: user cache, nearest shipped bucket, target's choice."""

from __future__ import annotations

import json
import math

from duotile.codegen import choose_config as cc
from duotile.kernels_spec.registry import get
from duotile.passes.autotune import cache as tcache


def test_bucket_distance_counts_octaves():
    assert cc.bucket_distance({"M": 4096, "N": 1024}, {"M": 4096, "N": 1024}) == 0
    assert cc.bucket_distance({"M": 4096, "N": 1024}, {"M": 1024, "N": 2048}) == 3
    assert cc.bucket_distance({"M": 4096}, {"N": 4096}) == math.inf


def _table(tmp_path, entries):
    data = {"schema": tcache.SCHEMA, "checksum": tcache._checksum(entries), "entries": entries}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(data))
    return path


def _entry(spec, case, config, target="sm100"):
    sig = spec.kernel.bind(spec.meta_inputs(case))
    key = tcache.make_key(spec.kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present,
                          constants=spec.constants_of(case))
    return tcache.key_hash(key), {"key": key, "config": config}


def test_nearest_bucket_within_reach_answers_and_far_ones_do_not(tmp_path):
    spec = get("rmsnorm")
    near_hash, near = _entry(spec, {"T": 64, "D": 4096}, {"ROWS": 2})
    far_hash, far = _entry(spec, {"T": 64, "D": 512}, {"ROWS": 4})
    path = _table(tmp_path, {near_hash: near, far_hash: far})
    for width, want in ((5120, {"ROWS": 2}), (2048, {"ROWS": 2}), (256, {"ROWS": 4})):
        sig = spec.kernel.bind(spec.meta_inputs({"T": 8, "D": width}))
        assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=path) == want, width
    sig = spec.kernel.bind(spec.meta_inputs({"T": 8, "D": 1 << 20}))  # 8 octaves from the nearest
    assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=path) is None


def test_an_entry_todays_code_refuses_is_skipped_for_the_next(tmp_path):
    spec = get("rmsnorm")
    bad_hash, bad = _entry(spec, {"T": 64, "D": 4096}, {"ROWS": 3})  # not in ROWS's space
    ok_hash, ok = _entry(spec, {"T": 64, "D": 8192}, {"ROWS": 2})
    path = _table(tmp_path, {bad_hash: bad, ok_hash: ok})
    sig = spec.kernel.bind(spec.meta_inputs({"T": 8, "D": 4096}))
    skipped = []
    assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=path, skipped=skipped) == {"ROWS": 2}
    assert len(skipped) == 1 and "ROWS" in skipped[0]


def test_a_gpu_takes_its_own_entries_first_and_another_gpus_of_the_target_where_it_has_none(tmp_path, monkeypatch):
    """The shipped table was measured on an H200: an H100 (same sm90 code) gets those entries, not
    the cost model's choice, unless the table holds its own within reach, which win even farther."""
    spec = get("rmsnorm")
    monkeypatch.setattr(tcache, "device_name", lambda target: "NVIDIA H200")
    h200_hash, h200 = _entry(spec, {"T": 64, "D": 4096}, {"ROWS": 2})
    monkeypatch.setattr(tcache, "device_name", lambda target: "NVIDIA H100 80GB HBM3")
    h100_hash, h100 = _entry(spec, {"T": 64, "D": 1024}, {"ROWS": 4})
    sig = spec.kernel.bind(spec.meta_inputs({"T": 8, "D": 4096}))
    only_h200 = _table(tmp_path, {h200_hash: h200})
    assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=only_h200) == {"ROWS": 2}
    both = _table(tmp_path, {h200_hash: h200, h100_hash: h100})
    assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=both) == {"ROWS": 4}  # its own, 2 octaves away
    monkeypatch.setattr(tcache, "device_name", lambda target: "NVIDIA H200")
    assert cc.nearest_shipped(spec.kernel, "sm100", sig, path=both) == {"ROWS": 2}


def test_sm90_model_choice_moves_tile_sizes_only():
    spec = get("gemm")
    sig = spec.kernel.bind(spec.meta_inputs({"M": 64, "N": 4096, "K": 4096}))
    config, source, _ = cc.explain_choice(spec.kernel, "sm90", sig)
    assert source in ("model", "default", "table")
    if source == "model":
        from duotile.codegen.target import get_target

        knobs = get_target("sm90").default_knobs()
        assert all(config[k] == v for k, v in knobs.items() if k in config)


def test_interpreter_takes_the_defaults():
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.meta_inputs({"T": 8, "D": 512}))
    assert cc.explain_choice(spec.kernel, "interpret", sig)[:2] == (None, "default")


def test_starting_table_matches_sizes_dtypes_and_constants(tmp_path):
    path = tmp_path / "starting.json"
    path.write_text(json.dumps({"entries": [
        {"kernel": "flash_attention", "target": "ascend950", "when": {"D": 128, "CAUSAL": True},
         "config": {"BM": 64, "BN": 64}, "why": "test"},
        {"kernel": "gemm", "target": "sm100", "when": {"dtypes": {"a": "f8e4m3"}}, "config": {"BK": 128},
         "why": "test"}]}))
    attn, gemm = get("flash_attention"), get("gemm")
    causal = attn.kernel.bind(attn.meta_inputs({"B": 1, "H": 2, "S": 256, "D": 128}))
    assert cc.starting_config(attn.kernel, "ascend950", causal, {"CAUSAL": True}, path=path) == {"BM": 64, "BN": 64}
    assert cc.starting_config(attn.kernel, "ascend950", causal, {"CAUSAL": False}, path=path) is None
    fp8 = gemm.kernel.bind(gemm.meta_inputs({"M": 64, "N": 64, "K": 128, "dtype": "f8e4m3"}))
    bf16 = gemm.kernel.bind(gemm.meta_inputs({"M": 64, "N": 64, "K": 128}))
    assert cc.starting_config(gemm.kernel, "sm100", fp8, path=path) == {"BK": 128}
    assert cc.starting_config(gemm.kernel, "sm100", bf16, path=path) is None


def test_shipped_starting_table_is_valid_today():
    """Every shipped starting entry names a kernel, a target and a config today's code accepts."""
    from duotile.codegen.target import target_names
    from duotile.kernels_spec.registry import load_all

    specs = load_all()
    for entry in cc.load_starting():
        assert entry["kernel"] in specs and entry["target"] in target_names() and entry["why"], entry
        spec = specs[entry["kernel"]]
        assert set(entry["config"]) - set(spec.kernel.tunables) <= set(
            __import__("duotile.codegen.target", fromlist=["KNOB_NAMES"]).KNOB_NAMES), entry


def test_block_scaled_projections_get_their_measured_hand_schedule_at_every_row_count():
    """V4.1's wq_b (32-wide blocks) gets the shipped starting config, the same at one decode row and
    at a prefill chunk (one build serves every M); V4's wq_b, where the cost model's choice measured
    fastest, keeps it."""
    spec = get("gemm_blockscaled")
    cases = spec.model_cases()
    for shape in ("v41/wq_b/decode1", "v41/wq_b/prefill4096"):
        sig = spec.kernel.bind(spec.meta_inputs(cases[shape]))
        config, source, _ = cc.explain_choice(spec.kernel, "sm90", sig, spec.constants_of(cases[shape]))
        assert source == "starting" and config["warp_specialize"] == "manual" and config["SPLIT"] == 1, shape
        assert (config["BM"], config["BN"], config["threads"]) == (64, 128, 128)
    v4 = cases["v4/wq_b/decode1"]
    assert cc.explain_choice(spec.kernel, "sm90", spec.kernel.bind(spec.meta_inputs(v4)),
                             spec.constants_of(v4))[1] == "model"


def _sm90_choice(spec, case):
    sig = spec.kernel.bind(spec.meta_inputs(case))
    return cc.target_choice(spec.kernel, "sm90", sig, spec.constants_of(case))


def test_decode_gemm_is_split_over_k_and_a_prefill_gemm_is_not():
    """One row of a 5120 -> 1280 projection makes 5 output tiles at the defaults (76 us
    modelled, 67 us measured on an H200): the search must cross several slower splits to reach
    one that fills the SMs; a 4,096-row chunk already fills them and stays one phase."""
    spec = get("gemm")
    decode = _sm90_choice(spec, {"M": 1, "N": 1280, "K": 5120, "dtype": "f8e4m3"})
    assert decode["BM"] == 64 and decode["SPLIT"] >= 4, decode
    prefill = _sm90_choice(spec, {"M": 4096, "N": 1280, "K": 5120, "dtype": "f8e4m3"})
    assert prefill["SPLIT"] == 1, prefill


def test_search_leaves_defaults_that_overflow_two_sizes_at_once():
    """At 1 x 32 outputs the default tile (128 x 256) wastes both M and N; moving one tunable
    at a time from it finds nothing, so the search also starts from the smallest tiles."""
    spec = get("gemm")
    choice = _sm90_choice(spec, {"M": 1, "N": 32, "K": 5120})
    assert choice is not None and choice["BM"] == 64 and choice["BN"] <= 64, choice


def test_one_row_tile_is_not_waste():
    """The smallest tensor-core tile (64 rows) over one row is what a decode GEMM must take."""
    from duotile.passes.autotune.constraints import Constraints

    spec = get("gemm")
    sig = spec.kernel.bind(spec.meta_inputs({"M": 1, "N": 256, "K": 256}))
    cons = Constraints(spec.kernel, sig, "sm90")
    assert cons.check({"BM": 64, "BN": 64, "BK": 64, "SPLIT": 2}).ok
    verdict = cons.check({"BM": 128, "BN": 64, "BK": 64, "SPLIT": 2})
    assert not verdict.ok and any("only masked work" in r for r in verdict.reasons), verdict.reasons


def test_decode_choice_streams_long_k_steps_and_splits_k():
    """At one row of an 8192 -> 5120 fp8 projection each program waits on its own pipeline:
    measured on an H200 (2026-12-01, benchmarks/results/decode_gemm_configs.md), 128-column K
    steps beat 64-column ones at equal tiles and stages, and a split K fills the SMs."""
    spec = get("gemm")
    choice = _sm90_choice(spec, {"M": 1, "N": 5120, "K": 8192, "dtype": "f8e4m3"})
    assert choice["SPLIT"] > 1 and choice["BK"] == 128, choice


def test_a_pipelined_program_waits_its_own_latency():
    """The latency term is per program: sm90's warp-specialised form holds one program an SM
    (its register file), and more stages shorten the wait of each step."""
    from duotile.codegen.target import get_target
    from duotile.passes.autotune.constraints import Constraints
    from duotile.passes.autotune.cost_model import estimate_phases

    spec = get("gemm")
    sig = spec.kernel.bind(spec.meta_inputs({"M": 1, "N": 5120, "K": 8192, "dtype": "f8e4m3"}))
    cons, machine = Constraints(spec.kernel, sig, "sm90"), get_target("sm90").machine

    def est(knobs=None, **config):
        verdict = cons.check({"BM": 64, "BN": 64, "BK": 64, "SPLIT": 4, **config, **(knobs or {})}, full=False)
        assert verdict.ok, verdict.reasons
        return estimate_phases(verdict.phases, machine, knobs)

    two, five = est(STAGES=2), est(STAGES=5)
    assert two.resident == five.resident == 1
    assert two.bound == "latency" and two.time_s > 1.5 * five.time_s
    assert est({"warp_specialize": "off"}, STAGES=2).resident > 1  # no producer warp group: several fit


def test_the_target_choice_is_searched_once_a_call_and_handed_out_as_a_copy(monkeypatch):
    """The cost model's pick is a pure function of the kernel, target, call and constants: the
    process keeps it (a model's shapes repeat across targets and batch sizes). The caller gets a
    copy, so changing it does not change the next caller's."""
    monkeypatch.setattr(cc, "_CHOICES", {})
    searched = []
    real = cc._choose
    monkeypatch.setattr(cc, "_choose", lambda *a: searched.append(a[1]) or real(*a))
    spec = get("gemm")
    sig = spec.kernel.bind(spec.meta_inputs({"M": 64, "N": 1024, "K": 4096}))
    first = cc.target_choice(spec.kernel, "sm100", sig)
    assert first is not None and searched == ["sm100"]
    first["BM"] = -1
    assert cc.target_choice(spec.kernel, "sm100", sig)["BM"] != -1 and searched == ["sm100"]
    cc.target_choice(spec.kernel, "sm90", sig)  # another target: a search of its own
    assert searched == ["sm100", "sm90"]


def test_the_v41_router_and_the_compressor_sharing_its_bucket_take_their_own_entries():
    """Both shipped entries sit in the bucket (K 8192, M 4096, N 512); each call takes the one tuned
    at its exact shape (H200, 2026-12-03: the router 36.9 us with 64 x 192 tiles; the compressor's
    64 x 256 tiles at N 512, 41.6 us)."""
    spec = get("gemm")
    got = {}
    for shape in ("v41/router/prefill4096", "v41/compressor_ratio1/prefill4096"):
        case = spec.model_cases()[shape]
        sig = spec.kernel.bind(spec.meta_inputs(case))
        config, source, _ = cc.explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))
        assert source == "table", shape
        got[shape] = (config["BM"], config["BN"])
    assert got == {"v41/router/prefill4096": (64, 192), "v41/compressor_ratio1/prefill4096": (64, 256)}


# the cost model's choice at a few model shapes, one per kernel kind and target: a change that
# means to keep every choice (a faster search, cached passes) must keep these
PINNED_CHOICES = [
    ("gemm", "v4/compressor_csa/decode16", "sm90",
     {"BK": 128, "BM": 64, "BN": 128, "SPLIT": 8, "STAGES": 3, "cluster": 1, "full_row": False,
      "persistent": False, "raster": 0, "threads": 256, "tma_store": False, "warp_specialize": "auto"}),
    ("gemm", "v4/compressor_csa/decode16", "sm100",
     {"BK": 128, "BM": 128, "BN": 32, "SPLIT": 2, "STAGES": 4, "raster": 0, "threads": 256}),
    ("gemm", "v4/compressor_csa/decode64", "ascend950",
     {"BK": 128, "BM": 64, "BN": 256, "SPLIT": 4, "STAGES": 3, "cores": 32, "threads": 128, "vector_split": False}),
    ("flash_attention", "v4/d128/s1024_causal", "sm90",
     {"BM": 128, "BN": 192, "DG": 1, "STAGES": 2, "cluster": 1, "overlap": False, "persistent": False, "raster": 0,
      "threads": 256, "tma_store": False, "warp_specialize": "auto"}),
    ("flash_attention", "v4/d128/s1024_causal", "ascend950",
     {"BM": 128, "BN": 128, "DG": 1, "STAGES": 1, "cores": 32, "threads": 128, "vector_split": False}),
    ("indexer_logits", "v4/r4_ctx1m/decode16", "sm100", {"BN": 64, "NB": 8, "STAGES": 2, "raster": 0, "threads": 256}),
    ("rmsnorm", "v4/hidden/decode16", "sm90", {"ALIGN": 2048, "ROWS": 4, "raster": 0, "threads": 256}),
    ("topk", "v4/r4_ctx1m/decode16", "ascend950", {"CHUNK": 4096, "PHASED": False, "cores": 24, "threads": 128}),
]


def test_the_model_choice_at_pinned_shapes_is_unchanged():
    for name, shape, target, want in PINNED_CHOICES:
        spec = get(name)
        case = spec.model_shapes[shape]
        sig = cc.at_choice_batch(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)))
        assert cc._choose(spec.kernel, target, sig, spec.constants_of(case)) == want, (name, shape, target)


def test_a_builds_model_choice_does_not_depend_on_which_call_came_first():
    """One build serves every list length of the sparse prefill (and every row count of the dense
    decode): its config is ranked over the model shapes that share the build, so V4's prefill gets
    the same config whether a CSA layer (640 slots) or an HCA layer (8,320) calls first. Ranked at
    each call's own sizes they differ (what the first call used to fix for both)."""
    for name, shapes in (("sparse_mqa_prefill", ("v4/csa_r4_topk640/prefill4096", "v4/hca8320/prefill4096")),
                         ("mqa_decode", ("v4/window128/decode1", "v4/topk640/decode16", "v4/hca1m8320/decode64"))):
        spec = get(name)
        cases = [spec.model_shapes[s] for s in shapes]
        sigs = [spec.kernel.bind(spec.meta_inputs(c)) for c in cases]
        chosen = [cc.target_choice(spec.kernel, "sm90", s, spec.constants_of(c)) for s, c in zip(sigs, cases)]
        assert all(c == chosen[0] for c in chosen), (name, chosen)
        alone = [cc._choose(spec.kernel, "sm90", cc.at_choice_batch(spec.kernel, s), spec.constants_of(c))
                 for s, c in zip(sigs, cases)]
        assert len({repr(a) for a in alone}) > 1, name  # the rule has something to decide


def test_the_calls_a_choice_is_ranked_over_are_the_model_shapes_of_its_build():
    spec = get("sparse_mqa_prefill")
    case = spec.model_shapes["v41/csa_r2_topk640/prefill4096"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    sigs = cc.choice_signatures(spec.kernel, sig, spec.constants_of(case))
    # V4's CSA, V4.1's CSA2 (the same list length over more rows) and V4's HCA
    assert sorted((s.shapes["L"], s.shapes["N"]) for s in sigs) == [(640, 20608), (640, 36992), (8320, 12416)]
    assert all(s.shapes["T"] == cc.CHOICE_BATCH and s.key() == sig.key() for s in sigs)
    # the epilogue's build (optional inputs present) has no model shape: the call alone, at the choice batch
    epi = {**case, "rope": "random", "P": 4096, "GROUPS": 8, "QBLOCK": 32}
    own = spec.kernel.bind(spec.meta_inputs(epi))
    assert [s.shapes for s in cc.choice_signatures(spec.kernel, own, spec.constants_of(epi))] == \
        [{**own.shapes, "T": cc.CHOICE_BATCH}]
    # a kernel whose only dynamic size is its batch: the call at the choice batch
    rms = get("rmsnorm")
    rsig = rms.kernel.bind(rms.meta_inputs(rms.model_shapes["v4/hidden/decode16"]))
    assert [s.shapes for s in cc.choice_signatures(rms.kernel, rsig)] == [{**rsig.shapes, "T": cc.CHOICE_BATCH}]


def test_a_starting_entry_can_ask_for_an_optional_tensor_given_or_not(tmp_path):
    """``present`` in an entry's ``when``: the stored-row decodes' SPLIT 8 serves the builds with
    compressed rows; a window-only layer's build (no ``cmp``) is left to the cost model's SPLIT 1;
    V4's HCA layers, called with each query's list length (``lens``: another build), take SPLIT 32."""
    for name, swa, compressed, hca in (
            ("sparse_mqa_decode_fp8_nope", "v4/swa128/decode64", "v4/csa_r4_topk640/decode1", "v4/hca8320/decode1"),
            ("sparse_mqa_decode_fp8", "v41/swa128/decode64", "v41/csa_r2_topk640/decode64", None)):
        spec = get(name)
        got = {}
        for shape in filter(None, (swa, compressed, hca)):
            case = spec.model_shapes[shape]
            config, source, _ = cc.explain_choice(spec.kernel, "sm90", spec.kernel.bind(spec.meta_inputs(case)),
                                                  spec.constants_of(case))
            got[shape] = (source, config["SPLIT"])
        want = {swa: ("model", 1), compressed: ("starting", 8), **({hca: ("starting", 32)} if hca else {})}
        assert got == want, name
    path = tmp_path / "starting.json"
    path.write_text(json.dumps({"entries": [
        {"kernel": "sparse_mqa_decode_fp8", "target": "sm90", "when": {"present": {"cmp": False}},
         "config": {"SPLIT": 2}}]}))
    spec = get("sparse_mqa_decode_fp8")
    for shape, want in (("v41/swa128/decode1", {"SPLIT": 2}), ("v41/csa_r2_topk640/decode1", None)):
        sig = spec.kernel.bind(spec.meta_inputs(spec.model_shapes[shape]))
        assert cc.starting_config(spec.kernel, "sm90", sig, path=path) == want, shape
