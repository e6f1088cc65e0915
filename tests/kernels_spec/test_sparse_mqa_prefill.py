"""The sparse prefill reference a chunk of tokens at a time: the same outputs and error bounds as
one pass over every token, and chunks that fit the gather budget at the model's largest shape (V4's
HCA layer at a 4,096-token chunk once asked 130 GiB of one H200)."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec import get
from duotile.kernels_spec import sparse_mqa_prefill as sp
from duotile.kernels_spec.sparse_mqa_decode import sparse_mqa_decode_reference

SPEC = get("sparse_mqa_prefill")
CASE = {"T": 11, "H": 8, "D": 64, "N": 90, "L": 40}


def test_chunked_reference_equals_one_pass(monkeypatch):
    x = SPEC.make_inputs(CASE, torch.device("cpu"), 7)
    whole = sparse_mqa_decode_reference(x["q"], x["kv"][None].expand(CASE["T"], -1, -1), x["idx"], x["sink"])
    bound_whole = sp._error_bound(CASE, "o", x)
    monkeypatch.setattr(sp, "GATHER_BYTES", 3 * CASE["L"] * CASE["D"] * 8)  # three tokens a chunk
    assert len(sp._token_chunks(x["q"], x["idx"])) == 4
    got = sp.sparse_mqa_prefill_reference(x["q"], x["kv"], x["idx"], x["sink"])
    for name in ("o", "lse"):
        assert torch.equal(got[name], whole[name]), name
    assert torch.equal(sp._error_bound(CASE, "o", x), bound_whole)


def test_chunks_fit_the_budget_at_the_largest_model_shape():
    shape = SPEC.model_shapes["v4/hca8320/prefill4096"]
    x = SPEC.make_inputs(shape, torch.device("meta"), 0)
    chunks = sp._token_chunks(x["q"], x["idx"])
    assert chunks[0][0] == 0 and chunks[-1][1] == shape["T"]
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert max(hi - lo for lo, hi in chunks) * shape["L"] * shape["D"] * 8 <= sp.GATHER_BYTES


def test_chunked_bound_with_the_epilogue_is_each_chunks_rotated_bound(monkeypatch):
    """The bound of a rotated output, a chunk of tokens at a time: each chunk's own positions."""
    case = {**CASE, "D": 128, "rope": "random", "P": 200}  # 64 nope, 64 rope channels
    x = SPEC.make_inputs(case, torch.device("cpu"), 7)
    whole = sp._error_bound(case, "o", x)
    monkeypatch.setattr(sp, "GATHER_BYTES", 3 * CASE["L"] * case["D"] * 8)
    assert len(sp._token_chunks(x["q"], x["idx"])) == 4
    assert torch.equal(sp._error_bound(case, "o", x), whole)
    plain = {k: v for k, v in x.items() if k not in ("positions", "cos", "sin")}
    moved = whole != sp._error_bound(CASE, "o", plain)
    assert moved[..., -64:].any() and not moved[..., :-64].any()  # the rope channels' bound alone


def test_the_epilogue_and_fp8_output_generate_for_sm90_at_the_runtimes_call():
    """V4.1's prefill call as the runtime makes it (rotation by -P, wo_a's FP8 input per 32 channels,
    8 groups) at a 4,096-token chunk: three phases on sm90 (attention, rotation, quantisation); sm100
    holds no 64 x 512 accumulator in TMEM, as for the plain call."""
    from benchmarks.model_shape_builds import generate_row

    case = {**SPEC.model_shapes["v41/csa_r2_topk640/prefill4096"], "rope": "random", "P": 8192, "GROUPS": 8,
            "QBLOCK": 32}
    row = generate_row(SPEC, "v41/csa_r2_topk640/prefill4096+epilogue", case, "sm90")
    assert row.status == "generated" and len(row.sources) == 3, row.message
    rope_src, quant_src = row.sources[1], row.sources[2]
    assert "cos" in rope_src and "sin" in rope_src and "o_q" in quant_src and "o_qs" in quant_src
    plain = generate_row(SPEC, "v41/csa_r2_topk640/prefill4096", SPEC.model_shapes["v41/csa_r2_topk640/prefill4096"],
                         "sm90")
    assert len(plain.sources) == 1
    assert generate_row(SPEC, "sm100", case, "sm100").reason.startswith("CapacityError: TMEM overflow")


def test_stored_compressed_rows_generate_for_sm90_at_the_runtimes_call():
    """Each model's chunk as the runtime calls it: the window's rows in BF16, the compressed rows as
    stored (V4.1: 32,768 NVFP4-like rows of 288 bytes; V4: 16,384 FP8-nope rows of 584), dequantised
    in the kernel, with the epilogue: sm90 source in three phases, the first reading them."""
    from benchmarks.model_shape_builds import generate_row

    for shape, nc, fmt, block, tensor in (("v41/csa_r2_topk640/prefill4096", 32768, "nvfp4", 32, "cmp_scale"),
                                          ("v4/csa_r4_topk640/prefill4096", 16384, "fp8_nope", 128, "cmp_rope")):
        case = {**SPEC.model_shapes[shape], "N": 4096 + 127, "NC": nc, "FORMAT": fmt, "rope": "random", "P": 8192,
                "GROUPS": 8, "QBLOCK": block}
        row = generate_row(SPEC, f"{shape}+stored", case, "sm90")
        assert row.status == "generated" and len(row.sources) == 3 and tensor in row.sources[0], (shape, row.message)


def test_stored_rows_are_refused_alone_or_short():
    from duotile import codegen, dsl

    case = SPEC.cases["stored_holes"]
    x = SPEC.make_inputs(case, torch.device("cpu"), 3)
    kernel = codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))
    with pytest.raises(dsl.DslError, match="give cmp and cmp_scale together"):
        kernel(**{**x, "cmp_scale": None})
    short = x["cmp"][:, :20].contiguous()
    with pytest.raises(dsl.DslError, match="cmp's rows"):
        kernel(**{**x, "cmp": short, "cmp_scale": short.view(torch.float8_e4m3fn)})
    nope = SPEC.make_inputs(SPEC.cases["stored_nope_holes"], torch.device("cpu"), 3)
    with pytest.raises(dsl.DslError, match="argument 'cmp_nope' has NC=80, but argument 'cmp' bound NC=90"):
        kernel(**{**x, **{k: nope[k] for k in ("cmp_nope", "cmp_codes", "cmp_rope")}})  # both formats
    with pytest.raises(dsl.DslError, match="give cmp_nope, cmp_codes and cmp_rope together"):
        kernel(**{**nope, "cmp_rope": None})
    from duotile.kernels_spec.prefill_rows import Stored

    with pytest.raises(dsl.DslError, match="give one format of compressed rows"):  # shapes that bind together
        Stored.of(*(object(),) * 5)
    assert Stored.of(None, None, None, None, None).fmt is None
