"""V4.1's cache rows kept as the bytes model.md 3.4 specifies, not as the values they decode to.

* ``StoredRing``: a layer's window ring, W rows of 512 e4m3 values and 16 UE8M0 codes (one a 32
  channels): 528 bytes a row where the dequantised ring held 1,024 (BF16) or 2,048 (FP32).
* ``Nvfp4Rows``: a KV source's compressed rows, growing: e2m1 codes two a byte and an E4M3 scale a
  16 channels, 288 bytes a row.

Each keeps its bytes as planes (``planes``: the attribute names of tensors with one row a cache
row), so that a decode step stacks each plane of its sequences (``stacked.py``) and the
stored-row decode kernel (``kernels_spec/sparse_mqa_decode_fp8.py``) reads them as they are. The
bytes are written by the ``kv_encode`` model op (the ``quantize`` / ``quantize_fp4`` kernels'
format). A read through ``[]`` / ``view`` / ``data`` decodes them: the values the reference
attends over, the ones the dequantised cache held (the rows were rounded to the same format).
"""

from __future__ import annotations

import torch

from .quant import decode_fp8_rows, decode_nvfp4_rows

FP8_BLOCK = 32  # channels a UE8M0 code of a window row covers (V4.1)
NVFP4_BLOCK = 16  # channels an E4M3 scale of a compressed row covers


class StoredRing:
    """A window ring of ``size`` rows as stored; ``ring[slots]`` reads rows as ``dtype`` values,
    ``write(slots, (values, codes))`` stores encoded rows."""

    planes = ("values", "codes")

    def __init__(self, size: int, width: int, dtype: torch.dtype, device: torch.device | str):
        self.values = torch.zeros(size, width, dtype=torch.float8_e4m3fn, device=device)
        self.codes = torch.full((size, width // FP8_BLOCK), 127, dtype=torch.uint8, device=device)
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, slots) -> torch.Tensor:
        return decode_fp8_rows(self.values[slots], self.codes[slots], FP8_BLOCK).to(self.dtype)

    def write(self, slots: torch.Tensor, encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.values[slots], self.codes[slots] = encoded

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.codes))


class Nvfp4Rows:
    """Compressed rows as stored, with capacity doubling (``cache.Rows``' interface: ``n``,
    ``append``, ``view``, ``data``; the last two decode)."""

    planes = ("packed", "scales")

    def __init__(self, width: int, device: torch.device | str):
        self.packed = torch.zeros(16, width // 2, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(16, width // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=device)
        self.n = 0

    def append(self, encoded: tuple[torch.Tensor, torch.Tensor]) -> None:
        need = self.n + encoded[0].shape[0]
        for name, rows in zip(self.planes, encoded):
            plane = getattr(self, name)
            if need > plane.shape[0]:
                grown = plane.new_zeros(max(need, 2 * plane.shape[0]), plane.shape[1])
                grown[: self.n] = plane[: self.n]
                setattr(self, name, grown)
            getattr(self, name)[self.n : need] = rows
        self.n = need

    @property
    def data(self) -> torch.Tensor:
        """Every row of the capacity, decoded (FP32)."""
        return decode_nvfp4_rows(self.packed, self.scales, NVFP4_BLOCK)

    @property
    def view(self) -> torch.Tensor:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))
