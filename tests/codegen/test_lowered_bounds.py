"""The bounds check of the code TileLang lowers (codegen/tilelang_cuda/lowered_bounds.py): every
read and write of a tensor proven inside it, or the build refused naming the tensor, the dimension
and the index. Small hand-written TileLang kernels hold each pattern; the generated kernels meet the
check in every full build (test_model_shape_builds.py's representative builds among them)."""

from __future__ import annotations

import pytest

from duotile.codegen.target import Artifact, get_target
from duotile.dsl.errors import UnguardedAccessError

pytest.importorskip("tilelang")
pytestmark = pytest.mark.slow

HEAD = '''import tilelang
import tilelang.language as T
n_T = T.dynamic("n_T")
'''

# the pattern the GPU sweep's fences found in gemm_blockscaled: a scale code read at each of a K
# step's four blocks where the tensor holds one block (K = 16 in 32-wide blocks), its test naming
# the other axis only. The block numbers are constants, which TileLang's own bounds pass
# (tl.LegalizeSafeMemoryAccess) leaves untested.
PAST_A_SIZE_1_AXIS = HEAD + '''
@T.prim_func
def scales_kernel(s: T.Tensor((2, 1,), "uint8"), o: T.Tensor((2, 4,), "float32")):
    with T.Kernel(4, threads=32) as (bx,):
''' + "".join(f"        o[bx % 2, {kb}] = T.Cast(\"float32\", T.if_then_else(bx < 2{{}}, s[bx, {kb}], T.uint8(0)))"
             f"  # scales.py:7\n" for kb in range(4))

GUARDED = PAST_A_SIZE_1_AXIS.format(*(f" and {kb} < 1" for kb in range(4)))
PAST_A_SIZE_1_AXIS = PAST_A_SIZE_1_AXIS.format(*[""] * 4)

# rows of a dynamic size in blocks of four, the last block's rows tested against it (or not)
ROW_BLOCKS = HEAD + '''
@T.prim_func
def rows_kernel(x: T.Tensor((n_T, 64,), "float32"), y: T.Tensor((n_T, 64,), "float32")):
    with T.Kernel(T.ceildiv(n_T, 4), threads=64) as (bx,):
        m = T.alloc_var("int32", init=bx)
        for r in T.serial(4):
            if m * 4 + r < n_T:
                y[m * 4 + r, T.get_thread_binding()] = x[m * 4 + r, T.get_thread_binding()]  # rows.py:9
'''

UNTESTED_ROWS = ROW_BLOCKS.replace("            if m * 4 + r < n_T:\n    ", "")
NO_TILELANG_TESTS = {"tl.disable_safe_memory_legalize": True}  # TileLang's own tests of variable indices

# a row number read from memory (a gather): the spec's promise, counted and not proven
GATHER = HEAD + '''
@T.prim_func
def gather_kernel(idx: T.Tensor((8,), "int32"), x: T.Tensor((100, 64,), "float32"), y: T.Tensor((8, 64,), "float32")):
    with T.Kernel(8, threads=64) as (bx,):
        y[bx, T.get_thread_binding()] = x[idx[bx], T.get_thread_binding()]  # gather.py:4
'''

# a row number read from memory into a register, then tested (or not) before it indexes a tensor
GATHER_TESTED = HEAD + '''
@T.prim_func
def gather_kernel(idx: T.Tensor((8,), "int32"), x: T.Tensor((100, 64,), "float32"), y: T.Tensor((8, 64,), "float32")):
    with T.Kernel(8, threads=64) as (bx,):
        r = T.alloc_var("int32", init=idx[bx])
        if 0 <= r and r < 100:
            y[bx, T.get_thread_binding()] = x[r, T.get_thread_binding()]  # gather.py:6
'''


def _report(source: str, tmp_path, more: dict | None = None):
    from duotile.codegen.tilelang_cuda import toolchain

    more = more or {}
    path = tmp_path / "k.py"
    path.write_text(source)
    entry = source.split("def ")[1].split("(")[0]
    prim, configs = toolchain.load_generated(str(path), entry)
    return toolchain.lower_checked(prim, "sm_90a", {**configs, **more})[1]


def test_a_read_past_a_size_1_axis_is_found_and_its_guard_proves_it_inside(tmp_path):
    report = _report(PAST_A_SIZE_1_AXIS, tmp_path)
    assert [(a.kind, a.tensor, a.dim) for a in report.unproven] == [("read", "s", 1)] * 3, report.unproven
    assert {a.index for a in report.unproven} == {"1", "2", "3"}  # block 0 lies inside
    assert all(a.guards == ("bx < 2",) for a in report.unproven), report.unproven
    guarded = _report(GUARDED, tmp_path)
    assert guarded.unproven == [] and guarded.proven > 0


def test_rows_of_a_dynamic_size_are_proven_by_their_test_and_found_without_it(tmp_path):
    """The last block of four rows, tested against n_T by the kernel or, where it does not, by
    TileLang's own pass (which tests a variable index it cannot prove); with neither, both the read
    and the write are found."""
    report = _report(ROW_BLOCKS, tmp_path)
    assert report.unproven == [] and report.proven >= 4, report  # the register m put in place of its reads
    assert _report(UNTESTED_ROWS, tmp_path).unproven == []
    bare = _report(UNTESTED_ROWS, tmp_path, NO_TILELANG_TESTS)
    assert {(a.kind, a.tensor, a.dim) for a in bare.unproven} == {("read", "x", 0), ("write", "y", 0)}, bare
    assert _report(ROW_BLOCKS, tmp_path, NO_TILELANG_TESTS).unproven == []


def test_an_index_read_from_memory_is_counted_not_refused(tmp_path):
    report = _report(GATHER, tmp_path)
    assert report.unproven == [] and report.data == 1 and report.proven >= 3, report


def test_a_build_refuses_an_unguarded_access_naming_the_tensor_dimension_and_spec_line(tmp_path):
    """Before nvcc runs: the error names the read, the spec line of its statement and how to print
    the source."""
    art = Artifact("scales", "sm90", stages={"tilelang": PAST_A_SIZE_1_AXIS}, meta={"entry": "scales_kernel"})
    with pytest.raises(UnguardedAccessError) as err:
        get_target("sm90").build(art, str(tmp_path))
    msg = str(err.value)
    assert msg.startswith("scales.py:7: sm90: the generated scales") and "read of `s` at dimension 1 (extent 1)" in msg
    assert "(and 2 more)" in msg and "duotile show scales --target sm90 --stage tilelang" in msg
    assert "cuda" not in art.stages  # refused before the CUDA source was kept, so before nvcc


def test_the_sweeps_scale_code_case_builds_with_every_access_proven(tmp_path):
    """gemm_blockscaled at the GPU sweep's case random-seed20261207006 and its config (K = 16 in
    32-wide blocks, K steps of 128): lowered for sm90, every read of its scale codes is proven."""
    from duotile.codegen.compile import specialize
    from duotile.codegen.tilelang_cuda import toolchain
    from duotile.kernels_spec import load_all

    spec = load_all()["gemm_blockscaled"]
    case = {"G": 2, "M": 70, "N": 64, "K": 16, "BLOCK": 32, "scales": "normal", "zero_rows": True}
    config = {"BM": 64, "BN": 32, "BK": 128, "STAGES": 4, "SPLIT": 1, "SCALES": "promote"}
    module, knobs = specialize(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90", config,
                               spec.constants_of(case))
    src = get_target("sm90").generate(module, knobs).stages["tilelang"]
    path = tmp_path / "k.py"
    path.write_text(src)
    prim, configs = toolchain.load_generated(str(path), "gemm_blockscaled_kernel")
    report = toolchain.lower_checked(prim, "sm_90a", configs)[1]
    assert report.unproven == [] and report.proven >= 15, report


def test_a_register_read_from_memory_stays_unknown_and_is_counted_with_the_data_indexed(tmp_path, monkeypatch):
    """The walk does not put the load a register holds in place of its reads (a routed kernel's
    expert and row numbers: their loads, put inside every test around them, once took TVM's analyzer
    minutes to enter, the moe_gemm_mxfp4 build past CI's time limit). Its reads stay the spec's
    promise: counted, not refused, whether a test surrounds them or not."""
    from duotile.codegen.tilelang_cuda import lowered_bounds

    walks, run = [], lowered_bounds._Walk.run
    monkeypatch.setattr(lowered_bounds._Walk, "run", lambda self: walks.append(self) or run(self))
    for source in (GATHER_TESTED, GATHER_TESTED.replace("        if 0 <= r and r < 100:\n    ", "")):
        report = _report(source, tmp_path, NO_TILELANG_TESTS)
        assert report.unproven == [] and report.data == 1 and report.proven == 4, report  # x's row is the data
    assert len(walks) == 2 and all(w.known == {} for w in walks)  # r, stored from idx, is not replaced by idx[bx]
