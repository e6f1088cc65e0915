"""Manifold-constrained hyper-connections (model.md 2.3; V4.1 single-pass wiring in 2.13).

All mixing math is FP32; the residual streams X [T, n, D] are stored in the activation dtype.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model_ops import model_op
from .common import Ctx, matmul


class HCSite:
    """One mHC site (attention or FFN): `fn` [(2+n)n, nD], `base` [(2+n)n], `scale` [3]."""

    def __init__(self, cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        self.n, self.iters, self.hc_eps, self.eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn, self.base, self.scale = fn, base, scale

    @model_op("hc_pre")
    def mixes(self, ctx: Ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre [T, n], post [T, n], comb [T, n, n] from the current streams."""
        ops, n = ctx.ops, self.n
        v = x.float().flatten(1)
        rinv = ops.rsqrt(ops.mean(v * v, -1) + self.eps)
        m = matmul(ctx, v, self.fn) * rinv[:, None]
        pre = ops.sigmoid(m[:, :n] * self.scale[0] + self.base[:n]) + self.hc_eps
        post = 2 * ops.sigmoid(m[:, n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        c0 = (m[:, 2 * n :] * self.scale[2] + self.base[2 * n :]).view(-1, n, n)
        return pre, post, self.sinkhorn(ctx, c0)

    def sinkhorn(self, ctx: Ctx, c0: torch.Tensor) -> torch.Tensor:
        """Row softmax, then column-first alternating normalisation (1 + iters-1 rounds), eps everywhere."""
        ops, eps = ctx.ops, self.hc_eps
        m = ops.softmax(c0, -1) + eps
        m = m / (ops.sum(m, -2).unsqueeze(-2) + eps)
        for _ in range(self.iters - 1):
            m = m / (ops.sum(m, -1).unsqueeze(-1) + eps)
            m = m / (ops.sum(m, -2).unsqueeze(-2) + eps)
        return m


@model_op("hc_collapse")
def collapse(ctx: Ctx, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_s pre_s * X[s] (FP32 accumulate) in the activation dtype."""
    return ctx.act(ctx.ops.sum(pre[:, :, None] * x.float(), 1))


@model_op("hc_post")
def expand(ctx: Ctx, f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[j] = post_j * f + sum_i comb[i, j] * R[i]  (contracting comb's first index)."""
    mixed = ctx.ops.sum(comb[:, :, :, None] * residual.float()[:, :, None, :], 1)
    return ctx.act(post[:, :, None] * f.float()[:, None, :] + mixed)


class HCHead:
    """Final V4 collapse with `hc_head_*` (sigmoid weights, no Sinkhorn)."""

    def __init__(self, cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        self.eps, self.hc_eps = cfg.rms_norm_eps, cfg.hc_eps
        self.fn, self.base, self.scale = fn, base, scale

    @model_op("hc_head")
    def __call__(self, ctx: Ctx, x: torch.Tensor) -> torch.Tensor:
        ops = ctx.ops
        v = x.float().flatten(1)
        rinv = ops.rsqrt(ops.mean(v * v, -1) + self.eps)
        m = matmul(ctx, v, self.fn) * rinv[:, None]
        pre = ops.sigmoid(m * self.scale[0] + self.base) + self.hc_eps
        return collapse(ctx, x, pre)
