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

from typing import Any

import torch

from .ops import FastOps
from .quant import FP8_ACT_FLOOR

# spec -> the model op its builds are reported under (hc_head's pre_in form serves hc_collapse)
_OP_OF = {
    "rmsnorm": "rms_norm", "gather_rows": "embed", "topk": "topk", "router": "route",
    "sparse_mqa_decode": "sparse_attention", "indexer_logits": "index_scores", "hc_pre": "hc_pre",
    "hc_post": "hc_post", "hc_head": "hc_head", "quantize": "linear_q", "gemm_blockscaled": "linear_q",
    "sample": "sample", "gemm": "linear", "engram_hash": "engram_hash", "engram_gate": "engram",
    "moe_permute": "moe_experts", "moe_gemm_mxfp4": "moe_experts", "swiglu_quant": "moe_experts",
    "moe_combine": "moe_experts", "candidate_pool": "candidate_pool", "compressor_prefill": "compress",
}


class GeneratedOps:
    """`base`'s primitives, with the ones a duotile kernel covers swapped in."""

    def __init__(self, base: FastOps):
        self.base = base
        self.invariant = base.invariant
        self._kernels: dict[tuple, Any] = {}
        self._serves = {"rms_norm": self._rms_norm, "embed": self._embed, "topk": self._topk,
                        "route": self._route, "sparse_attention": self._sparse_attention,
                        "index_scores": self._index_scores, "hc_pre": self._hc_pre,
                        "hc_collapse": self._hc_collapse, "hc_post": self._hc_post, "hc_head": self._hc_head,
                        "linear_q": self._linear_q, "sample": self._sample, "linear": self._linear,
                        "lm_head": self._lm_head, "engram_hash": self._engram_hash, "engram": self._engram,
                        "moe_experts": self._moe_experts, "candidate_pool": self._candidate_pool,
                        "compress": self._compress}
        self._moe_packs: dict[int, tuple] = {}  # id(MoE) -> (the MoE, its weights stacked for the kernels)
        self._bf16: dict[tuple, tuple] = {}  # weight's place -> (weight, version, BF16 copy or None)

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def kernel_for(self, op: str):
        return self._serves.get(op)

    def builds(self) -> dict[str, int]:
        """Per op: the builds made for it. A kernel whose sizes are dynamic builds once for every
        token count and batch (``codegen.compile`` caches one build per call signature, dynamic
        sizes left out)."""
        out: dict[str, int] = {}
        for (spec_name, *_), kernel in self._kernels.items():
            op = _OP_OF.get(spec_name, spec_name)
            out[op] = out.get(op, 0) + len(kernel._cache)
        return out

    def _kernel(self, spec_name: str, device: torch.device, constants: dict) -> Any:
        from .. import codegen
        from ..kernels_spec import get

        key = (spec_name, str(device), tuple(sorted(constants.items())))
        if key not in self._kernels:
            sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            self._kernels[key] = codegen.compile(get(spec_name).kernel, "sm90" if sm90 else "interpret",
                                                 constants=constants)
        return self._kernels[key]

    def _rms_norm(self, ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None or x.numel() == 0:
            return NotImplemented  # the unweighted per-head norm: no kernel form yet
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        kernel = self._kernel("rmsnorm", rows.device, {"EPS": float(eps)})
        kernel(x=rows, weight=weight.float().contiguous(), y=out)
        return out.reshape(x.shape)

    def _embed(self, ctx, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() == 0 or table.dtype not in (torch.bfloat16, torch.float32):
            return NotImplemented
        idx = tokens.to(table.device, torch.int32).contiguous()
        out = torch.empty(idx.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
        self._kernel("gather_rows", table.device, {})(table=table.contiguous(), idx=idx, out=out)
        return out

    def _topk(self, ctx, scores: torch.Tensor, k: int) -> torch.Tensor:
        if scores.numel() == 0:
            return NotImplemented
        idx = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
        self._kernel("topk", scores.device, {"TOPK": int(k)})(scores=scores.float().contiguous(), idx=idx)
        return idx.long()

    def _route(self, moe, ctx, logits: torch.Tensor, tokens: torch.Tensor):
        t, k = logits.shape[0], moe.topk
        if t == 0:
            return NotImplemented
        experts = torch.empty(t, k, dtype=torch.int32, device=logits.device)
        weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
        if moe.tid2eid is not None:
            choice = {"tid2eid": moe.tid2eid.to(logits.device), "token_ids": tokens.to(logits.device)}
        else:
            choice = {"bias": moe.bias.float().contiguous()}
        kernel = self._kernel("router", logits.device, {"TOPK": k, "SCALE": float(moe.scale)})
        kernel(logits=logits.float().contiguous(), experts=experts, weights=weights, **choice)
        return experts.long(), weights

    def _sparse_attention(self, ctx, q, keys, valid, sink, scale: float) -> torch.Tensor:
        """The decode kernel, one query a batch row over its own rows: BF16 in (the forward's
        activations are BF16 values), the slots it may not see marked -1."""
        s, n, d = keys.shape
        if ctx.dtype != torch.bfloat16 or s == 0 or n == 0 or scale != d ** -0.5:
            return NotImplemented
        slots = torch.arange(n, dtype=torch.int32, device=keys.device).expand(s, n)
        idx = torch.where(valid.to(keys.device), slots, -1).to(torch.int32).contiguous()
        o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        self._kernel("sparse_mqa_decode", q.device, {})(q=q.to(torch.bfloat16).contiguous(),
                                                         kv=keys.to(torch.bfloat16).contiguous(), idx=idx,
                                                         sink=sink.float().contiguous(), o=o)
        return o.float()

    def _index_scores(self, ctx, qi, wts, keys, n_visible) -> torch.Tensor:
        """The indexer over one sequence's key rows, which every query of the chunk reads; the
        visible prefix as ``pos`` at ratio 1 (visible iff j < pos + 1)."""
        s, n = qi.shape[0], keys.shape[0]
        if ctx.dtype != torch.bfloat16 or s == 0 or n == 0:
            return NotImplemented
        k = keys.to(torch.bfloat16)[None].expand(s, n, keys.shape[1]).contiguous()
        pos = (n_visible.to(qi.device) - 1).to(torch.int32)
        logits = torch.empty(s, n, dtype=torch.float32, device=qi.device)
        self._kernel("indexer_logits", qi.device, {"RATIO": 1})(q=qi.to(torch.bfloat16).contiguous(),
                                                               w=wts.float().contiguous(), k=k, pos=pos,
                                                               logits=logits)
        return logits

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

    def _linear_q(self, linear, ctx, x: torch.Tensor) -> torch.Tensor:
        """An FP8 block-scaled weight: the activation quantised by ``quantize`` (e4m3, a UE8M0 code
        per 1 x b), then ``gemm_blockscaled`` on both sets of codes; BF16 out, as FP32."""
        block, packed = linear.act_block, linear.packed
        rows = x.reshape(-1, x.shape[-1])
        if (not ctx.quant or packed is None or packed[0] != "fp8" or rows.shape[0] == 0
                or rows.shape[1] % block or x.dtype not in (torch.bfloat16, torch.float32)):
            return NotImplemented
        _, codes, scales = packed
        t, dev = rows.shape[0], rows.device
        q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=dev)
        qs = torch.empty(t, rows.shape[1] // block, dtype=torch.uint8, device=dev)
        self._kernel("quantize", dev, {"BLOCK": block, "FLOOR": FP8_ACT_FLOOR})(x=rows.contiguous(), q=q, scale=qs)
        c = torch.empty(1, t, codes.shape[0], dtype=torch.bfloat16, device=dev)
        self._kernel("gemm_blockscaled", dev, {"BLOCK": block})(a=q[None], a_scale=qs[None], b=codes[None],
                                                                b_scale=scales[None], c=c)
        return c[0].float().reshape(*x.shape[:-1], codes.shape[0])

    def _sample(self, ctx, row: torch.Tensor, params, seed: int, position: int) -> int:
        """The `sample` kernel, with the sampler's own noise of (seed, position); a request with a
        top-k / top-p filter (applied before the draw) stays on the reference."""
        if params.temperature > 0 and (params.top_k != -1 or params.top_p < 1):
            return NotImplemented
        if not bool(torch.isfinite(row).all()):
            return NotImplemented  # the reference names the problem
        dev = row.device
        token = torch.empty(1, dtype=torch.int32, device=dev)
        self._kernel("sample", dev, {})(logits=row.float().reshape(1, -1).contiguous(),
                                        temperature=torch.tensor([params.temperature], dtype=torch.float32, device=dev),
                                        seed=torch.tensor([seed], dtype=torch.int64, device=dev),
                                        position=torch.tensor([position], dtype=torch.int32, device=dev), token=token)
        return int(token[0])

    def _bf16_weight(self, w: torch.Tensor) -> torch.Tensor | None:
        """A weight's BF16 copy where BF16 holds it exactly (weights stored as BF16), else None.
        Keyed by where the values live, not by the tensor object: a view made per call (wo_a's
        group ``g``) is a new object each time, whose ``id`` a later view may reuse. The entry
        holds the source, so its memory is never freed and handed to another tensor."""
        key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, str(w.device))
        hit = self._bf16.get(key)
        if hit is None or hit[0]._version != hit[1]:
            b = w.to(torch.bfloat16).contiguous()
            hit = self._bf16[key] = (w, w._version, b if torch.equal(b.float(), w.float()) else None)
        return hit[2]

    def _linear(self, ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``gemm`` with an FP32 result, where both operands are BF16 values (an FP32 weight, such
        as the compressors', stays on the reference: the GEMM reads BF16)."""
        rows = x.reshape(-1, x.shape[-1])
        b = self._bf16_weight(w)
        if b is None or rows.shape[0] == 0 or rows.shape[1] % 8 or w.shape[0] % 4:
            return NotImplemented  # rows of A / B / C: whole 16-byte units
        a = rows.to(torch.bfloat16)
        if not torch.equal(a.float(), rows.float()):
            return NotImplemented
        c = torch.empty(rows.shape[0], w.shape[0], dtype=torch.float32, device=rows.device)
        self._kernel("gemm", rows.device, {})(a=a.contiguous(), b=b, c=c)
        return c.reshape(*x.shape[:-1], w.shape[0])

    def _lm_head(self, ctx, h: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float):
        y = self._rms_norm(ctx, h, norm, eps)
        if y is NotImplemented:
            return NotImplemented
        return self._linear(ctx, ctx.act(y), head)

    def _engram_hash(self, engram, ctx, history: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk: its table rows by ``engram_hash``, from the n-1 tokens before it."""
        prev = engram.padded_history(history)
        if not prev or tokens.numel() == 0:
            return NotImplemented
        dev = engram.table.device
        ids = torch.empty(1, tokens.numel(), engram.primes.numel(), dtype=torch.int32, device=dev)
        self._kernel("engram_hash", dev, {})(history=torch.tensor([prev], dtype=torch.int32, device=dev),
                                             tokens=tokens.to(dev, torch.int32).reshape(1, -1),
                                             mult=engram.mult.to(dev), primes=engram.primes.to(dev),
                                             offsets=engram.offsets.to(dev), ids=ids)
        return ids[0].long()

    def _engram(self, engram, ctx, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows by ``gather_rows``, ``wkv`` as the forward's own linear op, the gated update by
        ``engram_gate``."""
        d = engram.cfg.hidden_size
        if not self._hc_ready(x) or engram.table.dtype not in (torch.bfloat16, torch.float32):
            return NotImplemented
        dev, flat = x.device, ids.to(x.device, torch.int32).reshape(-1).contiguous()
        rows = torch.empty(flat.numel(), engram.table.shape[1], dtype=engram.table.dtype, device=dev)
        self._kernel("gather_rows", dev, {})(table=engram.table.contiguous(), idx=flat, out=rows)
        kv = ctx.act(engram.wkv(ctx, ctx.act(rows.reshape(x.shape[0], -1)))).float()
        key, value = kv[:, : 4 * d].reshape(-1, 4, d).contiguous(), kv[:, 4 * d :].contiguous()
        out = torch.empty(x.shape, dtype=ctx.dtype, device=dev)
        self._kernel("engram_gate", dev, {"EPS": float(engram.cfg.rms_norm_eps)})(
            x=x.contiguous(), key=key, value=value, qk=engram.qk.float().contiguous(), out=out)
        return out

    def _packs_of(self, moe):
        """The MoE's weights as its kernels read them, stacked once: the routed experts' w1 | w3
        codes [E, 2I, D / 2] and w2 [E, D, I / 2] (MXFP4, UE8M0 per 32), the shared expert's
        w1 | w3 [2I, D] and w2 (FP8 blocks); None where a weight is not packed that way."""
        hit = self._moe_packs.get(id(moe))
        if hit is not None:
            return hit[1]
        ex, sh = moe.experts, moe.shared
        kinds = {lin.packed[0] if lin.packed else None for e in ex for lin in (e.w1, e.w3, e.w2)}
        if kinds != {"fp4"} or sh is None or {lin.packed[0] if lin.packed else None
                                              for lin in (sh.w1, sh.w3, sh.w2)} != {"fp8"}:
            packs = None
        else:
            def stack(part):
                return [torch.stack([torch.cat([e.w1.packed[part], e.w3.packed[part]]) for e in ex]),
                        torch.stack([e.w2.packed[part] for e in ex])]
            (w13, w2), (s13, s2) = stack(1), stack(2)
            packs = {"w13": w13, "s13": s13, "w2": w2, "s2": s2,
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
            h=h.view(rows, 2, width), q=q, scale=s, **extra)
        return q, s

    def _grouped(self, q, qs, w, ws, counts, offsets, block: int) -> torch.Tensor:
        out = torch.empty(q.shape[0], w.shape[1], dtype=torch.bfloat16, device=q.device)
        self._kernel("moe_gemm_mxfp4", q.device, {"ABLOCK": block})(a=q, a_scale=qs, w=w, w_scale=ws, counts=counts,
                                                                     offsets=offsets, out=out)
        return out

    def _blockscaled(self, q, qs, codes, scales, block: int) -> torch.Tensor:
        c = torch.empty(1, q.shape[0], codes.shape[0], dtype=torch.bfloat16, device=q.device)
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

    def _candidate_pool(self, ctx, scores: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int):
        """The pool as the runtime's boolean [S, N] (the kernel's block list is not used yet)."""
        s, n = scores.shape
        if s == 0 or n == 0:
            return NotImplemented
        dev = scores.device
        blocks = torch.empty(s, topk_blocks, dtype=torch.int32, device=dev)
        pool = torch.empty(s, n, dtype=torch.uint8, device=dev)
        self._kernel("candidate_pool", dev, {"BLOCK": int(block), "TOPK_BLOCKS": int(topk_blocks)})(
            scores=scores.float().contiguous(), visible=n_visible.to(dev, torch.int32).contiguous(), blocks=blocks,
            pool=pool)
        return pool.bool()

    def _compress(self, ctx, st, c: torch.Tensor, z: torch.Tensor, start: int, ratio: int, overlap: bool):
        """``compressor_prefill`` over the chunk, its banked state laid out from the runtime's
        carry (the open window's tokens; with ``overlap`` the previous window's A halves in the
        other bank) and read back into it after."""
        t, width = c.shape
        if t == 0 or (overlap and width % 2):
            return NotImplemented
        from ..kernels_spec.compressor_prefill import windows_touched

        dev, banks, half = c.device, 2 if overlap else 1, width // 2
        slot = lambda p: ((p // ratio) % banks) * ratio + p % ratio  # noqa: E731 - compressor.py's layout
        state_c = torch.zeros(banks * ratio, width, device=dev)
        state_z = torch.zeros(banks * ratio, width, device=dev)
        w0 = (start - st.pending_c.shape[0]) // ratio
        for i in range(st.pending_c.shape[0]):
            state_c[slot(w0 * ratio + i)], state_z[slot(w0 * ratio + i)] = st.pending_c[i], st.pending_z[i]
        if overlap and st.prev_c is not None:
            for j in range(ratio):
                p = (w0 - 1) * ratio + j
                state_c[slot(p), :half], state_z[slot(p), :half] = st.prev_c[j], st.prev_z[j]
        n = windows_touched(t, ratio)
        out = torch.empty(n, half if overlap else width, device=dev)
        windows = torch.empty(n, dtype=torch.int32, device=dev)
        carry_c, carry_z = torch.empty_like(state_c), torch.empty_like(state_z)
        self._kernel("compressor_prefill", dev, {"RATIO": ratio, "OVERLAP": bool(overlap)})(
            c=c.float().contiguous(), z=z.float().contiguous(),
            start=torch.tensor([start], dtype=torch.int32, device=dev), state_c=state_c, state_z=state_z, out=out,
            windows=windows, carry_c=carry_c, carry_z=carry_z)
        done = windows >= 0
        end = start + t
        w_end = end // ratio
        open_slots = [slot(p) for p in range(w_end * ratio, end)]
        st.pending_c, st.pending_z = carry_c[open_slots].clone(), carry_z[open_slots].clone()
        if overlap and w_end > w0:
            last = [slot((w_end - 1) * ratio + j) for j in range(ratio)]
            st.prev_c, st.prev_z = carry_c[last, :half].clone(), carry_z[last, :half].clone()
        return out[done], w0
