"""The indexer over a prefill chunk on the interpreter: the reference within the decode form's bound
and the -inf mask exact over the cases; each query's row equal, bit for bit, to the decode form run on
that query alone with the chunk's keys (kernels and references); small integers exact; a query's bits
independent of the chunk and of BM; pinned tilings; the work the causal skip saves; bad inputs named."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen import choose_config as cc
from duotile.kernels_spec import get
from duotile.kernels_spec import indexer_logits_prefill as ilp
from duotile.kernels_spec.compare import check_outputs
from duotile.kernels_spec.model_shapes import V4_FLASH, V41_FLASH

SPEC = get("indexer_logits_prefill")
DECODE = get("indexer_logits")
CPU = torch.device("cpu")


def _run(spec, case: dict, inputs: dict, config: dict | None = None) -> torch.Tensor:
    out = {**inputs, "logits": torch.full_like(inputs["logits"], float("nan"))}
    cfg = spec.config_of(case) if config is None else config
    codegen.compile(spec.kernel, "interpret", config=cfg, constants=spec.constants_of(case))(**out)
    return out["logits"]


def _visible(case: dict, inputs: dict) -> torch.Tensor:
    """(T, N) bool: query t sees row j, j < (pos_t + 1) // RATIO."""
    vis = (inputs["pos"].long() + 1) // case.get("RATIO", 4)
    return torch.arange(case["N"])[None, :] < vis[:, None]


def _check(case: dict, inputs: dict, got: torch.Tensor) -> None:
    want = SPEC.run_reference(inputs, case)["logits"]
    check_outputs(SPEC, case, {**inputs, "logits": got}, {"logits": want})
    visible = _visible(case, inputs)
    assert torch.equal(torch.isneginf(got), ~visible), "the -inf mask is not exactly the invisible rows"
    assert bool(torch.isfinite(got[visible]).all())


def _as_decode(inputs: dict, t: int) -> dict:
    """Query t as a decode call: a batch of one sequence whose rows are the chunk's keys."""
    n = inputs["k"].shape[0]
    return {"q": inputs["q"][t:t + 1].contiguous(), "w": inputs["w"][t:t + 1].contiguous(),
            "k": inputs["k"][None].contiguous(), "pos": inputs["pos"][t:t + 1].contiguous(),
            "logits": torch.full((1, n), float("nan"))}


@pytest.mark.parametrize("name", sorted(SPEC.cases))
def test_case_matches_reference_and_masks_exactly(name):
    case = SPEC.cases[name]
    inputs = SPEC.make_inputs(case, CPU, 7)
    _check(case, inputs, _run(SPEC, case, inputs))


def test_cases_cover_the_causal_edges():
    """What the cases claim: a query that sees no row, a block whose every query sees none (all of
    its tiles skipped), repeated positions, positions past the rows, a ragged last tile."""
    first = SPEC.cases["v4_first_chunk"]
    vis = _visible(first, SPEC.make_inputs(first, CPU, 7)).sum(1)
    assert vis[:3].tolist() == [0, 0, 0] and vis[-1] == first["N"]
    rep = SPEC.cases["repeated_positions"]
    pos = SPEC.make_inputs(rep, CPU, 7)["pos"]
    assert torch.equal(pos[0::2], pos[1::2])
    mixed = SPEC.cases["mixed_positions"]
    pos = SPEC.make_inputs(mixed, CPU, 7)["pos"].long()
    vis = (pos + 1) // mixed["RATIO"]
    assert bool((vis == 0).any()) and bool((vis > mixed["N"]).any())
    assert SPEC.cases["v4_chunk_end"]["N"] % 64 and SPEC.cases["one_query"]["T"] == 1
    none = SPEC.cases["one_query_sees_none"]
    assert bool(torch.isneginf(_run(SPEC, none, SPEC.make_inputs(none, CPU, 7))).all())


def test_edge_codes_reach_both_ends_of_the_format_and_stay_finite():
    case = SPEC.cases["mxfp4_edge_codes"]
    x = SPEC.make_inputs(case, CPU, 7)
    codes = x["k"][:, case["D"] // 2:]
    assert int(codes.min()) == 0 and int(codes.max()) == max(ilp.EDGE_CODES) and int(codes.max()) < 255
    got = _run(SPEC, case, x)
    assert bool(torch.isfinite(got[_visible(case, x)]).all())


@pytest.mark.parametrize("config", [{"BM": 1, "BN": 32, "NB": 1, "STAGES": 1},
                                    {"BM": 4, "BN": 64, "NB": 2, "STAGES": 2}])
@pytest.mark.parametrize("dtype", ["bf16", "mxfp4"])
def test_each_query_equals_the_decode_form_bit_for_bit(config, dtype):
    """Query t's row is the decode kernel's for one sequence holding the chunk's keys, at the same BN:
    the same gemm tile, the same head sum, the same mask."""
    case = {"T": 11, "H": 32, "N": 90, "D": 128, "RATIO": 2, "dtype": dtype, "positions": "mixed"}
    inputs = SPEC.make_inputs(case, CPU, 21)
    got = _run(SPEC, case, inputs, config)
    dec_cfg = {"BN": config["BN"], "NB": config["NB"], "STAGES": config["STAGES"]}
    dec_case = {"B": 1, "H": 32, "L": 90, "D": 128, "RATIO": 2}
    for t in range(case["T"]):
        one = _as_decode(inputs, t)
        assert torch.equal(_run(DECODE, dec_case, one, dec_cfg)[0], got[t]), t


def test_the_references_agree_query_by_query():
    case = {"T": 9, "H": 64, "N": 70, "D": 128, "RATIO": 4, "dtype": "mxfp4", "positions": "mixed"}
    x = SPEC.make_inputs(case, CPU, 5)
    want = SPEC.run_reference(x, case)["logits"]
    bound = SPEC.allowed_error(case, "logits", want, x)
    for t in range(case["T"]):
        one = _as_decode(x, t)
        dec = DECODE.run_reference(one, {"RATIO": 4})["logits"][0]
        assert torch.equal(torch.isneginf(dec), torch.isneginf(want[t]))
        fin = torch.isfinite(dec)
        assert bool(((dec[fin] - want[t][fin]).abs() <= 2.0 ** -24 * dec[fin].abs()).all()), t  # one rounding
        assert torch.equal(DECODE.allowed_error({"RATIO": 4}, "logits", dec[None], one)[0], bound[t]), t


def test_the_reference_in_ranges_equals_one_pass(monkeypatch):
    case = {"T": 11, "H": 32, "N": 90, "D": 64, "RATIO": 2, "dtype": "mxfp4", "positions": "mixed"}
    x = SPEC.make_inputs(case, CPU, 9)
    whole = SPEC.run_reference(x, case)["logits"]
    bound = SPEC.allowed_error(case, "logits", whole, x)
    monkeypatch.setattr(ilp, "KEY_RANGE", 16)
    monkeypatch.setattr(ilp, "PRODUCTS", 3 * 16 * 32)  # three queries a range
    assert len(ilp._ranges(11, 90, 32)) == 6 and len(ilp._ranges(11, 90, 32)[0][2]) == 4
    assert torch.equal(SPEC.run_reference(x, case)["logits"], whole)
    assert torch.equal(SPEC.allowed_error(case, "logits", whole, x), bound)


def test_small_integer_inputs_are_exact():
    """Every partial sum is an integer below 2^24 (times a power of two): exact in any order."""
    for cfg in ({"BM": 1, "BN": 32, "NB": 1, "STAGES": 1}, {"BM": 4, "BN": 64, "NB": 2, "STAGES": 2}):
        case = {"T": 10, "H": 32, "N": 90, "D": 128, "RATIO": 2, "values": "ints", "positions": "mixed"}
        inputs = SPEC.make_inputs(case, CPU, 3)
        assert torch.equal(_run(SPEC, case, inputs, cfg), SPEC.run_reference(inputs, case)["logits"]), cfg


def test_a_query_gets_the_same_bits_alone_in_a_chunk_and_at_any_bm():
    case = {"T": 13, "H": 64, "N": 130, "D": 128, "RATIO": 4, "positions": "mixed"}
    inputs = SPEC.make_inputs(case, CPU, 11)
    full = _run(SPEC, case, inputs, {"BM": 4, "BN": 32, "NB": 2, "STAGES": 1})
    for bm in (1, 2, 8):
        assert torch.equal(_run(SPEC, case, inputs, {"BM": bm, "BN": 32, "NB": 2, "STAGES": 1}), full), bm
    for lo, hi in ((0, 1), (5, 6), (3, 13)):
        part = {k: (v[lo:hi].contiguous() if k in ("q", "w", "pos", "logits") else v) for k, v in inputs.items()}
        got = _run(SPEC, {**case, "T": hi - lo}, part, {"BM": 4, "BN": 32, "NB": 2, "STAGES": 1})
        assert torch.equal(got, full[lo:hi]), (lo, hi)


PINNED = [
    {"BM": 1, "BN": 32, "NB": 1, "STAGES": 1},
    {"BM": 2, "BN": 64, "NB": 2, "STAGES": 2},
    {"BM": 4, "BN": 32, "NB": 4, "STAGES": 1},
    {"BM": 8, "BN": 128, "NB": 1, "STAGES": 2},
]


@pytest.mark.parametrize("config", PINNED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", ["bf16", "mxfp4"])
def test_pinned_tilings_agree_with_the_reference(config, dtype):
    """A sequence's first chunk (blocks wholly skipped, queries that see nothing) with T and N ragged
    against every tile size."""
    case = {"T": 23, "H": 32, "N": 201, "D": 128, "RATIO": 1, "start": 100, "dtype": dtype}
    inputs = SPEC.make_inputs(case, CPU, 17)
    _check(case, inputs, _run(SPEC, case, inputs, config))


@pytest.mark.parametrize("seed", range(6))
def test_seeded_random_cases(seed):
    case = SPEC.random_case(random.Random(700 + seed))
    inputs = SPEC.make_inputs(case, CPU, 700 + seed)
    _check(case, inputs, _run(SPEC, case, inputs))


def _skipped_by_brute_force(pos, n, ratio, bm, bn, nb) -> float:
    """Each block's tiles past every one of its queries' visible rows, counted tile by tile."""
    vis = ((pos.long() + 1) // ratio).tolist()
    t, skipped = len(vis), 0
    for m0 in range(0, t, bm):
        seen = max(vis[m0:m0 + bm])
        for row in range(0, n, bn):
            if row >= seen:
                skipped += len(vis[m0:m0 + bm]) * min(bn, n - row)
    return skipped / (t * n)


def test_the_causal_skip_is_counted_and_saves_half_a_first_chunk():
    pos = torch.arange(4096, dtype=torch.int32)  # a sequence's first chunk at V4's ratio
    frac = ilp.skipped_fraction(pos, 1024, 4, 4, 64, 4)
    assert frac == pytest.approx(_skipped_by_brute_force(pos, 1024, 4, 4, 64, 4), abs=1e-12)
    assert 0.45 < frac < 0.5  # the triangle's half, less the tiles its diagonal cuts
    late = torch.arange(61440, 65536, dtype=torch.int32)  # the chunk ending a 64K context: 1/32 of it
    assert ilp.skipped_fraction(late, 16384, 4, 4, 64, 4) == pytest.approx(
        _skipped_by_brute_force(late, 16384, 4, 4, 64, 4), abs=1e-12)
    assert 0.02 < ilp.skipped_fraction(late, 16384, 4, 4, 64, 4) < 1 / 32
    ragged = torch.tensor([5, 0, 0, 40, 2, 300, 7], dtype=torch.int32)
    assert ilp.skipped_fraction(ragged, 50, 2, 2, 8, 2) == pytest.approx(
        _skipped_by_brute_force(ragged, 50, 2, 2, 8, 2), abs=1e-12)


def test_flops_count_the_visible_pairs():
    case = {"T": 4096, "H": 64, "N": 1024, "D": 128, "RATIO": 4}  # a first chunk: about half the square
    assert SPEC.flops(case) == pytest.approx(2 * 64 * 128 * 4096 * 1024 / 2, rel=1e-3)
    assert SPEC.flops(SPEC.model_shapes["v4/r4_ctx4k/prefill4096"]) == pytest.approx(34.4e9, rel=0.01)  # 5.4


def test_model_shapes_follow_each_models_indexer():
    for m, ratios in ((V4_FLASH, {4}), (V41_FLASH, {1, 2})):
        mine = SPEC.model_cases(m.name)
        assert {c["RATIO"] for c in mine.values()} == ratios
        assert all(c["H"] == m.index_heads and c["D"] == m.index_head_dim for c in mine.values())
        assert all(c["T"] * c["N"] <= ilp.MAX_LOGITS for c in mine.values())
    assert SPEC.model_shapes["v4/r4_ctx1m_mxfp4/prefill4096"]["N"] == 262144
    assert SPEC.model_shapes["v41/r1_ctx1m/prefill1024"]["N"] == 1 << 20
    x = SPEC.meta_inputs(SPEC.model_shapes["v41/r2_ctx64k_mxfp4/prefill4096"])
    assert x["k"].dtype == torch.uint8 and x["k"].shape == (32768, 68)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_model_shapes_get_the_starting_config_that_shares_key_tiles(target):
    """The cost model alone picks BM 1 (one query a block); the shipped starting entries give 4, and
    one stage to MXFP4 rows (TileLang fails on two)."""
    for shape, stages in (("v4/r4_ctx64k/prefill4096", 2), ("v41/r1_ctx64k_mxfp4/prefill4096", 1)):
        case = SPEC.model_shapes[shape]
        sig = SPEC.kernel.bind(SPEC.meta_inputs(case))
        config, source, _ = cc.explain_choice(SPEC.kernel, target, sig, SPEC.constants_of(case))
        assert source == "starting" and config["BM"] == 4 and config["STAGES"] == stages, (shape, config)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_config_a_user_gets_generates_at_every_head_count(target):
    """The starting entries serve every head count: sm100's tcgen05 takes a 64-row bf16 tile only at
    N a multiple of 64, so the catch-all entry must be 128 rows (a tiny model's 2 or 4 heads, padded
    to 16, were refused under a 64-row one)."""
    from duotile.codegen.compile import specialize_phases
    from duotile.codegen.target import get_target

    tgt = get_target(target)
    for h in (2, 4, 32, 64):
        for dtype in ("bf16", "mxfp4"):
            case = {"T": 8, "H": h, "N": 40, "D": 128, "RATIO": 1, "dtype": dtype}
            sig = SPEC.kernel.bind(SPEC.meta_inputs(case))
            config = cc.choose_config(SPEC.kernel, target, sig, SPEC.constants_of(case))
            phases, knobs = specialize_phases(SPEC.kernel, sig, tgt, config, SPEC.constants_of(case))
            for m in phases:
                tgt.generate(m, tgt.phase_knobs(m, knobs))


def test_bad_inputs_are_named():
    case = {"T": 3, "H": 32, "N": 20, "D": 128, "RATIO": 2}
    x = SPEC.make_inputs(case, CPU, 1)
    narrow = {**x, "k": x["k"][:, :64].contiguous()}
    with pytest.raises(dsl.DslError, match="k's rows must hold D values"):
        _run(SPEC, case, narrow, {"BM": 1, "BN": 32, "NB": 1, "STAGES": 1})
    short = {**x, "k": torch.zeros(20, 60, dtype=torch.uint8)}
    with pytest.raises(dsl.DslError, match="short of D / 2 bytes"):
        _run(SPEC, case, short, {"BM": 1, "BN": 32, "NB": 1, "STAGES": 1})
    with pytest.raises(dsl.DslError, match="RATIO 0 must be a positive int"):
        codegen.compile(SPEC.kernel, "interpret", config={"BM": 1, "BN": 32, "NB": 1, "STAGES": 1},
                        constants={"RATIO": 0})(**x)
