"""V4.1's cache rows kept as the bytes model.md 3.4 specifies, not as the values they decode to.

* ``StoredRing``: a layer's window ring, W rows of 512 e4m3 values and 16 UE8M0 codes (one a 32
  channels): 528 bytes a row where the dequantised ring held 1,024 (BF16) or 2,048 (FP32).
* ``Nvfp4Rows``: a KV source's compressed rows, growing: e2m1 codes two a byte and an E4M3 scale a
  16 channels, 288 bytes a row.

Each row is its values, then its scales, in one u8 tensor (``planes``: the one attribute, so that
a decode step stacks its sequences' rows, ``stacked.py``); the stored-row decode kernel
(``kernels_spec/sparse_mqa_decode_fp8.py``) reads them as they are, and ``kv_insert`` writes the
window's row in that layout. The bytes are written by the ``kv_encode`` model op (the ``quantize``
/ ``quantize_fp4`` kernels' formats). A read through ``[]`` / ``view`` / ``data`` decodes them: the
values the reference attends over, the ones the dequantised cache held (the rows were rounded to
the same format).
"""

from __future__ import annotations

import torch

from .quant import decode_fp8_rows, decode_nvfp4_rows

FP8_BLOCK = 32  # channels a UE8M0 code of a window row covers (V4.1)
NVFP4_BLOCK = 16  # channels an E4M3 scale of a compressed row covers


class StoredRing:
    """A window ring of ``size`` rows as stored: ``rows`` [W, D + D / 32] u8, each row its e4m3
    values' bytes, then its codes (``kv_insert``'s row). ``ring[slots]`` reads rows as ``dtype``
    values; ``write(slots, rows)`` stores rows of bytes (``kv_encode``)."""

    planes = ("rows",)

    def __init__(self, size: int, width: int, dtype: torch.dtype, device: torch.device | str):
        self.rows = torch.zeros(size, width + width // FP8_BLOCK, dtype=torch.uint8, device=device)
        self.rows[:, width:] = 127  # a scale of one
        self.width, self.dtype = width, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows.shape[0], self.width))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def __getitem__(self, slots) -> torch.Tensor:
        return decode_ring_rows(self.rows[slots], self.width).to(self.dtype)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows[slots] = rows

    def nbytes(self) -> int:
        return self.rows.numel()


class Nvfp4Rows:
    """Compressed rows as stored, with capacity doubling (``cache.Rows``' interface: ``n``,
    ``append``, ``view``, ``data``; the last two decode): ``rows`` [capacity, D / 2 + D / 16] u8,
    each row its e2m1 pairs, then its E4M3 scales' bytes."""

    planes = ("rows",)

    def __init__(self, width: int, device: torch.device | str):
        self.rows = torch.zeros(16, width // 2 + width // NVFP4_BLOCK, dtype=torch.uint8, device=device)
        self.width, self.n = width, 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self.rows.shape[0]:
            grown = self.rows.new_zeros(max(need, 2 * self.rows.shape[0]), self.rows.shape[1])
            grown[: self.n] = self.rows[: self.n]
            self.rows = grown
        self.rows[self.n : need] = rows
        self.n = need

    @property
    def data(self) -> torch.Tensor:
        """Every row of the capacity, decoded (FP32)."""
        return decode_compressed_rows(self.rows, self.width)

    @property
    def view(self) -> torch.Tensor:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return self.rows.numel()


def decode_ring_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """FP32 values of window rows as stored (u8 [..., width + width / 32])."""
    return decode_fp8_rows(rows[..., :width].view(torch.float8_e4m3fn), rows[..., width:], FP8_BLOCK)


def decode_compressed_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """FP32 values of compressed rows as stored (u8 [..., width / 2 + width / 16])."""
    half = width // 2
    return decode_nvfp4_rows(rows[..., :half], rows[..., half:].view(torch.float8_e4m3fn), NVFP4_BLOCK)
