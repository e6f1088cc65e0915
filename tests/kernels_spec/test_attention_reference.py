"""The attention reference computes its queries in chunks (a 16,384-token sequence's scores are
64 GiB in fp32): chunked and whole agree to the last bits, causal or not."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec import flash_attention as fa


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_reference_equals_the_whole(monkeypatch, causal):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    whole = fa.attention_reference(q, k, v, causal)
    monkeypatch.setattr(fa, "QUERY_CHUNK_ELEMENTS", 2 * 3 * 37 * 5)  # 5 query rows a chunk: 8 chunks
    chunked = fa.attention_reference(q, k, v, causal)
    # the same math; a chunk's shape may change how torch vectorises a sum (the last fp32 bit)
    torch.testing.assert_close(chunked["lse"], whole["lse"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked["o"], whole["o"], atol=0, rtol=2 ** -7)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / 4.0
    if causal:
        s = s.masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(chunked["lse"], torch.logsumexp(s, -1))
    torch.testing.assert_close(chunked["o"].float(), torch.softmax(s, -1) @ v.float(), atol=8e-3, rtol=8e-3)
