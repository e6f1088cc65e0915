"""Generated kernels inside the runtime: an ops flavour that runs duotile kernels where one exists.

`GeneratedOps(base)` forwards every primitive to `base` (`FastOps` or `InvariantOps`) and serves
the model ops (model_ops.py) a kernel spec covers: `kernel_for(op)` hands the forward a function
with the op's signature, which runs the spec (in `_OP_OF`) and returns what the reference returns:

* on an sm90 GPU (compute capability 9.0) as its sm90 build, elsewhere on the interpreter (the
  same Tile IR executed with PyTorch: slow, but the same arithmetic order on any machine);
* with the config `codegen.compile` finds: the user's tuning cache, then the table shipped in
  `duotile/tuned/` (H200), else the kernel's defaults.

A function may decline a call it has no kernel form for (returning ``NotImplemented``: an empty
tensor, the unweighted norm, FP32 activations where the kernel takes BF16); the reference runs it
then, and the report counts it as a reference call. The kernels reduce each row on its own, in an
order fixed by their configs, so a row's result never depends on the batch around it
(`check_batch_invariance` proves a config cannot change that order with the batch size). They are
not bitwise equal to the reference ops: sums run in another order, the indexer keeps its dot
products in FP32 where the reference rounds them to BF16, and attention writes BF16. `duotile
generate --kernels generated` selects this flavour.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any

import torch

from ..ops import FastOps
from .ahead import BuildDeferred, DeferringKernel
from .attention import AttentionKernels
from .dense import DenseKernels
from .moe import MoEKernels
from .streams import StreamKernels

# spec -> the model op its builds are reported under (hc_head's pre_in form serves hc_collapse)
_OP_OF = {
    "rmsnorm": "rms_norm", "gather_rows": "embed", "topk": "topk", "router": "route",
    "sparse_mqa_decode": "sparse_attention", "indexer_logits": "index_scores",
    "indexer_logits_prefill": "index_scores", "hc_pre": "hc_pre",
    "hc_post": "hc_post", "hc_head": "hc_head", "quantize": "linear_q", "gemm_blockscaled": "linear_q",
    "sample": "sample", "gemm": "linear", "engram_hash": "engram_hash", "engram_gate": "engram",
    "moe_permute": "moe_experts", "moe_gemm_mxfp4": "moe_experts", "swiglu_quant": "moe_experts",
    "moe_combine": "moe_experts", "candidate_pool": "candidate_pool", "compressor_prefill": "compress",
    "compressor_decode": "compress_decode",
    "rope": "rope", "kv_round": "kv_round", "gemm_f32": "linear", "quantize_fp4": "kv_encode",
    "sparse_mqa_decode_fp8": "sparse_attention_stored", "sparse_mqa_decode_fp8_nope": "sparse_attention_stored",
    "sparse_mqa_prefill": "sparse_attention_rows",
    "kv_insert": "kv_insert", "indexer_logits_pool": "index_scores_pool",
}

class GeneratedOps(DenseKernels, AttentionKernels, StreamKernels, MoEKernels):
    """`base`'s primitives, with the model ops a duotile kernel covers served by the kernels (the
    methods of the mixins, one module per area)."""

    def __init__(self, base: FastOps):
        self.base = base
        self.invariant = base.invariant
        self._kernels: dict[tuple, Any] = {}
        self._by_call: dict[tuple, Any] = {}  # the same kernels by the calls' own (unsorted) keys
        self._consts: dict[tuple, Any] = {}  # small constant tensors by what and device (a norm's unit weight)
        self._serves = {"rms_norm": self._rms_norm, "embed": self._embed, "topk": self._topk,
                        "route": self._route, "sparse_attention": self._sparse_attention,
                        "index_scores": self._index_scores, "hc_pre": self._hc_pre,
                        "hc_collapse": self._hc_collapse, "hc_post": self._hc_post, "hc_head": self._hc_head,
                        "linear_q": self._linear_q, "grouped_linear_q": self._grouped_linear_q,
                        "sample": self._sample, "linear": self._linear,
                        "lm_head": self._lm_head, "engram_hash": self._engram_hash, "engram": self._engram,
                        "moe_experts": self._moe_experts, "candidate_pool": self._candidate_pool,
                        "compress": self._compress, "compress_decode": self._compress_decode,
                        "rope": self._rope, "kv_round": self._kv_round, "kv_encode": self._kv_encode,
                        "kv_insert": self._kv_insert,
                        "sparse_attention_stored": self._sparse_attention_stored,
                        "sparse_attention_rows": self._sparse_attention_rows,
                        "index_scores_pool": self._index_scores_pool}
        self._moe_packs: dict[int, tuple] = {}  # id(MoE) -> (the MoE, its weights stacked for the kernels)
        # weight's place -> (weight, version, BF16 copy or None), the most recent BF16_KEPT of them: a
        # weight dequantised for one use (a packed-only layer on the reference path) is not kept long
        self._bf16: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self._ahead = None  # while building ahead (ahead.py): calls without a build are deferred
        self._held: list | None = None  # while a CUDA graph captures: the cached tensors it reads (`holding`)
        self._fp8_input = None  # the latest decode output with wo_a's FP8 input beside it (attention.py)
        self.fused_fp8_inputs = 0  # wo_a inputs taken from an attention kernel rather than quantised again

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def kernel_for(self, op: str):
        fn = self._serves.get(op)
        if fn is None or self._ahead is None:
            return fn
        return functools.partial(_declining_deferred, fn)

    @contextlib.contextmanager
    def holding(self):
        """Collects the cached tensors the ops hand to kernels inside, for a CUDA graph captured
        inside to keep: its replays read them at their addresses, and a replay, running no Python,
        does not keep them recent in their cache. The one cache that drops entries is the weights'
        BF16 copies (the most recent BF16_KEPT); an evicted copy's memory would go to other tensors
        while the graph still reads it. The launches' other tensors are not collected: the model
        holds the weights and the other caches keep every entry, and what the capture allocates
        belongs to the graph's memory pool, which later captures may share once the capture drops
        it (a graph held every one would keep each capture's intermediates to itself)."""
        saved, self._held = self._held, []
        try:
            yield self._held
        finally:
            self._held = saved

    def builds(self) -> dict[str, int]:
        """Per op: the builds made for it. A kernel whose sizes are dynamic builds once for every
        token count and batch (``codegen.compile`` caches one build per call signature, dynamic
        sizes left out)."""
        out: dict[str, int] = {}
        for (spec_name, *_), kernel in self._kernels.items():
            op = _OP_OF.get(spec_name, spec_name)
            out[op] = out.get(op, 0) + len(kernel._cache)
        return out

    def signatures(self) -> list:
        """The distinct build signatures of the calls made so far (``codegen.prebuild``): what
        ``duotile build --signatures`` builds ahead for another run."""
        from ...codegen.prebuild import signatures_of

        return signatures_of(self._kernels.values())

    def _kernel(self, spec_name: str, device: torch.device, constants: dict) -> Any:
        # a call's own form of the key first (no sorting, no device name: a few us a call, and a
        # decode step makes hundreds), then the canonical one
        kernel = self._by_call.get((spec_name, device, *constants.items()))
        if kernel is None:
            kernel = self._by_call[(spec_name, device, *constants.items())] = self._compiled(spec_name, device,
                                                                                              constants)
        if self._ahead is not None:
            return DeferringKernel(kernel, self._ahead)
        return kernel

    def _compiled(self, spec_name: str, device: torch.device, constants: dict) -> Any:
        from ... import codegen
        from ...kernels_spec import get

        key = (spec_name, str(device), tuple(sorted(constants.items())))
        if key not in self._kernels:
            sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            self._kernels[key] = codegen.compile(get(spec_name).kernel, "sm90" if sm90 else "interpret",
                                                 constants=constants)
        return self._kernels[key]


def _declining_deferred(fn, *args, **kw):
    """``fn``, or ``NotImplemented`` (the reference runs the op) where a kernel call of it was
    deferred while building ahead."""
    try:
        return fn(*args, **kw)
    except BuildDeferred:
        return NotImplemented
