"""Quantisation formats of the released checkpoints and the reference's rounding points (model.md 2.10, 4).

Every function here is a pure round trip on float tensors ("simulated" quantisation): it returns the
dequantised values the released model computes with. Storage codecs (packing FP4 nibbles, splitting a
weight into FP8 values and UE8M0 block scales) live here too, so the checkpoint writer and loader share
one definition of each format.

* FP8 e4m3: max 448, round to nearest even (torch's cast), values clamped first.
* FP4 e2m1: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, round to nearest, ties to the even code.
* UE8M0 scale: the power of two `2^ceil(log2(amax / qmax))`, computed with an exact exponent test.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring FP4 codes; a tie goes to the even code (down after an even code).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP8_ACT_FLOOR = 1e-4
FP4_FLOOR = 6.0 * 2.0**-126
NVFP4_FLOOR = 6.0 * 2.0**-9  # the E4M3 scale's floor: amax / 6 >= 2^-9, e4m3's smallest subnormal


def ue8m0_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two `s` with `amax / s <= qmax` (FP32, exact at powers of two); NaN where
    `amax` is not finite (UE8M0's NaN code, as the quantiser kernel writes: frexp of Inf or NaN
    gives exponent 0, which read as a scale of 1)."""
    ratio = amax.float() / qmax
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(torch.isfinite(ratio), scale, torch.full_like(scale, float("nan")))


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values (already divided by their scale) onto the e4m3 grid."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (bit 3 = sign, bits 0-2 = magnitude index) of FP32 values already divided by their scale."""
    mag = x.float().abs().clamp(max=FP4_MAX)
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for k, mid in enumerate(_FP4_MIDPOINTS):
        above = mag > mid if k % 2 == 0 else mag >= mid
        idx += above.to(torch.uint8)
    sign = (x < 0) & (idx > 0)
    return idx | (sign.to(torch.uint8) << 3)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    mag = FP4_GRID.to(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    return fp4_decode(fp4_codes(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, an even last dim) two a byte: the low nibble holds element 2k, the high
    nibble element 2k + 1 (model.md 4.1, torch's ``float4_e2m1fn_x2``)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    raw = packed.view(torch.uint8)
    return torch.stack([raw & 15, raw >> 4], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


def fp8_block_round(x: torch.Tensor, block: int, floor: float = 0.0) -> torch.Tensor:
    """FP8 e4m3 round trip with one UE8M0 scale per `block` consecutive channels of the last dim."""
    b = _blocks(x, block)
    scale = ue8m0_scale(b.abs().amax(-1, keepdim=True).clamp(min=floor), FP8_MAX)
    return (fp8_round(b / scale) * scale).flatten(-2)


def act_quant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The dynamic activation quantiser in front of every FP8/FP4 GEMM (per 128 channels, amax >= 1e-4)."""
    if x.shape[-1] % block:
        block = math.gcd(x.shape[-1], block)
    return fp8_block_round(x, block, FP8_ACT_FLOOR)


def mxfp4_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 with one UE8M0 scale per 32 channels (MXFP4): index queries and keys."""
    b = _blocks(x, block)
    scale = ue8m0_scale(b.abs().amax(-1, keepdim=True).clamp(min=FP4_FLOOR), FP4_MAX)
    return (fp4_round(b / scale) * scale).flatten(-2)


def nvfp4_scale(amax: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale of a block: ``e4m3(max(amax, 6 x 2^-9) / 6)``, clamped to e4m3's 448."""
    return fp8_round(amax.float().clamp(min=NVFP4_FLOOR) / FP4_MAX)


def nvfp4_round(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """V4.1 compressed-KV format: e2m1 values with an E4M3 scale per 16 channels, no global scale."""
    b = _blocks(x, block)
    scale = nvfp4_scale(b.abs().amax(-1, keepdim=True))
    return (fp4_round(b / scale) * scale).flatten(-2)


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised Sylvester Walsh-Hadamard matrix of order n (a power of two), symmetric and orthogonal."""
    if n & (n - 1):
        raise ValueError(f"Hadamard order {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


# ---- cache rows as stored (model.md 3.4) ---------------------------------------------------------

def decode_fp8_rows(values: torch.Tensor, codes: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP32 values of FP8 rows as stored (the ``quantize`` kernel's bytes): each e4m3 value times
    2^(code - 127) of its ``block`` channels, NaN at code 255."""
    scale = codes.view(torch.float8_e8m0fnu).float()
    return (values.float().unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2)


def decode_nvfp4_rows(packed: torch.Tensor, scales: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP32 values of NVFP4-like rows as stored (``quantize_fp4``'s bytes): each e2m1 value (the
    even element in a byte's low nibble) times the E4M3 scale of its ``block`` channels."""
    values = fp4_decode(unpack_fp4(packed)).unflatten(-1, (-1, block))
    return (values * scales.float()[..., None]).flatten(-2)


# ---- storage codecs (checkpoint writer / loader) -------------------------------------------------

def quantize_fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a [out, in] weight into e4m3 values and UE8M0 scales, one per block x block tile."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(rows, block, cols, block)
    scale = ue8m0_scale(tiles.abs().amax(dim=(1, 3)).clamp(min=2.0**-100), FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * block, cols * block)
    return q[:out_dim, :in_dim].to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out_dim, in_dim = q.shape
    s = scale.float().repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return q.float() * s


def quantize_fp4_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> packed int8 [out, in/2] (low nibble = even element) and UE8M0 scales [out, in/32]."""
    b = _blocks(w, block)
    scale = ue8m0_scale(b.abs().amax(-1, keepdim=True).clamp(min=FP4_FLOOR), FP4_MAX)
    packed = pack_fp4(fp4_codes(b / scale).flatten(-2))
    return packed.view(torch.int8), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp4_rows(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    values = fp4_decode(unpack_fp4(packed))
    return (values.unflatten(-1, (-1, block)) * scale.float()[..., None]).flatten(-2)


def quantize_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 with one UE8M0 scale per 32 values (Engram tables): e4m3 [rows, d], scales [rows, d/32]."""
    b = _blocks(w, block)
    scale = ue8m0_scale(b.abs().amax(-1, keepdim=True).clamp(min=2.0**-100), FP8_MAX)
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    return q.to(torch.float8_e4m3fn), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, block)) * scale.float()[..., None]).flatten(-2)


def dequantize_packed(packed: tuple[str, torch.Tensor, torch.Tensor], block: int) -> torch.Tensor:
    """The FP32 value of a weight as a kernel reads it (``Checkpoint.packed``): FP8 codes with a
    UE8M0 byte per ``block`` x ``block``, or MXFP4 pairs with a UE8M0 byte per 32 of a row."""
    kind, codes, scales = packed
    scale = scales.view(torch.float8_e8m0fnu)
    if kind == "fp8":
        return dequantize_fp8_blocks(codes, scale, block)
    if kind == "fp4":
        return dequantize_fp4_rows(codes, scale)
    raise ValueError(f"packed weight of kind {kind!r}: fp8 or fp4 only")
