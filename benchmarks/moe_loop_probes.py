"""The MoE grouped GEMM's main loop with one stage left out at a time: where a K step's work goes.
A copy of ``moe_gemm_mxfp4``'s main phase (the tile table passed in, as ``moe_permute`` and the
first two phases make it), with ``PROBE`` bits that replace one stage by a cheaper one:

* 1: the activations read as two contiguous (BM, BK / 2) tiles (TMA, pipelined) instead of the
  even and odd columns gathered from global memory: the cost of the gathers (wrong values);
* 2: each weight nibble converted as an integer instead of decoded and scaled (wrong values).

    python3 benchmarks/moe_loop_probes.py --sass              # main-loop instructions (no GPU)
    python3 benchmarks/moe_loop_probes.py [SHAPE ...]         # times on the GPU (H200), us a call

Both report the V4 decode-64 w13 shape unless shapes (``moe_gemm_mxfp4`` model shapes) are named.
The error column says which variants compute the product (0 = the reference's bf16 result).
"""
from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from duotile import codegen, dsl  # noqa: E402
from duotile.kernels_spec import moe_gemm_mxfp4 as M  # noqa: E402
from duotile.kernels_spec.gemm_blockscaled import _pow2  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402


@dsl.kernel(batch_dim="R", dynamic=("R", "T"))
def probe(a: dsl.Tensor["R", "K", dsl.f8e4m3], a_scale: dsl.Tensor["R", "KA", dsl.u8],
          w: dsl.Tensor["E", "N", "KH", dsl.u8], w_scale: dsl.Tensor["E", "N", "KW", dsl.u8],
          counts: dsl.Tensor["E", dsl.i32], offsets: dsl.Tensor["E1", dsl.i32],
          starts: dsl.Tensor["E1", dsl.i32], owner: dsl.Tensor["T", dsl.i32],
          out: dsl.Tensor["R", "N", dsl.bf16], *, ABLOCK: dsl.Const = 128, PROBE: dsl.Const = 0,
          BM: dsl.Tunable = dsl.choice(64, 16, 32), BN: dsl.Tunable = dsl.choice(128, 64),
          BK: dsl.Tunable = dsl.choice(128, 64), STAGES: dsl.Tunable = dsl.int_range(1, 3, default=3)):
    n_e = w.E
    for t, n in dsl.grid(owner.T, dsl.cdiv(w.N, BN)):
        live = dsl.load(starts[n_e], (1,)) > t
        e = dsl.scalar(dsl.where(live, dsl.load(owner[t], (1,)), 0))
        begin = dsl.load(offsets[e], (1,))
        first = begin + (t - dsl.load(starts[e], (1,))) * BM
        local = first + dsl.arange(BM)
        rows = dsl.where(live & (local < begin + dsl.load(counts[e], (1,))), local, -1)
        r0 = dsl.scalar(dsl.where(live, first, 0))
        half = dsl.arange(BK // 2)[None, :]
        acc = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
        steps = dsl.where(live, dsl.cdiv(a.K, BK), 0).to(dsl.i32)
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=STAGES, stop=steps):
            col = k * BK
            byte = dsl.load(w[e, n * BN, k * (BK // 2)], (BN, BK // 2), role="operand")
            code = M._step_codes(w_scale, (e, n * BN), k * (BK // M.WBLOCK), BN, half, BK, M.WBLOCK)
            sa = _pow2(dsl.load(a_scale[r0, col // ABLOCK], (BM, 1)))
            for nib, parity in ((M._low(byte), 0), (M._high(byte), 1)):
                if PROBE & 1:
                    x = dsl.load(a[r0, col + parity * (BK // 2)], (BM, BK // 2), role="operand")
                else:
                    x = dsl.load(a[r0, col + 2 * dsl.arange(BK // 2) + parity], (BM, BK // 2))
                wv = nib().to(dsl.bf16) if PROBE & 2 else M._weights(nib, code)
                dsl.gemm((x.to(dsl.f32) * sa).to(dsl.bf16), wv, acc, transpose_b=True)
        dsl.store(out[rows, n * BN], acc.to(dsl.bf16))


VARIANTS = [("as shipped", 0, {}), ("contiguous activations", 1, {}), ("integer weights", 2, {}),
            ("both", 3, {}), ("as shipped, BM 16", 0, {"BM": 16}), ("as shipped, BN 64", 0, {"BN": 64})]
BASE = {"BM": 64, "BN": 128, "BK": 128, "STAGES": 3}  # moe_gemm_mxfp4's shipped sm90 starting config
SPEC = "moe_gemm_mxfp4"


def tables(counts: torch.Tensor, bm: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile table the first two phases write: each expert's first row tile, each tile's expert."""
    tiles = (counts.long() + bm - 1) // bm
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(tiles, 0)
    owner = torch.searchsorted(starts[1:], torch.arange(int(starts[-1])), right=True)
    return starts.int().to(device), owner.int().to(device)


def compiled(case: dict, bits: int, cfg: dict):
    return codegen.compile(probe, "sm90", config=cfg, constants={"ABLOCK": case["K"] // case["KA"], "PROBE": bits})


def build(job) -> tuple[float, str]:
    """Build one variant (a process of its own); its SASS where cuobjdump is found."""
    shape, bits, cfg = job
    case = load_all()[SPEC].model_cases()[shape]
    x = load_all()[SPEC].make_inputs(case, torch.device("meta"), 0)
    x["starts"] = torch.empty(case["E"] + 1, dtype=torch.int32)
    x["owner"] = torch.empty(1, dtype=torch.int32)
    t0 = time.perf_counter()
    art = compiled(case, bits, cfg).artifacts(**x)[0]
    return time.perf_counter() - t0, art.stages.get("sass", "")


def timed(case, x, bits, cfg) -> tuple[float, float]:
    """(us a call, largest error over the reference's largest value) of one variant."""
    starts, owner = tables(x["counts"].cpu(), cfg["BM"], "cuda")
    kernel = compiled(case, bits, cfg)
    out = x["out"].clone()
    args = {k: x[k] for k in ("a", "a_scale", "w", "w_scale", "counts", "offsets")}

    def call():
        kernel(**args, starts=starts, owner=owner, out=out)

    call()
    torch.cuda.synchronize()
    rows = torch.arange(case["R"], device="cuda") < int(x["offsets"][-1])
    err = ((out.float() - x["want"]).abs()[rows].max() / x["want"][rows].abs().max()).item()
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        call()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / 20, err


def main() -> int:
    from benchmarks.sass_loop import describe, functions

    args = [a for a in sys.argv[1:] if a != "--sass"]
    shapes = args or ["v4/e256_w13/decode64"]
    jobs = [(s, bits, {**BASE, **o}) for s in shapes for _name, bits, o in VARIANTS]
    with ProcessPoolExecutor(min(15, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        built = list(pool.map(build, jobs))
    if "--sass" in sys.argv:
        for (shape, _bits, cfg), (name, _b, _o), (_s, sass) in zip(jobs, VARIANTS * len(shapes), built):
            for fn, instrs in functions(sass).items():
                print(f"{shape} {name} {cfg}: " + describe(fn, instrs, 0)[2])
        return 0
    spec = load_all()[SPEC]
    for shape in shapes:
        case = spec.model_cases()[shape]
        x = spec.make_inputs(case, torch.device("cuda"), 0)
        x["want"] = spec.run_reference({k: v.clone() for k, v in x.items()}, case)["out"].float()
        for name, bits, o in VARIANTS:
            us, err = timed(case, x, bits, {**BASE, **o})
            print(f"{shape} {name:24s} {({**BASE, **o})}: {us:8.0f} us a call, error {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
