"""Level 3 for NVIDIA: every kernel is generated, lowered by TileLang and compiled by nvcc for
sm_90a and sm_100a, and the instructions are the ones each architecture needs."""

from __future__ import annotations

import re
import shutil

import pytest

from duotile.codegen.driver import build_case
from duotile.codegen.tilelang_cuda.inspect import ptx_counts
from duotile.dsl.errors import CapacityError
from duotile.kernels_spec import load_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]
pytest.importorskip("tilelang")

# head dim 512 holds a 64x512 fp32 accumulator: sm100's TMEM cannot take it (tested below)
WIDE = {("flash_attention", "d512"), ("mqa_decode", "hca_1m")}
# the foundation kernels' build cases in full; the model's newer kernels are built to cubins at a
# representative model shape of each (tests/codegen/test_model_shape_builds.py), not twice
FOUNDATION = {"flash_attention", "gemm", "gemm_splitk", "mqa_decode", "rmsnorm", "gather_rows"}
# where a build is refused or fails today, with why (strict: a fix must drop the entry)
EXPECTED: dict[tuple[str, str], str] = {}  # (sparse_mqa_decode's sm100 refusal: the model-shape test)
CASES = [(n, c) for n, s in sorted(load_all().items()) if n in FOUNDATION for c in s.build_cases
         if (n, c) not in WIDE]


def _cubin_params():
    return [pytest.param(n, c, t, id=f"{t}-{n}-{c}",
                         marks=[pytest.mark.xfail(strict=True, reason=EXPECTED[n, t])] if (n, t) in EXPECTED else [])
            for n, c in CASES for t in ("sm90", "sm100")]
BUILDS: dict = {}


def built(name, case_name, target):
    key = (name, case_name, target)
    if key not in BUILDS:
        spec = load_all()[name]
        BUILDS[key] = build_case(spec, case_name, spec.build_cases[case_name], target)
    r = BUILDS[key]
    assert r.ok, r.error
    return r.artifact


@pytest.mark.parametrize("name,case_name,target", _cubin_params())
def test_builds_to_cubin(name, case_name, target):
    built(name, case_name, target)
    for a in BUILDS[(name, case_name, target)].artifacts:  # every phase of a multi-phase kernel
        assert a.files["cubin"].endswith(".cubin")
        assert ("T.Kernel(" in a.stages["tilelang"] or "T.ClusterKernel(" in a.stages["tilelang"])
        assert "__global__" in a.stages["cuda"]
        assert "#line" not in a.stages["cuda"]
        assert "bounds" in a.meta and a.timings["bounds_check"] > 0  # the lowered code was checked (a TMA-only
        # kernel, gemm at 8192^3, has no load or store to prove: its copies are descriptors)


@pytest.mark.parametrize("name,case_name", [("gemm", "bf16_8192"), ("gemm", "fp8_8192"),
                                            ("flash_attention", "d128"), ("flash_attention", "d128_causal")])
def test_sm100_uses_tcgen05_not_mma_sync(name, case_name):
    counts = ptx_counts(built(name, case_name, "sm100").stages["ptx"])
    assert counts.get("tcgen05.mma", 0) > 0, counts
    assert counts.get("tcgen05.ld", 0) > 0, counts  # accumulators drained through registers
    assert "mma.sync" not in counts, counts


@pytest.mark.parametrize("name,case_name", [("gemm", "bf16_8192"), ("gemm", "fp8_8192"), ("flash_attention", "d128")])
def test_sm90_uses_wgmma_and_tma(name, case_name):
    counts = ptx_counts(built(name, case_name, "sm90").stages["ptx"])
    assert counts.get("wgmma", 0) > 0 and "mma.sync" not in counts, counts


def test_generated_source_names_spec_lines():
    text = built("gemm", "bf16_8192", "sm90").stages["tilelang"]
    assert re.search(r"T\.(wgmma_)?gemm\(.*# gemm\.py:\d+", text)  # the gemm statement names its spec line


@pytest.mark.parametrize("name,case_name", sorted(WIDE))
def test_head_dim_512_fits_sm90_with_its_pinned_config(name, case_name):
    for a in (built(name, case_name, "sm90"), *BUILDS[(name, case_name, "sm90")].artifacts[1:]):
        assert a.files["cubin"].endswith(".cubin")


def test_split_kv_decode_at_head_dim_512_is_refused_by_sm100_tmem_as_one_column_group():
    """A 64 x 512 output as one accumulator: its gemms' product tile alone fills TMEM. The config a
    user gets keeps it as column groups (kernels_spec/column_groups.py) and builds, with tcgen05."""
    spec = load_all()["mqa_decode"]
    r = build_case(spec, "hca_1m", spec.build_cases["hca_1m"], "sm100", config={"DG": 1, "threads": 256})
    assert not r.ok and r.rejected and "TMEM overflow" in r.error and "576 of 512 columns" in r.error
    user = build_case(spec, "hca_1m", spec.build_cases["hca_1m"], "sm100")
    assert user.ok, user.error
    assert ptx_counts("".join(a.stages.get("ptx", "") for a in user.artifacts)).get("tcgen05.mma", 0) > 0


def test_oversize_config_is_rejected_naming_memory_and_sizes():
    spec = load_all()["gemm"]
    r = build_case(spec, "big", spec.build_cases["bf16_8192"], "sm90",
                   config={"BM": 256, "BN": 256, "BK": 128, "STAGES": 5})
    assert not r.ok and "CapacityError" in r.error
    assert "shared memory" in r.error and "655360 bytes" in r.error and "227.0 KiB" in r.error


def test_tmem_overflow_is_rejected_on_sm100():
    spec = load_all()["flash_attention"]
    r = build_case(spec, "d512", spec.build_cases["d512"], "sm100", config={"BM": 64, "BN": 64, "STAGES": 1, "DG": 1})
    assert not r.ok and "TMEM" in r.error and "columns" in r.error
    with pytest.raises(CapacityError):
        raise CapacityError("sm100", "TMEM", 1, 0)


def test_fp8_promotion_interval_is_counted_in_k_elements_on_sm90():
    spec = load_all()["gemm"]
    case = spec.build_cases["fp8_8192"]
    r = build_case(spec, "fp8_8192", case, "sm90", config={"fp8_promote_k": 256, "BN": 128, "BK": 128})
    assert r.ok, r.error
    text = r.artifact.stages["tilelang"]  # K tile 128: every second step
    assert "clear_accum=(k) % 2 == 0" in text and "if T.Or((k) % 2 == 1, k == 63):" in text
    assert ptx_counts(r.artifact.stages["ptx"]).get("wgmma", 0) > 0
    every_step = build_case(spec, "fp8_8192", case, "sm90", config={"fp8_promote_k": 128, "BN": 128, "BK": 128})
    assert every_step.ok and "clear_accum=True" in every_step.artifact.stages["tilelang"]
    assert "T.Or(" not in every_step.artifact.stages["tilelang"]


def test_overlap_knob_pipelines_a_dependent_second_gemm_on_sm90():
    """FA3's schedule as a lowering rule: the P.V gemm and the rescale of its accumulator run one
    iteration behind (here under TileLang's warp specialisation, as T.Pipelined's order / stage;
    the manual schedule's rotation is tests/codegen/test_manual_ws.py). Compile-checked here; its
    speed and results are for the H200 (-m gpu)."""
    spec = load_all()["flash_attention"]
    r = build_case(spec, "d128", spec.build_cases["d128"], "sm90",
                   config={"overlap": True, "warp_specialize": "auto", "persistent": False, "BN": 128})
    assert r.ok, r.error
    head = next(line for line in r.artifact.stages["tilelang"].splitlines() if "T.Pipelined" in line)
    assert "order=[-1, -1, 0, " in head and "stage=[-1, -1, 0, " in head and head.rstrip(":").endswith("1])")
    assert ptx_counts(r.artifact.stages["ptx"]).get("wgmma", 0) > 0


def test_overlap_leaves_single_gemm_loops_alone():
    spec = load_all()["gemm"]
    r = build_case(spec, "bf16_8192", spec.build_cases["bf16_8192"], "sm90", config={"overlap": True})
    assert r.ok and "order=" not in r.artifact.stages["tilelang"]


def test_row_split_accumulator_needs_16_rows_a_warp_or_the_column_split_on_sm90():
    """Regression: BM=64 with 256 threads reached TileLang and failed there ("Layout infer
    conflict"). Such a tile is now split by columns (plan.py); one that neither split can lay out
    (176 columns over four warp groups) is rejected up front, naming the gemm's line."""
    from duotile.codegen.compile import specialize
    from duotile.codegen.tilelang_cuda.arch import SM90
    from duotile.codegen.tilelang_cuda.plan import make_plan
    from duotile.dsl.errors import UnsupportedError

    spec = load_all()["flash_attention"]
    case = spec.build_cases["d128"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    with pytest.raises(UnsupportedError, match=r"flash_attention\.py:\d+.*64-row accumulator.*16 warps"):
        specialize(spec.kernel, sig, "sm90", {"BM": 64, "threads": 512, "BN": 176})
    module, _ = specialize(spec.kernel, sig, "sm90", {"BM": 64, "threads": 256})
    assert len(make_plan(module, SM90, 256).col_split) == 2  # scores and output, by columns
    module, _ = specialize(spec.kernel, sig, "sm90", {"BM": 64, "threads": 128})  # 4 warps x 16 rows
    assert not make_plan(module, SM90, 128).col_split


def test_full_row_knob_issues_one_wgmma_as_wide_as_the_tile_on_sm90():
    """A 128x256 fp8 tile over two warp groups: the default square split gives each group
    128 x 128 (two m64n128k32 a step, the A tile read twice); full_row gives each group 64 rows of
    the full width (one m64n256k32). Checked in the PTX; the same registers, no spills."""
    spec = load_all()["gemm"]
    case = spec.build_cases["fp8_8192"]
    cfg = {"BM": 128, "BN": 256, "BK": 128, "fp8_promote_k": 0, "warp_specialize": "manual", "persistent": True}
    shapes = {}
    for full_row in (False, True):
        r = build_case(spec, "fp8_8192", case, "sm90", config={**cfg, "full_row": full_row}, use_tuned=False)
        assert r.ok, r.error
        shapes[full_row] = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)", r.artifact.stages["ptx"]))
        assert r.artifact.meta["ptxas"]["spill_stores"] == 0
        assert ("GemmWarpPolicy.FullRow" in r.artifact.stages["tilelang"]) == full_row
    assert shapes == {False: {"m64n128k32"}, True: {"m64n256k32"}}


def test_full_row_knob_needs_64_rows_a_warp_group_and_only_exists_with_a_gemm():
    from duotile.codegen.compile import specialize
    from duotile.codegen.target import get_target
    from duotile.dsl.errors import UnsupportedError

    spec = load_all()["gemm"]
    case = spec.build_cases["bf16_8192"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    with pytest.raises(UnsupportedError, match=r"gemm\.py:\d+.*64-row accumulator split by rows \(full_row\).*8 warps"):
        specialize(spec.kernel, sig, "sm90", {"BM": 64, "threads": 256, "full_row": True})
    module = specialize(spec.kernel, sig, "sm90", {"BM": 64, "threads": 128, "full_row": True})[0]
    assert "full_row" in get_target("sm90").knobs_for(module)
    norm = load_all()["rmsnorm"]
    nsig = norm.kernel.bind(norm.meta_inputs(norm.build_cases["hidden"]))
    assert "full_row" not in get_target("sm90").knobs_for(specialize(norm.kernel, nsig, "sm90", {})[0])
    assert "full_row" not in get_target("sm100").knobs


def test_warp_specialize_knob_switches_tilelangs_producer_warp_group_on_sm90():
    """The knob travels in the generated file (PASS_CONFIGS), so the build and the GPU launcher
    lower the same kernel: with it off, every warp issues cp.async and no register split exists."""
    spec = load_all()["gemm"]
    case = spec.build_cases["bf16_8192"]
    off = build_case(spec, "bf16_8192", case, "sm90", config={"warp_specialize": False})
    assert off.ok, off.error
    assert "'tl.disable_warp_specialized': True" in off.artifact.stages["tilelang"]
    assert "cp_async" in off.artifact.stages["cuda"] and "warpgroup_reg_alloc" not in off.artifact.stages["cuda"]
    on = build_case(spec, "bf16_8192", case, "sm90", config={"warp_specialize": True})
    assert on.ok, on.error
    assert "tl.disable_warp_specialized" not in on.artifact.stages["tilelang"]
    assert "warpgroup_reg_alloc" in on.artifact.stages["cuda"]


def test_ftz_knob_flushes_denormals_in_the_build_and_on_the_gpu():
    """ftz (default on) travels in the generated file as an nvcc flag that the offline build and
    TileLang's JIT both pass: exp2 becomes one MUFU.EX2 (ex2.approx.ftz) instead of a range check
    and two predicated multiplies around it; ftz=false keeps IEEE denormals."""
    on = built("flash_attention", "d128", "sm90")
    assert "'tl.device_compile_flags': ['--ftz=true']" in on.stages["tilelang"]
    assert "ex2.approx.ftz.f32" in on.stages["ptx"] and "ex2.approx.f32" not in on.stages["ptx"]
    spec = load_all()["flash_attention"]
    off = build_case(spec, "d128", spec.build_cases["d128"], "sm90", config={"ftz": False})
    assert off.ok, off.error
    assert "--ftz" not in off.artifact.stages["tilelang"]
    assert "ex2.approx.f32" in off.artifact.stages["ptx"] and "ex2.approx.ftz" not in off.artifact.stages["ptx"]


def test_ptxas_spills_are_recorded_and_shown():
    """A 256x256 fp32 accumulator over 256 threads is 256 registers a thread before anything else:
    ptxas spills it. The build records ptxas's report and the build table's note says SPILLS."""
    from duotile.codegen.tilelang_cuda.inspect import instruction_summary
    from duotile.codegen.tilelang_cuda.toolchain import ptxas_stats

    spec = load_all()["gemm"]
    case = {"M": 512, "N": 512, "K": 512}
    big = build_case(spec, "bf16_512", case, "sm90", config={"BM": 256, "BN": 256, "BK": 32, "STAGES": 2},
                     use_tuned=False)
    assert big.ok, big.error
    assert big.artifact.meta["ptxas"]["spill_stores"] > 0 and "SPILLS" in instruction_summary(big.artifact)
    fits = build_case(spec, "bf16_512", case, "sm90", config={"BM": 128, "BN": 128, "BK": 64, "STAGES": 2},
                      use_tuned=False)
    assert fits.ok and fits.artifact.meta["ptxas"]["spill_stores"] == 0
    assert "SPILLS" not in instruction_summary(fits.artifact)
    report = "ptxas info    : Used 90 registers\n    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads"
    assert ptxas_stats(report) == {"registers": 90, "spill_stores": 4, "spill_loads": 12, "stack": 8,
                                   "wgmma_serialized": 0}
    serial = report + "\nptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are " \
                      "serialized"
    assert ptxas_stats(serial)["wgmma_serialized"] == 1


@pytest.mark.parametrize("name,case_name", [(n, c) for n in ("gemm_splitk", "mqa_decode") for c in load_all()[n].cases])
def test_split_kernel_test_cases_build_for_sm90(name, case_name):
    """The -m gpu tests run these cases on the H200; building them here finds what would fail to
    compile there first. Regression: a loop over one split range starts at floor(s * blocks /
    SPLIT), and the gemm's clear_accum test printed it as sympy's `floor(...)`, which TileLang
    cannot read."""
    spec = load_all()[name]
    case = spec.cases[case_name]
    r = build_case(spec, case_name, case, "sm90", config=spec.config_of(case), use_tuned=False)
    assert r.ok, r.error
    for a in r.artifacts:
        assert a.files["cubin"].endswith(".cubin") and "floor" not in a.stages["tilelang"]
        assert a.meta["ptxas"]["spill_stores"] == 0


def test_sm100_refuses_a_gemm_tile_without_a_tcgen05_atom_naming_the_line():
    """Regression: a 64 x 32 scores tile (64 heads, 32-row blocks) reached TileLang's sm100
    lowering, which stopped with "TCGEN05 meta not initialized"; the target now asks TileLang's
    atom table first and names the gemm's line, so a sweep prunes the config with a reason."""
    from duotile.codegen.compile import specialize_phases
    from duotile.dsl.errors import UnsupportedError

    spec = load_all()["mqa_decode"]
    case = spec.cases["one_phase"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    with pytest.raises(UnsupportedError, match=r"mqa_decode\.py:\d+.*no tcgen05 instruction lowers a 64 x 32 x 128"):
        specialize_phases(spec.kernel, sig, "sm100", {**spec.config_of(case), "BN": 32})
    specialize_phases(spec.kernel, sig, "sm100", {**spec.config_of(case), "BN": 64})  # N 64: the .ws atom



def test_the_user_config_of_a_narrow_compressor_builds():
    """compressor_decode over 16 channels: the cost model chose a 64-wide channel tile (three
    quarters masked), whose masked selects TileLang 0.1.15 could not lower ("Cannot convert type
    boolx8 to CUDA type"); the waste rule of a gemm-less kernel now keeps its tile at 32."""
    from duotile import codegen

    spec = load_all()["compressor_decode"]
    case = {"B": 20, "form": "hca", "D": 16, "P": 8}
    kernel = codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case))
    (artifact,) = kernel.artifacts(**spec.meta_inputs(case))
    assert artifact.meta["config"]["BD"] <= 32 and "ptx" in artifact.stages


def test_knobs_of_a_kernel_of_two_phases_are_those_any_phase_can_use():
    """A K split and its combine: the knob filter reads every phase (it used to read the module's
    one grid, which a kernel of two phases does not have, and the tuner failed on every such spec)."""
    from duotile.codegen.target import get_target

    spec = load_all()["gemm_blockscaled"]
    case = spec.model_cases()["v4/wq_b/prefill4096"]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    traced = spec.kernel.trace(sig.dtypes, sig.present, {"SPLIT": 4}, spec.constants_of(case))
    assert len(traced.body.ops) == 2
    knobs = get_target("sm90").knobs_for(traced)
    assert {"cluster", "warp_specialize", "fp8_promote_k"} <= set(knobs)
