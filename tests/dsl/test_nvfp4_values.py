"""``dsl.nvfp4_values``: V4.1's NVFP4-like values (e2m1 codes two a byte, an E4M3 scale a 16) as
bf16. Its meaning on the interpreter for every byte at every E4M3 scale, the type rules at the spec
line and in verify_ir, the CUDA targets' device helper (run on the host over every byte at every scale) and
ascend950's refusal naming the op."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.dsl.ir import TileType
from duotile.kernels_spec.moe_gemm_mxfp4 import fp4_values
from duotile.passes.verify_ir import verify_ir
from tests.dsl.fragments import store_kernel
from tests.host_cuda import run_on_host


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
def test_cuda_targets_call_the_helper_into_shared_memory(target):
    """Eight values a call of ``duotile_nvfp4x8_bf16``: four packed bytes from column 4 i1, the
    scale of block i1 // 2, sixteen bytes into the shared operand, between two barriers."""
    pytest.importorskip("tilelang")
    text = _generate(target)
    assert "T.import_source(PRMT + MUL_BF16X2 + FP4_X8 + NVFP4_X8)" in text
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if "duotile_nvfp4x8_bf16" in x and "call_extern" in x)
    call = lines[at]
    assert "[i0, 4 * i1])" in call and "[i0, 8 * i1])" in call and "[i0, i1 // 2])" in call
    assert "T.Parallel(16, 8)" in lines[at - 1]
    assert "T.sync_threads()" in lines[at - 2] and "T.sync_threads()" in lines[at + 1]
    assert "fp4" in text.split("T.alloc_shared((16, 64,)")[0].splitlines()[-1]


HOST_MAIN = r"""
int main() {
  for (int scale = 0; scale < 256; ++scale)
    for (int byte = 0; byte < 256; ++byte) {
      unsigned char packed[4] = {(unsigned char)byte, (unsigned char)(255 - byte), (unsigned char)(byte ^ 0x5A),
                                 (unsigned char)(byte * 7)};
      unsigned char s = (unsigned char)scale;
      unsigned short out[8];
      duotile_nvfp4x8_bf16(packed, out, &s);
      for (int i = 0; i < 8; ++i) std::printf("%04x%c", out[i], i == 7 ? '\n' : ' ');
    }
  return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_device_helper_itself_gives_every_value_at_every_scale(tmp_path):
    """The helper's own source (device_helpers.NVFP4_X8 and what it calls), compiled for the host
    with its PTX instructions emulated, over four bytes of every kind at every E4M3 scale byte
    (subnormal, negative and NaN scales too): bit for bit the e2m1 value x the scale in bf16,
    element 2j from byte j's low nibble; NaN for the two NaN scales."""
    from duotile.codegen.tilelang_cuda.device_helpers import with_needs

    lines = run_on_host("".join(text for _, text in with_needs("NVFP4_X8")), HOST_MAIN, tmp_path)
    got = torch.tensor([[int(h, 16) for h in line.split(" ")] for line in lines], dtype=torch.int32)
    byte = torch.arange(256)
    packed = torch.stack((byte, 255 - byte, byte ^ 0x5A, (byte * 7) % 256), dim=1).to(torch.uint8).repeat(256, 1)
    scale = torch.arange(256).repeat_interleave(256).to(torch.uint8)[:, None].view(torch.float8_e4m3fn)
    want = (fp4_values(packed) * scale.double()).to(torch.bfloat16)
    nan = want.isnan()
    bits = want.view(torch.int16).int() & 0xFFFF
    assert torch.equal(got[~nan], bits[~nan])
    assert ((got[nan] & 0x7F80) == 0x7F80).all() and ((got[nan] & 0x7F) != 0).all()
    assert bool(nan.view(256, 256, 8)[0x7F].all()) and bool(nan.view(256, 256, 8)[0xFF].all())


def test_ascend_refuses_the_op_naming_it():
    pytest.importorskip("tilelang")
    with pytest.raises(UnsupportedError, match="nvfp4"):
        _generate("ascend950")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_nvcc_builds_the_helper(target, tmp_path):
    """TileLang lowers the helper's loop and nvcc builds it: the helper's bf16 multiplies in the
    CUDA source, a barrier after its calls, a cubin out."""
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    module, knobs = specialize(unpack, unpack.bind(_meta()), target, {})
    art = build_module(unpack, module, get_target(target), knobs, workdir=str(tmp_path / target), use_cache=False)
    cuda = art.stages["cuda"]
    after = cuda[cuda.index("duotile_nvfp4x8_bf16(("):]
    assert "mul.rn.bf16x2" in cuda and "__syncthreads()" in after
    assert art.files, "no cubin"
