"""Sparse decode attention over V4.1's FP8 window rows as stored: the rows the runtime keeps
(rounded to FP8 per 32 channels, held in BF16) and the same rows as the cache stores them (e4m3
bytes and UE8M0 codes) give the same bits through the FP8 kernel and the BF16 one, and the
runtime's attention agrees with them; a code's power of two reaches every channel of its block."""

from __future__ import annotations

import torch

from duotile import codegen
from duotile.kernels_spec import get
from duotile.kernels_spec.quantize import quantize_reference
from duotile.kernels_spec.sparse_mqa_decode_fp8 import dequantised, ring_rows
from duotile.runtime import quant
from duotile.runtime.layers.common import Ctx, sparse_attention
from duotile.runtime.ops import FastOps

FP8 = get("sparse_mqa_decode_fp8")
BF16 = get("sparse_mqa_decode")
CPU = torch.device("cpu")
CONFIG = {"BN": 32, "STAGES": 1, "SPLIT": 4}


def _run(spec, tensors: dict) -> dict:
    out = {"o": torch.full_like(tensors["o"], float("nan")), "lse": torch.full_like(tensors["lse"], float("nan"))}
    args = {k: v for k, v in tensors.items() if k not in out}
    codegen.compile(spec.kernel, "interpret", config=CONFIG)(**args, **out)
    return out


def _stored(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's bytes of FP32 rows (B, N, D): e4m3 values and a UE8M0 code per 32 channels."""
    b, n, d = rows.shape
    q = quantize_reference(rows.reshape(b * n, d), BLOCK=32, FLOOR=2.0 ** -118)
    return q["q"].view(b, n, d), q["scale"].view(b, n, d // 32)


def test_rows_as_stored_give_the_bits_of_the_rows_the_runtime_keeps():
    case = {"B": 3, "H": 64, "D": 128, "N": 96, "L": 80, "holes": 0.2, "valid": "all"}
    x = BF16.make_inputs(case, CPU, 3)
    rows = x["kv"].float() * 3.0
    kept = quant.fp8_block_round(rows, 32)  # the runtime's window rows (model.md 3.4's rounding)
    values, codes = _stored(rows)
    assert torch.equal(dequantised(values, codes).float(), kept)
    common = {k: x[k] for k in ("q", "idx", "sink", "o", "lse")}
    from_bf16 = _run(BF16, {**common, "kv": kept.to(torch.bfloat16)})
    ring = ring_rows(values, codes)  # the cache's rows: values, then codes
    from_fp8 = _run(FP8, {**common, "kv": ring.view(torch.float8_e4m3fn), "kv_scale": ring})
    assert torch.equal(from_fp8["o"].view(torch.int16), from_bf16["o"].view(torch.int16))
    assert torch.equal(from_fp8["lse"], from_bf16["lse"])
    idx = x["idx"]
    live = (idx >= 0) & (idx < case["N"])
    keys = kept.to(torch.bfloat16)[torch.arange(case["B"])[:, None], idx.clamp(min=0).long()]
    o = sparse_attention(Ctx(FastOps()), x["q"], keys, live, x["sink"], case["D"] ** -0.5)
    ref = from_fp8["o"].float()
    assert (o - ref).abs().max() <= 2.0 ** -7 * ref.abs().max()


def test_each_code_scales_its_own_32_channels():
    """One row whose codes differ block by block, every slot naming it: the output is that row,
    so each channel must carry its own block's power of two (a code read from the wrong column, or
    a block of 64, fails)."""
    case = {"B": 1, "H": 64, "D": 128, "W": 4, "L": 32, "valid": "all"}
    x = FP8.make_inputs(case, CPU, 1)
    x["idx"].fill_(2)
    x["kv_scale"][0, 2, 128:] = torch.tensor([120, 127, 131, 136], dtype=torch.uint8)  # the row's codes
    got = _run(FP8, x)
    want = dequantised(x["kv"][0, 2, :128], x["kv_scale"][0, 2, 128:])
    # softmax over 32 copies of one row and the sink: o = row x 32 e^l / (32 e^l + e^sink), the same
    # factor for every channel
    factor = got["o"][0].float() / want.float()[None, :]
    finite = want != 0
    assert torch.allclose(factor[:, finite], factor[:, finite][:, :1].expand(-1, int(finite.sum())), rtol=2 ** -7)


def test_rows_too_short_for_their_format_are_named():
    """A ring whose rows hold the values but not their codes (D bytes, not D + D / 32) is refused
    at the spec line, naming the tensor and the bytes a row needs."""
    import pytest

    from duotile.dsl.errors import DslError

    case = {"B": 1, "H": 64, "D": 128, "W": 4, "L": 8, "valid": "all"}
    x = FP8.make_inputs(case, CPU, 1)
    short = x["kv_scale"][..., :128].contiguous()
    with pytest.raises(DslError, match=r"kv's rows \(R bytes\) are short of D e4m3 values and their D / 32 codes "
                                       r"\(sizes .*'D': 128.*'R': 128") as err:
        _run(FP8, {**x, "kv": short.view(torch.float8_e4m3fn), "kv_scale": short})
    assert "sparse_mqa_decode_fp8.py" in str(err.value)  # the spec line of the requirement
