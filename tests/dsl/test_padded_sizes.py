"""``@dsl.kernel(padded={"L": fill})``: a static size whose calls are padded to its power-of-two
bucket with a fill the kernel treats as absent, so a size that grows during a generation builds
once a bucket."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import DslError


@dsl.kernel(padded={"L": float("-inf")})
def row_max(x: dsl.Tensor["B", "L", dsl.f32], y: dsl.Tensor["B", dsl.f32]):
    width = dsl.next_pow2(x.L)  # a tile shape that follows L: L cannot be dynamic
    for b in dsl.grid(x.B):
        dsl.store(y[b], dsl.load(x[b, 0], (1, width), other=float("-inf")).max(axis=1))


def test_lengths_of_one_bucket_share_a_build_and_keep_their_values():
    kernel = codegen.compile(row_max, "interpret")
    for n in (5, 6, 7, 8, 9):
        x = torch.randn(3, n) - 10  # below the fill's neighbours: a padded entry that counted would show
        y = torch.empty(3)
        kernel(x=x, y=y)
        assert torch.equal(y, x.amax(1)), n
    assert len(kernel._cache) == 2  # L in 5..8 -> 8, L = 9 -> 16


@dsl.kernel(padded={"L": 0.0})
def writes_its_padded_tensor(x: dsl.Tensor["L", dsl.f32]):
    for i in dsl.grid(1):
        dsl.store(x[i], dsl.load(x[i], (4,)) + 1.0)


def test_a_kernel_that_writes_a_padded_tensor_is_refused_naming_the_store():
    with pytest.raises(DslError, match=r"tensor 'x' carries a padded size and is written") as err:
        codegen.compile(writes_its_padded_tensor, "interpret")(x=torch.zeros(5))
    assert "test_padded_sizes.py" in str(err.value)


def test_a_padded_size_must_be_a_static_dimension():
    with pytest.raises(DslError, match="padded size 'Q'"):
        @dsl.kernel(padded={"Q": 0.0})
        def nowhere(x: dsl.Tensor["L", dsl.f32]):
            pass
    with pytest.raises(DslError, match="padded size 'L'"):
        @dsl.kernel(dynamic=("L",), padded={"L": 0.0})
        def both(x: dsl.Tensor["L", dsl.f32]):
            pass
