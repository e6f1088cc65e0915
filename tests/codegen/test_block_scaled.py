"""The block-scaled MMA rule (codegen/tilelang_cuda/block_scaled.py): a gemm of ``mxfp8_values`` by
``mxfp4_values`` on sm100, at a tile tcgen05's block-scaled MMA takes, keeps both operands FP8 in
shared memory and hands the codes to the MMA; every other tile, and sm90, lowers the values to
bf16. The kernel's meaning is the same either way (the interpreter, against float64), the MMA's
scale words hold each K atom's code, nvcc builds it for sm_100a with ``kind::mxf8f6f4.block_scale``
in the PTX (slow), and the e2m1 -> e4m3 device helper is exact for every byte (slow, on the host)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda.arch import SM90, SM100
from duotile.codegen.tilelang_cuda.block_scaled import find_block_scaled
from duotile.codegen.tilelang_cuda.plan import make_plan
from duotile.kernels_spec.moe_gemm_mxfp4 import fp4_values
from tests.host_cuda import run_on_host


@dsl.kernel
def w4a8(a: dsl.Tensor["M", "K", dsl.f8e4m3], sa: dsl.Tensor["M", "KA", dsl.u8], w: dsl.Tensor["N", "KH", dsl.u8],
         sw: dsl.Tensor["N", "KW", dsl.u8], out: dsl.Tensor["M", "N", dsl.bf16], *,
         ABLOCK: dsl.Const = 32, BM: dsl.Tunable = dsl.choice(128, 64), BN: dsl.Tunable = dsl.choice(128, 256, 64),
         BK: dsl.Tunable = dsl.choice(128, 64, 256), STAGES: dsl.Tunable = dsl.choice(2, 1)):
    for m, n in dsl.grid(dsl.cdiv(a.M, BM), dsl.cdiv(w.N, BN)):
        acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=STAGES):
            x = dsl.load(a[m * BM, k * BK], (BM, BK), role="operand")
            xs = dsl.load(sa[m * BM, (k * BK) // ABLOCK], (BM, BK // ABLOCK or 1), role="operand")
            packed = dsl.load(w[n * BN, k * (BK // 2)], (BN, BK // 2), role="operand")
            ws = dsl.load(sw[n * BN, k * (BK // 32)], (BN, BK // 32), role="operand")
            dsl.gemm(dsl.mxfp8_values(x, xs), dsl.mxfp4_values(packed, ws), acc, transpose_b=True)
        dsl.store(out[m * BM, n * BN], acc.to(dsl.bf16))


def _tensors(m=256, n=256, k=512, ablock=32, device="cpu", meta=False):
    if meta:
        with torch.device("meta"):
            return {"a": torch.empty(m, k, dtype=torch.float8_e4m3fn),
                    "sa": torch.empty(m, k // ablock, dtype=torch.uint8),
                    "w": torch.empty(n, k // 2, dtype=torch.uint8), "sw": torch.empty(n, k // 32, dtype=torch.uint8),
                    "out": torch.empty(m, n, dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(m + n + k + ablock)
    return {"a": (torch.randn(m, k, generator=g) * 4).to(torch.float8_e4m3fn),
            "sa": torch.randint(118, 136, (m, k // ablock), generator=g, dtype=torch.uint8),
            "w": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            "sw": torch.randint(118, 136, (n, k // 32), generator=g, dtype=torch.uint8),
            "out": torch.zeros(m, n, dtype=torch.bfloat16)}


def _generate(target, config=None, ablock=32, **sizes):
    tensors = _tensors(ablock=ablock, meta=True, **sizes)
    module, knobs = specialize(w4a8, w4a8.bind(tensors), target, config or {}, constants={"ABLOCK": ablock})
    return module, get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("ablock", [32, 128])
def test_the_kernel_means_the_scaled_product(ablock):
    """Interpreter: each row's sum of e4m3 x 2^(sa - 127) times e2m1 x 2^(sw - 127), rounded once
    to bf16 (the float64 product; fp32 sums of these sizes agree to the bf16 rounding)."""
    t = _tensors(m=128, n=128, k=256, ablock=ablock)
    codegen.compile(w4a8, "interpret", constants={"ABLOCK": ablock}, config={"BM": 64, "BN": 64, "BK": 64})(**t)
    x = t["a"].double() * torch.exp2(t["sa"].double() - 127).repeat_interleave(ablock, -1)
    w = fp4_values(t["w"]) * torch.exp2(t["sw"].double() - 127).repeat_interleave(32, -1)
    want = (x @ w.T).to(torch.bfloat16).float()
    assert torch.allclose(t["out"].float(), want, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("ablock", [32, 128])
def test_sm100_keeps_fp8_operands_and_hands_the_codes_to_the_mma(ablock):
    pytest.importorskip("tilelang")
    _, text = _generate("sm100", {"BM": 128, "BN": 128, "BK": 128}, ablock=ablock)
    assert "T.gemm_blockscaled(" in text and "duotile_mxfp4x16_e4m3" in text and "duotile_mxfp4x8_bf16" not in text
    assert "sf_a_granularity_k=32, sf_b_granularity_k=32" in text and "k_start=0" in text
    decoded = next(line for line in text.splitlines() if line.strip().startswith("fp4"))
    assert "T.alloc_shared((128, 128,)" in decoded and '"float8_e4m3"' in decoded  # half the bytes of bf16
    assert "T.reinterpret(" not in text  # the activations are not scaled into bf16
    # one warp (the MMA's issuer) transposes the words and copies them to TMEM, before the MMA
    body = text[text.index("if T.get_thread_binding() < 32:"):]
    order = [body.index(s) for s in ("tcgen05_sf_warp_transpose", "T.tcgen05_cp_warpx4", "T.gemm_blockscaled")]
    assert order == sorted(order)
    # byte j of a row's word is the code of K atom j: four codes of 32 columns, or one of 128 four times
    a_word = next(line for line in text.splitlines() if "sfa1_smem[i0] =" in line)
    want = [0, 1, 2, 3] if ablock == 32 else [0, 0, 0, 0]
    assert [int(c) for c in re.findall(r"\w+_smem\[i0, (\d+)\]", a_word)] == want
    assert re.findall(r"<< (\d+)\)", a_word) == ["0", "8", "16", "24"]


def test_a_64_column_step_fills_the_unread_bytes_with_a_scale_of_one():
    pytest.importorskip("tilelang")
    _, text = _generate("sm100", {"BM": 128, "BN": 128, "BK": 64})
    b_word = next(line for line in text.splitlines() if "sfb1_smem[i0] =" in line)
    assert b_word.count("_smem[i0, ") == 2 and f"T.cast({127 << 16}, \"uint32\")" in b_word


@pytest.mark.parametrize("config, why", [
    ({"BM": 64, "BN": 128, "BK": 128}, "64 rows: a TMEM copy moves 128 rows of scale words"),
    ({"BM": 128, "BN": 64, "BK": 128}, "64 columns: not a whole 128-row copy of B's words"),
    ({"BM": 128, "BN": 128, "BK": 256, "STAGES": 1}, "eight K atoms a step: more than a word's four codes"),
])
def test_other_tiles_lower_the_values_to_bf16(config, why):
    pytest.importorskip("tilelang")
    _, text = _generate("sm100", config)
    assert "T.gemm_blockscaled(" not in text, why
    assert "duotile_mxfp4x8_bf16" in text and "T.gemm(" in text and "mbar=" in text


def test_sm90_has_no_block_scaled_mma():
    pytest.importorskip("tilelang")
    module, text = _generate("sm90", {"BM": 128, "BN": 128, "BK": 128})
    assert "T.gemm_blockscaled(" not in text and "duotile_mxfp4x8_bf16" in text
    ops = list(module.walk())
    assert find_block_scaled(ops, SM90, make_plan(module, SM90).scope) == {}
    assert len(find_block_scaled(ops, SM100, make_plan(module, SM100).scope)) == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_builds_the_block_scaled_mma_for_sm100(tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    tensors = _tensors(meta=True)
    module, knobs = specialize(w4a8, w4a8.bind(tensors), "sm100", {"BM": 128, "BN": 128, "BK": 128})
    art = build_module(w4a8, module, get_target("sm100"), knobs, workdir=str(tmp_path), use_cache=False)
    ptx = art.stages["ptx"]
    assert re.search(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale", ptx)
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in ptx
    assert "duotile_mxfp4x16_e4m3" in art.stages["cuda"]


HOST_MAIN = r"""
int main() {
  for (int byte = 0; byte < 256; ++byte) {
    unsigned char packed[8];
    for (int j = 0; j < 8; ++j) packed[j] = (unsigned char)(byte * (2 * j + 1) + j);
    unsigned char out[16];
    duotile_mxfp4x16_e4m3(packed, out);
    for (int i = 0; i < 16; ++i) std::printf("%02x%c", out[i], i == 15 ? '\n' : ' ');
  }
  return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_the_e4m3_helper_gives_every_code_exactly(tmp_path):
    """``MXFP4_E4M3_X16``'s own source, compiled for the host with prmt emulated: every byte (each
    of the eight bytes a call reads a different one) gives the e4m3 bytes of its two e2m1 values in
    natural order, element 2j from byte j's low nibble; -0 for code 8."""
    from duotile.codegen.tilelang_cuda.device_helpers import MXFP4_E4M3_X16, PRMT

    lines = run_on_host(PRMT + MXFP4_E4M3_X16, HOST_MAIN, tmp_path)
    got = torch.tensor([[int(h, 16) for h in line.split(" ")] for line in lines], dtype=torch.uint8)
    byte = torch.arange(256)[:, None]
    packed = ((byte * (2 * torch.arange(8) + 1) + torch.arange(8)) % 256).to(torch.uint8)
    values = got.view(torch.float8_e4m3fn).double()
    assert torch.equal(values, fp4_values(packed))
    assert torch.equal(values.signbit(), ((packed.repeat_interleave(2, -1) >> torch.tensor([0, 4]).repeat(8)) & 8) > 0)


def test_a_kernel_imports_all_its_helpers_in_one_import_source():
    """TileLang takes one ``T.import_source`` a kernel (a second one fails: "Try to merge two
    annotations with different values for key pragma_import_c"): the helpers go in as one string,
    each once, a helper after the one it calls."""
    from duotile.codegen.tilelang_cuda.source import Source

    src = Source()
    for name in ("PRMT", "MXFP4_E4M3_X16", "PRMT", "MXFP4_X8"):
        src.helper(name, f"// {name}\n")
    imports = [d for d in src.decls if "T.import_source" in d]
    assert imports == ["T.import_source(PRMT + MXFP4_E4M3_X16 + MXFP4_X8)"]
    assert list(src.helpers) == ["PRMT", "MXFP4_E4M3_X16", "MXFP4_X8"]


@pytest.mark.slow
def test_sm90_keeps_the_promotion_form_of_the_dense_gemm_at_every_model_shape():
    """gemm_blockscaled's ``SCALES="operands"`` runs bf16 tensor cores on sm90 (no block-scaled
    MMA there): the config a user gets on sm90 keeps the promotion form, whose configs were
    measured, at every model shape; on sm100 the shipped config takes the operands form."""
    pytest.importorskip("tilelang")
    from duotile.codegen.choose_config import choose_config
    from duotile.kernels_spec import load_all

    spec = load_all()["gemm_blockscaled"]
    for shape, case in spec.model_shapes.items():
        sig = spec.kernel.bind(spec.meta_inputs(case))
        assert (choose_config(spec.kernel, "sm90", sig, spec.constants_of(case)) or {}).get(
            "SCALES", "promote") == "promote", shape
        assert choose_config(spec.kernel, "sm100", sig, spec.constants_of(case))["SCALES"] == "operands", shape


@dsl.kernel
def w4a8_hoisted(a: dsl.Tensor["M", "K", dsl.f8e4m3], sa: dsl.Tensor["M", "KA", dsl.u8],
                 w: dsl.Tensor["N", "KH", dsl.u8], sw: dsl.Tensor["N", "KW", dsl.u8],
                 out: dsl.Tensor["M", "N", dsl.bf16], *, ABLOCK: dsl.Const = 32,
                 BM: dsl.Tunable = dsl.choice(128, 64), BN: dsl.Tunable = dsl.choice(128, 64),
                 BK: dsl.Tunable = dsl.choice(128, 64)):
    """``w4a8`` with every scale code of the block's rows loaded once before the K loop, each step
    reading its own columns (``first=``), as moe_gemm_mxfp4 does."""
    for m, n in dsl.grid(dsl.cdiv(a.M, BM), dsl.cdiv(w.N, BN)):
        acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
        xs = dsl.load(sa[m * BM, 0], (BM, dsl.cdiv(dsl.cdiv(a.K, BK) * BK, ABLOCK)), role="operand")
        ws = dsl.load(sw[n * BN, 0], (BN, dsl.cdiv(a.K, BK) * (BK // 32)), role="operand")
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=2):
            x = dsl.load(a[m * BM, k * BK], (BM, BK), role="operand")
            packed = dsl.load(w[n * BN, k * (BK // 2)], (BN, BK // 2), role="operand")
            dsl.gemm(dsl.mxfp8_values(x, xs, first=(k * BK) // ABLOCK, block=min(BK, ABLOCK)),
                     dsl.mxfp4_values(packed, ws, first=k * (BK // 32)), acc, transpose_b=True)
        dsl.store(out[m * BM, n * BN], acc.to(dsl.bf16))


@pytest.mark.parametrize("ablock", [32, 128])
def test_codes_loaded_once_give_the_bits_of_codes_loaded_a_step(ablock):
    t = _tensors(m=128, n=128, k=256, ablock=ablock)
    h = {k: v.clone() for k, v in t.items()}
    config = {"BM": 64, "BN": 64, "BK": 64}
    codegen.compile(w4a8, "interpret", constants={"ABLOCK": ablock}, config=config)(**t)
    codegen.compile(w4a8_hoisted, "interpret", constants={"ABLOCK": ablock}, config=config)(**h)
    assert torch.equal(t["out"].view(torch.int16), h["out"].view(torch.int16))


@pytest.mark.parametrize("ablock", [32, 128])
def test_sm100_reads_each_steps_scale_words_from_the_wide_code_tiles(ablock):
    """The block-scaled rule still takes the gemm; byte j of a row's word is the code at the step's
    first column plus atom j (plus 0 for V4's one code a 128-column step)."""
    pytest.importorskip("tilelang")
    tensors = _tensors(ablock=ablock, meta=True)
    config = {"BM": 128, "BN": 128, "BK": 128}
    module, knobs = specialize(w4a8_hoisted, w4a8_hoisted.bind(tensors), "sm100", config, constants={"ABLOCK": ablock})
    text = get_target("sm100").generate(module, knobs).stages["tilelang"]
    assert "T.gemm_blockscaled(" in text
    a_word = next(line for line in text.splitlines() if "sfa1_smem[i0] =" in line)
    b_word = next(line for line in text.splitlines() if "sfb1_smem[i0] =" in line)
    first_a = "4 * k" if ablock == 32 else "k"
    assert [f"{first_a} + {j if ablock == 32 else 0}" in a_word for j in range(4)] == [True] * 4, a_word
    assert all(f"4 * k + {j}" in b_word for j in range(4)), b_word


def test_the_rule_passes_over_a_scaled_tile_whose_size_is_not_bound_yet():
    """Regression: a config space is drawn from the traced module before its sizes are bound; a
    scaled-values tile of a size symbol (the indexer's MXFP4 keys, (BN, D)) feeding an sm100 gemm
    made the rule's int() of its shape raise, and no config could be chosen."""
    from duotile.codegen.choose_config import choose_config
    from duotile.kernels_spec import load_all

    spec = load_all()["indexer_logits"]
    case = spec.model_shapes["v41/r2_ctx1m_mxfp4/decode16"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    assert choose_config(spec.kernel, "sm100", sig, spec.constants_of(case))
