"""The sparse prefill reference a chunk of tokens at a time: the same outputs and error bounds as
one pass over every token, and chunks that fit the gather budget at the model's largest shape (V4's
HCA layer at a 4,096-token chunk once asked 130 GiB of one H200)."""

from __future__ import annotations

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
