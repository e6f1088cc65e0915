"""Mixture of experts: sqrt-softplus router (hash or noaux top-k), clamped SwiGLU experts (model.md 2.6)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..device import ship
from ..model_ops import model_op
from .common import Ctx, Linear, act_quant, matmul


class Expert:
    """Clamped SwiGLU: up in [-limit, limit], gate <= limit; an optional per-row weight before w2."""

    def __init__(self, w1: Linear, w3: Linear, w2: Linear, limit: float):
        self.w1, self.w3, self.w2, self.limit = w1, w3, w2, limit

    @model_op("expert")
    def __call__(self, ctx: Ctx, xq: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """xq: activations already act-quantised (shared by all experts of a token). Returns FP32."""
        g = ctx.act(ctx.ops.linear(xq, self.w1.weight)).float()
        u = ctx.act(ctx.ops.linear(xq, self.w3.weight)).float()
        a = ctx.ops.silu(g.clamp(max=self.limit)) * u.clamp(-self.limit, self.limit)
        if weight is not None:
            a = a * weight[:, None]
        return ctx.act(self.w2(ctx, ctx.act(a))).float()


class MoE:
    def __init__(self, cfg: ModelConfig, gate: torch.Tensor, bias: torch.Tensor | None,
                 tid2eid: torch.Tensor | None, experts: list[Expert], shared: Expert | None, act_block: int):
        self.gate, self.bias, self.tid2eid = gate, bias, tid2eid
        self.experts, self.shared, self.act_block = experts, shared, act_block
        self.topk, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.stack: dict | None = None  # the routed experts' codes stacked once (reference._expert_stack)

    def route(self, ctx: Ctx, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and weights [T, k] (FP32): the gate GEMM, then the choice."""
        return self.choose(ctx, matmul(ctx, x, self.gate), tokens)

    @model_op("route")
    def choose(self, ctx: Ctx, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and weights of gate logits [T, E]: sqrt(softplus), top-k by score + bias (or
        the hash table's row of each token), the unbiased scores renormalised and scaled."""
        ops = ctx.ops
        s = torch.sqrt(ops.softplus(logits))
        if self.tid2eid is not None:
            idx = self.tid2eid[ship(tokens, self.tid2eid.device)]
        else:
            idx = torch.sort(s + self.bias, dim=-1, descending=True, stable=True).indices[:, : self.topk]
        w = s.gather(-1, idx)
        w = w / ops.sum(w, -1).unsqueeze(-1) * self.scale
        return idx, w

    def __call__(self, ctx: Ctx, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        idx, w = self.route(ctx, x, tokens)
        return self.experts_out(ctx, x, idx, w)

    @model_op("moe_experts")
    def experts_out(self, ctx: Ctx, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The FFN's output in the activation dtype: the activation quantised once, every token's
        routed experts weighted and summed over its k choices in a fixed order, plus the shared
        expert."""
        xq = act_quant(ctx, x, self.act_block) if ctx.quant else x.float()
        out = self.routed(ctx, xq, idx, w)
        if self.shared is not None:
            out = out + self.shared(ctx, xq)
        return ctx.act(out)

    def routed(self, ctx: Ctx, xq: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The routed experts of every token, weighted, summed over its k choices in a fixed order (FP32)."""
        y = torch.zeros(xq.shape[0], idx.shape[1], xq.shape[1], dtype=torch.float32, device=xq.device)
        for e in torch.unique(idx).tolist():
            rows, slots = (idx == e).nonzero(as_tuple=True)
            y[rows, slots] = self.experts[e](ctx, xq[rows], w[rows, slots])
        return ctx.ops.sum(y, 1)
