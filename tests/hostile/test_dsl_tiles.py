"""Tile shapes a CUDA target cannot take are refused before TileLang or ptxas sees them, naming the
tile's spec line: register tiles past the per-thread register budget (a 4096 x 4096 f32 tile
built with 256 KiB of stack a thread), and register tiles TileLang cannot spread over the threads.
A TileLang failure that names a buffer of the generated source names the spec line it came from."""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.driver import build_case, generate_case
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda import toolchain
from duotile.codegen.tilelang_cuda.capacity import REGISTER_LIMIT
from duotile.dsl.errors import CapacityError, UnsupportedError
from duotile.kernels_spec import load_all


@dsl.kernel
def copy_tile(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32], *,
              R: dsl.Const = 1, C: dsl.Const = 256):
    for i in dsl.grid(dsl.cdiv(x.N, R)):
        t = dsl.load(x[i * R, 0], (R, C))
        dsl.store(y[i * R, 0], t)


def _lower(target: str, threads: int | None = None, **consts):
    x = torch.empty(8, 8, device="meta")
    config = {"threads": threads} if threads else None
    return specialize(copy_tile, copy_tile.bind({"x": x, "y": x}), get_target(target), config, consts)


def _load_line() -> str:
    src, start = inspect.getsourcelines(copy_tile.fn)
    return f"hostile/test_dsl_tiles.py:{start + next(i for i, s in enumerate(src) if 'dsl.load' in s)}"


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_register_tile_past_the_budget_is_refused_naming_tile_line_and_bytes(target):
    with pytest.raises(CapacityError) as err:
        _lower(target, R=4096, C=4096)
    e = err.value
    assert e.memory == "registers per thread" and e.capacity == REGISTER_LIMIT == 4080
    assert e.needed == 4096 * 4096 * 4 // 256  # one f32 tile over the default 256 threads
    assert str(e).startswith(_load_line())
    assert "f32[4096x4096]" in str(e) and "262144 bytes a thread" in str(e) and "over 256 threads" in str(e)


def test_the_register_limit_is_inclusive_and_divides_by_the_threads():
    _lower("sm90", R=255, C=1024)  # 255 x 1024 f32 over 256 threads: 4080 bytes a thread, the limit
    with pytest.raises(CapacityError, match="needs 4096 bytes"):
        _lower("sm90", R=256, C=1024)
    _lower("sm90", threads=512, R=256, C=1024)  # the same tile over twice the threads


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_every_build_case_default_config_fits_the_register_budget(target):
    """The config a user gets for each build case (the shipped tables' or the defaults)."""
    for name, spec in sorted(load_all().items()):
        for case_name, case in spec.build_cases.items():
            try:
                generate_case(spec, case, target)
            except CapacityError as err:  # head dim 512 overflows sm100's TMEM (or, beside two row formats'
                # tiles, its shared memory: sparse_mqa_decode_fp8), as test_model_shape_builds allows
                assert err.memory in ("TMEM", "shared memory") and case["D"] == 512, (name, case_name, str(err))


@pytest.mark.parametrize("shape,threads", [((3, 5), 256), ((1, 200), 256), ((1, 768), 256), ((2, 384), 256),
                                           ((1, 384), 128), ((128, 176), 256)])
def test_register_tiles_that_tilelang_lays_out_are_accepted(shape, threads):
    _lower("sm90", threads=threads, R=shape[0], C=shape[1])


def test_a_vector_broadcast_over_a_larger_tile_takes_that_tiles_layout():
    # fp8 gemm's 192-element column scale, read as [None, :] over the 128 x 192 output tile: it
    # lowers (and builds) at 128 threads, so the vector alone does not decide
    spec = load_all()["gemm"]
    generate_case(spec, spec.build_cases["fp8_8192"], "sm90", use_tuned=False,
                  config={"BM": 128, "BN": 192, "BK": 64, "STAGES": 2, "threads": 128})


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("shape,threads", [((1, 300), 256), ((1, 384), 256), ((3, 300), 256), ((1, 640), 256)])
def test_register_tiles_tilelang_cannot_lay_out_are_refused_at_their_line(target, shape, threads):
    with pytest.raises(UnsupportedError, match=f"cannot be laid out over {threads} threads") as err:
        _lower(target, threads=threads, R=shape[0], C=shape[1])
    assert str(err.value).startswith(_load_line())
    assert f"f32[{shape[0]}x{shape[1]}] of {shape[0] * shape[1]} elements" in str(err.value)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("shape", [(3, 5), (1, 768)])
def test_accepted_odd_tiles_really_lower(shape):
    pytest.importorskip("tilelang")
    x = torch.zeros(8, 8)
    k = codegen.compile(copy_tile, "sm90", constants={"R": shape[0], "C": shape[1]})
    assert k.artifact(x=x, y=x).files["cubin"].endswith(".cubin")


@pytest.fixture
def conflict_naming_a_buffer(monkeypatch, tmp_path):
    """TileLang's layout conflicts name the buffer: here one naming rmsnorm's loaded weight tile."""
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    pytest.importorskip("tilelang")

    def fail(prim, sm, configs=None):
        raise RuntimeError(f"Layout infer conflict between {fail.buffer} and another buffer in T.Parallel")

    monkeypatch.setattr(toolchain, "lower_checked", fail)
    return fail


def test_a_lowering_failure_naming_a_buffer_names_its_spec_line(conflict_naming_a_buffer):
    spec = load_all()["rmsnorm"]
    case = spec.build_cases["hidden"]
    text = generate_case(spec, case, "sm90", use_tuned=False)[0].stages["tilelang"]
    line = next(s for s in text.splitlines() if "T.copy(weight[" in s)
    buffer = line.split(", ")[-1].split(")")[0]
    conflict_naming_a_buffer.buffer = buffer
    r = build_case(spec, "hidden", case, "sm90", use_tuned=False)
    assert not r.ok
    tag = line.rsplit("# ", 1)[1]  # rmsnorm.py:N
    assert r.error.startswith(f"LoweringError: {tag}: sm90: TileLang "), r.error
    assert f"at buffer `{buffer}`, generated for this spec line" in r.error


def test_a_lowering_failure_naming_no_buffer_keeps_the_config_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    pytest.importorskip("tilelang")

    def fail(prim, sm, configs=None):
        raise RuntimeError("Check failed: (has_best) is false: no available layout found")

    monkeypatch.setattr(toolchain, "lower_checked", fail)
    spec = load_all()["rmsnorm"]
    r = build_case(spec, "hidden", spec.build_cases["hidden"], "sm90", use_tuned=False)
    assert r.error.startswith("LoweringError: sm90: TileLang ") and "at buffer" not in r.error
