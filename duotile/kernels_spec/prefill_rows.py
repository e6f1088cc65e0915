"""Where ``sparse_mqa_prefill`` reads its rows: the sequence's BF16 rows (``kv``) alone, or those in
a list's first ``ring_slots(WINDOW)`` slots (the window's) and the compressed rows as the cache stores
them in the rest, dequantised in the kernel's gather. Two stored formats, as the decode kernels read
them:

- V4.1's NVFP4-like rows (``cmp`` u8 and ``cmp_scale`` e4m3, the same bytes typed twice: e2m1 pairs,
  an E4M3 scale per 16 channels; ``sparse_mqa_decode_fp8``);
- V4's FP8-nope rows (``cmp_nope`` e4m3, ``cmp_codes`` u8, ``cmp_rope`` bf16, the same bytes typed
  thrice: D - ROPE e4m3 values, ROPE bf16 channels, a UE8M0 code per 64 values;
  ``sparse_mqa_decode_fp8_nope``), whose two parts are two column groups of the attention (one
  accumulator each), the window's BF16 rows split alike.

The kernel side (``row_sources``), the reference's one set of rows (``joined``) and the test inputs
(``stored_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dsl
from ..dsl.ops import NVFP4_BLOCK
from .column_groups import column_groups
from .kv_insert import row_bytes
from .sparse_mqa_decode_fp8 import check_block, compressed_rows, nvfp4_dequantised, nvfp4_rows, ring_slots
from .sparse_mqa_decode_fp8_nope import CODE_BLOCK as NOPE_CODE_BLOCK
from .sparse_mqa_decode_fp8_nope import _code_columns, _random_rows, nope_column_groups, row_groups, rows_dequantised


@dataclass
class Stored:
    """The call's stored compressed rows: ``nvfp4`` (``cmp``, ``cmp_scale``) or ``fp8_nope``
    (``cmp_nope``, ``cmp_codes``, ``cmp_rope``), or neither (``fmt`` None)."""

    fmt: str | None
    tensors: tuple = ()

    @classmethod
    def of(cls, cmp, cmp_scale, cmp_nope, cmp_codes, cmp_rope) -> Stored:
        nvfp4, nope = (cmp, cmp_scale), (cmp_nope, cmp_codes, cmp_rope)
        if len({t is None for t in nvfp4}) > 1:
            raise dsl.DslError("sparse_mqa_prefill: give cmp and cmp_scale together (the compressed rows and their "
                               "scales), or neither")
        if len({t is None for t in nope}) > 1:
            raise dsl.DslError("sparse_mqa_prefill: give cmp_nope, cmp_codes and cmp_rope together (V4's compressed "
                               "rows as values, codes and rope channels), or none")
        if cmp is not None and cmp_nope is not None:
            raise dsl.DslError("sparse_mqa_prefill: give one format of compressed rows (cmp, or cmp_nope), not both")
        if cmp is not None:
            return cls("nvfp4", nvfp4)
        return cls("fp8_nope", nope) if cmp_nope is not None else cls(None)


def row_sources(q, kv, stored: Stored, WINDOW, ROPE, BN, DG=1):
    """(``_attend``'s gather, its column groups or None): the BF16 rows the slots name (a dead slot
    reads a zero row), or the window's and the stored rows' parts of the list (module docstring);
    the output's columns in ``DG`` groups (``sparse_mqa_decode.column_groups``; with V4's stored
    rows the nope channels' groups, then the rope channels)."""
    d = q.D
    if stored.fmt == "fp8_nope":
        nope = _nope_width(q, stored, ROPE)
        nope_groups, columns = nope_column_groups(nope, ROPE, DG)
    else:
        nope_groups, columns = None, column_groups(d, DG)

    def window(slots):  # by the output's column groups, where it has them
        tiles = [dsl.load(kv[slots, first], (BN, width), role="operand") for first, width in columns or ((0, d),)]
        return tiles if columns else tiles[0]

    if stored.fmt is None:
        return window, columns
    check_block(BN)
    if not (isinstance(WINDOW, int) and WINDOW >= 1):
        raise dsl.DslError(f"sparse_mqa_prefill: WINDOW {WINDOW!r} must be a positive int (the window slots a list "
                           f"starts with)")
    ring = ring_slots(WINDOW) // BN  # the list's blocks of window rows
    rows = stored.tensors[0].NC
    if stored.fmt == "nvfp4":
        return [(0, ring, window, kv.N), (ring, None, _nvfp4_gather(q, *stored.tensors, BN, columns), rows)], columns
    gather = _nope_gather(*stored.tensors, nope, ROPE, BN, nope_groups)
    return [(0, ring, window, kv.N), (ring, None, gather, rows)], columns


def _nvfp4_gather(q, cmp, cmp_scale, BN, columns=None):
    d = q.D
    dsl.require(cmp.RC >= d // 2 + d // NVFP4_BLOCK,
                "cmp's rows (RC bytes) are short of D / 2 bytes of e2m1 pairs and their D / 16 scales")

    def gather(slots):  # past the stored rows: a zero row, dead
        rows = dsl.where(slots < cmp.NC, slots, -1)
        tiles = [nvfp4_rows(cmp, cmp_scale, (), rows, width, BN, first=first, d=d)
                 for first, width in columns or ((0, d),)]
        return tiles if columns else tiles[0]

    return gather


def _nope_width(q, stored: Stored, ROPE) -> int:
    """D - ROPE, checked: whole codes' blocks, and rows long enough for the values, rope and codes."""
    if not (isinstance(ROPE, int) and ROPE > 0 and ROPE % 16 == 0):
        raise dsl.DslError(f"ROPE {ROPE!r} must be a positive multiple of 16 (the rope channels)")
    nope = q.D - ROPE
    for cond in (nope >= NOPE_CODE_BLOCK, NOPE_CODE_BLOCK * (nope // NOPE_CODE_BLOCK) >= nope):
        dsl.require(cond, f"D - ROPE (the nope channels) must be a positive multiple of {NOPE_CODE_BLOCK}")
    values, codes, rope = stored.tensors
    dsl.require(codes.RC >= nope + 2 * ROPE + _code_columns(nope),
                "cmp_codes' rows (RC bytes) are short of D - ROPE e4m3 values, ROPE bf16 channels and the codes")
    for cond in (2 * rope.RH >= codes.RC, 2 * rope.RH <= codes.RC):
        dsl.require(cond, "cmp_rope must be the rows as bf16 (RC / 2 columns)")
    return nope


def _nope_gather(values, codes, rope, nope, ROPE, BN, nope_groups=None):
    def gather(slots):  # past the stored rows: a zero row, dead
        return list(row_groups(values, codes, rope, (), dsl.where(slots < values.NC, slots, -1), nope, ROPE, BN,
                               nope_groups))

    return gather


# -- the reference's rows and the test inputs -----------------------------------------------------
def joined(q, kv, idx, inputs: dict, WINDOW=128, ROPE=64):
    """(rows, index list) over one set of rows: ``kv`` then the stored compressed rows of
    ``inputs`` dequantised (float64), the list's compressed slots moved past ``kv``'s N rows, -1
    for a slot naming no row of its part; ``kv`` and ``idx`` as they are without stored rows."""
    d = q.shape[-1]
    if inputs.get("cmp") is not None:
        half = d // 2
        extra = nvfp4_dequantised(inputs["cmp"][:, :half], inputs["cmp_scale"][:, half:half + d // NVFP4_BLOCK])
    elif inputs.get("cmp_codes") is not None:
        extra = rows_dequantised(inputs["cmp_codes"], d, ROPE)
    else:
        return kv, idx
    n, nc = kv.shape[0], extra.shape[0]
    ring = torch.arange(idx.shape[-1], device=idx.device) < ring_slots(WINDOW)
    index = torch.where(ring, torch.where((idx >= 0) & (idx < n), idx, -1),
                        torch.where((idx >= 0) & (idx < nc), idx + n, -1))
    return torch.cat([kv.double(), extra]), index


def stored_inputs(case, device, seed, base: dict) -> dict:
    """``base`` (inputs over ``N`` + ``NC`` rows) with ``NC`` compressed rows as stored in the case's
    ``FORMAT`` (``nvfp4``, the default, or ``fp8_nope``), the list's first ``ring_slots(WINDOW)``
    slots naming ``kv`` rows and the rest compressed rows (its holes kept; with ``out_of_range``, one
    slot of each part past its rows)."""
    d, n, nc, fmt = case["D"], case["N"], case["NC"], case.get("FORMAT", "nvfp4")
    width = d // 2 + d // NVFP4_BLOCK if fmt == "nvfp4" else row_bytes(d, fmt)
    if device.type == "meta":
        return {**base, **_views(fmt, torch.empty(nc, width, dtype=torch.uint8))}
    g = torch.Generator(device=device).manual_seed(seed + 7)
    if fmt == "nvfp4":
        packed = torch.randint(0, 256, (nc, d // 2), generator=g, device=device, dtype=torch.uint8)
        scales = torch.exp2(torch.randint(-2, 3, (nc, d // NVFP4_BLOCK), generator=g, device=device).float())
        rows = compressed_rows(packed, scales.to(torch.float8_e4m3fn))
    else:
        rows = _random_rows((nc,), d, g, device, case.get("codes", (122, 132)))
    part = ring_slots(case.get("WINDOW", 128))
    idx = base["idx"]
    ring = torch.arange(idx.shape[-1], device=idx.device) < part
    idx = torch.where(idx < 0, -1, torch.where(ring, idx % n, idx % nc)).to(idx.dtype)
    if case.get("out_of_range") and idx.shape[-1] > part:
        idx[:, 2], idx[:, part] = n, nc
    return {**base, "idx": idx, **_views(fmt, rows)}


def _views(fmt: str, rows: torch.Tensor) -> dict:
    if fmt == "nvfp4":
        return {"cmp": rows, "cmp_scale": rows.view(torch.float8_e4m3fn)}
    return {"cmp_nope": rows.view(torch.float8_e4m3fn), "cmp_codes": rows, "cmp_rope": rows.view(torch.bfloat16)}
