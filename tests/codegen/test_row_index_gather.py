"""A gather whose index is a (1, N) row tile reads the index along its long axis: the CUDA source
indexes it at [0, i] (an (N, 1) tile would read [i, 0]); the other way runs past the tile. (Found
in top-k's merge of chunk lists, which gathered list heads by a row of pointers.)"""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target


@dsl.kernel
def heads(lists: dsl.Tensor["B", "M", dsl.f32], ptr: dsl.Tensor["B", "N", dsl.i32], out: dsl.Tensor["B", "N", dsl.f32],
          *, N: dsl.Const = 64, STRIDE: dsl.Const = 8):
    for b in dsl.grid(lists.B):
        at = dsl.arange(N)[None, :] * STRIDE + dsl.load(ptr[b, 0], (1, N))  # list j's head
        dsl.store(out[b, 0], dsl.load(lists[b, at], (1, N), other=-1.0))


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"lists": torch.randn(2, 64 * 8, generator=g), "ptr": torch.randint(0, 8, (2, 64), generator=g).int(),
            "out": torch.zeros(2, 64)}


def test_the_interpreter_reads_each_lists_head():
    t = _tensors()
    codegen.compile(heads, "interpret")(**t)
    want = torch.gather(t["lists"], 1, (torch.arange(64) * 8 + t["ptr"]).long())
    assert torch.equal(t["out"], want)


def test_the_cuda_source_reads_the_row_index_at_0_i():
    pytest.importorskip("tilelang")
    with torch.device("meta"):
        meta = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in _tensors().items()}
    module, knobs = specialize(heads, heads.bind(meta), "sm90", {})
    text = get_target("sm90").generate(module, knobs).stages["tilelang"]
    gathers = [line for line in text.splitlines() if "lists[" in line and "if_then_else" in line]
    assert gathers and all("_frag[0, i1]" in line and "_frag[i1, 0]" not in line for line in gathers), gathers
