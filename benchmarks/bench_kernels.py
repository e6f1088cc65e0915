"""Benchmarks of the foundation kernels and the split decode kernels on the H200 (sm90 build), against PyTorch peers
measured in the same run. Usage:

    python benchmarks/bench_kernels.py [--kernels gemm_bf16,gemm_fp8,attention,rmsnorm,gemm_decode,mqa_decode]
                                       [--sweep] [--interleave [ROUNDS]]

``--sweep`` also times a few hand-picked configs per kernel (the full search is `duotile tune`).
Every timed config is first checked against the reference on the same inputs. Each row is timed in
alternation with its peer; ``--interleave`` times all of a kernel's rows and peers in turn, round
after round (12 by default), so the rows also compare with each other under the same clocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    MEASURED,
    PEAK,
    bench,
    copy_bandwidth,
    interleaved,
    mqa_peer,
    paired,
    round_ratio,
    scaled_mm_peer,
    write_results,
)
from duotile import codegen  # noqa: E402
from duotile.kernels_spec import get  # noqa: E402
from duotile.passes.autotune.cache import best_config  # noqa: E402

INTERLEAVE, ROUNDS = False, 12  # --interleave [ROUNDS] (main)
FP8 = {"BM": 128, "BN": 128, "BK": 128, "STAGES": 4, "raster": 16}
MANUAL = {"warp_specialize": "manual"}  # duotile's producer / consumer roles (manual_ws.py)
PERSISTENT = {**MANUAL, "persistent": True}  # one block per SM walks the tiles (persistent.py)
FP8_WIDE = {**FP8, "BN": 256, "fp8_promote_k": 0, **MANUAL}  # 128x256 tiles: no registers to promote
SWEEP = {
    "gemm_bf16": [{}, {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4, "raster": 8, "warp_specialize": "auto"},
                  {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4, "raster": 8, **PERSISTENT},
                  {"BM": 128, "BN": 192, "BK": 64, "STAGES": 4, "raster": 8, **PERSISTENT},
                  {"BM": 256, "BN": 192, "BK": 64, "STAGES": 4, "raster": 8, **MANUAL, "full_row": True},
                  # the output through shared memory and TMA stores (tma_store.py), with and without clusters
                  {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4, "raster": 8, **PERSISTENT, "tma_store": True},
                  {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4, "raster": 8, **PERSISTENT, "cluster": 2,
                   "tma_store": True}],
    # fp8_promote_k N: the fp8 partial sums join the fp32 accumulator every N elements of K (0: never)
    "gemm_fp8": [{}, {**FP8, "fp8_promote_k": 0}, FP8_WIDE, {**FP8_WIDE, "persistent": True},
                 {**FP8, "BM": 256, "fp8_promote_k": 0, **PERSISTENT},
                 # promotion overlapped with the next group's gemms (manual schedule; promote_fp8.py)
                 {**FP8, "fp8_promote_k": 256, **MANUAL}, {**FP8, "fp8_promote_k": 128, **MANUAL},
                 {**FP8, "fp8_promote_k": 256, **PERSISTENT},
                 # 128x192 tiles: 2752 tiles fill 132 SMs in 20.8 rounds where 128x256's 2048 need 15.5
                 # (wave quantisation); one step fragment fits beside the accumulator (TileLang's
                 # pipeline promotes synchronously; the manual schedule's two step fragments spill)
                 {**FP8, "BN": 192, "fp8_promote_k": 0, **PERSISTENT}, {**FP8, "BN": 192, "fp8_promote_k": 256},
                 {**FP8, "BN": 192, "fp8_promote_k": 256, "STAGES": 5},
                 # full_row: one m64nBN wgmma per warp group instead of two m64n(BN/2)
                 {**FP8_WIDE, "persistent": True, "full_row": True}, {**FP8, "BN": 192, "fp8_promote_k": 256,
                                                                      "full_row": True},
                 # clusters of two blocks: the B tile multicast to both (persistent.py)
                 {**FP8_WIDE, "persistent": True, "cluster": 2},
                 # and the output through shared memory and TMA stores (tma_store.py)
                 {**FP8_WIDE, "persistent": True, "cluster": 2, "tma_store": True}],
    # attention rows start from the build case's config: manual + overlap + persistent, 192-key blocks
    "attention": [{}, {"ftz": False}, {"BN": 128}, {"BN": 128, "STAGES": 3}, {"BN": 176},
                  {"cluster": 2}, {"BN": 176, "cluster": 2},  # pairs of query blocks share K and V
                  {"BN": 128, "persistent": False},
                  {"BN": 128, "warp_specialize": "auto", "overlap": False, "persistent": False}],
    "attention_causal": [{}, {"warp_specialize": "auto", "overlap": False}, {"persistent": True}],
    "rmsnorm": [{}, {"ROWS": 2, "threads": 512}],
    # the split count: 32 output tiles of 64x128 fill a quarter of the SMs unsplit
    "gemm_decode": [{}, {"SPLIT": 1}, {"SPLIT": 2}, {"SPLIT": 8}, {"SPLIT": 16},
                    {"warp_specialize": "manual"}, {"warp_specialize": "manual", "SPLIT": 8}],
    "mqa_decode": [{}, {"SPLIT": 1}, {"SPLIT": 8}, {"SPLIT": 32},
                   # two warp groups, the 64 x 512 accumulator split by columns: no spills (plan.py)
                   {"threads": 256}, {"threads": 256, "SPLIT": 32}],
}
for _name in ("gemm_bf16", "gemm_fp8", "attention", "gemm_decode"):
    SWEEP[_name].insert(1, None)  # the tuned config, as codegen.compile picks it


def _tuned(spec, case, inputs) -> dict | None:
    sig = spec.kernel.bind(inputs)
    return best_config(spec.kernel, "sm90", sig.shapes, dtypes=sig.dtypes, present=sig.present,
                       constants=spec.constants_of(case))


def precompile(spec, case, configs, inputs) -> list:
    """Build every config at once on a thread pool (nvcc runs in subprocesses), so the timing loop
    only loads; returns (kernel, build seconds) or the exception, per config."""
    def one(cfg):
        t0 = time.perf_counter()
        try:
            k = codegen.compile(spec.kernel, "sm90", config=cfg, constants=spec.constants_of(case))
            k.artifact(**inputs)
            return k, time.perf_counter() - t0
        except Exception as err:  # reported in the row; the sweep goes on
            return err

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, configs))


def verified(spec, case, inputs):
    """(ok, note): the outputs against the reference, with the worst error relative to the scale."""
    ref = spec.run_reference(inputs, case)
    notes, ok = [], True
    for out in spec.outputs:
        got, want = inputs[out].float(), ref[out].float()
        err = (got - want).abs()
        bad = int((~((err <= spec.allowed_error(case, out, want, inputs)) | (got == want))).sum())  # equal infs pass
        notes.append(f"{out} max err {err.max().item():.3g} (max |ref| {want.abs().max().item():.3g}, "
                     f"{bad} outside bound)")
        ok = ok and bad == 0
    return ok, "; ".join(notes)


def time_configs(label, spec, case, configs, work, unit, peer_fn, peak, peer_for=None):
    """Verify, then time each config in alternation with the peer (``paired``), so the ratio is
    taken under the same clocks and temperature (these drift between rows); with ``--interleave``
    every verified config and every peer take turns in one loop (``common.interleaved``), so the
    rows compare with each other too. ``peer_for(config)``, when given, picks the like-for-like
    peer of a config: (name, function)."""
    inputs = spec.make_inputs(case, torch.device("cuda"), 0)
    rows, timed = [], []
    # {}: the case's own config (what duotile build uses untuned); None: the tuned config that
    # codegen.compile finds in the tuning cache or the shipped table (duotile/tuned/tuning.json)
    tuned = _tuned(spec, case, inputs) if None in configs else None
    if None in configs and tuned is None:
        print(f"{label}: no tuned config for this device and toolchain; skipping the tuned row", flush=True)
        configs = [c for c in configs if c is not None]
    full = [tuned if cfg is None else {**spec.config_of(case, "sm90"), **cfg} for cfg in configs]
    for cfg, run_cfg, built in zip(configs, full, precompile(spec, case, full, inputs)):
        row = {"kernel": label, "config": f"tuned {run_cfg}" if cfg is None else (cfg or "default")}
        rows.append(row)
        try:
            if isinstance(built, Exception):
                raise built
            k, compile_s = built
            k(**inputs)
            ok, why = verified(spec, case, inputs)
            row.update(check=why, compile_s=round(compile_s, 1))
            if not ok:
                row.update(status=f"WRONG ({why})")
                continue
            peer_name, peer = peer_for(run_cfg) if peer_for else (None, peer_fn)
            timed.append((row, lambda k=k: k(**inputs), peer_name, peer))
            if not INTERLEAVE:
                peer_ms, ms, ratio, spread = paired(peer, timed[-1][1])
                _fill(row, ms, peer_ms, ratio, spread, work, unit, peak, peer_name)
        except Exception as err:  # keep sweeping
            row.update(status=f"FAIL {type(err).__name__}: {str(err)[:160]}")
        print(row, flush=True)
    if INTERLEAVE and timed:
        _time_interleaved(timed, work, unit, peak)
    return rows


def _time_interleaved(timed, work, unit, peak):
    """Every verified config and each distinct peer, timed in turn round after round."""
    peers = {name: fn for _, _, name, fn in timed}
    fns = {**{("peer", name): fn for name, fn in peers.items()}, **{i: t[1] for i, t in enumerate(timed)}}
    times = interleaved(fns, ROUNDS)
    for i, (row, _, peer_name, _) in enumerate(timed):
        ratio, spread = round_ratio(times[("peer", peer_name)], times[i])
        _fill(row, statistics.median(times[i]), statistics.median(times[("peer", peer_name)]), ratio, spread,
              work, unit, peak, peer_name)
        print(row, flush=True)


def _fill(row, ms, peer_ms, ratio, spread, work, unit, peak, peer_name):
    rate = work / (ms * 1e-3) / 1e12
    row.update(status="ok", ms=round(ms, 4), **{unit: round(rate, 1)}, roofline=f"{rate / peak:.0%}",
               peer_ms=round(peer_ms, 4), vs_peer=round(ratio, 3), spread=spread,
               **({"peer": peer_name} if peer_name else {}))


def gemm_bf16(sweep):
    spec, n = get("gemm"), 8192
    case = spec.build_cases["bf16_8192"]  # {}: its config_for, what `duotile build` uses untuned
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    peer_fn = lambda: torch.matmul(a, b.t())  # noqa: E731
    peer = bench(peer_fn)
    flops = 2.0 * n ** 3
    peer_row = {"kernel": "gemm_bf16", "config": "torch.matmul (peer)", "status": "ok", "ms": round(peer, 4),
                "TFLOP/s": round(flops / peer / 1e9, 1)}
    return [peer_row] + time_configs("gemm_bf16", spec, case, SWEEP["gemm_bf16"] if sweep else [{}], flops,
                                     "TFLOP/s", peer_fn, PEAK["bf16_tflops"])


def gemm_fp8(sweep):
    spec, n = get("gemm"), 8192
    case = spec.build_cases["fp8_8192"]
    x = spec.make_inputs(case, torch.device("cuda"), 0)
    _, peer_fn = scaled_mm_peer(x, {})
    _, fast_fn = scaled_mm_peer(x, {"fp8_promote_k": 0})  # the peer of configs that never promote
    peer = bench(peer_fn)
    ref = spec.run_reference(x, case)["c"].float()
    for label, fn in (("use_fast_accum=False", peer_fn), ("use_fast_accum=True", fast_fn)):
        print(f"torch._scaled_mm {label}: max err {(fn().float() - ref).abs().max().item():.3g} "
              f"(max |ref| {ref.abs().max().item():.3g})", flush=True)
    fast = bench(fast_fn)
    one = torch.ones((), device="cuda")
    peer_t = bench(lambda: torch._scaled_mm(x["a"], x["b"].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    flops = 2.0 * n ** 3
    rows = [{"kernel": "gemm_fp8", "config": "torch._scaled_mm rowwise (peer)", "status": "ok", "ms": round(peer, 4),
             "TFLOP/s": round(flops / peer / 1e9, 1)},
            {"kernel": "gemm_fp8", "config": "torch._scaled_mm rowwise, use_fast_accum=True", "status": "ok",
             "ms": round(fast, 4), "TFLOP/s": round(flops / fast / 1e9, 1)},
            {"kernel": "gemm_fp8", "config": "torch._scaled_mm tensorwise", "status": "ok", "ms": round(peer_t, 4),
             "TFLOP/s": round(flops / peer_t / 1e9, 1)}]
    return rows + time_configs("gemm_fp8", spec, case, SWEEP["gemm_fp8"] if sweep else [{}], flops, "TFLOP/s",
                               peer_fn, PEAK["fp8_tflops"], lambda cfg: scaled_mm_peer(x, cfg))


def attention(sweep, causal=False):
    spec = get("flash_attention")
    case = spec.build_cases["d128_causal" if causal else "d128"]  # B 4, H 32, S 4096, D 128
    x = spec.make_inputs(case, torch.device("cuda"), 0)
    peer_fn = lambda: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)  # noqa: E731
    peer = bench(peer_fn)
    flops = 4.0 * 4 * 32 * 4096 * 4096 * 128 / (2 if causal else 1)
    label = "attention_causal" if causal else "attention"
    rows = [{"kernel": label, "config": "torch SDPA (peer)", "status": "ok", "ms": round(peer, 4),
             "TFLOP/s": round(flops / peer / 1e9, 1)}]
    return rows + time_configs(label, spec, case, SWEEP[label] if sweep else [{}], flops, "TFLOP/s", peer_fn,
                               PEAK["bf16_tflops"])


def rmsnorm(sweep):
    spec = get("rmsnorm")
    case = {"T": 4096, "D": 4096}  # 16M elements
    x = spec.make_inputs(case, torch.device("cuda"), 0)
    nbytes = spec.bytes_moved(case)
    copy_tbs = copy_bandwidth(2 * case["T"] * case["D"])
    peer_fn = lambda: F.rms_norm(x["x"], (case["D"],), x["weight"], 1e-6)  # noqa: E731
    peer = bench(peer_fn)
    rows = [{"kernel": "rmsnorm", "config": "copy (ceiling)", "status": "ok", "TB/s": round(copy_tbs, 2)},
            {"kernel": "rmsnorm", "config": "torch F.rms_norm (peer)", "status": "ok", "ms": round(peer, 4),
             "TB/s": round(nbytes / peer / 1e9, 2)}]
    got = time_configs("rmsnorm", spec, case, SWEEP["rmsnorm"] if sweep else [{}], nbytes, "TB/s", peer_fn,
                       PEAK["hbm_tbs"])
    for r in got:
        if "TB/s" in r:
            r["vs_copy"] = f"{r['TB/s'] / copy_tbs:.0%}"
    return rows + got


def _decode(label, spec_name, case_name, peer_name, make_peer, sweep):
    """A split decode kernel (bandwidth-bound: TB/s of its compulsory bytes) against its peer."""
    spec = get(spec_name)
    case = spec.build_cases[case_name]
    x = spec.make_inputs(case, torch.device("cuda"), 0)
    peer_fn = make_peer(x)
    peer = bench(peer_fn)
    nbytes = spec.bytes_moved(case)
    rows = [{"kernel": label, "config": f"{peer_name} (peer)", "status": "ok", "ms": round(peer, 4),
             "TB/s": round(nbytes / peer / 1e9, 2)}]
    return rows + time_configs(label, spec, case, SWEEP[label] if sweep else [{}], nbytes, "TB/s", peer_fn,
                               PEAK["hbm_tbs"])


def gemm_decode(sweep):
    """The split-K decode GEMM (16 rows x 8192 -> 4096, bf16): bound by reading the weight."""
    return _decode("gemm_decode", "gemm_splitk", "wo_b_decode", "torch.matmul",
                   lambda x: lambda: torch.matmul(x["a"], x["b"].t()), sweep)


def mqa_decode(sweep):
    """Split-KV decode attention, 4 sequences x 64 heads x 512 over 8,320 rows (HCA at 1M)."""
    return _decode("mqa_decode", "mqa_decode", "hca_1m", "torch SDPA, enable_gqa", mqa_peer, sweep)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="gemm_bf16,gemm_fp8,attention,attention_causal,rmsnorm,gemm_decode,"
                                        "mqa_decode")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--interleave", nargs="?", type=int, const=12, default=0, metavar="ROUNDS",
                   help="time every row and peer in turn, ROUNDS rounds (default 12)")
    args = p.parse_args(argv)
    global INTERLEAVE, ROUNDS
    INTERLEAVE, ROUNDS = bool(args.interleave), args.interleave or ROUNDS
    torch.backends.cuda.matmul.allow_tf32 = False
    fns = {"gemm_bf16": gemm_bf16, "gemm_fp8": gemm_fp8, "attention": attention,
           "attention_causal": lambda s: attention(s, causal=True), "rmsnorm": rmsnorm, "gemm_decode": gemm_decode,
           "mqa_decode": mqa_decode}
    rows = []
    for name in args.kernels.split(","):
        rows += fns[name](args.sweep)
    print(f"ceilings torch reaches on an H200: {MEASURED}")
    write_results("kernels_sm90", rows, ["kernel", "config", "status", "ms", "TFLOP/s", "TB/s", "roofline",
                                         "peer", "peer_ms", "vs_peer", "spread", "vs_copy", "compile_s", "check"])


if __name__ == "__main__":
    main()
