"""Cache rows kept as the bytes model.md 3 specifies, not as the values they decode to.

Row formats (``FORMATS``; each row its values, then its scales, in one u8 row):

* ``fp8/32`` (V4.1's window ring): 512 e4m3 values and 16 UE8M0 codes, one a 32 channels: 528
  bytes a row where the dequantised ring held 1,024 (BF16) or 2,048 (FP32).
* ``fp8_nope`` (V4's window ring and compressed rows, model.md 3.1): 448 e4m3 nope channels, the
  64 rope channels in BF16, 7 UE8M0 codes (one a 64 nope channels) and a padding byte: 584 bytes.
* ``nvfp4`` (V4.1's compressed rows): e2m1 codes two a byte and an E4M3 scale a 16: 288 bytes.
* ``mxfp4`` (both models' index keys): e2m1 codes and a UE8M0 code a 32: 68 bytes at 128.

``StoredRing`` holds a layer's window ring, ``PackedRows`` a layer's growing rows. Each keeps one
u8 tensor (``planes``: the one attribute, so that a decode step stacks its sequences' rows,
``stacked.py``); the stored-row decode kernels (``kernels_spec/sparse_mqa_decode_fp8.py`` and
``sparse_mqa_decode_fp8_nope.py``) read them as they are, and ``kv_insert`` writes a window's row in
that layout. The bytes are written by the ``kv_encode`` model op (the ``quantize`` /
``quantize_fp4`` kernels' formats). A read through ``[]`` / ``view`` / ``data`` decodes them: the
values the reference attends over, the ones the dequantised cache held (the rows were rounded to
the same format).
"""

from __future__ import annotations

import torch

from .quant import decode_fp8_rows, decode_nvfp4_rows, dequantize_fp4_rows

FP8_BLOCK = 32  # channels a UE8M0 code of a V4.1 window row covers
NOPE_BLOCK = 64  # nope channels a UE8M0 code of a V4 row covers
NOPE_ROPE = 64  # rope channels a V4 row keeps in BF16
NVFP4_BLOCK = 16  # channels an E4M3 scale of a compressed row covers
MXFP4_BLOCK = 32  # channels a UE8M0 code of an index key covers
FP4_BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
FORMATS = ("fp8/32", "fp8_nope", "nvfp4", "mxfp4")


def row_bytes(width: int, fmt: str) -> int:
    """Bytes of a row of ``width`` channels in format ``fmt`` (``FORMATS``)."""
    if fmt == "fp8/32":
        return width + width // FP8_BLOCK
    if fmt == "fp8_nope":
        nope = width - NOPE_ROPE
        return nope + 2 * NOPE_ROPE + -(-(nope // NOPE_BLOCK) // 8) * 8
    if fmt in FP4_BLOCKS:
        return width // 2 + width // FP4_BLOCKS[fmt]
    raise ValueError(f"row format {fmt!r}: one of {', '.join(FORMATS)}")


def decode_rows(rows: torch.Tensor, width: int, fmt: str) -> torch.Tensor:
    """FP32 values of rows as stored (u8 [..., ``row_bytes``]) in format ``fmt``."""
    if fmt == "fp8/32":
        return decode_fp8_rows(rows[..., :width].view(torch.float8_e4m3fn), rows[..., width:], FP8_BLOCK)
    if fmt == "fp8_nope":
        nope = width - NOPE_ROPE
        codes = rows[..., nope + 2 * NOPE_ROPE : nope + 2 * NOPE_ROPE + nope // NOPE_BLOCK]
        values = decode_fp8_rows(rows[..., :nope].view(torch.float8_e4m3fn), codes, NOPE_BLOCK)
        rope = rows[..., nope : nope + 2 * NOPE_ROPE].contiguous().view(torch.bfloat16).float()
        return torch.cat([values, rope], -1)
    half = width // 2
    if fmt == "nvfp4":
        return decode_nvfp4_rows(rows[..., :half], rows[..., half:].view(torch.float8_e4m3fn), NVFP4_BLOCK)
    if fmt == "mxfp4":
        return dequantize_fp4_rows(rows[..., :half], rows[..., half:].view(torch.float8_e8m0fnu), MXFP4_BLOCK)
    raise ValueError(f"row format {fmt!r}: one of {', '.join(FORMATS)}")


def _unit_codes(rows: torch.Tensor, width: int, fmt: str) -> None:
    """Set an FP8 format's UE8M0 codes to 127 (a scale of one): unwritten rows decode to zeros
    under any code, and to a code a reader expects of a fresh row."""
    if fmt == "fp8/32":
        rows[:, width:] = 127
    elif fmt == "fp8_nope":
        nope = width - NOPE_ROPE
        rows[:, nope + 2 * NOPE_ROPE : nope + 2 * NOPE_ROPE + nope // NOPE_BLOCK] = 127


class StoredRing:
    """A window ring of ``size`` rows as stored: ``rows`` [W, row bytes] u8 in format ``fmt``
    (``fp8/32``, V4.1's, or ``fp8_nope``, V4's: ``kv_insert``'s rows). ``ring[slots]`` reads rows
    as ``dtype`` values; ``write(slots, rows)`` stores rows of bytes (``kv_encode``)."""

    planes = ("rows",)

    def __init__(self, size: int, width: int, dtype: torch.dtype, device: torch.device | str, fmt: str = "fp8/32"):
        if fmt not in ("fp8/32", "fp8_nope"):
            raise ValueError(f"StoredRing: format {fmt!r}: fp8/32 (V4.1) or fp8_nope (V4)")
        self.rows = torch.zeros(size, row_bytes(width, fmt), dtype=torch.uint8, device=device)
        _unit_codes(self.rows, width, fmt)
        self.width, self.dtype, self.fmt = width, dtype, fmt

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows.shape[0], self.width))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def __getitem__(self, slots) -> torch.Tensor:
        return decode_rows(self.rows[slots], self.width, self.fmt).to(self.dtype)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows[slots] = rows

    def nbytes(self) -> int:
        return self.rows.numel()


class PackedRows:
    """Growing rows as stored, with capacity doubling (``cache.Rows``' interface: ``n``,
    ``append``, ``view``, ``data``; the last two decode): ``rows`` [capacity, row bytes] u8 in
    format ``fmt``: ``nvfp4`` (V4.1's compressed rows, 288 bytes at 512), ``fp8_nope`` (V4's, 584)
    or ``mxfp4`` (the index keys, 68 bytes at 128)."""

    planes = ("rows",)

    def __init__(self, width: int, fmt: str, device: torch.device | str):
        self.width, self.fmt, self.n = width, fmt, 0
        self.rows = torch.zeros(16, row_bytes(width, fmt), dtype=torch.uint8, device=device)

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
        return decode_rows(self.rows, self.width, self.fmt)

    @property
    def view(self) -> torch.Tensor:
        """The ``n`` rows, decoded (FP32): the capacity past them is not decoded."""
        return decode_rows(self.rows[: self.n], self.width, self.fmt)

    @property
    def stored(self) -> torch.Tensor:
        """The ``n`` rows as stored (u8), for a reader that decodes them itself (an index-key
        kernel) rather than every row decoded on the host (``view``)."""
        return self.rows[: self.n]

    def nbytes(self) -> int:
        return self.rows.numel()
