"""The index_scores op on generated kernels over a prefill chunk: keys shared by the chunk's queries
(2-D) go to ``indexer_logits_prefill`` without a copy of the keys a query, and score what the
per-query form (``indexer_logits`` over the same keys, each query's own copy) scores."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec.indexer_logits_prefill import _mxfp4_rows
from duotile.runtime.generated import _OP_OF, GeneratedOps
from duotile.runtime.layers.common import Ctx, index_scores
from duotile.runtime.ops import FastOps


def _inputs(kind: str):
    g = torch.Generator().manual_seed(4)
    s, h, n, d = 7, 32, 45, 128
    qi = torch.randn(s, h, d, generator=g).to(torch.bfloat16)
    wts = torch.randn(s, h, generator=g) * (h * d) ** -0.5
    keys = torch.randn(n, d, generator=g).to(torch.bfloat16)
    if kind == "mxfp4":  # the cache's rows as stored
        keys = _mxfp4_rows(keys, "data", g)
    n_visible = torch.tensor([0, 1, 5, 20, 44, 45, 45])  # none, one, some, every row
    return qi, wts, keys, n_visible


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_shared_keys_run_the_prefill_kernel_and_score_as_the_per_query_form(kind):
    qi, wts, keys, n_visible = _inputs(kind)
    ops = GeneratedOps(FastOps())
    got = index_scores(Ctx(ops, dtype=torch.bfloat16), qi, wts, keys, n_visible)
    assert {k[0] for k in ops._kernels} == {"indexer_logits_prefill"}
    assert ops.builds() == {"index_scores": 1}
    per_query = keys[None].expand(qi.shape[0], *keys.shape).contiguous()
    want = index_scores(Ctx(GeneratedOps(FastOps()), dtype=torch.bfloat16), qi, wts, per_query, n_visible)
    assert torch.equal(torch.isneginf(got), torch.arange(keys.shape[0])[None, :] >= n_visible[:, None])
    assert torch.equal(got, want)  # the same tile sizes on the interpreter: the same sums


def test_both_forms_report_under_the_index_scores_op():
    assert _OP_OF["indexer_logits_prefill"] == _OP_OF["indexer_logits"] == "index_scores"
