"""A gathered gemm operand lives in shared memory on the CUDA targets (plan.py's first rule).

Regression: sparse decode's rows, gathered by an index list, were gathered into a 64 x 512 BF16
register tile and copied to shared memory before each of the three gemms that read it. Beside the
64 x 512 FP32 accumulator, ptxas spilled 21 KB a thread at the model's decode shape, and a call of
640 rows took 165 us on an H200."""

from __future__ import annotations

import re
import shutil

import pytest

from duotile.codegen.build import build_module
from duotile.codegen.choose_config import choose_config
from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda.plan import make_plan
from duotile.kernels_spec.registry import load_all

SHAPE = "v41/csa_r2_topk640/decode64"


def _phases(target: str):
    spec = load_all()["sparse_mqa_decode"]
    case = spec.model_shapes[SHAPE]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    config = choose_config(spec.kernel, target, sig, spec.constants_of(case))
    return spec, specialize_phases(spec.kernel, sig, target, config, spec.constants_of(case))


def test_the_gathered_rows_are_written_into_shared_memory_once_a_block():
    target = "sm90"  # (sm100 refuses this kernel: its 64 x 512 accumulator overflows TMEM)
    _, (phases, knobs) = _phases(target)
    tgt = get_target(target)
    module = phases[0]
    plan = make_plan(module, tgt.arch, int(knobs.get("threads", 256)))
    gathers = [op for op in module.walk() if op.name == "gather" and op.result.type.role.name == "OPERAND"]
    assert gathers and all(plan.scope[op.result.id] == "shared" for op in gathers)
    src = tgt.generate(module, tgt.phase_knobs(module, knobs)).stages["tilelang"]
    (rows,) = re.findall(r"^\s*(\w+) = T\.alloc_shared\(\(\w+, 512,\), \"bfloat16\"\)", src, re.M)[1:]  # q, rows
    assert re.search(rf"^\s*{rows}\[i0, i1\] = T\.if_then_else\(", src, re.M)  # gathered straight in
    assert f"T.copy({rows}" not in src and "_frag_smem = T.alloc_shared((64, 512" not in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sparse_decode_at_the_model_shape_does_not_spill():
    spec, (phases, knobs) = _phases("sm90")
    tgt = get_target("sm90")
    art = build_module(spec.kernel, phases[0], tgt, tgt.phase_knobs(phases[0], knobs))
    assert art.meta["ptxas"]["spill_stores"] == 0 and art.meta["ptxas"]["stack"] == 0, art.meta["ptxas"]


def test_the_index_tile_of_the_gather_lives_in_shared_memory_so_every_thread_copies_rows():
    """Regression: as a register tile, the 64 row indices were laid out over the threads with
    replicas in both warp groups, TileLang laid the gather's loop out the same way and guarded it
    by the replica's owner: two of 256 threads copied the 64 KB (a ThreadSync warning about a
    hoisted barrier was the only sign), about 20 us a 64-row block on an H200."""
    _, (phases, knobs) = _phases("sm90")
    tgt = get_target("sm90")
    module = phases[0]
    plan = make_plan(module, tgt.arch, int(knobs.get("threads", 256)))
    (gather,) = [op for op in module.walk() if op.name == "gather"]
    assert plan.scope[gather.args[0].id] == "shared"
    src = tgt.generate(module, tgt.phase_knobs(module, knobs)).stages["tilelang"]
    assert re.search(r'^\s*idx\w*_smem = T\.alloc_shared\(\(64,\), "int32"\)', src, re.M)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_gather_into_shared_memory_is_asynchronous():
    """Rows named by an index were copied by plain loads, which the compiler serialises (each
    waits for its predecessor's store): about 11 us a 64-row block on an H200. The gather's loop
    asks for cp.async (a dead row zero-filled) and waits once for all of its copies."""
    spec, (phases, knobs) = _phases("sm90")
    tgt = get_target("sm90")
    art = build_module(spec.kernel, phases[0], tgt, tgt.phase_knobs(phases[0], knobs))
    assert '"parallel_prefer_async": True' in art.stages["tilelang"]
    assert "cp_async_gs_conditional<16>" in art.stages["cuda"] and "cp.async" in art.stages["ptx"]


def _fp8_phases():
    spec = load_all()["sparse_mqa_decode_fp8"]
    case = spec.model_shapes["v41/csa_r2_topk640/decode16"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    config = choose_config(spec.kernel, "sm90", sig, spec.constants_of(case))
    return spec, specialize_phases(spec.kernel, sig, "sm90", config, spec.constants_of(case))


def test_a_computed_index_tile_of_a_gather_lives_in_shared_memory_too():
    """Regression: the stored-row decode gathers its window rows by ``where(slots < W, slots, -1)``
    and its compressed rows by ``where(slots >= W, slots - W, -1)``, tiles computed from the
    loaded slots. Kept in registers, they took the replicated layout again: 8 of 256 threads
    issued every row copy (128 copies of 16 bytes each a step)."""
    _, (phases, knobs) = _fp8_phases()
    tgt = get_target("sm90")
    module = phases[0]
    plan = make_plan(module, tgt.arch, int(knobs.get("threads", 256)))
    gathers = [op for op in module.walk() if op.name == "gather"]
    assert len(gathers) == 4 and all(plan.scope[op.args[0].id] == "shared" for op in gathers)
    assert {op.args[0].id for op in gathers} != {gathers[0].args[0].id}  # two computed index tiles


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_u8_rows_are_gathered_by_cp_async_by_every_thread():
    """Regression: a u8 gather's zero fill was an i32 literal, so TileLang widened every byte to
    i32 and back and copied with plain loads; typed as the tile, the packed NVFP4 rows go by
    cp.async like the e4m3 ones, and no copy loop is guarded by a thread's replica."""
    spec, (phases, knobs) = _fp8_phases()
    tgt = get_target("sm90")
    art = build_module(spec.kernel, phases[0], tgt, tgt.phase_knobs(phases[0], knobs))
    cuda = art.stages["cuda"]
    assert 'T.cast(0, "uint8")' in art.stages["tilelang"]
    assert "cp_async_gs_conditional<16>((&(((uchar*)cmp" in cuda
    assert "cp_async_gs_conditional<16>((&(((fp8_e4_t*)kv" in cuda
    lines = cuda.splitlines()
    copies = [i for i, line in enumerate(lines) if "cp_async_gs_conditional<16>" in line]
    guard = "((int)threadIdx.x) & 31) >> 2)"  # a replica's owner: the guard the copies had
    assert copies and not any(guard in line for i in copies for line in lines[i - 3:i])
