"""``dsl.mxfp8_values``: block-scaled FP8 values (e4m3, a UE8M0 code per block of columns) as bf16.
Its meaning on the interpreter for every e4m3 byte at every code and for each block size, the type
rules at the spec line and in verify_ir, the CUDA lowering (a device helper into the shared operand,
its codes read from shared memory, run on the host over every byte at every code) and
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
from duotile.passes.verify_ir import verify_ir
from tests.dsl.fragments import store_kernel
from tests.host_cuda import run_on_host


@dsl.kernel
def scale(x: dsl.Tensor["R", "C", dsl.f8e4m3], s: dsl.Tensor["R", "G", dsl.u8], out: dsl.Tensor["R", "C", dsl.bf16], *,
          BR: dsl.Tunable = dsl.choice(16), BC: dsl.Tunable = dsl.choice(128, 64), BLOCK: dsl.Const = 32):
    for r, c in dsl.grid(dsl.cdiv(x.R, BR), dsl.cdiv(x.C, BC)):
        values = dsl.load(x[r * BR, c * BC], (BR, BC), role="operand")
        codes = dsl.load(s[r * BR, (c * BC) // BLOCK], (BR, BC // BLOCK or 1), role="operand")
        dsl.store(out[r * BR, c * BC], dsl.mxfp8_values(values, codes))


@dsl.kernel
def computed_codes(x: dsl.Tensor["R", "C", dsl.f8e4m3], s: dsl.Tensor["R", "G", dsl.u8],
                   out: dsl.Tensor["R", "C", dsl.bf16]):
    for r in dsl.grid(dsl.cdiv(x.R, 16)):
        values = dsl.load(x[r * 16, 0], (16, 64), role="operand")
        codes = dsl.load(s[r * 16, 0], (16, 2)) + 1  # a map: not a loaded tile
        dsl.store(out[r * 16, 0], dsl.mxfp8_values(values, codes))


def reference(x: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """Each e4m3 value times 2^(code - 127) of its block, exact in float64, rounded once to bf16;
    NaN for code 255."""
    scale = torch.where(s == 255, torch.nan, torch.exp2(s.double() - 127)).repeat_interleave(block, -1)
    return (x.double() * scale[:, :x.shape[1]]).to(torch.bfloat16)


def _meta(rows=32, cols=256, groups=8):
    with torch.device("meta"):
        return {"x": torch.empty(rows, cols, dtype=torch.float8_e4m3fn),
                "s": torch.empty(rows, groups, dtype=torch.uint8),
                "out": torch.empty(rows, cols, dtype=torch.bfloat16)}


def test_every_e4m3_byte_at_every_code():
    """256 rows, row r at code r, each holding all 256 e4m3 bytes (NaN bytes included): the
    product is exact in fp32 at every code (4 significant bits, down to 2^-136), so the one
    rounding is to bf16: its subnormals kept (down to 2^-133), +-Inf past the range, NaN for code
    255 and NaN values."""
    x = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)
    s = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    out = torch.zeros(256, 256, dtype=torch.bfloat16)
    codegen.compile(scale, "interpret")(x=x, s=s, out=out)
    want = reference(x, s, 32)
    assert torch.equal(out.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert torch.equal(out.isnan(), want.isnan()) and out[255].isnan().all()
    assert out[127, 0x38].item() == 1.0 and out[7, 1].item() == 2.0 ** -129 and out[0, 1].item() == 0.0
    assert torch.isinf(out[254, 0x7E])


@pytest.mark.parametrize("block, tile", [(32, 128), (128, 128), (128, 64)])
def test_blocks_take_their_own_codes(block, tile):
    """A code per 32 columns (V4.1), per 128 (V4), and one code for a tile inside a 128-block."""
    g = torch.Generator().manual_seed(block + tile)
    x = (torch.randn(32, 256, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.randint(100, 150, (32, 256 // block), generator=g, dtype=torch.uint8)
    out = torch.zeros(32, 256, dtype=torch.bfloat16)
    codegen.compile(scale, "interpret", constants={"BLOCK": block}, config={"BC": tile})(x=x, s=s, out=out)
    assert torch.equal(out.view(torch.int16), reference(x, s, block).view(torch.int16))


@pytest.mark.parametrize("body, match", [
    ("dsl.mxfp8_values(dsl.load(s[0, 0], (16, 64)), dsl.load(s[0, 0], (16, 2)))",
     r"values must be a 2-d f8e4m3 tile, got u8"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(x[0, 0], (16, 2)))",
     r"codes must be a 2-d u8 tile, got f8e4m3"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(s[0, 0], (16, 3)))",
     r"codes \(16, 3\) do not split values \(16, 64\) into blocks"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(s[0, 0], (8, 2)))",
     r"codes \(8, 2\) do not split values \(16, 64\)"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(s[0, 0], (16, 8)), first=1)",
     r"give first and block together"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(s[0, 0], (16, 8)), first=7, block=32)",
     r"codes \(16, 8\) from column 7 do not hold 2 columns"),
    ("dsl.mxfp8_values(dsl.load(x[0, 0], (16, 64)), dsl.load(s[0, 0], (16, 8)), first=0, block=48)",
     r"block = 48 must be a positive int dividing the 64 columns"),
])
def test_wrong_tiles_are_refused_at_the_spec_line(body, match):
    kernel = store_kernel("x: dsl.Tensor['R', 'C', dsl.f8e4m3], s: dsl.Tensor['R', 'G', dsl.u8], "
                          "out: dsl.Tensor['R', 'C', dsl.bf16]", body)
    x = torch.zeros(32, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(DslError, match=match) as err:
        codegen.compile(kernel, "interpret")(x=x, s=torch.zeros(32, 8, dtype=torch.uint8),
                                              out=torch.zeros(32, 256, dtype=torch.bfloat16))
    assert "fragment.py:3" in str(err.value)


def test_verify_ir_checks_the_types_and_blocks_of_the_op():
    module, _ = specialize(scale, scale.bind(_meta()), "interpret", {})
    op = next(o for o in module.walk() if o.name == "mxfp8")
    verify_ir(module)
    t = op.result.type
    op.result.type = TileType(t.shape, dsl.f32, t.role)
    with pytest.raises(DslError, match="mxfp8 takes e4m3 values and u8 scale codes to bf16"):
        verify_ir(module)
    op.result.type = TileType((t.shape[0], 96), dsl.bf16, t.role)
    with pytest.raises(DslError, match=r"are not \(R, C\), \(R, G\) -> \(R, C\)"):
        verify_ir(module)


def _generate(kernel, target, tensors):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_scale_into_the_shared_operand(target):
    """Outside a block-scaled gemm: eight values a call of ``duotile_mxfp8x8_bf16`` into the shared
    bf16 operand, each call's code read from the shared codes at its block (column i1 // 4 for a
    block of 32); codes that no load made are refused."""
    pytest.importorskip("tilelang")
    text = _generate(scale, target, _meta())
    decl = next(line for line in text.splitlines() if line.strip().startswith("fp8"))
    assert "T.alloc_shared((16, 128,)" in decl and '"bfloat16"' in decl
    assert "T.import_source(MUL_BF16X2 + UE8M0_BF16X2 + MXFP8_X8)" in text
    call = next(line for line in text.splitlines() if "call_extern" in line)
    assert "[i0, 8 * i1])" in call and "[i0, i1 // 4]" in call
    with pytest.raises(UnsupportedError, match=r"mxfp8_values reads its scale codes from shared memory.*dsl.load"):
        _generate(computed_codes, target, {k: v[:, :64] if k != "s" else v[:, :2] for k, v in _meta().items()})


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_a_block_below_eight_values_is_scaled_value_by_value(target):
    """A code per 4 columns is finer than the helper's eight values: the loop over each value, its
    code's float bits (255 NaN) times the value."""
    pytest.importorskip("tilelang")
    module, knobs = specialize(scale, scale.bind(_meta(groups=64)), target, {}, constants={"BLOCK": 4})
    text = get_target(target).generate(module, knobs).stages["tilelang"]
    assert "duotile_mxfp8x8_bf16" not in text
    assert "[i0, i1 // 4]" in text and "T.reinterpret(" in text and "2143289344" in text


HOST_MAIN = r"""
int main() {
  for (int code = 0; code < 256; ++code)
    for (int byte = 0; byte < 256; byte += 8) {
      unsigned char values[8];
      for (int i = 0; i < 8; ++i) values[i] = (unsigned char)(byte + i);
      unsigned short out[8];
      duotile_mxfp8x8_bf16(values, out, code);
      for (int i = 0; i < 8; ++i) std::printf("%04x%c", out[i], i == 7 ? '\n' : ' ');
    }
  return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_device_helper_itself_gives_every_byte_at_every_code(tmp_path):
    """The helper's own source (device_helpers.MXFP8_X8 and what it calls), compiled for the host
    with its PTX conversions and multiply emulated, over every e4m3 byte at every code: bit for bit
    the reference's value x 2^(code - 127) rounded once to bf16 (subnormals kept, +-Inf past the
    range); NaN for code 255 and for the NaN bytes."""
    from duotile.codegen.tilelang_cuda.device_helpers import with_needs

    lines = run_on_host("".join(text for _, text in with_needs("MXFP8_X8")), HOST_MAIN, tmp_path)
    got = torch.tensor([[int(h, 16) for h in line.split(" ")] for line in lines], dtype=torch.int32).view(256, 256)
    x = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)
    s = torch.arange(256, dtype=torch.uint8)[:, None]
    want = reference(x, s, 256)
    nan = want.isnan()
    assert torch.equal(got[~nan], want.view(torch.int16).int()[~nan] & 0xFFFF)
    assert ((got[nan] & 0x7F80) == 0x7F80).all() and ((got[nan] & 0x7F) != 0).all()
    assert bool(nan[255].all()) and bool(nan[:, 0x7F].all()) and int(got[127, 0x38]) == 0x3F80


def test_ascend_refuses_the_op_naming_it():
    pytest.importorskip("tilelang")
    with pytest.raises(UnsupportedError, match="mxfp8"):
        _generate(scale, "ascend950", _meta())


@dsl.kernel
def scale_hoisted(x: dsl.Tensor["R", "C", dsl.f8e4m3], s: dsl.Tensor["R", "G", dsl.u8],
                  out: dsl.Tensor["R", "C", dsl.bf16], *, BC: dsl.Tunable = dsl.choice(64, 128),
                  BLOCK: dsl.Const = 32):
    """Every code of 16 rows loaded once, each column step reading its own from ``first`` on."""
    for r in dsl.grid(dsl.cdiv(x.R, 16)):
        codes = dsl.load(s[r * 16, 0], (16, dsl.cdiv(dsl.cdiv(x.C, BC) * BC, BLOCK)), role="operand")
        for c in dsl.range(dsl.cdiv(x.C, BC)):
            values = dsl.load(x[r * 16, c * BC], (16, BC), role="operand")
            got = dsl.mxfp8_values(values, codes, first=(c * BC) // BLOCK, block=min(BC, BLOCK))
            dsl.store(out[r * 16, c * BC], got)


@pytest.mark.parametrize("block, tile", [(32, 128), (128, 128), (128, 64), (32, 64)])
def test_a_wide_code_tile_read_from_first_gives_the_same_values(block, tile):
    """``first`` / ``block``: the codes of every step loaded once (as moe_gemm_mxfp4 does) give
    the values of a code tile loaded a step, bit for bit, including a ragged last step (C = 224)."""
    g = torch.Generator().manual_seed(block * tile)
    x = (torch.randn(32, 224, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.randint(100, 150, (32, -(-224 // block)), generator=g, dtype=torch.uint8)
    out = torch.zeros(32, 224, dtype=torch.bfloat16)
    codegen.compile(scale_hoisted, "interpret", constants={"BLOCK": block}, config={"BC": tile})(x=x, s=s, out=out)
    assert torch.equal(out.view(torch.int16), reference(x, s, block).view(torch.int16))


def test_a_loop_that_reads_past_the_code_tile_fails_on_the_interpreter():
    """A ``first`` that grows past the codes tile (here a tile one step short) is named, not read
    as garbage."""
    @dsl.kernel
    def short(x: dsl.Tensor["R", "C", dsl.f8e4m3], s: dsl.Tensor["R", "G", dsl.u8],
              out: dsl.Tensor["R", "C", dsl.bf16]):
        for r in dsl.grid(dsl.cdiv(x.R, 16)):
            codes = dsl.load(s[r * 16, 0], (16, 4), role="operand")
            for c in dsl.range(dsl.cdiv(x.C, 64)):
                values = dsl.load(x[r * 16, c * 64], (16, 64), role="operand")
                dsl.store(out[r * 16, c * 64], dsl.mxfp8_values(values, codes, first=2 * c, block=32))

    with pytest.raises(DslError, match=r"mxfp8 reads codes 4 \.\. 5 of a row, past its 4-column codes tile"):
        codegen.compile(short, "interpret")(x=torch.zeros(16, 192, dtype=torch.float8_e4m3fn),
                                             s=torch.zeros(16, 6, dtype=torch.uint8),
                                             out=torch.zeros(16, 192, dtype=torch.bfloat16))


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_read_the_codes_from_first(target):
    pytest.importorskip("tilelang")
    text = _generate(scale_hoisted, target, _meta(cols=256, groups=8))
    assert "s0_smem[i0, 2 * c + i1 // 4]" in text  # the step's codes: from column 2c of the wide tile
