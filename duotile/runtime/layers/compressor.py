"""KV compressors: gated softmax pooling of m tokens into one row (model.md 2.5.4, V4.1 in 2.13).

`pool_windows` implements the general chunked rule: the carried open-window tokens are joined with
the chunk's tokens, every completed window is pooled, and the remainder is carried again. For the
overlapping ratio-4 compressor (`overlap=True`) each token's value/score vector has an A half (for
the next window) and a B half (for its own), and window w pools the 8 slots
{A halves of window w-1} U {B halves of window w}; window 0's missing A slots have score -inf.
Pooling is per channel; the state is FP32 like the reference.
"""

from __future__ import annotations

import torch

from ..cache import CompressorState
from ..model_ops import model_op
from .common import Ctx
from .step import one_token_each


@model_op("compress")
def pool_windows(ctx: Ctx, st: CompressorState, c: torch.Tensor, z: torch.Tensor, start: int, ratio: int,
                 overlap: bool) -> tuple[torch.Tensor, int]:
    """Feed values c [S, width] and scores z [S, width] (FP32, ape added) of positions start.. .

    Returns the pooled rows of the windows completed by this chunk [nw, width or width/2] and the index
    of the first of them.
    """
    st.as_lists(start, ratio, overlap)
    c = torch.cat([st.pending_c, c.float()])
    z = torch.cat([st.pending_z, z.float()])
    first = (start - st.pending_c.shape[0]) // ratio
    nw = c.shape[0] // ratio
    done = nw * ratio
    st.pending_c, st.pending_z = c[done:].clone(), z[done:].clone()
    vc = c[:done].view(nw, ratio, c.shape[-1])
    vz = z[:done].view(nw, ratio, z.shape[-1])
    if overlap and nw:
        half = vc.shape[-1] // 2
        a_c, a_z = vc[..., :half], vz[..., :half]
        if st.prev_c is None:
            prev_c = torch.zeros_like(a_c[:1])
            prev_z = torch.full_like(a_z[:1], float("-inf"))
        else:
            prev_c, prev_z = st.prev_c[None], st.prev_z[None]
        vc = torch.cat([torch.cat([prev_c, a_c[:-1]]), vc[..., half:]], 1)
        vz = torch.cat([torch.cat([prev_z, a_z[:-1]]), vz[..., half:]], 1)
        st.prev_c, st.prev_z = a_c[-1].clone(), a_z[-1].clone()
    elif overlap:
        return c.new_zeros(0, c.shape[-1] // 2), first
    pooled = ctx.ops.sum(ctx.ops.softmax(vz, 1) * vc, 1)
    return pooled, first


@model_op("compress_decode")
def pool_decode(ctx: Ctx, states: list[CompressorState], c: torch.Tensor, z: torch.Tensor, starts: list[int],
                ratio: int, overlap: bool) -> torch.Tensor:
    """A decode step's pooling: sequence b's one new token (c[b], z[b]) at position ``starts[b]``
    enters its state; the rows of the windows that completes (those with ``starts[b] % ratio ==
    ratio - 1``), in sequence order. The reference: each sequence's ``pool_windows`` body."""
    rows = [pool_windows.__wrapped__(ctx, st, c[b : b + 1], z[b : b + 1], p, ratio, overlap)[0]
            for b, (st, p) in enumerate(zip(states, starts))]
    return torch.cat(rows)


def pool_all(ctx: Ctx, states: list[CompressorState], c: torch.Tensor, z: torch.Tensor, seqs: list,
             ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every sequence's pooling of a step (``(StepSeq, slice)`` pairs, ``states`` theirs): the rows
    of all windows completed, in sequence order, their positions (a window's first token, host)
    and each sequence's count. A decode step (one token each) pools in one call."""
    starts = [seq.start for seq, _ in seqs]
    if one_token_each(seqs):
        counts = [int(p % ratio == ratio - 1) for p in starts]
        rows = pool_decode(ctx, states, c, z, starts, ratio, overlap)
        pos = torch.tensor([p - ratio + 1 for p, n in zip(starts, counts) if n], dtype=torch.long)
        return rows, pos, counts
    pooled = [pool_windows(ctx, st, c[sl], z[sl], seq.start, ratio, overlap) for st, (seq, sl) in zip(states, seqs)]
    pos = torch.cat([(torch.arange(rows.shape[0]) + first) * ratio for rows, first in pooled])
    return torch.cat([rows for rows, _ in pooled]), pos, [rows.shape[0] for rows, _ in pooled]
