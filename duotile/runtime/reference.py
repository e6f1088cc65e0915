"""The whole V4 / V4.1 forward in plain PyTorch: prefill chunks and one-token decode with state.

`Model.forward(step)` runs several sequences at once, each with a chunk of new tokens (a decode step
is a chunk of one). Token-parallel work (projections, norms, mHC, MoE) runs on all rows of the step;
cache updates and attention run per sequence. Blocks follow model.md 2.1 (V4, two-pass mHC) and 2.13
(V4.1, single-pass mHC with Engram); the MTP layer / DSpark blocks are loaded by the checkpoint reader
but not run. V4.1 runs every layer on every prompt token (exact full decoder prefill, no bounded
replay - model.md 3.5).
"""

from __future__ import annotations

import os

import torch

from .cache import SequenceCache
from .config import ModelConfig
from .device import resolve_device, ship
from .graphs import Sections
from .layers.attention_v4 import AttentionV4
from .layers.attention_v41 import AttentionV41
from .layers.common import Ctx, WeightSource, rms_norm
from .layers.engram import Engram
from .layers.mhc import HCHead, HCSite, collapse, expand
from .layers.moe import Expert, MoE
from .layers.step import Step, StepSeq
from .model_ops import model_op
from .ops import FastOps, InvariantOps
from .stored import NOPE_ROPE
from .weights import Checkpoint


def _moe(cfg: ModelConfig, ws: WeightSource, layer: int) -> MoE:
    p, limit = f"layers.{layer}.ffn.", cfg.swiglu_limit
    stack = _expert_stack(cfg, ws, p)
    experts = []
    for e in range(cfg.n_routed_experts):
        views = [None] * 3 if stack is None else [
            ("fp4", stack["w13"][e, rows], stack["s13"][e, rows]) for rows in (stack["w1"], stack["w3"])] + [
            ("fp4", stack["w2"][e], stack["s2"][e])]
        experts.append(Expert(*(ws.linear(f"{p}experts.{e}.{w}", packed=v) for w, v in zip(("w1", "w3", "w2"), views)),
                              limit))
    shared = None
    if cfg.n_shared_experts:
        shared = Expert(ws.linear(p + "shared_experts.w1"), ws.linear(p + "shared_experts.w3"),
                        ws.linear(p + "shared_experts.w2"), limit)
    hashed = cfg.is_hash_layer(layer)
    moe = MoE(cfg, ws.t(p + "gate.weight"), None if hashed else ws.t(p + "gate.bias"),
              ws.t(p + "gate.tid2eid") if hashed else None, experts, shared, ws.act_block)
    moe.stack = stack
    return moe


def _expert_stack(cfg: ModelConfig, ws: WeightSource, p: str) -> dict | None:
    """The routed experts' MXFP4 codes as the grouped GEMM reads them, placed once: ``w13`` [E, 2I,
    D / 2] (w1 then w3 of each expert) with ``s13`` [E, 2I, D / 32], ``w2`` [E, D, I / 2] with
    ``s2``; each expert's ``Linear`` holds views of them. None where the experts' codes are not kept
    (``ws.packed`` false) or are not MXFP4."""
    n = cfg.n_routed_experts
    if not ws.packed or not n or ws.ckpt.specs[ws.weight_name(f"{p}experts.0.w1")].kind != "fp4":
        return None
    parts = {w: [ws.ckpt.packed(ws.weight_name(f"{p}experts.{e}.{w}")) for e in range(n)] for w in ("w1", "w3", "w2")}
    inter = parts["w1"][0][1].shape[0]
    stack = {"w13": torch.empty((n, 2 * inter, *parts["w1"][0][1].shape[1:]), dtype=torch.uint8, device=ws.device),
             "s13": torch.empty((n, 2 * inter, *parts["w1"][0][2].shape[1:]), dtype=torch.uint8, device=ws.device),
             "w2": torch.empty((n, *parts["w2"][0][1].shape), dtype=torch.uint8, device=ws.device),
             "s2": torch.empty((n, *parts["w2"][0][2].shape), dtype=torch.uint8, device=ws.device)}
    for e in range(n):
        for w, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
            stack["w13"][e, rows].copy_(parts[w][e][1])
            stack["s13"][e, rows].copy_(parts[w][e][2])
        stack["w2"][e].copy_(parts["w2"][e][1])
        stack["s2"][e].copy_(parts["w2"][e][2])
    ws.device_bytes += sum(t.numel() for t in stack.values())
    return {**stack, "w1": slice(0, inter), "w3": slice(inter, 2 * inter)}


class Block:
    """One decoder layer: [Engram], attention site, FFN site."""

    def __init__(self, cfg: ModelConfig, ws: WeightSource, layer: int):
        p = f"layers.{layer}."
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.attn_norm, self.ffn_norm = ws.t(p + "attn_norm.weight"), ws.t(p + "ffn_norm.weight")
        self.hc_attn = HCSite(cfg, ws.t(p + "hc_attn_fn"), ws.t(p + "hc_attn_base"), ws.t(p + "hc_attn_scale"))
        self.hc_ffn = HCSite(cfg, ws.t(p + "hc_ffn_fn"), ws.t(p + "hc_ffn_base"), ws.t(p + "hc_ffn_scale"))
        self.attn = (AttentionV41 if cfg.is_v41 else AttentionV4)(cfg, ws, layer)
        self.moe = _moe(cfg, ws, layer)
        self.engram = Engram(cfg, ws, layer) if layer in cfg.engram_layer_ids else None

    def _norm(self, ctx: Ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ctx.act(rms_norm(ctx, x, w, self.eps))

    def two_pass(self, ctx: Ctx, x: torch.Tensor, step: Step) -> torch.Tensor:
        """V4: each site collapses with the `pre` it computes from the current streams."""
        *heads, _ = self._attention(ctx, x, None, step)
        return self._ffn(ctx, *heads, None, step)[0]

    def single_pass(self, ctx: Ctx, x: torch.Tensor, pre_prev: torch.Tensor, step: Step):
        """V4.1: each site collapses with the `pre` of the previous site; returns (X, pre for the next)."""
        if self.engram is not None:
            ids = torch.cat([self.engram.rows_of(ctx, s.cache.engram_history, s.tokens) for s in step.seqs])
            x = self.engram(ctx, x, ids)
        *heads, pre_a = self._attention(ctx, x, pre_prev, step)
        return self._ffn(ctx, *heads, pre_a, step)

    def _attention(self, ctx: Ctx, x: torch.Tensor, pre_in: torch.Tensor | None, step: Step):
        """The attention site up to its heads' outputs: (the outputs, the streams, post, comb, the
        site's pre). It collapses with ``pre_in`` (V4.1: the previous site's), or with the pre it
        computes (V4). Its first part, the site's mixes, the collapse, the norm and the row-only
        projections, has the step's token count's shapes alone: it runs from a CUDA graph where
        the model keeps them (graphs.py); the rest (rope at the step's positions, the caches, the
        selection, attention) runs as it comes."""
        def projections(x: torch.Tensor, *pre_in: torch.Tensor):
            pre, post, comb = self.hc_attn.mixes(ctx, x)
            a_in = self._norm(ctx, collapse(ctx, x, pre_in[0] if pre_in else pre), self.attn_norm)
            return pre, post, comb, a_in, *self.attn.project(ctx, a_in)

        pre, post, comb, a_in, *projected = self._section(ctx, "attention", projections, x,
                                                          *(() if pre_in is None else (pre_in,)))
        return self.attn.heads(ctx, a_in, step, tuple(projected)), x, post, comb, pre

    def _ffn(self, ctx: Ctx, o: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             pre_in: torch.Tensor | None, step: Step):
        """The attention's output projection and expand, then the FFN half: (X after them, the FFN
        site's pre), collapsed as ``_attention`` does. Their shapes are the step's token count's
        alone: they run from a CUDA graph where the model keeps them. With ``ctx.fp8_wo_a`` the
        output projection runs before the graph: its FP8 input may come from the attention
        kernel beside ``o`` (generated/attention.py), which a graph's copy of ``o`` is not."""
        def half(x: torch.Tensor, tokens: torch.Tensor, o: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 *pre_in: torch.Tensor):
            x = expand(ctx, o if ctx.fp8_wo_a else self.attn.output(ctx, o), x, post, comb)
            pre_f, post, comb = self.hc_ffn.mixes(ctx, x)
            f = self.moe(ctx, self._norm(ctx, collapse(ctx, x, pre_in[0] if pre_in else pre_f), self.ffn_norm),
                         tokens)
            return expand(ctx, f, x, post, comb), pre_f

        if ctx.fp8_wo_a:
            o = self.attn.output(ctx, o)
        return self._section(ctx, "ffn", half, x, step.device_tokens(x.device), o, post, comb,
                             *(() if pre_in is None else (pre_in,)))

    def _section(self, ctx: Ctx, name: str, fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if ctx.sections is None:
            return fn(*inputs)
        return ctx.sections.run(ctx.tally, (name, self.layer), fn, *inputs)


@model_op("embed")
def embed(ctx: Ctx, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ``tokens``."""
    return table[tokens.to(table.device)]


@model_op("lm_head")
def lm_head(ctx: Ctx, h: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float) -> torch.Tensor:
    """FP32 logits of the picked rows: the final RMSNorm (rounded to the activation dtype), then the
    vocabulary projection."""
    return ctx.ops.linear(ctx.act(ctx.ops.rms_norm(h, norm, eps)), head)


KERNELS = ("reference", "generated")
DTYPES = (torch.bfloat16, torch.float32)


def check_dtype(dtype) -> None:
    """The activation dtype must be one the forward is written for (BF16 like the release, or FP32)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; the activation dtype must be one of "
                         f"{', '.join(map(str, DTYPES))}")


def make_ops(batch_invariant: bool, kernels: str = "reference"):
    """The primitives a model runs on: PyTorch's (`reference`), or with duotile's generated kernels
    swapped in where a spec covers the op (`generated`, see the generated package)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: {kernels!r} is not one of {', '.join(KERNELS)}")
    ops = InvariantOps() if batch_invariant else FastOps()
    if kernels == "generated":
        from .generated import GeneratedOps

        ops = GeneratedOps(ops)
    return ops


GRAPH_TOKENS = 64  # the most tokens of a step whose sections replay from graphs: model.md's decode batches


class Model:
    """The reference model built from a validated checkpoint."""

    def __init__(self, checkpoint: Checkpoint, *, dtype: torch.dtype = torch.bfloat16, quant: bool = True,
                 batch_invariant: bool = False, device: torch.device | str = "cpu", kernels: str = "reference",
                 packed_only: bool | None = None, stored_rows: bool | None = None, fp8_wo_a: bool = False,
                 graphs: bool = False):
        """``packed_only``: keep the quantised weights as released codes alone, each dequantised at
        its use on the reference path (a quarter or an eighth of the dequantised bytes); by default
        so with the generated kernels (they read the codes), never with the reference ops.
        ``stored_rows``: keep the window rings, compressed rows and index keys as their bytes
        (``stored.py``: V4.1's 528- and 288-byte rows, V4's 584-byte ones, 68-byte keys), by default
        wherever the rows are quantised (``quant``); the values read from them are the ones the
        dequantised cache held. ``fp8_wo_a``: run the grouped ``wo_a`` as engines do, its input
        quantised to FP8 like every other FP8 projection's, on the weight's codes, rather than in
        BF16 on its dequantised value as the released reference does (model.md 2.10); needs
        ``quant``. Off by default: the reference's numerics. ``graphs``: replay each layer's attention
        projections and FFN half of a step of at most ``GRAPH_TOKENS`` tokens from CUDA graphs
        (graphs.py); needs the generated kernels on a CUDA device. Off by default: right on the
        one GPU workload it has run, its bitwise GPU test not yet run (docs/runtime.md).
        ``DUOTILE_GRAPHS_CHECK=1`` also runs each replayed section eagerly and raises where a bit
        differs (``graphs.ReplayMismatch``)."""
        check_dtype(dtype)
        device = resolve_device(device)
        cfg = self.config = checkpoint.config
        packed = kernels == "generated" if packed_only is None else packed_only
        if fp8_wo_a and not quant:
            raise ValueError("fp8_wo_a: wo_a's input is quantised to FP8, and with quant=False nothing is quantised")
        ws = WeightSource(checkpoint, device, packed=packed, dequantised=not packed, fp8_wo_a=fp8_wo_a)
        self.device, self.dtype = device, dtype
        self.stored_rows = quant if stored_rows is None else stored_rows
        if self.stored_rows and not quant:
            raise ValueError("stored_rows: the cache rows are stored as their quantised bytes, and with quant=False "
                             "they are not quantised")
        if self.stored_rows and not cfg.is_v41 and cfg.qk_rope_head_dim != NOPE_ROPE:
            raise ValueError(f"stored_rows: V4's rows keep {NOPE_ROPE} rope channels in BF16; this configuration has "
                             f"qk_rope_head_dim = {cfg.qk_rope_head_dim}")
        if graphs and (kernels != "generated" or device.type != "cuda"):
            raise ValueError(f"graphs: CUDA graphs replay generated kernels on a CUDA device; this model runs "
                             f"{kernels} ops on {device}")
        ops = make_ops(batch_invariant, kernels)
        self.ctx = Ctx(ops, dtype, quant, fp8_wo_a=(cfg.o_groups, ws.act_block) if fp8_wo_a else None,
                       sections=Sections(GRAPH_TOKENS, check=os.environ.get("DUOTILE_GRAPHS_CHECK") == "1",
                                         hold=ops.holding) if graphs else None)
        self.embed, self.norm, self.head = ws.t("embed.weight"), ws.t("norm.weight"), ws.t("head.weight")
        self.blocks = [Block(cfg, ws, layer) for layer in range(cfg.num_hidden_layers)]
        self.weight_bytes = ws.device_bytes  # on the device, as kept: packed codes, or dequantised values
        self.weights_kept = "packed" if not ws.dequantised else "dequantised"
        self.checkpoint = checkpoint
        self.hc_head = None
        if not cfg.is_v41:
            self.hc_head = HCHead(cfg, ws.t("hc_head_fn"), ws.t("hc_head_base"), ws.t("hc_head_scale"))

    def nextn_weights(self) -> dict[str, torch.Tensor]:
        """The MTP layer (V4) / DSpark blocks (V4.1), dequantised on demand; running them is a later issue."""
        return {name: self.checkpoint.get(name).to(self.device) for name in self.checkpoint.specs
                if name.startswith("mtp.")}

    def new_cache(self) -> SequenceCache:
        return SequenceCache.create(self.config, self.dtype, self.device, stored=self.stored_rows)

    @torch.no_grad()
    def forward(self, seqs: list[StepSeq], all_logits: bool = False) -> list[torch.Tensor]:
        """Run one step; per sequence, FP32 logits of its last token [V] (or of every token [S, V])."""
        cfg, ctx = self.config, self.ctx
        step = Step(seqs)
        e = ctx.act(embed(ctx, self.embed, step.tokens))
        x = e[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        if cfg.is_v41:
            pre = torch.zeros(x.shape[0], cfg.hc_mult, device=x.device)
            pre[:, 0] = 1.0
            for block in self.blocks:
                x, pre = block.single_pass(ctx, x, pre, step)
            h = collapse(ctx, x, pre)
        else:
            for block in self.blocks:
                x = block.two_pass(ctx, x, step)
            h = self.hc_head(ctx, x)
        self._advance(step)
        rows = [torch.arange(sl.start, sl.stop) if all_logits else torch.tensor([sl.stop - 1]) for sl in step.slices]
        picked = h[ship(torch.cat(rows), h.device)]
        logits = lm_head(ctx, picked, self.norm, self.head, cfg.rms_norm_eps)
        out, at = [], 0
        for r in rows:
            out.append(logits[at : at + len(r)] if all_logits else logits[at])
            at += len(r)
        return out

    def _advance(self, step: Step) -> None:
        look = self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0
        for seq in step.seqs:
            seq.cache.num_tokens += len(seq.tokens)
            if look:
                seq.cache.engram_history = (seq.cache.engram_history + seq.tokens.tolist())[-look:]
