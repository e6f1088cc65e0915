"""``dsl.mxfp4_values``: MXFP4 weights (e2m1 codes two a byte, a UE8M0 scale per 32 values) as bf16
values in natural order. Its meaning on the interpreter for every byte at every scale code, the
type rules at the spec line and in verify_ir, the sm90 / sm100 lowering (a device helper, eight
values a call, into shared memory, a barrier before the values are read: compiled by nvcc in the
slow test) and ascend950's refusal naming the op."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.dsl.ir import TileType
from duotile.kernels_spec.gemm_blockscaled import ue8m0_values
from duotile.kernels_spec.moe_gemm_mxfp4 import fp4_values
from duotile.passes.verify_ir import verify_ir
from tests.dsl.fragments import store_kernel
from tests.host_cuda import run_on_host


@dsl.kernel
def unpack(w: dsl.Tensor["R", "C", dsl.u8], s: dsl.Tensor["R", "S", dsl.u8], out: dsl.Tensor["R", "K", dsl.bf16], *,
           BR: dsl.Tunable = dsl.choice(16), BC: dsl.Tunable = dsl.choice(32)):
    for r, c in dsl.grid(dsl.cdiv(w.R, BR), dsl.cdiv(w.C, BC)):
        packed = dsl.load(w[r * BR, c * BC], (BR, BC), role="operand")
        codes = dsl.load(s[r * BR, c * (BC // 16)], (BR, BC // 16))
        dsl.store(out[r * BR, c * 2 * BC], dsl.mxfp4_values(packed, codes))


@dsl.kernel
def computed_codes(w: dsl.Tensor["R", "C", dsl.u8], s: dsl.Tensor["R", "S", dsl.u8],
                   out: dsl.Tensor["R", "K", dsl.bf16]):
    for r in dsl.grid(dsl.cdiv(w.R, 16)):
        packed = dsl.load(w[r * 16, 0], (16, 32), role="operand")
        codes = dsl.load(s[r * 16, 0], (16, 2)) + 1  # a map: not a loaded tile
        dsl.store(out[r * 16, 0], dsl.mxfp4_values(packed, codes))


def _tensors(rows=256, cols=64, device="cpu"):
    w = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols).remainder(256).to(torch.uint8)
    s = (torch.arange(rows * cols // 16).reshape(rows, cols // 16) * 7).remainder(256).to(torch.uint8)
    out = torch.zeros(rows, 2 * cols, dtype=torch.bfloat16, device=device)
    return {"w": w.to(device), "s": s.to(device), "out": out}


def _meta(rows=256, cols=64):
    with torch.device("meta"):
        return {"w": torch.empty(rows, cols, dtype=torch.uint8), "s": torch.empty(rows, cols // 16, dtype=torch.uint8),
                "out": torch.empty(rows, 2 * cols, dtype=torch.bfloat16)}


def test_every_byte_at_every_scale_code_is_its_value_in_natural_order():
    """256 rows of every byte, row r at scale code r in each block: element 2j is the low nibble of
    byte j; e2m1 x 2^(code - 127) rounded to bf16 (exact where it is a bf16 number, subnormals
    kept), +-Inf past the range, NaN for code 255."""
    w = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    s = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    out = torch.zeros(256, 512, dtype=torch.bfloat16)
    codegen.compile(unpack, "interpret")(w=w, s=s, out=out)
    want = (fp4_values(w) * ue8m0_values(s).double().repeat_interleave(32, -1)).to(torch.bfloat16)
    assert torch.equal(out[:255], want[:255])
    assert torch.isnan(out[255]).all()
    low = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    assert torch.equal(out[127, 0:32:2].float(), low) and torch.equal(out[127, 1:512:32].float(), low)
    assert out[0, 2].item() == 2.0 ** -128 and torch.isinf(out[254, 2 * 7]) and out[252, 14].item() == 6.0 * 2.0 ** 125


def test_blocks_take_their_own_codes():
    x = _tensors()
    codegen.compile(unpack, "interpret")(**x)
    want = (fp4_values(x["w"]) * ue8m0_values(x["s"]).double().repeat_interleave(32, -1)).to(torch.bfloat16)
    assert torch.equal(x["out"].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("body, match", [
    ("dsl.mxfp4_values(dsl.load(s[0, 0], (16, 2)).to(dsl.i32), dsl.load(s[0, 0], (16, 2)))",
     r"packed must be a 2-d u8 tile, got i32"),
    ("dsl.mxfp4_values(dsl.load(w[0, 0], (16, 24)), dsl.load(s[0, 0], (16, 2)))",
     r"hold 48 values a row, not whole blocks of 32"),
    ("dsl.mxfp4_values(dsl.load(w[0, 0], (16, 32)), dsl.load(s[0, 0], (16, 4)))",
     r"codes must be \(16, 2\)"),
    ("dsl.mxfp4_values(dsl.load(w[0, 0], (16, 32)), dsl.load(s[0, 0], (16, 4)), first=3)",
     r"codes \(16, 4\) from column 3 do not hold 2 columns"),
])
def test_wrong_tiles_are_refused_at_the_spec_line(body, match):
    kernel = store_kernel("w: dsl.Tensor['R', 'C', dsl.u8], s: dsl.Tensor['R', 'S', dsl.u8], "
                          "out: dsl.Tensor['R', 'K', dsl.bf16]", body)
    with pytest.raises(DslError, match=match) as err:
        codegen.compile(kernel, "interpret")(**_tensors())
    assert "fragment.py:3" in str(err.value)


def test_verify_ir_checks_the_types_of_the_op():
    module, _ = specialize(unpack, unpack.bind(_meta()), "interpret", {})
    op = next(o for o in module.walk() if o.name == "mxfp4")
    verify_ir(module)
    t = op.result.type
    op.result.type = TileType(t.shape, dsl.f32, t.role)
    with pytest.raises(DslError, match="mxfp4 takes u8 packed codes and u8 scale codes to bf16"):
        verify_ir(module)


def _generate(kernel, target, tensors):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_call_the_helper_into_shared_memory(target):
    pytest.importorskip("tilelang")
    text = _generate(unpack, target, _meta())
    assert "T.import_source(PRMT + MUL_BF16X2 + UE8M0_BF16X2 + FP4_X8 + MXFP4_X8)" in text
    assert "duotile_mxfp4x8_bf16" in text
    loop = text[text.index("T.sync_threads()"):]  # a barrier before the helper's writes and one after them
    assert loop.index("duotile_mxfp4x8_bf16") < loop.index("T.sync_threads()", 1) < loop.index("T.copy(fp4")
    assert "fp4" in text.split("T.alloc_shared((16, 64,)")[0].splitlines()[-1]  # the values live in shared memory
    with pytest.raises(UnsupportedError, match=r"reads its scale codes from shared memory.*dsl.load"):
        _generate(computed_codes, target, _meta())


def test_ascend_refuses_the_op_naming_it():
    pytest.importorskip("tilelang")
    with pytest.raises(UnsupportedError, match="mxfp4"):
        _generate(unpack, "ascend950", _meta())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_helper_compiles_and_its_writes_are_waited_for(target, tmp_path):
    """nvcc builds it; the writes through the helper's pointer, which TileLang's barrier planning
    does not see, are followed by a barrier before the store reads the values (without the
    emitter's own, the values went out before they were written)."""
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    module, knobs = specialize(unpack, unpack.bind(_meta()), target, {})
    art = build_module(unpack, module, get_target(target), knobs, workdir=str(tmp_path / target), use_cache=False)
    cuda = art.stages["cuda"]
    after = cuda[cuda.index("duotile_mxfp4x8_bf16(("):]
    assert "mul.rn.bf16x2" in cuda
    assert "__syncthreads()" in after and after.index("__syncthreads()") < after.index("tma_store(")


HOST_MAIN = r"""
int main() {
  for (int code = 0; code < 256; ++code)
    for (int byte = 0; byte < 256; ++byte) {
      unsigned char packed[4] = {(unsigned char)byte, (unsigned char)(255 - byte), (unsigned char)(byte ^ 0x5A),
                                 (unsigned char)(byte * 7)};
      unsigned short out[8];
      duotile_mxfp4x8_bf16(packed, out, code);
      for (int i = 0; i < 8; ++i) std::printf("%04x%c", out[i], i == 7 ? '\n' : ' ');
    }
  return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_device_helper_itself_gives_every_value_at_every_code(tmp_path):
    """The helper's own source (device_helpers.MXFP4_X8), compiled for the host with its two PTX
    instructions emulated (prmt's byte select with sign replication; mul.rn.bf16x2 as the exact
    product rounded once to bf16), over four bytes of every kind at every scale code: bit for bit
    the reference's e2m1 value x 2^(code - 127) in bf16, element 2j from byte j's low nibble."""
    from duotile.codegen.tilelang_cuda.device_helpers import with_needs

    lines = run_on_host("".join(text for _, text in with_needs("MXFP4_X8")), HOST_MAIN, tmp_path)
    got = torch.tensor([[int(h, 16) for h in line.split(" ")] for line in lines], dtype=torch.int32)
    byte = torch.arange(256)
    packed = torch.stack((byte, 255 - byte, byte ^ 0x5A, (byte * 7) % 256), dim=1).to(torch.uint8).repeat(256, 1)
    code = torch.arange(256).repeat_interleave(256).to(torch.uint8)[:, None]
    want = (fp4_values(packed) * ue8m0_values(code).double()).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    nan = code[:, 0] == 255
    assert torch.equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7F80) == 0x7F80).all() and ((got[nan] & 0x7F) != 0).all()  # NaN at code 255
