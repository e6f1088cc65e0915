"""The shared-memory count of loops run one after the other: the tiles made within one outermost
loop (a value lives in the region it is made in) share their bytes with the next loop's (TileLang
merges shared buffers by lifetime): the largest loop's count, plus the tiles made before the
loops, which count for all."""

from __future__ import annotations

import torch

from duotile import dsl
from duotile.codegen.compile import specialize
from duotile.codegen.tilelang_cuda.arch import SM90
from duotile.codegen.tilelang_cuda.capacity import usage

TILE = 64 * 256 * 2  # bytes of one (64, 256) bf16 tile


@dsl.kernel
def _two_loops(a: dsl.Tensor["N", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16],
               y: dsl.Tensor["M", "N", dsl.f32]):
    for m in dsl.grid(dsl.cdiv(y.M, 64)):
        acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
        left = dsl.load(a[0, 0], (64, 256), role="operand")  # made before both loops: counts throughout
        for k in dsl.range(2):
            right = dsl.load(a[k * 64, 0], (64, 256), role="operand")  # this loop's alone
            dsl.gemm(left, right, acc, transpose_b=True)
        for k in dsl.range(2):
            right = dsl.load(b[k * 64, 0], (64, 256), role="operand")  # the next loop's alone
            dsl.gemm(left, right, acc, transpose_b=True)
        dsl.store(y[m * 64, 0], acc)


@dsl.kernel
def _a_small_loop_then_a_large_one(a: dsl.Tensor["N", "K", dsl.bf16], y: dsl.Tensor["M", "N", dsl.f32]):
    for m in dsl.grid(dsl.cdiv(y.M, 64)):
        acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
        left = dsl.load(a[0, 0], (64, 256), role="operand")
        for k in dsl.range(2):
            right = dsl.load(a[k * 64, 0], (64, 256), role="operand")
            dsl.gemm(left, right, acc, transpose_b=True)
        for k in dsl.range(2):  # two tiles live together: the larger loop sets the count
            one = dsl.load(a[k * 64, 0], (64, 256), role="operand")
            two = dsl.load(a[64 - k * 64, 0], (64, 256), role="operand")
            dsl.gemm(left, one, acc, transpose_b=True)
            dsl.gemm(left, two, acc, transpose_b=True)
        dsl.store(y[m * 64, 0], acc)


def _shared(kernel, **tensors) -> int:
    module, _ = specialize(kernel, kernel.bind(tensors), "sm90", {"threads": 128})
    return usage(module, SM90, 128)["shared"]


def test_loops_one_after_the_other_share_their_tiles_bytes():
    a = torch.zeros(128, 256, dtype=torch.bfloat16)
    shared = _shared(_two_loops, a=a, b=a.clone(), y=torch.zeros(64, 128))
    assert shared == 2 * TILE  # ``left`` and one loop's ``right``, not both loops'


def test_the_largest_loop_sets_the_count():
    a = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert _shared(_a_small_loop_then_a_large_one, a=a, y=torch.zeros(64, 128)) == 3 * TILE
