"""What both models' attention layers share: a step's attention split where a CUDA graph needs it.

``project`` makes every projection of the step's rows that reads no position and no cache (the
queries before their rope, the window KV projection, the index queries and head weights), so that
it can replay from a graph (``runtime/graphs.py``); ``heads`` (each model's own) does the rest up
to the heads' outputs; ``output`` is the grouped low-rank output projection.
"""

from __future__ import annotations

import torch

from .common import Ctx, grouped_output, matmul, rms_norm
from .step import Step


class AttentionSite:
    """Mixed into ``AttentionV4`` / ``AttentionV41``, which set the weights and ``indexed``."""

    per_head_norm = False  # V4: the queries take an unweighted RMSNorm per head

    @property
    def indexed(self) -> bool:
        """Whether the layer scores compressed rows with index queries of its own."""
        raise NotImplementedError

    def __call__(self, ctx: Ctx, x: torch.Tensor, step: Step, projected: tuple | None = None) -> torch.Tensor:
        """The attention output of the step's rows ``x``, projected (``output``)."""
        return self.output(ctx, self.heads(ctx, x, step, projected))

    def project(self, ctx: Ctx, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's projections of its rows alone: the queries before their rope, the window KV
        projection and, on an indexed layer, the index queries before their rope and the index
        head weights."""
        cfg, t = self.cfg, x.shape[0]
        qr = ctx.act(rms_norm(ctx, self.wq_a(ctx, x), self.q_norm, cfg.rms_norm_eps))
        q = ctx.act(self.wq_b(ctx, qr)).view(t, cfg.num_attention_heads, cfg.head_dim)
        if self.per_head_norm:
            q = ctx.act(rms_norm(ctx, q, None, cfg.rms_norm_eps))
        kvw = self.wkv(ctx, x)
        if not self.indexed:
            return q, kvw
        qi = ctx.act(self.idx_wq_b(ctx, qr)).view(t, cfg.index_n_heads, cfg.index_head_dim)
        wts = matmul(ctx, x, self.idx_proj) * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        return q, kvw, qi, wts

    def heads(self, ctx: Ctx, x: torch.Tensor, step: Step, projected: tuple | None = None) -> torch.Tensor:
        """The heads' outputs [T, H, d] for the step's rows ``x``; ``projected``: ``project(ctx, x)``,
        made already (a graph's)."""
        raise NotImplementedError

    def output(self, ctx: Ctx, o: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection of the heads' outputs ``o`` [T, H, d]."""
        return grouped_output(ctx, o.flatten(1), self.wo_a, self.wo_b, self.cfg.o_groups)
