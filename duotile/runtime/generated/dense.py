"""Kernels for the dense ops: norms, embedding rows, GEMMs (FP8 block-scaled; BF16, or FP32 split
into BF16 parts, with an FP32 result), the LM head and sampling."""

from __future__ import annotations

import torch

from ..device import ints, ship

BF16_KEPT = 4096  # BF16 copies kept: every weight of a model a few layers deep, not every temporary


class DenseKernels:
    """Mixed into ``GeneratedOps``: each method serves one model op (``_serves``)."""

    def _rms_norm(self, ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        if rows.shape[0] == 0:  # no rows: nothing to launch
            return out.reshape(x.shape)
        if weight is None:  # the unweighted per-head norm: a weight of ones scales by exactly 1
            weight = self._ones(rows.shape[1], rows.device)
        kernel = self._kernel("rmsnorm", rows.device, {"EPS": float(eps)})
        kernel(x=rows, weight=weight.float().contiguous(), y=out)
        return out.reshape(x.shape)

    def _ones(self, n: int, device) -> torch.Tensor:
        key = ("ones", n, device)
        if key not in self._consts:
            self._consts[key] = torch.ones(n, device=device)
        return self._consts[key]

    def _embed(self, ctx, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() == 0 or table.dtype not in (torch.bfloat16, torch.float32):
            return NotImplemented
        idx = ship(tokens.to(torch.int32), table.device)
        out = torch.empty(idx.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
        self._kernel("gather_rows", table.device, {})(table=table.contiguous(), idx=idx, out=out)
        return out

    def _linear_q(self, linear, ctx, x: torch.Tensor) -> torch.Tensor:
        """An FP8 block-scaled weight: the activation quantised by ``quantize`` (e4m3, a UE8M0 code
        per 1 x b), then ``gemm_blockscaled`` on both sets of codes; FP32 out, as the reference's."""
        block, packed = linear.act_block, linear.packed
        rows = x.reshape(-1, x.shape[-1])
        if (not ctx.quant or packed is None or packed[0] != "fp8" or rows.shape[0] == 0
                or rows.shape[1] % block or x.dtype not in (torch.bfloat16, torch.float32)):
            return NotImplemented
        _, codes, scales = packed
        c = self._blockscaled(*self._quantize(rows, block), codes, scales, block, out=torch.float32)
        return c.float().reshape(*x.shape[:-1], codes.shape[0])

    def _grouped_linear_q(self, ctx, og: torch.Tensor, wo_a) -> torch.Tensor:
        """The grouped ``wo_a`` on its FP8 codes: the activation quantised by ``quantize`` (a group
        is whole blocks of it), or as the decode kernel that wrote it wrote it quantised too
        (``fused_fp8_input``: the same bits), then one ``gemm_blockscaled`` over the groups (its G
        axis), each group's A, codes and scales a contiguous slice; FP32 [T, G * N] out.
        A group whose rows or columns are not whole blocks goes to the reference."""
        t, groups, k = og.shape
        block, packed = wo_a.act_block, wo_a.packed
        if (not ctx.quant or packed is None or packed[0] != "fp8" or t == 0 or k % block
                or og.dtype not in (torch.bfloat16, torch.float32)):
            return NotImplemented
        _, codes, scales = packed
        n = codes.shape[0] // groups
        if n % block or codes.shape[1] != k:
            return NotImplemented
        fused = self.fused_fp8_input(og, block)  # written by the decode kernel with ``og``
        if fused is not None:
            a, sa = fused
        else:
            q, qs = self._quantize(og.reshape(t, groups * k), block)
            a = q.view(t, groups, k).transpose(0, 1).contiguous()  # group-major, as the kernel reads A
            sa = qs.view(t, groups, k // block).transpose(0, 1).contiguous()
        c = torch.empty(groups, t, n, dtype=torch.float32, device=og.device)
        self._kernel("gemm_blockscaled", og.device, {"BLOCK": block})(
            a=a, a_scale=sa, b=codes.view(groups, n, k), b_scale=scales.view(groups, n // block, -1), c=c)
        return c.transpose(0, 1).reshape(t, groups * n)

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
            while len(self._bf16) > BF16_KEPT:
                self._bf16.popitem(last=False)
        self._bf16.move_to_end(key)
        if self._held is not None and hit[2] is not None:  # a graph capturing: it keeps the copy (`holding`)
            self._held.append(hit[2])
        return hit[2]

    def _linear(self, ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``gemm`` with an FP32 result where both operands are BF16 values; ``gemm_f32`` (an FP32
        operand split into BF16 hi and lo parts) where one is not: the compressors' FP32 weights,
        V4's Hadamard matrix, FP32 activations. A BF16 activation (by its dtype) and
        a weight whose values BF16 holds (checked once a weight) are passed as BF16 (not split). A
        weight of a few rows (N not a multiple of 4: a C row is whole 16-byte units) gets zero rows,
        whose columns are dropped; no rows is an empty result, no launch."""
        (n, k), rows = w.shape, x.reshape(-1, x.shape[-1])
        if rows.shape[1] != k or k % 8:
            return NotImplemented  # rows of A / B: whole 16-byte units (a mismatch: the reference says so)
        if rows.shape[0] == 0:
            return torch.zeros(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
        # BF16 by its dtype: a check of the values would wait for the GPU at every call, and would let
        # one row's values choose the kernel of the others (a caller with BF16 values passes BF16)
        a_bf16, b = rows.dtype == torch.bfloat16, self._bf16_weight(w)
        spec = "gemm" if a_bf16 and b is not None else "gemm_f32"
        a = rows if a_bf16 else rows.float()
        b = w.float() if b is None else b
        if n % 4:
            b = torch.cat([b, b.new_zeros(-n % 4, k)])
        c = torch.empty(rows.shape[0], b.shape[0], dtype=torch.float32, device=rows.device)
        self._kernel(spec, rows.device, {})(a=a.contiguous(), b=b.contiguous(), c=c)
        return (c[:, :n].contiguous() if n % 4 else c).reshape(*x.shape[:-1], n)

    def _lm_head(self, ctx, h: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float):
        y = self._rms_norm(ctx, h, norm, eps)
        if y is NotImplemented:
            return NotImplemented
        return self._linear(ctx, ctx.act(y), head)

    def _sample(self, ctx, rows: torch.Tensor, params: list, seeds: list[int], positions: list[int]) -> list[int]:
        """The `sample` kernel over the batch's rows (finite, as the engine passes them), with the
        sampler's own noise of each row's (seed, position), and one host read of the tokens; a batch
        with a top-k / top-p filter (applied before the draw) stays on the reference."""
        if any(p.temperature > 0 and (p.top_k != -1 or p.top_p < 1) for p in params):
            return NotImplemented
        dev, b = rows.device, rows.shape[0]
        token = torch.empty(b, dtype=torch.int32, device=dev)
        temps = ship(torch.tensor([p.temperature for p in params], dtype=torch.float32), dev)
        self._kernel("sample", dev, {})(logits=rows.float().contiguous(), temperature=temps,
                                        seed=ints(seeds, dev, torch.int64), position=ints(positions, dev), token=token)
        return token.tolist()
