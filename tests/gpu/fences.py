"""Kernel inputs in fenced memory: a read or a write past a tensor shows.

The memory of each input tensor (its whole storage, shared by the inputs that are views of one
another, which stay views of one another) is copied into the middle of an allocation whose
``FENCE`` bytes before and after it are 0xFF: NaN in every floating format the specs take (f32,
bf16, f16, e4m3, e5m2, UE8M0) and -1 in every integer one. A kernel that reads past a tensor
meets NaN or an index of -1, which its result shows against the reference; one that writes past
it changes a fence, which ``breaches`` names. Without fences such a read finds whatever the
caching allocator left there: gemm_blockscaled read the byte after its activation scale codes
through sweeps that passed, until a CUDA-graph run of the tiny V4.1 put a 255 there
(codegen/tilelang_cuda/unit_axes.py). A tensor that is a slice of a larger storage is fenced at
its storage's ends (the GPU specs' inputs are each their own allocation).
"""

from __future__ import annotations

import torch

FENCE = 512  # bytes each side: whole 128-byte lines, and a multiple of every dtype's size


class Fenced:
    """``inputs`` (name -> tensor or value) with every non-empty tensor moved into fenced memory."""

    def __init__(self, inputs: dict):
        self.inputs, self._buffers = {}, {}  # storage address -> (fenced bytes, size, first name)
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                self.inputs[name] = t
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._buffers:
                n = storage.nbytes()
                buf = torch.full((2 * FENCE + n,), 0xFF, dtype=torch.uint8, device=t.device)
                buf[FENCE:FENCE + n].copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
                self._buffers[storage.data_ptr()] = (buf, n, name)
            buf = self._buffers[storage.data_ptr()][0]
            at = FENCE // t.element_size() + t.storage_offset()
            self.inputs[name] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                buf.untyped_storage(), at, t.shape, t.stride())

    def breaches(self) -> list[str]:
        """The tensors whose fences a kernel wrote, each with where: 'c: 12 bytes after changed'."""
        out = []
        for buf, n, name in self._buffers.values():
            before = int((buf[:FENCE] != 0xFF).sum())
            after = int((buf[FENCE + n:] != 0xFF).sum())
            if before or after:
                where = [f"{k} bytes {side}" for k, side in ((before, "before"), (after, "after")) if k]
                out.append(f"{name}: {' and '.join(where)} changed")
        return out
