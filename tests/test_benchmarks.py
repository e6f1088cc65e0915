"""The benchmark scripts' own logic, on the CPU (their timings need the H200)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch

from benchmarks import common, tune_sweep
from duotile.kernels_spec.registry import load_all


def test_paired_timing_takes_the_median_of_per_round_ratios(monkeypatch):
    """Rounds alternate peer and candidate; the ratio is taken within a round (the clocks drift
    between rounds: here both slow down by half in round 2, and the ratio holds)."""
    times = iter([2.0, 1.0, 3.0, 1.5, 2.2, 1.0])  # peer, candidate, peer, candidate, ...
    calls = []

    def fake_bench(fn, reps, device):
        calls.append((fn, reps, device))
        return next(times)

    monkeypatch.setattr(common, "bench", fake_bench)
    peer_fn, fn = object(), object()
    peer_ms, ms, ratio, spread = common.paired(peer_fn, fn, rounds=3, device="cpu")
    assert [c[0] for c in calls] == [peer_fn, fn] * 3 and {c[1:] for c in calls} == {(10, "cpu")}
    assert (peer_ms, ms, ratio, spread) == (2.2, 1.0, 2.0, "2.000-2.200")


def test_tune_table_row_shows_the_paired_peer():
    best = SimpleNamespace(config={"BN": 176, "persistent": True}, final_ms=1.863)
    res = SimpleNamespace(best=best, metric="measured", default=SimpleNamespace(final_ms=1.877, counts=True),
                          speedup=1.007, counts=lambda: {"pruned": 32})
    entry = {"sweep_wall_s": 325.0, "peer": {"name": "F.scaled_dot_product_attention", "time_ms": 1.88,
                                             "best_ms": 1.87, "ratio": 1.005, "spread": "0.95-1.04"}}
    row = tune_sweep._row("flash_attention_d128", res, entry)
    assert "BN=176 persistent=True | 1.863 | 1.877 | 1.007x |" in row
    assert "1.88 ms vs 1.87 ms in alternation: 1.005x (0.95-1.04)" in row and "| 32/0/0 | 325 s |" in row


def test_tune_sweep_refuses_an_unknown_sweep_name(capsys):
    """Regression: `--only rmsnorm` matched no sweep, ran nothing and then failed reading a
    table it never wrote; it is now refused up front, naming the sweeps."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        tune_sweep.main(["--only", "rmsnorm,gemm_bf16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no sweep named rmsnorm;" in err and "rmsnorm_16M" in err


def test_fp8_peer_is_like_for_like_with_the_promotion_setting(monkeypatch):
    """A config that never promotes is paired with cuBLAS's fast accumulation, a promoting one
    (or the case default, which promotes) with torch._scaled_mm's default."""
    import torch

    seen = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: seen.append(kw["use_fast_accum"]))
    x = {"a": torch.zeros(2, 2), "b": torch.zeros(2, 2), "a_scale": torch.ones(2), "b_scale": torch.ones(2)}
    for cfg, label, fast in (({"fp8_promote_k": 0}, "torch._scaled_mm use_fast_accum=True", True),
                             ({"fp8_promote_k": 256}, "torch._scaled_mm", False), ({}, "torch._scaled_mm", False)):
        name, fn = tune_sweep.peer("gemm_fp8", x, cfg)
        fn()
        assert (name, seen[-1]) == (label, fast)


def test_tune_table_row_counts_a_sweep_where_nothing_passed():
    """A sweep whose every config was pruned (head dim 512 on sm100's TMEM) still says how many."""
    res = SimpleNamespace(best=None, metric="model", counts=lambda: {"pruned": 90, "compile_error": 2})
    row = tune_sweep._row("mqa_decode_hca", res, {"sweep_wall_s": 12.0})
    assert "no candidate passed" in row and "| 90/2/0 | 12 s |" in row


def test_mqa_peer_is_the_decode_attention_it_is_timed_against():
    """The split-KV decode kernel's peer (SDPA in grouped-query form) computes the same thing as
    the kernel's reference, so the bench compares like with like."""
    import torch

    from duotile.kernels_spec import get

    spec = get("mqa_decode")
    case = {"B": 2, "H": 64, "R": 40, "D": 64}
    x = {k: v.float() for k, v in spec.make_inputs(case, torch.device("cpu"), 0).items()}
    got = common.mqa_peer(x)().squeeze(2)
    assert torch.allclose(got, spec.run_reference(x, case)["o"].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name,case", [("sparse_mqa_decode", {"B": 3, "H": 16, "D": 64, "N": 90, "L": 40}),
                                       ("sparse_mqa_prefill", {"T": 7, "H": 16, "D": 64, "N": 90, "L": 40})])
def test_sparse_attention_peer_is_the_runtimes_attention_over_the_same_rows(name, case, monkeypatch):
    """The sparse kernels' peer, the runtime's composite, computes what the kernels' reference does
    (live slots alone, the sink in the denominator), also when it goes a chunk of queries a call."""
    from duotile.kernels_spec import get

    spec = get(name)
    x = spec.make_inputs({**case, "valid": "all"}, torch.device("cpu"), 3)
    want = spec.run_reference(x, case)["o"].float()
    monkeypatch.setattr(common, "PEER_GATHER_BYTES", 2 * case["L"] * case["D"] * 4)  # two queries a call
    label, call = common.sparse_attention_peer(x)
    got = torch.cat(call())
    assert "2 queries a call" in label
    assert (got - want).abs().max() <= 2.0 ** -7 * want.abs().max()


def test_interleaved_rows_take_ratios_against_their_own_peer_within_each_round(monkeypatch):
    """--interleave: every row and each distinct peer is timed once a round, in one order; a row's
    ratio is against its own peer (fast accumulation or not) in the same round."""
    from benchmarks import bench_kernels

    fast, slow = object(), object()
    a, b = object(), object()
    clocks = iter([1.0, 2.0])  # round 1 at full clocks, round 2 at half
    base = {fast: 0.8, slow: 0.9, a: 1.0, b: 0.9}
    order, scale = [], {}

    def fake_bench(fn, reps, device):
        if fn is fast:  # the first timed in a round: the board's state for that round
            scale["now"] = next(clocks)
        order.append(fn)
        return base[fn] * scale["now"]

    monkeypatch.setattr(common, "bench", fake_bench)
    rows = [{"kernel": "k", "config": "A"}, {"kernel": "k", "config": "B"}]
    timed = [(rows[0], a, "fast", fast), (rows[1], b, "default", slow)]
    monkeypatch.setattr(bench_kernels, "ROUNDS", 2)
    bench_kernels._time_interleaved(timed, work=1e9, unit="TFLOP/s", peak=1.0)
    assert order == [fast, slow, a, b] * 2
    assert rows[0]["vs_peer"] == 0.8 and rows[0]["peer"] == "fast" and rows[0]["spread"] == "0.800-0.800"
    assert rows[1]["vs_peer"] == 1.0 and rows[1]["peer_ms"] == 1.35 and rows[1]["ms"] == 1.35


def _blockscaled_inputs(block: int, m: int = 4, k: int = 256, n: int = 256):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1, m, k, generator=g).to(torch.float8_e4m3fn),
            "b": torch.randn(1, n, k, generator=g).to(torch.float8_e4m3fn),
            "a_scale": torch.randint(120, 134, (1, m, k // block), dtype=torch.uint8, generator=g),
            "b_scale": torch.randint(120, 134, (1, n // block, k // block), dtype=torch.uint8, generator=g)}


def test_block_scales_are_the_codes_decoded_in_torchs_column_major_layout():
    from benchmarks.common import block_scales

    inputs = _blockscaled_inputs(128)
    sa, sb = block_scales(inputs, 0)
    assert sa.shape == (4, 2) and sa.stride() == (1, 4)  # (M, K/128), column-major
    assert sb.shape == (2, 2) and sb.stride() == (1, 2)  # (K/128, N/128), column-major
    assert torch.equal(sa, torch.exp2(inputs["a_scale"][0].float() - 127))
    assert torch.equal(sb, torch.exp2(inputs["b_scale"][0].float() - 127).t())
    assert block_scales(_blockscaled_inputs(32), 0) is None  # V4.1's blocks: torch has no such form


def test_blockscaled_peer_says_when_it_falls_back_to_row_scales():
    from benchmarks.common import blockscaled_mm_peer

    label, _ = blockscaled_mm_peer(_blockscaled_inputs(32))
    assert label == "torch._scaled_mm row-scaled (blocks not 128 wide)"
    if not torch.cuda.is_available():  # torch's CPU _scaled_mm takes no block scales: a refusal, named
        label, _ = blockscaled_mm_peer(_blockscaled_inputs(128))
        assert label.startswith("torch._scaled_mm row-scaled (block-scaled refused: ")


def test_ab_checkouts_child_imports_the_checkout_it_measures(tmp_path):
    """The A/B's timing process imports duotile from the checkout named, not from this one."""
    import os
    import subprocess
    import sys

    (tmp_path / "duotile").mkdir()
    (tmp_path / "duotile" / "__init__.py").write_text("raise SystemExit('imported the base checkout')\n")
    out = subprocess.run([sys.executable, "benchmarks/ab_checkouts.py", "--child", str(tmp_path), "gemm:x"],
                         capture_output=True, text=True, env={**os.environ, "AB_CONFIG": "{}"})
    assert "imported the base checkout" in out.stderr


def test_ab_checkouts_cut_short_prints_what_it_measured_and_stops_its_builds(tmp_path):
    """A phase's ``timeout`` (SIGTERM) during the builds: the run says so, prints its table (empty
    rows) and leaves no build process behind; it does not wait for the builds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "duotile").mkdir()
    (tmp_path / "duotile" / "__init__.py").write_text("import time\ntime.sleep(60)\n")  # a build that hangs
    proc = subprocess.Popen([sys.executable, "benchmarks/ab_checkouts.py", "--base", str(tmp_path), "--jobs", "2",
                             "gemm:v41/wq_b/decode1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ""})
    time.sleep(4)  # the two build processes are running (the base one sleeps)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < 20
    assert "stopped (SIGTERM) after 0 measurements" in out
    assert "| gemm:v41/wq_b/decode1 | - | - | - |" in out
    left = subprocess.run(["pgrep", "-f", f"--child {tmp_path}"], capture_output=True, text=True).stdout
    assert left == "", "a build process outlived the run"


def test_ab_checkouts_table_takes_medians_over_rounds_and_says_each_check():
    from benchmarks.ab_checkouts import HERE, table

    this = str(HERE)
    rows = [{"root": "/b", "shape": "s", "us": 300.0, "check": "ok"}, {"root": "/b", "shape": "s", "us": 100.0,
                                                                        "check": "ok"},
            {"root": this, "shape": "s", "us": 100.0, "check": "ok"}, {"root": this, "shape": "s", "us": 100.0,
                                                                         "check": "FAIL (3 off)"},
            {"root": this, "shape": "t", "error": "no build"}]
    text = table(rows, "/b", ["s", "t"])
    assert "| s | 200.0 | 100.0 | 2.00 | ok; FAIL (3 off), ok |" in text
    assert "| t | - | - | - | ; error |" in text


def test_blockscaled_configs_time_model_shapes_and_hold_each_shipped_starting_config():
    from benchmarks import blockscaled_configs as bc
    from duotile.codegen.choose_config import load_starting

    cases = load_all()["gemm_blockscaled"].model_cases()
    for proj in bc.PROJECTIONS.split(","):
        assert f"{proj}/decode64" in cases and f"{proj}/prefill4096" in cases, proj
    # the H200's entries (the benchmark's machine); sm100's is chosen by hand, with its reason
    shipped = [e["config"] for e in load_starting() if e["kernel"] == "gemm_blockscaled" and e["target"] == "sm90"]
    assert shipped and all(c in [p for p in bc.CONFIGS.values() if p] for c in shipped)


def test_model_benchmark_runs_its_workload_and_reports_it_against_the_peer(tmp_path):
    """bench_model.py's workload on the CPU (tiny V4, the reference ops), then its report, against a
    peer entry made from the same rows at twice the time: every row's ratio is 2."""
    import argparse
    import copy
    import json

    from benchmarks import bench_model, model_report

    args = argparse.Namespace(model="v4-tiny", layers=0, device="cpu", runs=["reference"], prompt=12, context=6,
                              batches=[1, 3], steps=1, repeats=1, jobs=1, out=str(tmp_path / "run.json"),
                              signatures=None, save_signatures=None, ahead=True, profile=0)
    bench_model.run(args)
    run = json.loads((tmp_path / "run.json").read_text())
    (ours,) = run["systems"]
    assert [r["phase"] for r in ours["rows"]] == ["prefill 12", "decode batch 1", "decode batch 3"]
    assert all(r["ms"] > 0 for r in ours["rows"])
    peer = copy.deepcopy(ours)
    peer.update(system="transformers", label="peer")
    for row in peer["rows"]:
        row["ms"] *= 2
    run["systems"].append(peer)
    run["copy_tbs"] = 4.0
    text = model_report.write_report([run], "bench_model_test", tmp_path).read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| v4-tiny")]
    assert [r[1] for r in rows] == ["reference"] * 3 + ["peer"] * 3
    assert [r[-1].rstrip(" |") for r in rows] == ["2.00"] * 3 + ["1.00"] * 3


def test_model_benchmark_floor_counts_the_experts_a_batch_reaches():
    from benchmarks.bench_model import floor_bytes
    from duotile.runtime.inventory import tensor_specs
    from duotile.runtime.presets import get_preset

    cfg = get_preset("v4-tiny")
    one, sixty_four, all_of_them = (floor_bytes(cfg, b) for b in (1, 64, 10_000))
    assert one < sixty_four < all_of_them
    specs = {sp.name: sp for sp in tensor_specs(cfg)}
    expert = sum(torch.Size(s).numel() * d.itemsize for w in ("w1", "w2", "w3")
                 for s, d in specs[f"layers.0.ffn.experts.0.{w}"].stored(cfg.weight_block_size[0]).values())
    k = cfg.num_experts_per_tok
    assert all_of_them - one == pytest.approx(cfg.num_hidden_layers * (cfg.n_routed_experts - k) * expert, rel=1e-6)


def test_model_benchmark_floor_leaves_out_the_tables_a_step_gathers_rows_of():
    """V4.1's Engram table (like the embedding) is read a few rows a token: not in the floor."""
    from benchmarks.bench_model import floor_bytes
    from duotile.runtime.inventory import tensor_specs
    from duotile.runtime.presets import get_preset

    cfg = get_preset("v41-tiny")
    specs = {sp.name: sp for sp in tensor_specs(cfg)}
    tables = [n for n in specs if n.endswith(".engram.embed")]
    assert tables
    total = sum(torch.Size(s).numel() * d.itemsize for sp in specs.values() if not sp.name.startswith("mtp.")
                and ".experts." not in sp.name for s, d in sp.stored(cfg.weight_block_size[0]).values())
    table_bytes = sum(torch.Size(s).numel() * d.itemsize for n in tables + ["embed.weight"]
                      for s, d in specs[n].stored(cfg.weight_block_size[0]).values())
    assert floor_bytes(cfg, 0) == total - table_bytes  # batch 0: no routed expert reached


SASS = """
        Function : k_p0
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.U8 R2, [R3] ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   EXIT ;
        Function : k_p1
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.U8 R2, [R3] ;
        /*0020*/                   LOP3.LUT R4, R2, 0x7, RZ, 0xc0, !PT ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0040*/              @!P1 BRA 0x10 ;
        /*0050*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0060*/                   BRA 0x50 ;
        /*0070*/               @P2 BRA 0x0 ;
"""


def test_sass_loop_takes_the_loop_that_holds_the_tensor_core_instructions():
    from benchmarks import sass_loop

    fns = sass_loop.functions(SASS)
    assert list(fns) == ["k_p0", "k_p1"]
    assert sass_loop.opcode("@!P1 BRA 0x10") == "BRA" and sass_loop.opcode("LDS.U8 R2, [R3]") == "LDS.U8"
    assert sass_loop.main_loop(fns["k_p0"]) == ["LDS.U8 R2, [R3]", "@P0 BRA 0x10"]  # no MMA: the largest loop
    # the loop at 0x10..0x40 holds the HGMMA; the larger one at 0x0..0x70 does too and wins, the
    # unconditional jump (not a loop's branch) is passed over
    body = sass_loop.main_loop(fns["k_p1"])
    assert len(body) == 8 and body[0].startswith("MOV")
    lines = sass_loop.describe("k_p1", fns["k_p1"], top=3)
    assert "main loop 8 a trip a thread (1 tensor-core instructions)" in lines[2]


def test_config_grid_takes_every_combination_with_typed_values():
    from benchmarks.config_grid import parse_grid

    grid = parse_grid(["threads=32,256", "ROWS=1,4", "overlap=true"])
    assert grid == [{"threads": 32, "ROWS": 1, "overlap": True}, {"threads": 32, "ROWS": 4, "overlap": True},
                    {"threads": 256, "ROWS": 1, "overlap": True}, {"threads": 256, "ROWS": 4, "overlap": True}]
    assert parse_grid(["warp_specialize=manual"]) == [{"warp_specialize": "manual"}]
    with pytest.raises(ValueError, match="NAME=V1,V2"):
        parse_grid(["threads"])


@pytest.mark.parametrize("argv,words", [
    (["nosuch", "--shapes", "*"], "no spec 'nosuch'; the specs: candidate_pool"),
    (["router", "--shapes", "*", "--grid", "threads"], "--grid 'threads': expected NAME=V1,V2"),
    (["router", "--shapes", "zzz"], "no model shape of router matches ['zzz']: v4/e256_top6/decode1"),
])
def test_config_grid_names_a_bad_argument(argv, words, capsys):
    from benchmarks.config_grid import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_config_grid_rows_check_time_and_name_each_config():
    """The grid's loop on the interpreter: a row a config, the user's config named, a refused one a
    cell that says so, every other cell checked against the reference and timed."""
    from benchmarks.config_grid import time_configs

    spec = load_all()["router"]
    written = []
    rows = time_configs(spec, ["v41/e384_top6/decode1"], [{"ROWS": 2}, {"ROWS": 3}, None], "t", jobs=1,
                        target="interpret", device="cpu", timer=lambda fn, reps: (fn(), 0.002)[1],
                        write=lambda name, rows, header, quiet=False: written.append(len(rows)))
    cells = [r["v41/e384_top6/decode1"] for r in rows]
    assert cells[0] == "2.0" and cells[1].startswith("not built: ") and cells[2] == "2.0"
    assert rows[0]["config"] == '{"ROWS": 2}' and rows[2]["config"].startswith("user: ")
    assert written == [1, 2, 3, 3]


def test_graphs_variants_copy_the_outputs_a_variant_names_and_no_other(monkeypatch):
    """graphs_variants.py's ``clone:SECTION:I`` hands out a copy of output I of that section's
    replays and the graph's own tensors otherwise; ``alias`` new tensor objects on the same memory."""
    from benchmarks import graphs_variants
    from duotile.runtime import graphs
    from tests.runtime.test_graphs import Holder, stand_in_capture

    original = graphs.Sections._replay
    monkeypatch.setattr(graphs.Sections, "_replay", original)  # put back after the test
    graphs_variants._patch_replay(graphs, torch, "clone:ffn:1")
    holder = Holder()
    capture, _ = stand_in_capture(holder)
    sections = graphs.Sections(max_tokens=8, capture=capture)

    def fn(x):
        holder.tally.count("hc_post", True)
        return x + 1, x * 2

    outs = {name: [sections.run(holder.tally, (name, 0), fn, torch.ones(2, 3)) for _ in range(3)]
            for name in ("ffn", "attention")}
    own = {name: sections._graphs[((name, 0), ((2, 3), torch.float32))].outputs for name in outs}
    assert outs["ffn"][2][0] is own["ffn"][0] and outs["ffn"][2][1] is not own["ffn"][1]
    assert torch.equal(outs["ffn"][2][1], own["ffn"][1])
    assert all(a is b for a, b in zip(outs["attention"][2], own["attention"]))
    graphs.Sections._replay = original
    graphs_variants._patch_replay(graphs, torch, "alias")
    got = sections.run(holder.tally, ("ffn", 0), fn, torch.ones(2, 3))
    assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(got, own["ffn"]))


def test_graphs_variants_finite_names_the_first_replay_with_non_finite_outputs(monkeypatch, capsys):
    """``finite`` prints the first replay whose outputs hold a NaN or an infinity, its section and
    whether its inputs were finite, once."""
    from benchmarks import graphs_variants
    from duotile.runtime import graphs
    from tests.runtime.test_graphs import Holder, stand_in_capture

    monkeypatch.setattr(graphs.Sections, "_replay", graphs.Sections._replay)  # put back after the test
    graphs_variants._patch_finite(graphs, torch)
    holder = Holder()
    capture, _ = stand_in_capture(holder)
    sections = graphs.Sections(max_tokens=8, capture=capture)

    def fn(x):
        holder.tally.count("hc_post", True)
        return (x.log(),)  # log(0) = -inf

    for value in (1.0, 2.0, 3.0, 0.0, 0.0):
        sections.run(holder.tally, ("ffn", 2), fn, torch.full((2, 3), value))
    out = capsys.readouterr().out
    assert out.count("first non-finite replay") == 1
    assert ("section ('ffn', 2), input shapes [(2, 3)], replay 3, outputs [0] not finite; inputs all finite: True"
            in out)


def test_graphs_variants_sync_waits_after_each_replay_and_returns_the_graph_outputs(monkeypatch):
    """``sync`` calls its wait once a replay, after it, and hands out the graph's own tensors."""
    from benchmarks import graphs_variants
    from duotile.runtime import graphs
    from tests.runtime.test_graphs import Holder, stand_in_capture

    monkeypatch.setattr(graphs.Sections, "_replay", graphs.Sections._replay)  # put back after the test
    waits = []
    graphs_variants._patch_sync(graphs, lambda: waits.append(sections.replays))
    holder = Holder()
    capture, _ = stand_in_capture(holder)
    sections = graphs.Sections(max_tokens=8, capture=capture)

    def fn(x):
        holder.tally.count("hc_post", True)
        return (x + 1,)

    outs = [sections.run(holder.tally, ("ffn", 0), fn, torch.ones(2, 3)) for _ in range(4)]
    assert waits == [1, 2, 3]  # the first call runs eagerly; each replay waits once, after it counted
    assert outs[3][0] is sections._graphs[(("ffn", 0), ((2, 3), torch.float32))].outputs[0]


def test_graphs_variants_builds_the_default_workload_first_and_stops_where_the_build_fails(monkeypatch, capsys):
    """The kernels of the default workload build in parallel before any variant runs (a variant
    left to build them one at a time runs past its limit); a failed build ends the script with its
    exit code and its output, before any variant."""
    from benchmarks import graphs_variants

    cmd = graphs_variants.prebuild_command(7)
    assert cmd[1:4] == ["-m", "duotile", "build"] and cmd[-4:] == ["--target", "sm90", "--jobs", "7"]
    assert graphs_variants.SIGNATURES.is_file()
    assert cmd[cmd.index("--signatures") + 1] == str(graphs_variants.SIGNATURES)
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 3, stdout="", stderr="no nvcc")

    monkeypatch.setattr(graphs_variants.subprocess, "run", fake_run)
    assert graphs_variants.main([]) == 3
    assert len(calls) == 1 and calls[0][3] == "build"
    err = capsys.readouterr().err
    assert "the build failed (exit 3)" in err and "no nvcc" in err
    calls.clear()  # another workload than the default: nothing built ahead, the variants run
    monkeypatch.setattr(graphs_variants.subprocess, "run",
                        lambda command, **kw: calls.append(command) or subprocess.CompletedProcess(command, 0, "", ""))
    assert graphs_variants.main(["--requests", "2"]) == 0
    assert [c[2:5] for c in calls] == [["--variant", v, "--no-prebuild"] for v in graphs_variants.VARIANTS]


def test_lowered_bounds_lowers_each_build_once_and_fails_on_an_access_not_proven(monkeypatch, capsys):
    """Model shapes that differ only in a dynamic size share a build (rmsnorm's decode batches: T);
    a real lowering's accesses are all proven; a row with an access not proven makes the exit 1
    and is listed."""
    pytest.importorskip("tilelang")
    from benchmarks import lowered_bounds as lb

    shapes = [(n, s, c) for n, s, c in lb.cases(True, None) if n == "rmsnorm" and s.startswith("v41/kv_norm/")]
    assert len(shapes) > 1 and len({lb.build_key(n, c, "sm90") for n, _, c in shapes}) == 1
    row = lb.check_one((*shapes[0], "sm90"))
    assert "error" not in row and row["phases"] == 1 and row["proven"] > 0 and row["unproven"] == [], row
    bad = {**row, "unproven": ["read of `x` at dimension 0 (extent n_T), index m * 4 + 3, under no test"]}

    class Pool:  # stands in for the worker processes: every build reports ``bad``
        def __init__(self, jobs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, jobs):
            return [bad for _ in jobs]

    monkeypatch.setattr(lb, "ProcessPoolExecutor", Pool)
    assert lb.main(["--specs", "rmsnorm", "--target", "sm90"]) == 1
    out = capsys.readouterr().out
    assert "| rmsnorm | sm90 |" in out and "read of `x` at dimension 0" in out
