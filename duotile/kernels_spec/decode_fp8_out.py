"""The sparse attention kernels' FP8 output (``sparse_mqa_decode``, its stored-row forms and
``sparse_mqa_prefill``, whose T chunk tokens are the B queries below): the
stored output, rope channels rotated, quantised as the grouped output projection ``wo_a`` takes its
input when engines run it in FP8 (model.md 2.5.7, 2.10): e4m3 with a UE8M0 code per ``QBLOCK``
channels of a row (128 in V4, 32 in V4.1), the ``quantize`` kernel's arithmetic (``fp8_block_code``
on the BF16 output, its amax floor 1e-4), so the bits are those of ``quantize`` run on ``o``.

The rows are written group-major, as ``gemm_blockscaled`` reads its A: the H heads form ``GROUPS``
groups of HG = H / GROUPS heads (model.md 2.5.7: group g is heads g HG .. g HG + HG - 1), and head h
of query b is row ``(h // HG) B HG + b HG + h % HG`` of ``o_q`` (B H x D, e4m3) and of ``o_qs``
(B H x D / QBLOCK, u8): viewed [GROUPS, B, HG D] and [GROUPS, B, HG D / QBLOCK], a group's rows and
codes are contiguous. A head's row is whole blocks (D a multiple of QBLOCK), so each block is one
head's QBLOCK channels, as the flattened [B, H D] rows' blocks are.

The two-phase decode kernels quantise in their combine, one ``QBLOCK``-wide column block of every
head a program (their ``BD`` is then ``QBLOCK``); the one-phase forms (a decode at SPLIT 1, the
prefill) read their stored output back in a phase of its own (``quant_phase``). The check: the
outputs are a function of the kernel's own ``o`` (``Spec.derived``: ``fp8_rows`` / ``fp8_codes``),
bit for bit.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..runtime.quant import FP8_ACT_FLOOR
from .quantize import NAN_CODE, quantize_reference
from .ue8m0 import f32_bits, fp8_block_code


class Fp8Out:
    """Where and how a decode kernel writes its FP8 output (the module docstring)."""

    def __init__(self, q, o_q, o_qs, groups, block):
        self.q, self.o_q, self.o_qs, self.groups, self.block = q, o_q, o_qs, groups, block
        self.per_group = q.H // groups

    def rows(self, b):
        """The rows of query b's heads, an index tile over the H heads."""
        h, hg = dsl.arange(self.q.H), self.per_group
        return (h // hg) * (self.q.shape[0] * hg) + b * hg + h % hg

    def store(self, b, j, y):
        """Quantise ``y`` (H x QBLOCK, bf16: column block j of query b's output) and write it and its
        codes at its heads' rows."""
        x = y.to(dsl.f32)
        code, inv, _ = fp8_block_code(x, f32_bits(FP8_ACT_FLOOR), NAN_CODE)
        rows = self.rows(b)
        dsl.store(self.o_q[rows, j * self.block], (x * inv[:, None]).to(dsl.f8e4m3))
        dsl.store(self.o_qs[rows, j], code[:, None].to(dsl.u8))


def fp8_out_of(name, q, o_q, o_qs, GROUPS, QBLOCK):
    """The kernel call's ``Fp8Out``, or None without ``o_q``; refuses a partial or misshapen one."""
    if o_q is None and o_qs is None:
        return None
    if o_q is None or o_qs is None:
        raise dsl.DslError(f"{name}: give o_q and o_qs together (wo_a's FP8 input and its codes), or neither")
    for what, v in (("GROUPS", GROUPS), ("QBLOCK", QBLOCK)):
        if not (isinstance(v, int) and v >= 1):
            raise dsl.DslError(f"{name}: {what} {v!r} must be a positive int (wo_a's groups, the FP8 block)")
    for cond in (q.H >= GROUPS, GROUPS * (q.H // GROUPS) >= q.H):
        dsl.require(cond, "H must be a multiple of GROUPS (a group is whole heads, model.md 2.5.7)")
    for cond in (q.D >= QBLOCK, QBLOCK * (q.D // QBLOCK) >= q.D):
        dsl.require(cond, "D must be a multiple of QBLOCK (a head's row is whole FP8 blocks)")
    queries = q.shape[0]  # B of a decode step, T of a prefill chunk
    for cond in (o_q.QR >= queries * q.H, o_q.QR <= queries * q.H):
        dsl.require(cond, "o_q must have a row per query and head (group-major)")
    for cond in (o_qs.QD >= q.D // QBLOCK, o_qs.QD <= q.D // QBLOCK):
        dsl.require(cond, "o_qs must have D / QBLOCK columns (a code a block)")
    return Fp8Out(q, o_q, o_qs, GROUPS, QBLOCK)


def quant_phase(q, o, out: Fp8Out) -> None:
    """The one-phase form's quantisation: each query's stored output read back, a block a program."""
    for b, j in dsl.grid(q.shape[0], q.D // out.block):
        out.store(b, j, dsl.load(o[b, 0, j * out.block], (q.H, out.block)))


# -- what the outputs must hold -------------------------------------------------------------------
def group_major(o: torch.Tensor, groups: int) -> torch.Tensor:
    """``o`` (B, H, D) as the kernel's rows (B H, D): group, then query, then the group's heads."""
    b, h, d = o.shape
    return o.view(b, groups, h // groups, d).transpose(0, 1).reshape(b * h, d)


def _quantised(case, inputs) -> dict:
    return quantize_reference(group_major(inputs["o"], case["GROUPS"]), BLOCK=case["QBLOCK"])


def fp8_rows(case, inputs) -> torch.Tensor:
    """``o_q``: ``quantize`` of the kernel's own ``o`` in the group-major rows."""
    return _quantised(case, inputs)["q"]


def fp8_codes(case, inputs) -> torch.Tensor:
    """``o_qs``: the codes of ``fp8_rows``."""
    return _quantised(case, inputs)["scale"]


DERIVED = {"o_q": fp8_rows, "o_qs": fp8_codes}


def fp8_out_inputs(case, device) -> dict:
    """The FP8 output's tensors where the case names ``GROUPS`` (and ``QBLOCK``), else none."""
    if "GROUPS" not in case:
        return {}
    rows, d = case["B"] * case["H"], case["D"]
    return {"o_q": torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=device),
            "o_qs": torch.empty(rows, d // case["QBLOCK"], dtype=torch.uint8, device=device)}


def fp8_out_constants(case) -> dict:
    """The FP8 output's constants where the case names them (a call without that output is the
    kernel at its defaults)."""
    return {"GROUPS": case["GROUPS"], "QBLOCK": case["QBLOCK"]} if "GROUPS" in case else {}
