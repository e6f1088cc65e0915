"""Kernels for the FFN's experts: the router's choice and the MoE (permute, the grouped W4A8 GEMMs
with SwiGLU + quantisation between them, the shared expert, the fixed-order combine)."""

from __future__ import annotations

import torch

from ..device import ship
from ..quant import FP8_ACT_FLOOR


class MoEKernels:
    """Mixed into ``GeneratedOps``: each method serves one model op (``_serves``)."""

    def _route(self, moe, ctx, logits: torch.Tensor, tokens: torch.Tensor):
        t, k = logits.shape[0], moe.topk
        if t == 0:
            return NotImplemented
        experts = torch.empty(t, k, dtype=torch.int32, device=logits.device)
        weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
        if moe.tid2eid is not None:
            choice = {"tid2eid": moe.tid2eid.to(logits.device), "token_ids": ship(tokens, logits.device)}
        else:
            choice = {"bias": moe.bias.float().contiguous()}
        kernel = self._kernel("router", logits.device, {"TOPK": k, "SCALE": float(moe.scale)})
        kernel(logits=logits.float().contiguous(), experts=experts, weights=weights, **choice)
        return experts.long(), weights

    def _packs_of(self, moe):
        """The MoE's weights as its kernels read them: the routed experts' w1 | w3 codes [E, 2I, D / 2]
        and w2 [E, D, I / 2] (MXFP4, UE8M0 per 32) as placed stacked at load (``MoE.stack``), the
        shared expert's w1 | w3 [2I, D] and w2 (FP8 blocks) joined once; None where a weight is not
        packed that way."""
        hit = self._moe_packs.get(id(moe))
        if hit is not None:
            return hit[1]
        ex, sh, st = moe.experts, moe.shared, moe.stack  # st: the experts' MXFP4 codes, stacked at load
        shared_kinds = {lin.packed[0] if lin.packed else None for lin in (sh.w1, sh.w3, sh.w2)} if sh else set()
        if st is None or shared_kinds != {"fp8"}:
            packs = None
        else:
            packs = {"w13": st["w13"], "s13": st["s13"], "w2": st["w2"], "s2": st["s2"],
                     "sh13": torch.cat([sh.w1.packed[1], sh.w3.packed[1]]), "shs13": torch.cat([sh.w1.packed[2],
                                                                                               sh.w3.packed[2]]),
                     "sh2": sh.w2.packed[1], "shs2": sh.w2.packed[2], "limit": float(ex[0].limit)}
        self._moe_packs[id(moe)] = (moe, packs)
        return packs

    def _quantize(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(x.shape[0], x.shape[1] // block, dtype=torch.uint8, device=x.device)
        self._kernel("quantize", x.device, {"BLOCK": block, "FLOOR": FP8_ACT_FLOOR})(x=x.contiguous(), q=q, scale=s)
        return q, s

    def _swiglu(self, h: torch.Tensor, block: int, limit: float, weight=None):
        rows, width = h.shape[0], h.shape[1] // 2
        q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=h.device)
        s = torch.empty(rows, width // block, dtype=torch.uint8, device=h.device)
        extra = {} if weight is None else {"weight": weight}
        self._kernel("swiglu_quant", h.device, {"BLOCK": block, "LIMIT": limit, "FLOOR": FP8_ACT_FLOOR})(
            h=h, q=q, scale=s, **extra)
        return q, s

    def _grouped(self, q, qs, w, ws, counts, offsets, block: int) -> torch.Tensor:
        out = torch.empty(q.shape[0], w.shape[1], dtype=torch.bfloat16, device=q.device)
        self._kernel("moe_gemm_mxfp4", q.device, {"ABLOCK": block})(a=q, a_scale=qs, w=w, w_scale=ws, counts=counts,
                                                                     offsets=offsets, out=out)
        return out

    def _blockscaled(self, q, qs, codes, scales, block: int, out=torch.bfloat16) -> torch.Tensor:
        """C in ``out``: the dense projections take FP32, as their reference keeps (a BF16 C moved the
        tiny models' logits by 0.5); the shared expert BF16, what swiglu_quant and moe_combine read."""
        c = torch.empty(1, q.shape[0], codes.shape[0], dtype=out, device=q.device)
        self._kernel("gemm_blockscaled", q.device, {"BLOCK": block})(a=q[None], a_scale=qs[None], b=codes[None],
                                                                     b_scale=scales[None], c=c)
        return c[0]

    def _moe_experts(self, moe, ctx, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """moe_permute groups the (token, expert) pairs; each pair's row is quantised and run through
        the fused w1 | w3 and the w2 grouped W4A8 GEMMs with swiglu_quant (clamp, routing weight,
        the FP8 quantisation of w2's input) between them; the shared expert runs on the block-scaled
        GEMM; moe_combine adds each token's rows in a fixed order."""
        block, packs = moe.act_block, self._packs_of(moe)
        t, k = idx.shape
        if (packs is None or not ctx.quant or ctx.dtype != torch.bfloat16 or x.dtype != torch.bfloat16
                or t == 0 or x.shape[1] % block):
            return NotImplemented
        dev, n_e, i32 = x.device, len(moe.experts), torch.int32
        counts, offsets = torch.empty(n_e, dtype=i32, device=dev), torch.empty(n_e + 1, dtype=i32, device=dev)
        order, where = torch.empty(t * k, dtype=i32, device=dev), torch.empty(t, k, dtype=i32, device=dev)
        self._kernel("moe_permute", dev, {})(topk_ids=idx.to(dev, i32).contiguous(), counts=counts, offsets=offsets,
                                             order=order, where=where)
        rows = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=dev)
        self._kernel("gather_rows", dev, {})(table=x.contiguous(), idx=(order // k).contiguous(), out=rows)
        qx, sx = self._quantize(x, block)
        h = self._grouped(*self._quantize(rows, block), packs["w13"], packs["s13"], counts, offsets, block)
        pair_w = w.reshape(-1)[order.long()].float().contiguous()
        y = self._grouped(*self._swiglu(h, block, packs["limit"], pair_w), packs["w2"], packs["s2"], counts,
                          offsets, block)
        hs = self._blockscaled(qx, sx, packs["sh13"], packs["shs13"], block)
        shared = self._blockscaled(*self._swiglu(hs, block, packs["limit"]), packs["sh2"], packs["shs2"], block)
        out = torch.empty(t, x.shape[1], dtype=torch.bfloat16, device=dev)
        self._kernel("moe_combine", dev, {"TOPK": k})(expert_out=y, where=where, shared_out=shared.contiguous(),
                                                      out=out)
        return out
