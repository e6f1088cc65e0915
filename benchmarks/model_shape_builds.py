"""What every kernel spec does at every model shape on every target: generated, built or refused
and why, as markdown tables (no GPU needed).

    python3 -m benchmarks.model_shape_builds                 # generation at every model shape: summary
    python3 -m benchmarks.model_shape_builds --all           # ... one row a shape and target
    python3 -m benchmarks.model_shape_builds --build         # + full builds of one shape per spec and model
    python3 -m benchmarks.model_shape_builds --model v41     # one model's shapes only

Generation specialises and lowers a case and writes its target source (TileLang) without
compiling it; a build also compiles (nvcc cubins for sm90 / sm100, TileLang's Ascend lowering to
Ascend C for ascend950). Each case builds with its own pinned config (``Spec.config_of``), not a
tuned one, so the table is the same on any machine.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from duotile.codegen.driver import build_case, generate_case
from duotile.dsl.errors import DslError
from duotile.kernels_spec import load_all

TARGETS = ("sm90", "sm100", "ascend950")
# the shape of each spec and model that is fully built: the model's defining GEMM (fp8 and bf16),
# a decode GEMM, the hidden norm, a long decode attention, a prefill attention (head dim 512 for V4,
# where sm90 alone fits it, and 128 for V4.1), a top-k row gather, the MoE router over each
# model's experts, the FP4 quantiser in each format (V4's MXFP4 index queries, V4.1's NVFP4 KV
# rows), and the FP8 block-scaled GEMM at a V4 decode and a V4.1 prefill (32-wide blocks)
REPRESENTATIVE = {
    "gemm": {"v4-flash": "v4/wo_b/prefill4096", "v41-flash": "v41/compressor_ratio2/prefill4096"},
    "gemm_f32": {"v4-flash": "v4/index_hadamard_q/decode16", "v41-flash": "v41/compressor_wkv/decode1"},
    "gemm_splitk": {"v4-flash": "v4/wo_b/decode16", "v41-flash": "v41/wq_a/decode1"},
    "gemm_blockscaled": {"v4-flash": "v4/wo_b/decode16", "v41-flash": "v41/wq_b/prefill4096"},
    "rmsnorm": {"v4-flash": "v4/hidden/prefill4096", "v41-flash": "v41/kv_norm/decode64"},
    "mqa_decode": {"v4-flash": "v4/hca1m8320/decode4", "v41-flash": "v41/topk640/decode64"},
    "flash_attention": {"v4-flash": "v4/d512/prefill4096_causal", "v41-flash": "v41/d128/s4096_causal"},
    "gather_rows": {"v4-flash": "v4/topk_rows_r4/decode16", "v41-flash": "v41/moe_permute/prefill4096"},
    "quantize": {"v4-flash": "v4/k4096/prefill4096", "v41-flash": "v41/k5120/decode16"},
    "quantize_fp4": {"v4-flash": "v4/mxfp4_index_q8192/prefill4096", "v41-flash": "v41/nvfp4_kv512/decode16"},
    "router": {"v4-flash": "v4/e256_top6/prefill4096", "v41-flash": "v41/e384_top6/decode16"},
    "indexer_logits": {"v4-flash": "v4/r4_ctx1m/decode16", "v41-flash": "v41/r1_ctx1m/decode4"},
    # the indexer over a prefill chunk: V4's bf16 keys and V4.1's MXFP4 rows as stored, at 64K context
    "indexer_logits_prefill": {"v4-flash": "v4/r4_ctx64k/prefill4096", "v41-flash": "v41/r1_ctx64k_mxfp4/prefill4096"},
    # V4.1's Reindex scoring of the candidate pool alone (V4.1 alone): MXFP4 keys at 1M, its build case's sizes
    "indexer_logits_pool": {"v41-flash": "v41/r1_ctx1m_mxfp4/decode16"},
    "kv_insert": {"v4-flash": "v4/window_kv584/decode16", "v41-flash": "v41/window_kv528/decode16"},
    "compressor_decode": {"v4-flash": "v4/csa_pool/decode16", "v41-flash": "v41/ratio2_pool/decode64"},
    "compressor_prefill": {"v4-flash": "v4/hca_pool/prefill4096", "v41-flash": "v41/ratio2_pool/prefill4096"},
    "topk": {"v4-flash": "v4/r4_ctx1m/decode16", "v41-flash": "v41/r1_ctx256k/decode16"},
    "moe_permute": {"v4-flash": "v4/e256_top6/prefill4096", "v41-flash": "v41/e384_top6/decode64"},
    "moe_combine": {"v4-flash": "v4/h4096_top6/decode64", "v41-flash": "v41/h5120_top6/prefill4096"},
    "moe_gemm_mxfp4": {"v4-flash": "v4/e256_w2/prefill4096", "v41-flash": "v41/e384_w13/decode16"},
    "sparse_mqa_decode": {"v4-flash": "v4/hca8320/decode16", "v41-flash": "v41/csa_r2_topk640/decode64"},
    "sparse_mqa_prefill": {"v4-flash": "v4/hca8320/prefill4096", "v41-flash": "v41/csa_r2_topk640/prefill4096"},
    # V4.1's FP8 window rows as stored (V4.1 alone: V4's rows keep BF16 rope channels)
    "sparse_mqa_decode_fp8": {"v41-flash": "v41/csa_r2_topk640/decode16"},
    # V4's 584-byte rows as stored (V4 alone: FP8 nope channels, BF16 rope)
    "sparse_mqa_decode_fp8_nope": {"v4-flash": "v4/csa_r4_topk640/decode16"},
    "rmsnorm_quant": {"v4-flash": "v4/hidden/prefill4096", "v41-flash": "v41/hidden/decode16"},
    "swiglu_quant": {"v4-flash": "v4/experts_i2048/decode64", "v41-flash": "v41/experts_i2304/prefill4096"},
    "sample": {"v4-flash": "v4/vocab129280/decode1", "v41-flash": "v41/vocab129280/decode64"},
    # mHC: a V4 prefill chunk and a V4.1 decode step at a site; the V4 head at decode, V4.1's at prefill
    "hc_pre": {"v4-flash": "v4/site_d4096/prefill4096", "v41-flash": "v41/site_d5120/decode16"},
    "hc_post": {"v4-flash": "v4/site_d4096/prefill4096", "v41-flash": "v41/site_d5120/decode16"},
    "hc_head": {"v4-flash": "v4/head_d4096/decode64", "v41-flash": "v41/head_d5120/prefill4096"},
    # Engram (V4.1 alone): the hash of a prefill chunk, the gate at a decode step (each its first
    # build case's sizes, so that CI's cubin test and this build share one artifact)
    "engram_hash": {"v41-flash": "v41/ngram4_h8/prefill4096"},
    "engram_gate": {"v41-flash": "v41/streams_d5120/decode64"},
    # V4.1's candidate pool (V4.1 alone) at a decode step over 1M positions: its build case's sizes
    "candidate_pool": {"v41-flash": "v41/r1_ctx1m/decode16"},
    "rope": {"v4-flash": "v4/index_q_h64_d128/decode16", "v41-flash": "v41/q_h64_d512/prefill4096"},
    # the cache rows' round trip: V4's window rows at a prefill chunk, V4.1's at a decode step (FP8)
    "kv_round": {"v4-flash": "v4/window_fp8_64_d448/prefill4096", "v41-flash": "v41/window_fp8_32_d512/decode16"},
}


@dataclass
class Row:
    spec: str
    shape: str
    target: str
    status: str  # "generated", "built" or "refused"
    reason: str = ""  # why refused, short (see ``reason_of``)
    seconds: float = 0.0
    error: Exception | None = None  # generation's exception (a build keeps only its message)
    message: str = ""  # the whole error message
    sources: tuple[str, ...] = ()  # generated: each phase's TileLang source


def reason_of(kind: str, message: str) -> str:
    """A refusal in a few words that group alike shapes: the error kind, what it says up to the
    first number or detail, and the spec line it names."""
    where = re.search(r"kernels_spec/(\w+\.py:\d+)", message)
    body = re.sub(r"^.*?kernels_spec/\w+\.py:\d+\s+`[^`]*`:\s*", "", message)
    body = re.sub(r"^(sm90|sm100|ascend950):\s*", "", body)
    body = re.sub(r"\s*\([^)]*\)", "", body)  # "UB (unified buffer) overflow" -> "UB overflow"
    head = re.split(r"[;:(]|\s\d", body, maxsplit=1)[0].strip().rstrip(",")  # "L1 overflow" keeps its 1
    return f"{kind}: {head}" + (f" at {where.group(1)}" if where else "")


def generate_row(spec, shape: str, case: dict, target: str) -> Row:
    t0 = time.perf_counter()
    try:
        arts = generate_case(spec, case, target)  # the config a user gets
        return Row(spec.name, shape, target, "generated", seconds=time.perf_counter() - t0,
                   sources=tuple(a.stages["tilelang"] for a in arts))
    except DslError as err:
        msg = str(err)
        return Row(spec.name, shape, target, "refused", reason_of(type(err).__name__, msg),
                   time.perf_counter() - t0, err, msg)


def build_row(spec, shape: str, case: dict, target: str) -> Row:
    r = build_case(spec, shape, case, target)  # the config a user gets
    if r.ok:
        return Row(spec.name, shape, target, "built", seconds=r.seconds)
    kind, _, msg = r.error.partition(": ")
    return Row(spec.name, shape, target, "refused", reason_of(kind, msg), r.seconds, message=r.error)


def generation_rows(model: str | None = None, targets=TARGETS, specs=None) -> list[Row]:
    specs = specs or load_all()
    return [generate_row(spec, shape, case, t) for _, spec in sorted(specs.items())
            for shape, case in spec.model_cases(model).items() for t in targets]


def build_rows(model: str | None = None, targets=TARGETS) -> list[Row]:
    specs = load_all()
    out = []
    for name, by_model in sorted(REPRESENTATIVE.items()):
        spec = specs[name]
        for shape in by_model.values():
            if model is None or shape in spec.model_cases(model):
                out += [build_row(spec, shape, spec.model_shapes[shape], t) for t in targets]
    return out


def summary_table(rows: list[Row]) -> str:
    """One row a spec and target: how many model shapes generated, and the refusals by reason."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.spec, r.target)].append(r)
    lines = ["| spec | target | generated | refused (shapes: reason) |", "|---|---|---|---|"]
    for (spec, target), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        ok = sum(r.status != "refused" for r in rs)
        why = Counter(r.reason for r in rs if r.status == "refused")
        refused = "; ".join(f"{n}: {reason}" for reason, n in why.most_common()) or "-"
        lines.append(f"| {spec} | {target} | {ok} of {len(rs)} | {refused} |")
    return "\n".join(lines)


def detail_table(rows: list[Row], seconds: bool = False) -> str:
    """One row a shape and target (with ``seconds``: how long each took)."""
    head = "| spec | shape | target | result |" + (" seconds |" if seconds else "")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for r in rows:
        result = r.status if r.status != "refused" else f"refused: {r.reason}"
        lines.append(f"| {r.spec} | {r.shape} | {r.target} | {result} |" + (f" {r.seconds:.1f} |" if seconds else ""))
    return "\n".join(lines)


def build_table(rows: list[Row]) -> str:
    return detail_table(rows, seconds=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="v4-flash / v41-flash (or v4 / v41); both by default")
    ap.add_argument("--target", default=",".join(TARGETS), help="comma-separated targets")
    ap.add_argument("--all", action="store_true", help="one row a shape and target")
    ap.add_argument("--build", action="store_true", help="also build one representative shape per spec and model")
    args = ap.parse_args(argv)
    targets = tuple(args.target.split(","))
    rows = generation_rows(args.model, targets)
    print(f"Generation at every model shape ({len(rows)} spec x shape x target):\n")
    print(detail_table(rows) if args.all else summary_table(rows))
    if args.build:
        print("\nFull builds, one representative shape per spec and model:\n")
        print(build_table(build_rows(args.model, targets)))


if __name__ == "__main__":
    main()
