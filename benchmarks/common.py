"""Timing and reporting shared by the benchmarks (GPU only)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from duotile.passes.autotune.timing import median_ms

# H200 SXM datasheet peaks (dense), and what torch itself reaches on an H200 (torch.matmul bf16,
# torch._scaled_mm fp8, a large device-to-device copy; measured November 2026)
PEAK = {"bf16_tflops": 989.0, "fp8_tflops": 1979.0, "hbm_tbs": 4.8}
MEASURED = {"bf16_tflops": 785.0, "fp8_tflops": 1261.0, "copy_tbs": 4.2}


def bench(fn, warmup: int = 5, reps: int = 20, flush: bool = True, device: str = "cuda") -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, each after an L2 flush, after a warm-up
    of at least 100 ms (the tuner's loop: ``duotile.passes.autotune.timing``)."""
    return median_ms(fn, device, warmup=warmup, reps=reps, flush=flush)


def paired(peer_fn, fn, rounds: int = 5, device: str = "cuda") -> tuple[float, float, float, str]:
    """Peer and candidate timed in alternation, ``rounds`` times (10 timed calls each, after the
    warm-up): (median peer ms, median candidate ms, median of the per-round ratios, their range).
    Clocks drift with temperature and the board's power cap; a ratio of neighbouring timings
    cancels most of it, where a peer timed once on a cool board does not."""
    t = interleaved({"peer": peer_fn, "mine": fn}, rounds, device)
    ratio, spread = round_ratio(t["peer"], t["mine"])
    return statistics.median(t["peer"]), statistics.median(t["mine"]), ratio, spread


def interleaved(fns: dict, rounds: int = 12, device: str = "cuda") -> dict[str, list[float]]:
    """Every function timed once a round (10 timed calls), in the same order, ``rounds`` times:
    the per-round medians by name. Ratios taken round by round compare configs under the same
    clocks, where configs timed one after another see the board warm up between them."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn, reps=10, device=device))
    return times


def round_ratio(peer: list[float], mine: list[float]) -> tuple[float, str]:
    """The median of the per-round ratios peer / mine (above 1: mine is faster), and their range."""
    ratios = sorted(p / m for p, m in zip(peer, mine))
    return statistics.median(ratios), f"{ratios[0]:.3f}-{ratios[-1]:.3f}"


def scaled_mm_peer(inputs: dict, config: dict) -> tuple[str, object]:
    """(label, call) of torch._scaled_mm, row / column scales, like for like with an fp8 gemm
    config: one that never promotes (``fp8_promote_k`` 0) keeps its sums in the tensor cores' own
    accumulator, as cuBLAS does with ``use_fast_accum=True``; a promoting one meets the default."""
    a, b = inputs["a"], inputs["b"]
    sa, sb = inputs["a_scale"][:, None].contiguous(), inputs["b_scale"][None, :].contiguous()
    fast = config.get("fp8_promote_k") == 0
    return (f"torch._scaled_mm{' use_fast_accum=True' if fast else ''}",
            lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                     use_fast_accum=fast))


def mqa_peer(inputs: dict):
    """torch's SDPA over the heads that share one K = V row (grouped-query form)."""
    import torch.nn.functional as F

    q, kv = inputs["q"].unsqueeze(2), inputs["kv"].unsqueeze(1)
    return lambda: F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)


def spec_peer(name: str, inputs: dict, config: dict, causal: bool = False) -> tuple[str, object]:
    """(label, call) of the torch operation that computes what spec ``name`` computes on
    ``inputs``, like for like with ``config`` (an fp8 gemm that never promotes meets fast
    accumulation); rmsnorm's peer is a copy of the same bytes, its bandwidth ceiling."""
    import torch.nn.functional as F

    if name in ("gemm", "gemm_splitk"):
        a, b = inputs["a"], inputs["b"]
        if a.dtype == torch.float8_e4m3fn:
            return scaled_mm_peer(inputs, config)
        return "F.linear", lambda: F.linear(a, b)
    if name == "flash_attention":
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        return "SDPA", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name == "mqa_decode":
        return "SDPA enable_gqa", mqa_peer(inputs)
    if name == "rmsnorm":
        x = inputs["x"]
        y = torch.empty_like(x)
        return "copy (x -> y)", lambda: y.copy_(x)
    if name == "topk":
        scores, k = inputs["scores"], inputs["idx"].shape[-1]
        return "torch.topk", lambda: torch.topk(scores, min(k, scores.shape[-1]), dim=-1)
    if name == "gemm_blockscaled":
        return blockscaled_mm_peer(inputs)
    if name == "moe_gemm_mxfp4":
        return grouped_mm_peer(inputs)
    if name in ("sparse_mqa_decode", "sparse_mqa_prefill"):
        return sparse_attention_peer(inputs)
    if name == "sparse_mqa_decode_fp8":  # a runtime that keeps its rows in BF16 (dequantised once, untimed)
        from duotile.kernels_spec.sparse_mqa_decode_fp8 import all_rows

        rows = all_rows(inputs["q"].shape[-1], inputs["kv"], inputs["kv_scale"], inputs.get("cmp"),
                        inputs.get("cmp_scale"))
        label, call = sparse_attention_peer({**inputs, "kv": rows.to(torch.bfloat16)})
        return label + " over BF16 rows", call
    if name == "sparse_mqa_decode_fp8_nope":  # likewise for V4's rows
        from duotile.kernels_spec.sparse_mqa_decode_fp8_nope import all_rows as v4_rows

        rows = v4_rows(inputs["q"].shape[-1], inputs["kv"], inputs.get("cmp"))
        label, call = sparse_attention_peer({**inputs, "kv": rows.to(torch.bfloat16)})
        return label + " over BF16 rows", call
    raise KeyError(f"no torch peer for {name!r}")


TORCH_BLOCK = 128  # the one block size torch's block-scaled _scaled_mm takes on sm90 (1x128, 128x128)


def block_scales(inputs: dict, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fp32 scales torch's block-scaled ``_scaled_mm`` takes for group ``group`` of a
    ``gemm_blockscaled`` call, both column-major: A's (M, K/128) per 1x128 block and B's
    (K/128, N/128) per 128x128 block, decoded from the UE8M0 codes; None where the call's blocks
    are not 128 wide (V4.1's 32)."""
    a, a_codes, b_codes = inputs["a"], inputs["a_scale"], inputs["b_scale"]
    k, n = a.shape[-1], inputs["b"].shape[1]
    if k != TORCH_BLOCK * a_codes.shape[-1] or n != TORCH_BLOCK * b_codes.shape[1]:
        return None
    sa = torch.exp2(a_codes[group].float() - 127)  # (M, KB)
    sb = torch.exp2(b_codes[group].float() - 127)  # (NB, KB): its transpose is (KB, NB), column-major
    return sa.t().contiguous().t(), sb.contiguous().t()


def blockscaled_mm_peer(inputs: dict) -> tuple[str, object]:
    """torch._scaled_mm with the call's own block scales, one call per group, where torch takes
    them (128-wide blocks); else, or where torch refuses the shape, the row-scaled form, the label
    saying which and why."""
    a, b = inputs["a"], inputs["b"]
    scales = [block_scales(inputs, i) for i in range(a.shape[0])]
    if scales[0] is None:
        label, call = rowwise_scaled_mm_peer(inputs)
        return f"{label} (blocks not 128 wide)", call
    calls = [(a[i], b[i].t(), sa, sb) for i, (sa, sb) in enumerate(scales)]

    def call():
        return [torch._scaled_mm(x, w, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16) for x, w, sa, sb in calls]

    try:
        call()
    except (RuntimeError, ValueError) as err:
        label, row = rowwise_scaled_mm_peer(inputs)
        return f"{label} (block-scaled refused: {str(err).splitlines()[0][:60]})", row
    return "torch._scaled_mm block-scaled", call


def rowwise_scaled_mm_peer(inputs: dict) -> tuple[str, object]:
    """torch._scaled_mm with one fp32 scale per row of A and of B (no per-block scales: a harder
    peer than the block-scaled form, which torch runs at about 0.8x the row-scaled rate), one call
    per group."""
    a, b = inputs["a"], inputs["b"]
    g, m, n = a.shape[0], a.shape[1], b.shape[1]
    sa, sb = torch.ones(m, 1, device=a.device), torch.ones(1, n, device=a.device)
    calls = [(a[i], b[i].t()) for i in range(g)]
    return ("torch._scaled_mm row-scaled", lambda: [torch._scaled_mm(x, w, scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.bfloat16)
                                                    for x, w in calls])


def copy_bandwidth(nbytes: int) -> float:
    """Measured device-to-device copy bandwidth (TB/s, read + write counted) for ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def write_results(name: str, rows: list[dict], header: list[str], quiet: bool = False) -> Path:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / f"{name}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    lines = [f"device: {device}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    extra = os.environ.get("OUT")
    if extra:
        for suffix in (".json", ".md"):
            Path(extra, f"{name}{suffix}").write_text((out / f"{name}{suffix}").read_text())
    if not quiet:
        print("\n".join(lines))
    return out / f"{name}.md"


def case_build(kernel_name: str, case_name: str, overrides: list[str]):
    """(kernel, inputs on the GPU, config) for a build case on sm90, its config with ``NAME=VALUE``
    overrides on top (what ``duotile show --config`` takes)."""
    from duotile import codegen
    from duotile.codegen.cli import _assignment
    from duotile.kernels_spec import get

    spec = get(kernel_name)
    case = spec.build_cases[case_name]
    cfg = {**spec.config_of(case, "sm90"), **dict(map(_assignment, overrides))}
    kernel = codegen.compile(spec.kernel, "sm90", config=cfg, constants=spec.constants_of(case))
    return kernel, spec.make_inputs(case, torch.device("cuda"), 0), cfg


def grouped_mm_peer(inputs: dict) -> tuple[str, object]:
    """torch._grouped_mm in bf16 over the same grouped rows (``offsets``) with bf16 expert weights
    of the same shape (random: a peer's values need not match; 4x the bytes of the MXFP4 weights),
    the bf16 MoE a user of torch runs; KeyError where torch refuses the shape."""
    a, w, offsets = inputs["a"], inputs["w"], inputs["offsets"]
    e, n, k = w.shape[0], w.shape[1], a.shape[1]
    x = a.to(torch.bfloat16)
    wb = torch.randn(e, n, k, device=a.device, dtype=torch.bfloat16)
    ends = offsets[1:].to(torch.int32).contiguous()
    call = lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=ends, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        call()
    except (RuntimeError, AttributeError) as err:
        raise KeyError(f"torch._grouped_mm refused: {err}") from err
    return "torch._grouped_mm bf16", call


PEER_GATHER_BYTES = 1 << 30  # the fp32 rows one call of the runtime's composite gathers at most


def sparse_attention_peer(inputs: dict) -> tuple[str, object]:
    """The runtime's sparse attention (``layers.common.sparse_attention``, FP32, its fast mode) on
    the same rows: each query's index list gathered from its sequence's rows (decode: q [B, H, D]
    over kv [B, N, D]; prefill: q [T, H, D] over one kv [N, D]), -1 a dead slot; queries in chunks
    whose gathered rows fit PEER_GATHER_BYTES (a 4,096-token chunk of V4's HCA layer would gather
    70 GB at once), the chunk size in the label."""
    from duotile.kernels_spec.sparse_mqa_prefill import token_ranges
    from duotile.runtime.layers.common import Ctx, sparse_attention
    from duotile.runtime.ops import FastOps

    q, kv, idx, sink = inputs["q"], inputs["kv"], inputs["idx"], inputs["sink"]
    rows = kv if kv.dim() == 3 else kv[None].expand(q.shape[0], -1, -1)
    ranges = token_ranges(q.shape[0], idx.shape[1] * q.shape[-1] * 4, PEER_GATHER_BYTES)
    ctx, scale = Ctx(FastOps()), q.shape[-1] ** -0.5

    def call():
        out = []
        for lo, hi in ranges:
            i = idx[lo:hi]
            live = (i >= 0) & (i < rows.shape[1])
            keys = rows[lo:hi].gather(1, i.clamp(0, rows.shape[1] - 1).long()[..., None].expand(-1, -1, rows.shape[2]))
            out.append(sparse_attention(ctx, q[lo:hi], keys, live, sink, scale))
        return out

    chunk = "" if len(ranges) == 1 else f", {ranges[0][1]} queries a call"
    return f"runtime sparse_attention (fp32{chunk})", call
