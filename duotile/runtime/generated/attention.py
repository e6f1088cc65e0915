"""Kernels for the attention path's ops: the indexer's scores, top-k, the candidate pool, the
compressors' pooling, sparse attention with the sink, rope and the KV / index rows' cache-format
round trip."""

from __future__ import annotations

import torch

from ..device import ints, ship
from ..layers.cache_rows import KV_ENCODE_FLOOR, nope_row_bytes
from ..stacked import restack, stack_of
from ..stored import NOPE_ROPE

# kv_round's formats (runtime/layers/common.py) -> the kv_round spec's constants
_KV_FORMATS = {"fp8/32": {"FORMAT": "fp8", "BLOCK": 32, "FLOOR": 0.0},
               "fp8/64": {"FORMAT": "fp8", "BLOCK": 64, "FLOOR": 0.0},
               "nvfp4": {"FORMAT": "nvfp4", "BLOCK": 16}, "mxfp4": {"FORMAT": "mxfp4", "BLOCK": 32}}


# kv_encode's formats -> (spec, its constants, value dtype, values a byte, values a scale); V4's
# fp8_nope rows are fp8/64's bytes of their nope channels with the rope channels' between
_ENCODINGS = {"fp8/32": ("quantize", {"BLOCK": 32, "FLOOR": KV_ENCODE_FLOOR}, torch.float8_e4m3fn, 1, 32),
              "fp8/64": ("quantize", {"BLOCK": 64, "FLOOR": KV_ENCODE_FLOOR}, torch.float8_e4m3fn, 1, 64),
              "nvfp4": ("quantize_fp4", {"FORMAT": "nvfp4"}, torch.uint8, 2, 16),
              "mxfp4": ("quantize_fp4", {"FORMAT": "mxfp4"}, torch.uint8, 2, 32)}


class AttentionKernels:
    """Mixed into ``GeneratedOps``: each method serves one model op (``_serves``)."""

    def _topk(self, ctx, scores: torch.Tensor, k: int) -> torch.Tensor:
        """A decode step's scores grow a row a step; the kernel pads them to their length's
        power-of-two bucket (its ``padded`` size): one build a bucket, not one a step. No scores
        (a sequence before its first compressed row): every slot -1, no launch."""
        if scores.numel() == 0:
            return torch.full((scores.shape[0], k), -1, dtype=torch.long, device=scores.device)
        idx = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
        self._kernel("topk", scores.device, {"TOPK": int(k)})(scores=scores.float().contiguous(), idx=idx)
        return idx.long()

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

    def _sparse_attention_rows(self, ctx, q, rows, idx, sink, scale: float, rotary=None, positions=None, cmp=None,
                               window=None, fmt=None):
        """The prefill kernel: each query over its own index list into the rows the chunk's queries
        share (BF16, as the forward's activations are), the kernel's BF16 output (what the caller
        rounds it to: kept, not copied). With ``cmp`` (the compressed rows as stored, V4.1's or
        V4's ``fmt``) the kernel dequantises them itself: each list's window part padded to the
        kernel's ``ring_slots``, the rows' bytes passed as each view the format's gather reads.
        With a ``rotary`` its epilogue rotates the output by -P (``_positions_and_table``); with
        ``ctx.fp8_wo_a`` it writes wo_a's FP8 input too, kept for ``_grouped_linear_q``
        (``_fp8_input``), as the decode kernels do."""
        from ...kernels_spec.sparse_mqa_decode_fp8 import ring_slots

        t, d = q.shape[0], rows.shape[-1]
        if ctx.dtype != torch.bfloat16 or t == 0 or rows.shape[0] == 0 or scale != d ** -0.5 or (
                rotary is not None and rotary.dim % 2):
            return NotImplemented
        o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        idx = ship(idx.to(torch.int32), q.device)
        consts = {}
        if cmp is not None:
            pad = idx.new_full((t, ring_slots(window) - window), -1)
            idx = torch.cat([idx[:, :window], pad, idx[:, window:]], 1)
            consts["WINDOW"] = window
        args = {"q": q.to(torch.bfloat16).contiguous(), "kv": rows.to(torch.bfloat16).contiguous(),
                "idx": idx.contiguous(), "sink": sink.float().contiguous(), "o": o}
        if fmt == "nvfp4":
            args.update(cmp=cmp, cmp_scale=cmp.view(torch.float8_e4m3fn))
        elif cmp is not None:  # V4's rows: e4m3 nope values, their codes, BF16 rope channels
            args.update(cmp_nope=cmp.view(torch.float8_e4m3fn), cmp_codes=cmp, cmp_rope=cmp.view(torch.bfloat16))
            consts["ROPE"] = NOPE_ROPE
        consts.update(self._fp8_output(ctx, o, args))
        if rotary is not None:
            at, cos, sin = self._positions_and_table(rotary, positions, q.device)
            args.update(positions=at, cos=cos, sin=sin)
        self._kernel("sparse_mqa_prefill", q.device, consts)(**args)
        return self._written(o)

    def _sparse_attention_stored(self, ctx, q, ring, idx, cmp, sink, scale: float, fmt: str = "fp8/32",
                                 rotary=None, positions=None, lens=None):
        """The stored-row decode kernel of the rings' format over the rings' and compressed rows'
        stacks as they are (each passed as its values', its scales' and, V4, its rope channels'
        tensor: the same memory): BF16 queries, the index list as given, the kernel's BF16 output
        (what the caller rounds it to: kept, not copied). With a ``rotary`` its epilogue rotates the
        output by -P: the rotary's table rows 0 .. the largest position (``_rope_table``) and the
        positions on the device. With ``ctx.fp8_wo_a`` the kernel writes wo_a's FP8 input too
        (``decode_fp8_out``), kept for ``_grouped_linear_q`` (``_fp8_input``). ``lens`` (each query's
        list length: an HCA layer's) goes to the kernel, whose split then cuts it, not the padded list."""
        b, d = q.shape[0], q.shape[-1]
        if ctx.dtype != torch.bfloat16 or b == 0 or scale != d ** -0.5 or (rotary is not None and rotary.dim % 2):
            return NotImplemented
        o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        args = {"q": q.to(torch.bfloat16).contiguous(), "idx": idx.contiguous(), "sink": sink.float().contiguous(),
                "o": o, "kv": ring.view(torch.float8_e4m3fn), "kv_scale": ring}
        consts = self._fp8_output(ctx, o, args)
        if rotary is not None:
            at, cos, sin = self._positions_and_table(rotary, positions, q.device)
            args.update(positions=at, cos=cos, sin=sin)
        if lens is not None:
            args["lens"] = ship(lens, q.device).to(torch.int32)
        if fmt == "fp8_nope":  # V4's rows: e4m3 nope channels, their codes, BF16 rope channels
            args["kv_rope"] = ring.view(torch.bfloat16)
            if cmp is not None:
                args.update(cmp=cmp.view(torch.float8_e4m3fn), cmp_scale=cmp, cmp_rope=cmp.view(torch.bfloat16))
            self._kernel("sparse_mqa_decode_fp8_nope", q.device, consts)(**args)
            return self._written(o)
        if cmp is not None:  # V4.1's NVFP4 compressed rows: e2m1 pairs, E4M3 scales
            args.update(cmp=cmp, cmp_scale=cmp.view(torch.float8_e4m3fn))
        self._kernel("sparse_mqa_decode_fp8", q.device, consts)(**args)
        return self._written(o)

    def _written(self, o: torch.Tensor) -> torch.Tensor:
        """``o`` as the kernel left it: the FP8 input kept with it is valid for this version of it
        (a later write to ``o`` makes it stale; the interpreter's own writes count as writes)."""
        if self._fp8_input is not None and self._fp8_input[0] is o:
            self._fp8_input = (o, o._version, *self._fp8_input[2:])
        return o

    def _fp8_output(self, ctx, o: torch.Tensor, args: dict) -> dict:
        """With ``ctx.fp8_wo_a`` (groups, block) that whole heads and blocks fit: the FP8 output's
        tensors put in ``args`` and kept with ``o`` (``_fp8_input``), its constants returned."""
        self._fp8_input = None
        b, h, d = o.shape
        if ctx.fp8_wo_a is None or not ctx.quant or h % ctx.fp8_wo_a[0] or d % ctx.fp8_wo_a[1]:
            return {}
        groups, block = ctx.fp8_wo_a
        o_q = torch.empty(b * h, d, dtype=torch.float8_e4m3fn, device=o.device)
        o_qs = torch.empty(b * h, d // block, dtype=torch.uint8, device=o.device)
        args.update(o_q=o_q, o_qs=o_qs)
        self._fp8_input = (o, o._version, o_q, o_qs, groups, block)
        return {"GROUPS": groups, "QBLOCK": block}

    def fused_fp8_input(self, og: torch.Tensor, block: int):
        """wo_a's FP8 input and codes, group-major [G, T, K] and [G, T, K / block], where ``og``
        ([T, G, K]) is the output a decode kernel wrote them with, unchanged since; else None."""
        kept, self._fp8_input = self._fp8_input, None
        if kept is None:
            return None
        o, version, o_q, o_qs, groups, at = kept
        t, g, k = og.shape
        if (og.data_ptr() != o.data_ptr() or og.numel() != o.numel() or o._version != version or g != groups
                or at != block or og.dtype != o.dtype):
            return None
        self.fused_fp8_inputs += 1
        return o_q.view(groups, t, k), o_qs.view(groups, t, k // block)

    def _kv_insert(self, ctx, rotary, x, weight, eps: float, positions: torch.Tensor, ring: torch.Tensor,
                   fmt: str = "fp8/32"):
        """``kv_insert`` on the rings' stack in place, in the rings' format (V4.1's ``fp8``, V4's
        ``fp8_nope``): the rotary's table rows 0 .. the largest position (its cached blocks of
        64, joined), the positions on the device."""
        b, d = x.shape
        if b == 0 or x.dtype not in (torch.bfloat16, torch.float32) or rotary.dim % 32:
            return NotImplemented
        dev = x.device
        at, cos, sin = self._positions_and_table(rotary, positions, dev)
        consts = {"FORMAT": "fp8" if fmt == "fp8/32" else fmt, "WINDOW": int(ring.shape[1]), "ROPE": rotary.dim,
                  "EPS": float(eps),
                  "FLOOR": KV_ENCODE_FLOOR}
        self._kernel("kv_insert", dev, consts)(kv=x.contiguous(), weight=weight.float().contiguous(),
                                                positions=at, cos=cos,
                                                sin=sin, cache=ring)
        return None

    def _positions_and_table(self, rotary, positions: torch.Tensor, dev):
        """A step's positions (host) on ``dev`` as int32 and the rotary's table rows 0 .. their
        largest (``_rope_table``): shipped once for the positions tensor a step's layers all pass
        (``kv_insert`` and the decode's epilogue, each layer), not once a call."""
        kept = self._consts.get(("positions",))
        if kept is None or kept[0] is not positions or kept[1] != dev:
            kept = self._consts[("positions",)] = (positions, dev, ship(positions.to(torch.int32), dev),
                                                   int(positions.max()))
        cos, sin = self._rope_table(rotary, kept[3] // rotary.BLOCK + 1, dev)
        return kept[2], cos, sin

    def _rope_table(self, rotary, blocks: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary's cos / sin rows of positions 0 .. 64 ``blocks`` - 1 on ``dev``, joined once
        and kept (the latest a rotary), grown in powers of two of its blocks as a context grows."""
        blocks = 1 << (blocks - 1).bit_length()
        key = ("rope_table", rotary, dev)
        kept = self._consts.get(key)
        if kept is None or kept[0] < blocks:
            parts = [rotary._block(k) for k in range(blocks)]
            kept = self._consts[key] = (blocks, *(torch.cat([p[i] for p in parts]).to(dev) for i in (0, 1)))
        return kept[1], kept[2]

    def _kv_encode(self, ctx, t: torch.Tensor, fmt: str):
        """``quantize`` (FP8, a UE8M0 code per 32 or, V4's nope channels, per 64, its least floor)
        or ``quantize_fp4`` (NVFP4, MXFP4) over the rows, each row's values and scales then joined
        as the cache stores them (V4's rope channels' BF16 bytes between); no rows, no launch."""
        if fmt == "fp8_nope":
            nope = t.shape[-1] - NOPE_ROPE
            encoded = self._kv_encode(ctx, t[..., :nope], "fp8/64")
            return nope_row_bytes(encoded[..., :nope], t[..., nope:].reshape(-1, NOPE_ROPE), encoded[..., nope:])
        form = _ENCODINGS.get(fmt)
        if form is None:
            return NotImplemented
        spec, consts, value_dtype, per_value, per_scale = form
        rows = t.reshape(-1, t.shape[-1]).contiguous()
        n, d = rows.shape
        q = torch.empty(n, d // per_value, dtype=value_dtype, device=t.device)
        scale = torch.empty(n, d // per_scale, dtype=torch.uint8, device=t.device)
        if n:
            self._kernel(spec, t.device, consts)(x=rows, q=q, scale=scale)
        return torch.cat([q.view(torch.uint8), scale], -1)

    def _index_scores(self, ctx, qi, wts, keys, n_visible) -> torch.Tensor:
        """The indexer over one sequence's key rows [N, c], which every query of the chunk reads
        (``indexer_logits_prefill``: each key tile read once for a block of queries), or over keys
        [S, N, c], each query's own (``indexer_logits``); the visible prefix as ``pos`` at ratio 1
        (visible iff j < pos + 1)."""
        s, n = qi.shape[0], keys.shape[-2]
        if ctx.dtype != torch.bfloat16:
            return NotImplemented
        if s == 0 or n == 0:  # no queries or no key rows yet: an empty score matrix, no launch
            return torch.empty(s, n, dtype=torch.float32, device=qi.device)
        k = keys if keys.dtype == torch.uint8 else keys.to(torch.bfloat16)  # MXFP4 rows as stored, or values
        spec = "indexer_logits" if k.dim() == 3 else "indexer_logits_prefill"
        pos = ship((n_visible - 1).to(torch.int32), qi.device)
        logits = torch.empty(s, n, dtype=torch.float32, device=qi.device)
        self._kernel(spec, qi.device, {"RATIO": 1})(q=qi.to(torch.bfloat16).contiguous(), w=wts.float().contiguous(),
                                                    k=k.contiguous(), pos=pos, logits=logits)
        return logits

    def _index_scores_pool(self, ctx, qi, wts, keys, n_visible, blocks, block: int) -> torch.Tensor:
        """A Reindex layer's scores of its candidate pool alone (``indexer_logits_pool``: the key
        rows of the listed blocks' positions, gathered, KB * block columns a query); the visible
        prefix as ``pos`` at ratio 1. Keys [S, N, c], each query's own (a decode step), or [N, c],
        one sequence's, which every query of its prefill chunk reads (``SHARED``); no key rows
        yet: every column -inf, no launch."""
        s, n = qi.shape[0], keys.shape[-2]
        if ctx.dtype != torch.bfloat16:
            return NotImplemented
        dev = qi.device
        if s == 0 or n == 0:
            return torch.full((s, blocks.shape[1] * block), float("-inf"), dtype=torch.float32, device=dev)
        k = keys if keys.dtype == torch.uint8 else keys.to(torch.bfloat16)  # MXFP4 rows as stored, or values
        logits = torch.empty(s, blocks.shape[1] * block, dtype=torch.float32, device=dev)
        shared = k.dim() == 2
        self._kernel("indexer_logits_pool", dev, {"RATIO": 1, "BLOCK": int(block), "SHARED": shared})(
            q=qi.to(torch.bfloat16).contiguous(), w=wts.float().contiguous(),
            k=(k[None] if shared else k).contiguous(),
            pos=ship((n_visible - 1).to(torch.int32), dev), blocks=ship(blocks.to(torch.int32), dev).contiguous(),
            logits=logits)
        return logits

    def _candidate_pool(self, ctx, scores: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int):
        """The pool's block list [S, KB] (int32; the kernel's boolean pool left out), whose
        positions alone the Reindex layers score (``_index_scores_pool``)."""
        s, n = scores.shape
        if s == 0 or n == 0:
            return NotImplemented
        dev = scores.device
        blocks = torch.empty(s, topk_blocks, dtype=torch.int32, device=dev)
        self._kernel("candidate_pool", dev, {"BLOCK": int(block), "TOPK_BLOCKS": int(topk_blocks)})(
            scores=scores.float().contiguous(), visible=ship(n_visible.to(torch.int32), dev), blocks=blocks)
        return blocks

    def _compress(self, ctx, st, c: torch.Tensor, z: torch.Tensor, start: int, ratio: int, overlap: bool):
        """``compressor_prefill`` over one sequence's chunk, on its state's banks (``cache.py``),
        which the kernel updates in place (its carry written over its state)."""
        t, width = c.shape
        if t == 0 or (overlap and width % 2):
            return NotImplemented
        from ...kernels_spec.compressor_prefill import windows_touched

        dev = c.device
        state_c, state_z = st.as_banks(start, ratio, overlap)
        n = windows_touched(t, ratio)
        out = torch.empty(n, width // 2 if overlap else width, device=dev)
        windows = torch.empty(n, dtype=torch.int32, device=dev)
        self._kernel("compressor_prefill", dev, {"RATIO": ratio, "OVERLAP": bool(overlap)})(
            c=c.float().contiguous(), z=z.float().contiguous(), start=ints([start], dev), state_c=state_c,
            state_z=state_z, out=out, windows=windows, carry_c=state_c, carry_z=state_z)
        # window start // ratio + i completes iff its last token is in the chunk: the first ones do
        return out[: (start + t) // ratio - start // ratio], start // ratio

    def _compress_decode(self, ctx, states: list, c: torch.Tensor, z: torch.Tensor, starts: list[int], ratio: int,
                         overlap: bool):
        """``compressor_decode``: every sequence's new token in one launch, on their states' banks
        stacked [B, slots, width] (kept stacked: each state's banks become a view of the stack, so
        the next step with the same sequences in the same order passes the stack as it is)."""
        b, width = c.shape
        if b == 0 or (overlap and width % 2):
            return NotImplemented
        dev = c.device
        state_c, state_z = _stacked_banks(states, starts, ratio, overlap)
        out = torch.empty(b, width // 2 if overlap else width, device=dev)
        windows = torch.empty(b, dtype=torch.int32, device=dev)
        self._kernel("compressor_decode", dev, {"RATIO": ratio, "OVERLAP": bool(overlap)})(
            c=c.float().contiguous(), z=z.float().contiguous(), positions=ints(starts, dev), state_c=state_c,
            state_z=state_z, out=out, windows=windows)
        done = [i for i, p in enumerate(starts) if p % ratio == ratio - 1]
        if len(done) == b:
            return out
        return out[ints(done, dev, torch.long)] if done else out[:0]

    def _rope_rows(self, positions: torch.Tensor, block: int, dev) -> tuple[int, int, torch.Tensor]:
        """The first and last 64-position block a step's positions (host) span and the positions
        counted from the first, on ``dev``: worked out once for the positions tensor a step's
        layers all pass (four rope calls a layer), not once a call."""
        kept = self._consts.get(("rope_rows",))
        if kept is not None and kept[0] is positions and kept[1] == (block, dev):
            return kept[2]
        lo, hi = int(positions.min()) // block, int(positions.max()) // block
        out = lo, hi, ship((positions - lo * block).to(torch.int32), dev)
        self._consts[("rope_rows",)] = (positions, (block, dev), out)
        return out

    def _rope(self, ctx, rotary, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``rope`` over the rows' own table rows: the rotary's blocks of 64 positions that the
        positions span, the positions counted from the first (as ``Rotary.cos_sin`` reads them)."""
        if x.dtype not in (torch.bfloat16, torch.float32) or x.shape[-1] % 2:
            return NotImplemented
        if positions.numel() == 0:  # no rows: nothing to launch
            return torch.empty(x.shape, dtype=torch.float32, device=x.device)
        lo, hi, idx = self._rope_rows(positions, rotary.BLOCK, x.device)
        blocks = [rotary._block(b) for b in range(lo, hi + 1)]
        cos, sin = blocks[0] if len(blocks) == 1 else (torch.cat([blk[i] for blk in blocks]) for i in (0, 1))
        rows = x.reshape(x.shape[0], -1, x.shape[-1]).contiguous()  # [T, heads (or 1), C]
        out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
        self._kernel("rope", x.device, {"ROPE": rotary.dim, "INVERSE": bool(inverse)})(
            x=rows, positions=idx, cos=cos.to(x.device).reshape(-1), sin=sin.to(x.device).reshape(-1), out=out)
        return out.reshape(x.shape)

    def _kv_round(self, ctx, t: torch.Tensor, fmt: str) -> torch.Tensor:
        """``kv_round`` over the rows of the last dim (whatever the leading dims: a block never
        crosses a row), FP32 out; no rows is an empty result, no launch. A width that is not
        whole blocks stays on the reference, which refuses it."""
        consts = _KV_FORMATS.get(fmt)
        if consts is None or t.dtype not in (torch.bfloat16, torch.float32) or t.dim() == 0 \
                or t.shape[-1] % consts["BLOCK"]:
            return NotImplemented
        rows = t.reshape(-1, t.shape[-1]).contiguous()
        out = torch.empty(rows.shape, dtype=torch.float32, device=t.device)
        if rows.numel():
            self._kernel("kv_round", t.device, consts)(x=rows, out=out)
        return out.reshape(t.shape)


def _stacked_banks(states: list, starts: list[int], ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The states' banks as [B, slots, width] tensors (``stacked.py``): kept as the stack's views."""
    banks = [st.as_banks(p, ratio, overlap) for st, p in zip(states, starts)]
    cs, zs = [c for c, _ in banks], [z for _, z in banks]
    base_c, base_z = stack_of(cs), stack_of(zs)
    if base_c is None or base_z is None:
        (base_c, views_c), (base_z, views_z) = restack(cs), restack(zs)
        for st, c, z in zip(states, views_c, views_z):
            st.banked = (c, z)
    return base_c, base_z
