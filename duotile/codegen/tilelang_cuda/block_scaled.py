"""The block-scaled MMA rule: a gemm of block-scaled operands on a target whose tensor cores apply
the scales themselves (sm100's ``tcgen05.mma ... kind::mxf8f6f4.block_scale``).

``dsl.mxfp8_values(values, codes)`` and ``dsl.mxfp4_values(packed, codes)`` mean bf16 values, and
elsewhere they are lowered so (an elementwise loop, a device helper). Where both operands of a gemm
are such values, the gemm's accumulator is in TMEM and its tile is one the instruction takes, the
values stay FP8 in shared memory and the codes go to the MMA:

* ``mxfp8_values``: the loaded e4m3 tile itself is the operand (no code is emitted for the op);
* ``mxfp4_values``: the e2m1 codes become e4m3 bytes (exact), sixteen a call of a device helper
  (``device_helpers.MXFP4_E4M3_X16``), into an FP8 shared tile;
* each operand's codes become one 32-bit word a row, byte j the code of the row's K atom j (32
  columns: the instruction's K for FP8); the first warp of the block (the one TileLang issues the
  MMA from, so that the copy is ordered before it) transposes the words into the tcgen05 copy's
  layout (``T.tcgen05_sf_warp_transpose``) and copies them to TMEM (``T.tcgen05_cp_warpx4``);
* ``T.gemm_blockscaled`` with ``k_start=0`` and granularity 32: atom j reads byte j.

Tiles the rule takes: A (M, K) and B (N, K), both K-major (``transpose_b=True``), M = 128 (the
copy moves 128 rows of words at a time), N = 128 or 256, K a multiple of 32 up to 128 (four atoms:
a word's four bytes), each code covering whole atoms. Any other gemm, or another target, lowers
the values to bf16 as before. The products are then exact at every code (the bf16 lowering rounds
them where a scaled value is not a bf16 number).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dsl.ir import Op, Value
from ...dsl.ops import MXFP4_BLOCK
from .arch import Arch
from .exprs import index

ATOM_K = 32  # K of one FP8 block-scaled MMA instruction: a scale code a row per atom
WORD_ATOMS = 4  # codes a 32-bit word holds; the instruction's scale id picks one
ROWS = 128  # rows of scale words one tcgen05.cp moves (32 x 128 bits to each of four lane quarters)
SCALED = ("mxfp4", "mxfp8")


@dataclass(frozen=True)
class Operand:
    op: Op  # the mxfp4 / mxfp8 op
    rows: int
    k: int
    block: int  # columns a code covers

    @property
    def codes(self) -> Value:
        return self.op.args[1]


@dataclass(frozen=True)
class BlockScaledGemm:
    a: Operand
    b: Operand


def _operand(op: Op | None, uses: dict[int, int]) -> Operand | None:
    if op is None or op.name not in SCALED or uses.get(op.result.id, 0) != 1:
        return None
    if not all(getattr(d, "is_Integer", False) for d in op.result.type.shape):
        return None  # a tile of a size not yet bound (a kernel's config space is drawn before binding)
    rows, k = (int(d) for d in op.result.type.shape)
    block = MXFP4_BLOCK if op.name == "mxfp4" else k // int(op.attrs["count"])
    return Operand(op, rows, k, block)


def _takes(a: Operand, b: Operand) -> bool:
    if a.rows != ROWS or b.rows not in (ROWS, 2 * ROWS) or a.k != b.k:
        return False
    if a.k % ATOM_K or a.k > ATOM_K * WORD_ATOMS:
        return False
    return all(x.block % ATOM_K == 0 for x in (a, b))


def find_block_scaled(ops: list[Op], arch: Arch, scope: dict[int, str]) -> dict[int, BlockScaledGemm]:
    """gemm op id -> its block-scaled form, for the gemms the rule takes (the module docstring)."""
    if not arch.block_scaled_mma:
        return {}
    made = {op.result.id: op for op in ops if op.result is not None}
    uses: dict[int, int] = {}
    for op in ops:
        for v in op.values():
            uses[v.id] = uses.get(v.id, 0) + 1
    out = {}
    for op in ops:
        if op.name != "gemm" or op.attrs["transpose_a"] or not op.attrs["transpose_b"]:
            continue
        if scope.get(op.args[2].id) != "tmem":
            continue
        a, b = (_operand(made.get(v.id), uses) for v in op.args[:2])
        if a is None or b is None or not _takes(a, b):
            continue
        if any(scope.get(v.id) != "shared" for x in (a, b) for v in x.op.args):
            continue
        out[id(op)] = BlockScaledGemm(a, b)
    return out


def raw_values(gemms: dict[int, BlockScaledGemm]) -> set[int]:
    """The mxfp4 / mxfp8 results such gemms read as FP8 (not bf16 values)."""
    return {x.op.result.id for g in gemms.values() for x in (g.a, g.b)}


def code_column(op: Op, within: str) -> str:
    """TileLang text of the codes column that column ``within`` of a scaled-values op's codes is:
    past the op's ``first`` (a wider tile of codes read from a column on)."""
    first = op.attrs["first"]
    return within if first == 0 else f"{index(first)} + {within}"


def scale_word(codes: str, x: Operand) -> str:
    """TileLang text of row ``i0``'s scale word: byte j the code of K atom j (127, a scale of one,
    past the tile's atoms: no instruction reads it)."""
    parts = []
    for j in range(WORD_ATOMS):
        if j * ATOM_K < x.k:
            parts.append(f'(T.cast({codes}[i0, {code_column(x.op, str(j * ATOM_K // x.block))}], "uint32") << {8 * j})')
        else:
            parts.append(f'T.cast({127 << (8 * j)}, "uint32")')
    return " | ".join(parts)


def emit_gemm(e, op: Op, g: BlockScaledGemm, acc: str, clear: str) -> None:
    """The block-scaled gemm at ``op``'s place: scale words into shared memory, the first warp's
    transpose and copy to TMEM, the MMA into ``acc`` (TMEM), and its wait. ``e``: the Emitter."""
    words, tmems = [], []
    for side, x in (("a", g.a), ("b", g.b)):
        name = f"sf{side}{e.barriers + 1}"  # numbered as the MMA's barrier
        e.src.decl(f'{name}_smem = T.alloc_shared(({x.rows},), "uint32")')
        e.src.decl(f'{name}_tmem = T.alloc_tmem(({ROWS}, {WORD_ATOMS * x.rows // ROWS}), "uint32")')
        e.src.line(f"for i0 in T.Parallel({x.rows}):", op.loc)
        e.src.line(f"    {name}_smem[i0] = {scale_word(e.name(x.codes), x)}", op.loc)
        words.append(f"{name}_smem")
        tmems.append(f"{name}_tmem")
    # one warp, the MMA's issuer: its copies to TMEM are ordered before its MMA
    e.src.line("if T.get_thread_binding() < 32:", op.loc)
    for w in words:
        e.src.line(f"    T.tcgen05_sf_warp_transpose({w})", op.loc)
    e.src.line("    T.fence_proxy_async()", op.loc)
    for w, t in zip(words, tmems):
        e.src.line(f"    T.tcgen05_cp_warpx4({w}, {t})", op.loc)
    bar = e.new_barrier()
    e.src.line(f"T.gemm_blockscaled({e.name(g.a.op.result)}, {e.name(g.b.op.result)}, {acc}, {tmems[0]}, {tmems[1]}, "
               f"transpose_A=False, transpose_B=True, mbar={bar}, clear_accum={clear}, k_start=0, "
               f"sf_a_granularity_k={ATOM_K}, sf_b_granularity_k={ATOM_K})", op.loc)
    e.src.line(f"T.mbarrier_wait_parity({bar}, {e.parity()})", op.loc)
