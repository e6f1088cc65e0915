"""V4.1's cache rows kept as the bytes model.md 3.4 specifies, not as the values they decode to.

* ``StoredRing``: a layer's window ring, W rows of 512 e4m3 values and 16 UE8M0 codes (one a 32
  channels): 528 bytes a row where the dequantised ring held 1,024 (BF16) or 2,048 (FP32).
* ``PackedRows``: a KV source's compressed rows, growing: e2m1 codes two a byte and an E4M3 scale a
  16 channels, 288 bytes a row; and its index keys, MXFP4 (a UE8M0 code a 32), 68 bytes a row.

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

from .quant import decode_fp8_rows, decode_nvfp4_rows, dequantize_fp4_rows

FP8_BLOCK = 32  # channels a UE8M0 code of a window row covers (V4.1)
NVFP4_BLOCK = 16  # channels an E4M3 scale of a compressed row covers
MXFP4_BLOCK = 32  # channels a UE8M0 code of an index key covers
FP4_BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}


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


class PackedRows:
    """Growing FP4 rows as stored, with capacity doubling (``cache.Rows``' interface: ``n``,
    ``append``, ``view``, ``data``; the last two decode): ``rows`` [capacity, row bytes] u8, each
    row its e2m1 pairs, then its scales. ``fmt``: ``nvfp4`` (an E4M3 scale a 16 channels: a KV
    source's compressed rows, 288 bytes at 512) or ``mxfp4`` (a UE8M0 code a 32: its index keys, 68
    bytes at 128)."""

    planes = ("rows",)

    def __init__(self, width: int, fmt: str, device: torch.device | str):
        self.width, self.fmt, self.n = width, fmt, 0
        self.rows = torch.zeros(16, width // 2 + width // FP4_BLOCKS[fmt], dtype=torch.uint8, device=device)

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
        return decode_fp4_rows(self.rows, self.width, self.fmt)

    @property
    def view(self) -> torch.Tensor:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return self.rows.numel()


def decode_ring_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """FP32 values of window rows as stored (u8 [..., width + width / 32])."""
    return decode_fp8_rows(rows[..., :width].view(torch.float8_e4m3fn), rows[..., width:], FP8_BLOCK)


def decode_fp4_rows(rows: torch.Tensor, width: int, fmt: str) -> torch.Tensor:
    """FP32 values of FP4 rows as stored (u8 [..., width / 2 + its scales]): NVFP4-like (E4M3 per
    16) or MXFP4 (UE8M0 per 32)."""
    half = width // 2
    if fmt == "nvfp4":
        return decode_nvfp4_rows(rows[..., :half], rows[..., half:].view(torch.float8_e4m3fn), NVFP4_BLOCK)
    return dequantize_fp4_rows(rows[..., :half], rows[..., half:].view(torch.float8_e8m0fnu), MXFP4_BLOCK)
