"""``dsl.nvfp4_values``: V4.1's NVFP4-like values (e2m1 codes two a byte, an E4M3 scale a 16) as
bf16. Its meaning on the interpreter for every byte at every E4M3 scale, the type rules at the spec
line and in verify_ir, the CUDA targets' loop (its magnitude formula checked against the e2m1 table)
and ascend950's refusal naming the op."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.dsl.ir import TileType
from duotile.dsl.ops import E2M1_MAGNITUDES
from duotile.kernels_spec.moe_gemm_mxfp4 import fp4_values
from duotile.passes.verify_ir import verify_ir
from tests.dsl.fragments import store_kernel


@dsl.kernel
def unpack(w: dsl.Tensor["R", "C", dsl.u8], s: dsl.Tensor["R", "S", dsl.f8e4m3], out: dsl.Tensor["R", "K", dsl.bf16]):
    for r, c in dsl.grid(dsl.cdiv(w.R, 16), dsl.cdiv(w.C, 32)):
        packed = dsl.load(w[r * 16, c * 32], (16, 32), role="operand")
        scales = dsl.load(s[r * 16, c * 4], (16, 4), role="operand")
        dsl.store(out[r * 16, c * 64], dsl.nvfp4_values(packed, scales))


def _meta(rows=256, cols=64):
    with torch.device("meta"):
        return {"w": torch.empty(rows, cols, dtype=torch.uint8),
                "s": torch.empty(rows, cols // 8, dtype=torch.float8_e4m3fn),
                "out": torch.empty(rows, 2 * cols, dtype=torch.bfloat16)}


def test_every_byte_at_every_e4m3_scale_is_its_value_in_natural_order():
    """256 rows of every byte (512 values), row r's scales all the e4m3 byte r: element 2j is the
    low nibble of byte j, the value e2m1 x scale, exact in bf16 for every finite scale (subnormal
    scales too), NaN for the NaN scales."""
    w = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    s = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 32).view(torch.float8_e4m3fn)
    out = torch.zeros(256, 512, dtype=torch.bfloat16)
    codegen.compile(unpack, "interpret")(w=w, s=s, out=out)
    want = fp4_values(w) * s.double().repeat_interleave(16, -1)  # float64: exact
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan) and bool(nan[0x7F].all()) and bool(nan[0xFF].all())
    assert torch.equal(out.double()[~nan], want[~nan])  # every finite value exact
    low = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    one = 0x38  # e4m3 1.0
    assert torch.equal(out[one, 0:32:2].float(), low) and torch.equal(out[one, 1:512:32].float(), low)
    assert out[1, 2].item() == 2.0 ** -10  # the smallest e4m3 subnormal scale times 0.5


@pytest.mark.parametrize("body, match", [
    ("dsl.nvfp4_values(dsl.load(w[0, 0], (16, 32)), dsl.load(w[0, 0], (16, 4)))",
     r"scales must be a 2-d f8e4m3 tile, got u8"),
    ("dsl.nvfp4_values(dsl.load(w[0, 0], (16, 4)), dsl.load(s[0, 0], (16, 1)))",
     r"hold 8 values a row, not whole blocks of 16"),
    ("dsl.nvfp4_values(dsl.load(w[0, 0], (16, 32)), dsl.load(s[0, 0], (16, 2)))",
     r"codes must be \(16, 4\)"),
])
def test_wrong_tiles_are_refused_at_the_spec_line(body, match):
    kernel = store_kernel("w: dsl.Tensor['R', 'C', dsl.u8], s: dsl.Tensor['R', 'S', dsl.f8e4m3], "
                          "out: dsl.Tensor['R', 'K', dsl.bf16]", body)
    with pytest.raises(DslError, match=match) as err:
        codegen.compile(kernel, "interpret")(w=torch.zeros(32, 64, dtype=torch.uint8),
                                              s=torch.zeros(32, 8, dtype=torch.float8_e4m3fn),
                                              out=torch.zeros(32, 128, dtype=torch.bfloat16))
    assert "fragment.py:3" in str(err.value)


def test_verify_ir_checks_the_types_of_the_op():
    module, _ = specialize(unpack, unpack.bind(_meta()), "interpret", {})
    op = next(o for o in module.walk() if o.name == "nvfp4")
    verify_ir(module)
    t = op.result.type
    op.result.type = TileType(t.shape, dsl.f32, t.role)
    with pytest.raises(DslError, match="nvfp4 takes u8 packed codes and e4m3 scales to bf16"):
        verify_ir(module)


def _generate(target):
    module, knobs = specialize(unpack, unpack.bind(_meta()), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_decode_into_shared_memory(target):
    """One loop over the values into the shared operand: the nibble of byte i1 // 2 (the low one
    for even i1), its magnitude, the sign from bit 3, times the block's scale read from shared
    memory."""
    pytest.importorskip("tilelang")
    text = _generate(target)
    line = next(x for x in text.splitlines() if "T.shift_right(" in x)
    assert "[i0, i1 // 2]" in line and "4 * (i1 % 2)" in line and "[i0, i1 // 16]" in line and ">= 8, -" in line
    assert "fp4" in text.split("T.alloc_shared((16, 64,)")[0].splitlines()[-1]


def test_the_loops_magnitude_formula_is_the_e2m1_table():
    """The emitted magnitude: half the code below 4, 6 for code 7, else the code less 2."""
    formula = [m * 0.5 if m < 4 else (6.0 if m == 7 else float(m - 2)) for m in range(8)]
    assert formula == list(E2M1_MAGNITUDES)


def test_ascend_refuses_the_op_naming_it():
    pytest.importorskip("tilelang")
    with pytest.raises(UnsupportedError, match="nvfp4"):
        _generate("ascend950")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_nvcc_builds_the_loop(target, tmp_path):
    """TileLang lowers the loop and nvcc builds it: the nibble shifts and the sign select in the
    CUDA source, a cubin out."""
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    module, knobs = specialize(unpack, unpack.bind(_meta()), target, {})
    art = build_module(unpack, module, get_target(target), knobs, workdir=str(tmp_path / target), use_cache=False)
    cuda = art.stages["cuda"]
    assert ">> (" in cuda and "& 15" in cuda and "fp42_smem" in cuda
    assert art.files, "no cubin"
