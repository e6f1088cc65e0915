"""sm90's ``gather_pipeline`` knob (``codegen/tilelang_cuda/gather_pipeline.py``): a pipelined loop
that gathers rows into shared memory issues the next block's copies before it waits for this
block's.

Regression: sparse decode's loops over blocks of rows were written ``T.Pipelined(num_stages=2)``,
and TileLang 0.1.15's own schedule lowered them with every block's copies awaited where they are
issued (``cp_async_wait<0>``): one global-memory latency a 64-row block, about 5.9 us a block at
SPLIT 1 on an H200 (``benchmarks/results/sparse_decode_configs.md``), whatever ``STAGES`` said."""

from __future__ import annotations

import re

import pytest
import torch

from duotile import dsl
from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda import gather_pipeline, toolchain
from duotile.codegen.tilelang_cuda.capacity import usage
from duotile.codegen.tilelang_cuda.plan import make_plan
from duotile.kernels_spec.registry import load_all
from duotile.passes.prefetch_loads import prefetch_loads

SM90 = get_target("sm90")
PIPELINED = {"BN": 64, "STAGES": 2, "SPLIT": 16, "BD": 64, "gather_pipeline": True}


def _phase0(name: str, shape: str, config: dict):
    spec = load_all()[name]
    case = spec.model_shapes[shape]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    phases, knobs = specialize_phases(spec.kernel, sig, SM90, config, spec.constants_of(case))
    return phases[0], knobs


def _loops(module):
    return [op for op in module.walk() if op.name == "for" and gather_pipeline.has_gather(op)]


def test_the_stored_row_decode_loops_put_the_index_tile_and_the_gathers_a_stage_ahead():
    module, knobs = _phase0("sparse_mqa_decode_fp8", "v41/csa_r2_topk640/decode1", PIPELINED)
    module = SM90._fused(prefetch_loads(module, skip=gather_pipeline.has_gather))
    plan = make_plan(module, SM90.arch, 256, pipelined_gathers=True)
    loops = _loops(module)
    assert len(loops) == 2  # the ring's blocks, then the compressed rows'
    for loop in loops:
        body = loop.regions[0].ops
        ahead = gather_pipeline.stage_zero(body, plan.scope)
        assert [body[i].name for i in sorted(ahead)] == ["load", "map", "gather", "gather"]
        # what stage 1 reads of stage 0 lives in shared memory (TileLang keeps a copy a stage)
        assert all(plan.scope[body[i].result.id] == "shared" for i in ahead)


def test_without_the_knob_the_index_tile_stays_in_registers_and_no_schedule_is_made():
    module, _ = _phase0("sparse_mqa_decode_fp8", "v41/csa_r2_topk640/decode1", PIPELINED)
    module = SM90._fused(prefetch_loads(module, skip=gather_pipeline.has_gather))
    plan = make_plan(module, SM90.arch, 256)  # the index tile a register tile: it would cross stages
    assert all(gather_pipeline.stage_zero(loop.regions[0].ops, plan.scope) is None for loop in _loops(module))


@pytest.mark.parametrize("name, shape", [("sparse_mqa_decode", "v41/csa_r2_topk640/decode1"),
                                         ("sparse_mqa_decode_fp8", "v41/csa_r2_topk640/decode1"),
                                         # (V4's HCA shapes carry each query's length, lens: their
                                         # loops end where the data says, which the knob leaves alone)
                                         ("sparse_mqa_decode_fp8_nope", "v4/csa_r4_topk640/decode1")])
def test_with_the_knob_the_generated_loops_wait_for_the_previous_block_only(name, shape):
    module, knobs = _phase0(name, shape, PIPELINED)
    art = SM90.generate(module, SM90.phase_knobs(module, knobs))
    src = art.stages["tilelang"]
    heads = re.findall(r"T\.Pipelined\(.*\)", src)
    # the index tile and the gathers first, a stage ahead; the rest after
    assert heads and all(re.search(r"stage=\[0, 0, (0, )*1, 1", h) for h in heads), heads
    plain, _ = _phase0(name, shape, {**PIPELINED, "gather_pipeline": False})
    assert "stage=" not in SM90.generate(plain, SM90.phase_knobs(plain, knobs)).stages["tilelang"]


def test_lowered_with_the_knob_the_loop_keeps_a_block_of_copies_in_flight(tmp_path):
    """TileLang's CUDA for the BF16-row decode: with the knob a wait that leaves the block just
    issued in flight (``cp_async_wait<k>``, k > 0); without it, only waits for every copy."""
    waits = {}
    for on in (True, False):
        config = {**PIPELINED, "gather_pipeline": on}
        module, knobs = _phase0("sparse_mqa_decode", "v41/csa_r2_topk640/decode64", config)
        art = SM90.generate(module, SM90.phase_knobs(module, knobs))
        py = tmp_path / f"kernel_{on}.py"
        py.write_text(art.stages["tilelang"])
        prim, configs = toolchain.load_generated(str(py), art.meta["entry"])
        waits[on] = set(re.findall(r"cp_async_wait<(\d+)>", toolchain.lower_to_cuda(prim, SM90.arch.sm, configs)))
    assert waits[True] - {"0"} and waits[False] == {"0"}, waits


def test_each_stage_zero_tile_counts_once_a_stage_in_shared_memory():
    module, _ = _phase0("sparse_mqa_decode", "v41/csa_r2_topk640/decode1", PIPELINED)
    module = SM90._fused(prefetch_loads(module, skip=gather_pipeline.has_gather))
    off, on = usage(module, SM90.arch, 256)["shared"], usage(module, SM90.arch, 256, pipelined_gathers=True)["shared"]
    # a second copy of the 64 x 512 BF16 rows (the row indices, a load into shared memory, count a
    # copy a stage either way)
    assert on - off == 64 * 512 * 2


def test_the_knob_is_offered_only_where_a_pipelined_loop_gathers():
    decode, _ = _phase0("sparse_mqa_decode", "v41/csa_r2_topk640/decode1", PIPELINED)
    assert "gather_pipeline" in SM90.knobs_for(decode)
    spec = load_all()["gemm"]
    case = next(iter(spec.model_shapes.values()))
    gemm = specialize_phases(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), SM90, None,
                             spec.constants_of(case))[0][0]
    assert "gather_pipeline" not in SM90.knobs_for(gemm)


@dsl.kernel
def _carried(x: dsl.Tensor["N", "D", dsl.bf16], idx: dsl.Tensor["L", dsl.i32], q: dsl.Tensor["M", "D", dsl.bf16],
             y: dsl.Tensor["M", "D", dsl.f32]):
    for m in dsl.grid(1):
        acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
        qt = dsl.load(q[0, 0], (64, 64), role="operand")
        shift = dsl.zeros((64,), dsl.i32)
        for n in dsl.pipelined(4, stages=2):
            rows = dsl.load(idx[n * 64], (64,), other=-1) + shift  # reads what the iteration below rewrites
            got = dsl.load(x[rows, 0], (64, 64), role="operand")
            dsl.gemm(qt, got, acc, transpose_b=True)
            shift[:] = shift + 1
        dsl.store(y[m * 64, 0], acc)


def test_a_loop_whose_gather_reads_a_value_carried_across_iterations_gets_no_schedule():
    sig = _carried.bind({"x": torch.empty(256, 64, dtype=torch.bfloat16, device="meta"),
                         "idx": torch.empty(256, dtype=torch.int32, device="meta"),
                         "q": torch.empty(64, 64, dtype=torch.bfloat16, device="meta"),
                         "y": torch.empty(64, 64, dtype=torch.float32, device="meta")})
    module = specialize_phases(_carried, sig, SM90, {"gather_pipeline": True})[0][0]
    module = SM90._fused(prefetch_loads(module, skip=gather_pipeline.has_gather))
    plan = make_plan(module, SM90.arch, 128, pipelined_gathers=True)
    (loop,) = _loops(module)
    body = loop.regions[0].ops
    assert [plan.scope[op.result.id] for op in body if op.name == "gather"] == ["shared"]
    assert gather_pipeline.stage_zero(body, plan.scope) is None
    without = [op for op in body if not (op.name == "map" and op.attrs.get("into") is not None)]
    assert gather_pipeline.stage_zero(without, plan.scope) is not None  # the carried write is the reason
    src = SM90.generate(module, {"threads": 128, "gather_pipeline": True}).stages["tilelang"]
    assert "stage=" not in src
