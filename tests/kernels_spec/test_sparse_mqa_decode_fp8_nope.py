"""Sparse decode attention over V4's rows as stored (FP8 nope channels with a UE8M0 code a 64, BF16
rope channels): the row kv_insert writes is the row this kernel reads; the kernel over the bytes
agrees with the BF16 kernel over the values they hold; each code scales its own 64 channels and
the rope channels are read from their own bytes; rows too short for the format are named."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import DslError
from duotile.kernels_spec import get
from duotile.kernels_spec.kv_insert import kv_insert_reference, rope_tables, row_bytes
from duotile.kernels_spec.sparse_mqa_decode_fp8_nope import rows_dequantised

NOPE = get("sparse_mqa_decode_fp8_nope")
BF16 = get("sparse_mqa_decode")
CPU = torch.device("cpu")
CONFIG = {"BN": 32, "STAGES": 1, "SPLIT": 4}


def _run(spec, tensors: dict, config=CONFIG) -> dict:
    out = {"o": torch.full_like(tensors["o"], float("nan")), "lse": torch.full_like(tensors["lse"], float("nan"))}
    args = {k: v for k, v in tensors.items() if k not in out}
    codegen.compile(spec.kernel, "interpret", config=config)(**args, **out)
    return out


def test_the_row_kv_insert_writes_is_the_row_read():
    """kv_insert's V4 row (``fp8_nope``) read by this kernel's reading of the bytes: the normed,
    rotated row rounded as the runtime rounds V4's (FP8 per 64 on the nope channels, BF16 rope)."""
    from duotile.runtime import quant

    g = torch.Generator().manual_seed(5)
    b, d = 4, 512
    kv, weight = torch.randn(b, d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    cos, sin = rope_tables(300)
    pos = torch.tensor([0, 7, 128, 299])
    cache = kv_insert_reference(kv.bfloat16(), weight.bfloat16(), pos, cos, sin, FORMAT="fp8_nope", FLOOR=2.0 ** -118)
    rows = cache["cache"][torch.arange(b), pos % 128]
    assert rows.shape[1] == row_bytes(d, "fp8_nope") == 584
    got = rows_dequantised(rows, d)
    nope = d - 64
    # the values the runtime keeps for V4's rows: RMSNorm (bf16), rope on the last 64 channels
    # (bf16), then the nope channels rounded to FP8 with a code a 64
    x = kv.bfloat16().float()
    y = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) / d + 1e-6) * weight.bfloat16().float()).bfloat16().float()
    c, s = cos[pos], sin[pos]
    a, bb = y[:, nope::2], y[:, nope + 1::2]
    rot = torch.stack([a * c - bb * s, a * s + bb * c], -1).flatten(1).bfloat16().float()
    assert torch.equal(got[:, :nope].float(), quant.fp8_block_round(y[:, :nope], 64))
    assert torch.equal(got[:, nope:].float(), rot)


def test_rows_as_stored_agree_with_the_bf16_kernel_over_their_values():
    case = {"B": 3, "H": 64, "D": 128, "W": 40, "N": 60, "L": 180, "holes": 0.2, "valid": "all"}
    from duotile.kernels_spec.sparse_mqa_decode_fp8 import joint_index

    x = NOPE.make_inputs(case, CPU, 3)
    rows = torch.cat([rows_dequantised(x["kv_scale"], 128), rows_dequantised(x["cmp_scale"], 128)], 1)
    common = {k: x[k] for k in ("q", "sink", "o", "lse")}
    common["idx"] = joint_index(x["idx"], 40, 60)  # the same slots, as indices into the ring's rows, then the others
    from_bf16 = _run(BF16, {**common, "kv": rows.to(torch.bfloat16)})
    assert torch.equal(rows.to(torch.bfloat16).double(), rows)  # every value a bf16 number
    from_bytes = _run(NOPE, {k: v for k, v in x.items()})
    ref = from_bf16["o"].float()
    # the same rows; the scores sum the nope and rope columns' products apart
    assert (from_bytes["o"].float() - ref).abs().max() <= 2.0 ** -7 * ref.abs().max()
    assert torch.allclose(from_bytes["lse"], from_bf16["lse"], rtol=1e-5, atol=1e-5)


def test_each_code_scales_its_own_64_channels_and_rope_reads_its_own_bytes():
    """One row whose codes differ block by block, every slot naming it: the output is that row
    (times one factor for every channel), so each nope channel carries its own block's power of two
    and each rope channel its own bf16 value."""
    case = {"B": 1, "H": 64, "D": 256, "W": 4, "L": 32, "valid": "all"}
    x = NOPE.make_inputs(case, CPU, 1)
    x["idx"].fill_(2)
    nope = 192
    x["kv_scale"][0, 2, nope + 128 : nope + 131] = torch.tensor([120, 127, 133], dtype=torch.uint8)
    got = _run(NOPE, x)
    want = rows_dequantised(x["kv_scale"][0, 2], 256).float()
    factor = got["o"][0].float() / want[None, :]
    finite = want != 0
    assert torch.allclose(factor[:, finite], factor[:, finite][:, :1].expand(-1, int(finite.sum())), rtol=2 ** -7)


def test_rows_too_short_for_their_format_are_named():
    case = {"B": 1, "H": 64, "D": 128, "W": 4, "L": 8, "valid": "all"}
    x = NOPE.make_inputs(case, CPU, 1)
    short = x["kv_scale"][..., :192].contiguous()  # the values and the rope, no codes
    views = {"kv": short.view(torch.float8_e4m3fn), "kv_scale": short, "kv_rope": short.view(torch.bfloat16)}
    with pytest.raises(DslError, match=r"kv's rows \(R bytes\) are short of D - ROPE e4m3 values") as err:
        _run(NOPE, {**x, **views})
    assert "sparse_mqa_decode_fp8_nope.py" in str(err.value)


def test_a_rope_view_of_other_rows_is_named():
    case = {"B": 1, "H": 64, "D": 128, "W": 4, "L": 8, "valid": "all"}
    x = NOPE.make_inputs(case, CPU, 1)
    other = torch.zeros(1, 4, 50, dtype=torch.bfloat16)
    with pytest.raises(DslError, match=r"kv_rope must be kv's rows as bf16"):
        _run(NOPE, {**x, "kv_rope": other})


def test_the_compressed_rows_come_as_three_views_or_none():
    case = {"B": 1, "H": 64, "D": 128, "W": 4, "N": 8, "L": 8, "valid": "all"}
    x = NOPE.make_inputs(case, CPU, 1)
    del x["cmp_rope"]
    with pytest.raises(DslError, match=r"give cmp, cmp_scale and cmp_rope together"):
        _run(NOPE, x)


def test_the_hca_model_shapes_time_every_list_at_its_full_length():
    """A benchmark at an HCA shape times each query's list at the shape's L (``"lens": "full"``):
    the test cases' mixed lengths (an empty list first) made batch 1 time an empty query."""
    hca = {k: c for k, c in NOPE.model_shapes.items() if "/hca" in k}
    assert hca and all(c["lens"] == "full" for c in hca.values())
    case = {**hca["v4/hca8320/decode4"], "N": 300, "L": 428}  # fewer rows: the lengths are what is checked
    lens = NOPE.make_inputs(case, CPU, seed=0)["lens"]
    assert lens.tolist() == [428] * 4
    mixed = NOPE.make_inputs({**case, "lens": True}, CPU, seed=0)["lens"]
    assert mixed[0] == 0 and mixed[1] == 428
