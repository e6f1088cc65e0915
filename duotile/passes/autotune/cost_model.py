"""An analytical cost model, for targets with no hardware here (sm100, ascend950).

**It ranks configs; it does not measure them.** Reports carry ``metric = "model"``.

The model reads the bound, fused Tile IR of one config (the same module the constraints
check), never a kernel's name:

- work per program: tensor-core flops (``gemm``: 2 m n k), vector element-ops (``map`` /
  ``ew`` / ``reduce``), global bytes (``load`` / ``gather`` / ``store`` tiles), each multiplied
  by the trips of the loops around it (a loop bound that depends on a grid index, as in causal
  attention, is taken at the grid's midpoint);
- DRAM bytes: every tensor once (compulsory) plus ``L2_MISS`` of the re-read tile traffic;
- occupancy: programs resident per SM from the config's shared memory and registers (CUDA),
  one per core on Ascend; then wave quantisation, ``waves = ceil(programs / (units x resident))``;
- the main (pipelined) loop: with ``S`` stages an iteration takes
  ``max(t_mma, t_vector, t_smem, t_dram, latency / (S - 1))``, with one stage
  ``latency + t_mma + t_vector + t_dram`` (no overlap); plus one pipeline fill per program.
  The latency term is a program's own: programs resident together share the SM's throughput
  (the other terms) but do not shorten each other's wait for their next stage, so a program of
  many short K steps is latency-bound however many share its SM. (Measured on the H200, a
  decode GEMM of 64 two-stage K steps a program, all programs resident at once, took 1.3 us a
  step: ``benchmarks/results/decode_gemm_profile.txt``.)

Each target holds its ``Machine`` (``Target.machine``: ``codegen/tilelang_cuda/tuning.py``,
``codegen/tilelang_ascend/tuning.py``). Peak figures (``reference/kernels.md`` section 1 for
NVIDIA): H200 989 / 1,979 TFLOP/s dense bf16 / fp8, 4.8 TB/s, 132 SMs; B200 2,250 / 4,500
TFLOP/s, 8 TB/s, 148 SMs. The reference notes give **no Ascend 950 figures**; those are
assumptions from Huawei's public announcement of the Ascend 950 (Huawei Connect, September
2025: 1 PFLOP/s FP8, 2 PFLOP/s FP4; 950DT with 4 TB/s HiZQ 2.0 HBM), with bf16 taken as half
the FP8 rate and 32 cube cores (each with two vector cores, the ``__mix__(1,2)`` split)
assumed. Shared-memory bandwidth, vector rates, latency and the L2 miss share are round
assumptions, stated per target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy

from ...dsl.ir import Module, Op, Role
from .usage import TileUsage, estimate_usage, threads_of


@dataclass(frozen=True)
class Machine:
    name: str
    units: int  # SMs / cube cores
    mma_flops: dict[int, float]  # operand bits -> dense FLOP/s (16 = bf16/f16, 8 = fp8)
    vector_flops: float  # element-ops/s over the chip
    dram_bw: float  # bytes/s
    smem_bw_unit: float  # operand-memory bytes/s per unit (smem / L1 -> L0)
    smem_per_unit: int  # bytes of operand memory per unit
    regs_per_unit: int  # 32-bit registers per SM (0: not a limit)
    max_resident: int  # programs per unit at most
    latency_s: float  # global-memory latency
    launch_s: float  # fixed cost per program
    mma_m: int = 64  # rows of one MMA issue group: B is re-read from operand memory per group
    assumed: str = ""
    acc_in_registers: bool = True  # accumulators count against registers (not TMEM / L0C)
    # vector units that each run a program's vector tiles (Ascend: the two AIVs of a cube core run
    # the same code; each holds the whole tile, or half with the vector_split knob)
    vector_copies: int = 1
    # programs per unit at most when the main loop is pipelined by a producer warp group (0: no
    # such cap). TileLang's warp-specialised sm90 form takes the register file for one program:
    # ``setmaxnreg`` 240 for 256 consumer threads and 24 for the 128 producers (64,512 of 65,536).
    pipelined_resident: int = 0
    threads_per_unit: int = 0  # resident threads a unit holds at most (0: no such limit)


L2_MISS = 0.15  # share of re-read tile traffic that misses L2 (assumption)

CORE_KNOBS = ("cores", "num_cores", "n_cores", "core_num", "CORES", "NUM_CORES")


@dataclass
class Estimate:
    time_s: float
    flops: float
    dram_bytes: float
    programs: int
    resident: int
    waves: int
    wave_efficiency: float
    bound: str  # which term dominated the main loop

    @property
    def time_ms(self) -> float:
        return self.time_s * 1e3


_NUMS: dict[tuple, float] = {}  # _num of an expression by expression and env: a phase shared by the
_NUMS_MAX = 50_000  # targets' searches (and by configs that differ in knobs alone) is estimated again


def _num(e, env: dict) -> float:
    if isinstance(e, (int, float, sympy.Number)):  # a number substitutes nothing
        return float(e)
    key = (e, tuple(env.items()))
    out = _NUMS.get(key)
    if out is None:
        if len(_NUMS) >= _NUMS_MAX:
            _NUMS.clear()
        out = _NUMS[key] = float(sympy.sympify(e).subs(env))
    return out


def _walk(block, trips: float, env: dict, acc: dict, loop_depth: int, main: list, mma_m: int):
    for op in block.ops:
        if op.name == "for":
            n = max(0.0, _num(op.attrs["extent"], env) - _num(op.attrs["start"], env))
            if not main and op.attrs.get("stages"):
                main.append((op, n))
            for r in op.regions:
                _walk(r, trips * n, env, acc, loop_depth + 1, main, mma_m)
            continue
        _count(op, trips, acc, mma_m)
        for r in op.regions:
            _walk(r, trips, env, acc, loop_depth, main, mma_m)


def _count(op: Op, trips: float, acc: dict, mma_m: int):
    if op.name == "gemm":
        a, b, c = op.args
        k = a.type.shape[0] if op.attrs.get("transpose_a") else a.type.shape[1]
        bits = a.type.dtype.bits
        acc.setdefault(("mma", bits), 0.0)
        acc[("mma", bits)] += 2.0 * float(c.type.numel()) * float(k) * trips
        groups = math.ceil(int(c.type.shape[0]) / mma_m)  # B is read once per MMA row group
        acc["smem"] += (float(a.type.numel()) + groups * float(b.type.numel())) * bits / 8 * trips
    elif op.name in ("map", "ew", "reduce", "cast"):
        src = op.result if op.result is not None else op.attrs.get("into")
        n = float(src.type.numel()) if src is not None else 0.0
        if op.name == "reduce":
            n = float(op.args[0].type.numel())
        acc["vector"] += n * trips
    elif op.name in ("load", "gather", "store", "scatter"):
        v = op.result if op.result is not None else op.args[0]
        acc["gmem"] += float(v.type.numel()) * v.type.dtype.bits / 8 * trips


def estimate(module: Module, m: Machine, knobs: dict[str, Any] | None = None,
             usage: TileUsage | None = None) -> Estimate:
    """The modelled time of one bound module on machine ``m`` (a target's ``machine``)."""
    knobs = knobs or {}
    usage = usage or estimate_usage(module)
    grid = module.grid
    extents = [max(1, int(_num(e, {}))) for e in grid.attrs["extents"]]
    programs = math.prod(extents)
    env = {v: (n - 1) / 2 for v, n in zip(grid.attrs["vars"], extents)}
    acc: dict = {"smem": 0.0, "vector": 0.0, "gmem": 0.0}
    main: list = []
    for r in grid.regions:
        _walk(r, 1.0, env, acc, 0, main, m.mma_m)

    units = m.units
    for k in CORE_KNOBS:
        if k in knobs:
            units = min(units, int(knobs[k]))
    resident = _resident(m, usage, knobs)
    if main and main[0][0].attrs["stages"] and m.pipelined_resident and knobs.get("warp_specialize", "auto") != "off":
        resident = min(resident, m.pipelined_resident)
    waves = math.ceil(programs / (units * resident))
    wave_eff = programs / (waves * units * resident)

    # each tensor the module reads or writes, once (a phase of a split kernel keeps every
    # parameter of the kernel, and an absent optional one stays listed: neither moves bytes)
    touched = {op.attrs["tensor"] for op in module.walk() if op.name in ("load", "store", "gather", "scatter")}
    compulsory = sum(float(sympy.Mul(*p.shape)) * p.dtype.bits / 8 for p in module.params if p.name in touched)
    traffic = acc["gmem"] * programs
    dram = compulsory + max(0.0, traffic - compulsory) * L2_MISS
    dram_per_program = dram / programs
    concurrent = units * resident  # programs sharing the chip at once
    # per-program rates while `concurrent` programs run together
    mma = sum(v / (m.mma_flops.get(key[1], m.mma_flops[16]) / concurrent)
              for key, v in acc.items() if isinstance(key, tuple))
    vec = acc["vector"] * m.vector_copies / (m.vector_flops / concurrent)
    smem = acc["smem"] / (m.smem_bw_unit / resident)
    mem = dram_per_program / (m.dram_bw / concurrent)
    trips, stages = (main[0][1], main[0][0].attrs["stages"] or 1) if main else (1.0, 1)
    trips = max(trips, 1.0)
    per_iter = {"mma": mma / trips, "vector": vec / trips, "smem": smem / trips, "dram": mem / trips}
    if stages >= 2:
        per_iter["latency"] = m.latency_s / (stages - 1)
        bound = max(per_iter, key=per_iter.get)
        t_iter = per_iter[bound]
    else:
        bound = "latency"
        t_iter = m.latency_s + per_iter["mma"] + per_iter["vector"] + per_iter["dram"]
    program_time = trips * t_iter + m.latency_s + m.launch_s / resident
    flops = sum(v for key, v in acc.items() if isinstance(key, tuple)) * programs
    return Estimate(waves * program_time, flops, dram, programs, resident, waves, wave_eff, bound)


def estimate_phases(phases: list[Module], m: Machine, knobs: dict[str, Any] | None = None,
                    usages: list[TileUsage] | None = None) -> Estimate:
    """A kernel of several phases runs them one after another: their times, work and traffic add
    up; the rest is the longest phase's. ``usages``: each phase's ``estimate_usage``, where the
    caller has it already (a ``Verdict``'s)."""
    parts = [estimate(p, m, knobs, u) for p, u in zip(phases, usages or [None] * len(phases))]
    if len(parts) == 1:
        return parts[0]
    main = max(parts, key=lambda e: e.time_s)
    return Estimate(sum(e.time_s for e in parts), sum(e.flops for e in parts), sum(e.dram_bytes for e in parts),
                    sum(e.programs for e in parts), main.resident, sum(e.waves for e in parts),
                    main.wave_efficiency, main.bound)


def _resident(m: Machine, usage: TileUsage, knobs: dict) -> int:
    """Programs that fit on one SM / core at once."""
    if m.max_resident == 1:
        return 1
    by_smem = m.smem_per_unit // max(1, usage.peak[Role.OPERAND] + 1024) if usage.peak[Role.OPERAND] else m.max_resident
    threads = threads_of(knobs)
    reg_bytes = usage.peak[Role.VECTOR] + (usage.peak[Role.ACCUMULATOR] if m.acc_in_registers else 0)
    regs = (math.ceil(reg_bytes / 4 / threads) + 32) * threads
    by_regs = m.regs_per_unit // regs if m.regs_per_unit else m.max_resident
    by_threads = m.threads_per_unit // threads if m.threads_per_unit else m.max_resident
    return max(1, min(m.max_resident, by_smem, by_regs, by_threads))
