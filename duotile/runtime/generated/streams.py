"""Kernels for the residual streams' ops: mHC's mixes, collapse, expand and head, and V4.1's Engram."""

from __future__ import annotations

import torch

from ..device import ints, ship


class StreamKernels:
    """Mixed into ``GeneratedOps``: each method serves one model op (``_serves``)."""

    @staticmethod
    def _hc_ready(x: torch.Tensor) -> bool:
        return x.shape[0] > 0 and x.dim() == 3 and x.shape[1] == 4 and x.dtype in (torch.bfloat16, torch.float32)

    def _hc_pre(self, site, ctx, x: torch.Tensor):
        """A site's mixes (pre, post, comb); the kernel's collapse by this site's pre is not kept."""
        if not self._hc_ready(x) or site.n != 4:
            return NotImplemented
        t, dev = x.shape[0], x.device
        pre, post = (torch.empty(t, 4, device=dev) for _ in range(2))
        comb, y = torch.empty(t, 4, 4, device=dev), torch.empty(t, x.shape[2], dtype=x.dtype, device=dev)
        constants = {"EPS": float(site.eps), "HC_EPS": float(site.hc_eps), "ITERS": int(site.iters)}
        self._kernel("hc_pre", dev, constants)(x=x.contiguous(), fn=site.fn.float().contiguous(),
                                                base=site.base.float().contiguous(),
                                                scale=site.scale.float().contiguous(), pre=pre, post=post,
                                                comb=comb, y=y)
        return pre, post, comb

    def _hc_collapse(self, ctx, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_s pre_s X[s], written in the activation dtype (hc_head's pre_in form)."""
        if not self._hc_ready(x):
            return NotImplemented
        y = torch.empty(x.shape[0], x.shape[2], dtype=ctx.dtype, device=x.device)
        self._kernel("hc_head", x.device, {})(x=x.contiguous(), y=y, pre_in=pre.float().contiguous())
        return y

    def _hc_post(self, ctx, f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        if not self._hc_ready(residual) or f.dtype not in (torch.bfloat16, torch.float32):
            return NotImplemented
        out = torch.empty(residual.shape, dtype=ctx.dtype, device=residual.device)
        self._kernel("hc_post", residual.device, {})(f=f.contiguous(), r=residual.contiguous(),
                                                     post=post.float().contiguous(),
                                                     comb=comb.float().contiguous(), out=out)
        return out

    def _hc_head(self, head, ctx, x: torch.Tensor) -> torch.Tensor:
        """V4's final collapse by its sigmoid weights."""
        if not self._hc_ready(x):
            return NotImplemented
        y = torch.empty(x.shape[0], x.shape[2], dtype=ctx.dtype, device=x.device)
        constants = {"EPS": float(head.eps), "HC_EPS": float(head.hc_eps)}
        self._kernel("hc_head", x.device, constants)(x=x.contiguous(), y=y, fn=head.fn.float().contiguous(),
                                                     base=head.base.float().contiguous(),
                                                     scale=head.scale.float().reshape(-1)[:1].contiguous())
        return y

    def _engram_hash(self, engram, ctx, history: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk: its table rows by ``engram_hash``, from the n-1 tokens before it."""
        prev = engram.padded_history(history)
        if not prev or tokens.numel() == 0:
            return NotImplemented
        dev = engram.table.device
        ids = torch.empty(1, tokens.numel(), engram.primes.numel(), dtype=torch.int32, device=dev)
        key = ("engram_hash", id(engram), str(dev))  # the layer's hash constants, placed once
        if key not in self._consts:
            self._consts[key] = tuple(t.to(dev) for t in (engram.mult, engram.primes, engram.offsets))
        mult, primes, offsets = self._consts[key]
        self._kernel("engram_hash", dev, {})(history=ints([prev], dev),
                                             tokens=ship(tokens.to(torch.int32).reshape(1, -1), dev),
                                             mult=mult, primes=primes, offsets=offsets, ids=ids)
        return ids[0].long()

    def _engram(self, engram, ctx, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows by ``gather_rows``, ``wkv`` as the forward's own linear op, the gated update by
        ``engram_gate``."""
        d = engram.cfg.hidden_size
        if not self._hc_ready(x) or engram.table.dtype not in (torch.bfloat16, torch.float32):
            return NotImplemented
        dev, flat = x.device, ship(ids.to(torch.int32).reshape(-1), x.device)
        rows = torch.empty(flat.numel(), engram.table.shape[1], dtype=engram.table.dtype, device=dev)
        self._kernel("gather_rows", dev, {})(table=engram.table.contiguous(), idx=flat, out=rows)
        kv = ctx.act(engram.wkv(ctx, ctx.act(rows.reshape(x.shape[0], -1)))).float()
        key, value = kv[:, : 4 * d].reshape(-1, 4, d).contiguous(), kv[:, 4 * d :].contiguous()
        out = torch.empty(x.shape, dtype=ctx.dtype, device=dev)
        self._kernel("engram_gate", dev, {"EPS": float(engram.cfg.rms_norm_eps)})(
            x=x.contiguous(), key=key, value=value, qk=engram.qk.float().contiguous(), out=out)
        return out
