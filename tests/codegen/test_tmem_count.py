"""sm100's TMEM count: a rewritten buffer takes TMEM columns only where a gemm writes it."""

from __future__ import annotations

import torch

from duotile import dsl
from duotile.codegen.compile import specialize
from duotile.codegen.tilelang_cuda.arch import SM100
from duotile.codegen.tilelang_cuda.capacity import usage
from duotile.dsl.errors import CapacityError
from duotile.kernels_spec.registry import get


@dsl.kernel
def _running_max(x: dsl.Tensor["T", "E", dsl.f32], y: dsl.Tensor["T", "E", dsl.f32]):
    for t in dsl.grid(x.T):
        best = dsl.full((1, x.E), float("-inf"), dsl.f32)
        seen = dsl.zeros((1, x.E), dsl.f32)
        for _ in dsl.range(2):
            row = dsl.load(x[t, 0], (1, x.E))
            best[:] = dsl.maximum(best, row)
            seen[:] = seen + row
        dsl.store(y[t, 0], best + seen)


def test_rewritten_vector_buffers_take_no_tmem():
    """Regression: two 1 x 512 vector buffers that a loop rewrites were counted as 1,024 TMEM
    columns and refused on sm100, though no gemm writes them."""
    x = torch.zeros(4, 512)
    sig = _running_max.bind({"x": x, "y": x.clone()})
    module, _ = specialize(_running_max, sig, "sm100", {"threads": 128})
    assert usage(module, SM100, 128)["tmem_columns"] == 0


def test_a_gemm_accumulator_that_vector_code_rewrites_still_counts():
    spec = get("mqa_decode")
    case = {"B": 1, "H": 64, "R": 640, "D": 512}
    try:
        from duotile.codegen.driver import generate_case

        generate_case(spec, case, "sm100", config={"threads": 128}, use_tuned=False)
        raised = None
    except CapacityError as err:
        raised = err
    assert raised is not None and raised.memory == "TMEM"
