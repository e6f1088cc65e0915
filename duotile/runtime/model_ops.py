"""The model's ops: the named units of the forward that a generated kernel may serve, and their count.

A model op is a function of the reference forward marked ``@model_op("name")``, whose parameters
include the step's ``ctx`` (``layers.common.Ctx``). A call asks ``ctx.ops.kernel_for(name)``: a
callable with the op's own signature that runs duotile kernels (``generated.GeneratedOps``), or
``None`` (the PyTorch flavours of ``ops.py``). It runs that, or the reference body, and counts the
call in ``ctx.tally`` as served by a generated kernel or by the reference. So a generation's report
says, op by op, what ran where; with ``--kernels generated`` an op at zero reference calls ran on
kernels only. Ops nest (a reference ``linear_q`` calls ``act_quant``, a reference ``hc_head`` calls
``linear``), and each level is counted on its own; a kernel that serves an outer op makes no inner
calls.

The ops, in the order a decoder layer meets them, are listed in ``OPS`` with what each computes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

OPS: dict[str, str] = {
    "embed": "token embedding rows",
    "engram_hash": "V4.1 Engram: the table rows of each token's n-grams (rolling hashes)",
    "engram": "V4.1 Engram: hashed n-gram rows, gated into the streams",
    "hc_pre": "mHC mixes of a site: pre, post and the Sinkhorn-normalised comb",
    "hc_collapse": "mHC collapse: sum of the streams weighted by pre",
    "hc_post": "mHC expand: post * f + comb-mixed residual streams",
    "hc_head": "V4's final mHC collapse (sigmoid weights, no Sinkhorn)",
    "rms_norm": "RMSNorm (weighted, or the unweighted per-head query norm)",
    "act_quant": "activation quantisation round trip (FP8 e4m3, UE8M0 block scales)",
    "linear": "a GEMM against an unquantised weight",
    "linear_q": "a GEMM against an FP8 / FP4 weight, its activation quantised first",
    "grouped_linear_q": "the grouped wo_a as engines run it: each group's activation quantised, its FP8 block",
    "rope": "interleaved rotary embedding of the rope channels (inverse at -P too)",
    "kv_round": "the window / compressed KV row's cache-format round trip",
    "kv_insert": "V4.1's window row of a decode step, fused: kv norm, rope, FP8 bytes, written into its ring slot",
    "kv_encode": "V4.1's window / compressed KV rows as the cache stores them (FP8 + UE8M0, NVFP4-like bytes)",
    "compress": "compressor pooling of completed windows (gated softmax over a window's slots)",
    "compress_decode": "compressor pooling of a decode step: one new token a sequence, all sequences at once",
    "index_scores": "lightning-indexer scores of the visible compressed rows",
    "candidate_pool": "V4.1 candidate pool: block maxima, newest block forced, top blocks (and their list)",
    "index_scores_pool": "V4.1 Reindex layers: index scores of the candidate pool's positions alone",
    "topk": "top-k selection of the scored rows (ties to the lowest index)",
    "sparse_attention": "one softmax with the sink over a query's window and selected rows",
    "sparse_attention_rows": "a prefill chunk's sparse_attention over rows its queries share, by index lists",
    "sparse_attention_stored": "a decode step's sparse_attention over the cache rows as stored, out rotated by -P",
    "route": "router scores and the chosen experts and weights",
    "moe_experts": "the FFN's experts: routed and shared clamped SwiGLU, and the fixed-order combine",
    "expert": "one (shared) expert's clamped SwiGLU",
    "lm_head": "final RMSNorm and the vocabulary projection (FP32 logits)",
    "sample": "one token per request from its logits, seeded by (seed, position)",
}


@dataclass
class Tally:
    """Calls per op: ``{name: [generated, reference]}``."""

    calls: dict[str, list[int]] = field(default_factory=dict)

    def count(self, name: str, generated: bool) -> None:
        row = self.calls.setdefault(name, [0, 0])
        row[0 if generated else 1] += 1

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (g, r) for k, (g, r) in self.calls.items()}

    def restore(self, before: dict[str, tuple[int, int]]) -> None:
        """Back to ``before`` (a ``snapshot``): calls recorded but never run (a graph's capture)."""
        self.calls = {k: [g, r] for k, (g, r) in before.items()}

    def add(self, calls: dict[str, tuple[int, int]]) -> None:
        """Count ``calls`` (per op: generated, reference) once more: a graph's replay."""
        for k, (g, r) in calls.items():
            row = self.calls.setdefault(k, [0, 0])
            row[0] += g
            row[1] += r

    def since(self, before: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """The calls made after ``before`` (a ``snapshot``), per op: (generated, reference)."""
        out = {}
        for k, (g, r) in self.calls.items():
            g0, r0 = before.get(k, (0, 0))
            if (g - g0, r - r0) != (0, 0):
                out[k] = (g - g0, r - r0)
        return out


def model_op(name: str) -> Callable:
    """Mark a reference function as the model op ``name`` (see the module docstring)."""
    if name not in OPS:
        raise ValueError(f"model op {name!r} is not one of OPS")

    def wrap(fn: Callable) -> Callable:
        at = list(inspect.signature(fn).parameters).index("ctx")

        @functools.wraps(fn)
        def run(*args, **kw):
            ctx = args[at] if len(args) > at else kw["ctx"]
            return dispatch(ctx, name, fn, args, kw)

        run.model_op = name
        return run

    return wrap


def dispatch(ctx, name: str, reference: Callable, args: tuple, kw: dict):
    """Run op ``name``: the kernel ``ctx.ops`` has for it (it may decline a call by returning
    ``NotImplemented``: a form it has no kernel for), else ``reference``; count which."""
    kernel = ctx.ops.kernel_for(name)
    if kernel is not None:
        out = kernel(*args, **kw)
        if out is not NotImplemented:
            ctx.tally.count(name, True)
            return out
    ctx.tally.count(name, False)
    return reference(*args, **kw)


def format_report(calls: dict[str, tuple[int, int]], builds: dict[str, int] | None = None) -> list[str]:
    """One line per op that ran, in ``OPS`` order: 'op: G generated, R reference', and the builds
    made for an op's kernels where ``builds`` names them."""
    order, builds = list(OPS), builds or {}
    lines = []
    for op, (g, r) in sorted(calls.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        made = f" (on {builds[op]} build(s))" if op in builds else ""
        lines.append(f"{op}: {g} generated{made}, {r} reference")
    return lines
