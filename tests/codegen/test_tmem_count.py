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


def _d512(name: str, dg: int) -> tuple[int, int | CapacityError]:
    """(the tuning filter's TMEM columns, the build's count or its refusal) for ``name``'s first
    phase at D 512 with ``DG`` column groups (V4.1's CSA decode shape, BN 64, one sequence)."""
    from duotile.codegen.compile import specialize_phases
    from duotile.passes.autotune.constraints import Constraints

    spec = get(name)
    case = {**next(c for s, c in spec.model_shapes.items() if "640" in s and s.endswith("decode1")), "B": 1}
    sig = spec.kernel.bind(spec.meta_inputs(case))
    config = {"BN": 64, "DG": dg, "threads": 256}
    verdict = Constraints(spec.kernel, sig, "sm100", spec.constants_of(case)).check(config, full=False)
    filtered = verdict.usage["tensor memory"]
    try:
        phases, _ = specialize_phases(spec.kernel, sig, "sm100", config, spec.constants_of(case))
    except CapacityError as err:
        return filtered, err
    return filtered, usage(phases[0], SM100, 256)["tmem_columns"]


def test_column_groups_share_one_product_tile_and_the_filter_counts_as_the_build_does():
    """A 64 x 512 attention output that vector work rewrites is a register tile on sm100, and each
    gemm into it multiplies into a fresh TMEM tile first: 512 columns beside the 64-column score
    tile overflow TMEM (DG 1); as column groups the groups share one product tile of their shape
    (plan.product_tile), so TMEM holds the scores and one group's columns. The autotuner's quick
    filter (tuning.cuda_limits) must count them alike, or it refuses every config the build takes
    (it did: it summed every accumulator, 576 columns at every DG)."""
    for name in ("sparse_mqa_decode", "sparse_mqa_decode_fp8", "mqa_decode"):
        filtered, built = _d512(name, 1)
        assert isinstance(built, CapacityError) and built.memory == "TMEM" and filtered > 512, (name, built)
        for dg, product in ((2, 256), (4, 128), (8, 64)):
            filtered, built = _d512(name, dg)
            assert built - product in (64, 128), (name, dg, built)  # one or two loops' score tiles
            # the filter counts the accumulators live at once (one loop's score tile where two
            # loops run one after the other), the build every TMEM tile it allocates
            assert filtered <= built <= 512 and built - filtered in (0, 64), (name, dg, filtered, built)


def test_the_d512_attention_kernels_fit_sm100_with_the_config_a_user_gets():
    """Regression: every attention kernel at head dim 512 was refused on sm100 (TMEM overflow:
    576 or 640 of 512 columns), so no model shape of the attention path had an sm100 build; the
    cost model now picks column groups that fit."""
    from duotile.codegen.choose_config import explain_choice

    for name in ("sparse_mqa_decode", "sparse_mqa_decode_fp8", "sparse_mqa_decode_fp8_nope", "mqa_decode",
                 "sparse_mqa_prefill"):
        spec = get(name)
        for shape, case in list(spec.model_shapes.items())[-2:]:  # test_model_shape_builds generates them all
            sig = spec.kernel.bind(spec.meta_inputs(case))
            chosen, _, _ = explain_choice(spec.kernel, "sm100", sig, spec.constants_of(case))
            assert chosen is not None and chosen.get("DG", 1) > 1, (name, shape, chosen)
