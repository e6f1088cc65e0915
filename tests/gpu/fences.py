"""Kernel inputs in fenced memory: a read or a write past a tensor shows.

Each contiguous tensor is copied into the middle of an allocation whose ``FENCE`` bytes before
and after it are 0xFF: NaN in every floating format the specs take (f32, bf16, f16, e4m3, e5m2,
UE8M0) and -1 in every integer one. A kernel that reads past a tensor meets NaN or an index of
-1, which its result shows against the reference; one that writes past a tensor changes a fence,
which ``breaches`` names. Without fences such a read finds whatever the caching allocator left
there: gemm_blockscaled read the byte after its activation scale codes through sweeps that passed,
until a CUDA-graph run of the tiny V4.1 put a 255 there (codegen/tilelang_cuda/unit_axes.py).
"""

from __future__ import annotations

import torch

FENCE = 512  # bytes each side: whole 128-byte lines, and the alignment of every dtype


class Fenced:
    """``inputs`` (name -> tensor) with every contiguous, non-empty tensor moved into fenced memory."""

    def __init__(self, inputs: dict):
        self.inputs, self._buffers = {}, {}
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.numel() == 0:
                self.inputs[name] = t
                continue
            n = t.numel() * t.element_size()
            buf = torch.full((2 * FENCE + n,), 0xFF, dtype=torch.uint8, device=t.device)
            body = buf[FENCE:FENCE + n].view(t.dtype).view(t.shape)
            body.copy_(t)
            self.inputs[name], self._buffers[name] = body, (buf, n)

    def breaches(self) -> list[str]:
        """The tensors whose fences a kernel wrote, each with where: 'c: 64 bytes after'."""
        out = []
        for name, (buf, n) in self._buffers.items():
            before = int((buf[:FENCE] != 0xFF).sum())
            after = int((buf[FENCE + n:] != 0xFF).sum())
            if before or after:
                where = [f"{k} bytes {side}" for k, side in ((before, "before"), (after, "after")) if k]
                out.append(f"{name}: {' and '.join(where)} changed")
        return out
