"""The generated model against its reference at a released configuration's real size, on a few
layers: logit error within a bound derived from the reference itself, and the share of positions
whose greedy token differs.

    python3 benchmarks/model_agreement.py --model v4-flash --layers 4 --tokens 48

Both are duotile's runtime on the same random weights (`runtime/random_weights.py`, drawn on the
GPU): ``reference`` runs the PyTorch reference ops (the released codes dequantised at each use),
``generated`` the sm90 builds (no config given), built ahead in ``--jobs`` processes before the
comparison. One sequence of ``--tokens`` random tokens is run teacher forced (one forward, every
position's FP32 logits), so each position compares the two on the same context.

The bound is the method of tests/runtime/test_generated.py: the reference is run a second time
with every linear output moved by 2^-20 relative (a few FP32 ulps, a random sign per element);
the largest logit change that causes is the reference's own spread at these weights, and the
generated model is held to twice it. A greedy token differs wherever the top two logits are
closer than the error, which random weights make common; that share is reported, not bounded.

Rows go to ``--out`` (JSON); ``--report A.json B.json`` joins runs into
``results/model_agreement.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUDGE = 2.0 ** -20  # relative change of each linear output in the spread run


def teacher_forced(model, seq: torch.Tensor) -> torch.Tensor:
    """FP32 logits at every position of ``seq``, the whole sequence in one forward."""
    from duotile.runtime.layers.step import StepSeq

    return model.forward([StepSeq(model.new_cache(), seq)], all_logits=True)[0].float()


def nudged(fn, seed: int = 0, ops: tuple[str, ...] = ("linear", "linear_q")):
    """``fn()`` with every floating output of the model ops ``ops`` moved by NUDGE relative, a
    random sign each (drawn on the CPU from ``seed``)."""
    from duotile.runtime import model_ops

    noise = torch.Generator().manual_seed(seed)
    dispatch = model_ops.dispatch

    def moved(ctx, name, op, args, kw):
        out = dispatch(ctx, name, op, args, kw)
        if name in ops and out.is_floating_point():
            sign = torch.randn(out.shape, generator=noise).sign().to(out.device)
            return (out.float() * (1 + NUDGE * sign)).to(out.dtype)
        return out

    model_ops.dispatch = moved
    try:
        return fn()
    finally:
        model_ops.dispatch = dispatch


def agreement(model_name: str, layers: int, tokens: int, device: str, jobs: int, log=print) -> dict:
    """The measurement of the module docstring, as one JSON-able row."""
    from duotile.runtime.generated.ahead import build_ahead
    from duotile.runtime.layer_subset import layer_subset
    from duotile.runtime.presets import PRESETS
    from duotile.runtime.random_weights import RandomCheckpoint
    from duotile.runtime.reference import Model

    subset = layer_subset(PRESETS[model_name](), layers)
    cfg = subset.config
    ckpt = RandomCheckpoint(cfg, seed=0, device=device)
    seq = torch.randint(3, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(7))
    t0 = time.perf_counter()
    reference = Model(ckpt, device=device, kernels="reference", packed_only=True)
    ref = teacher_forced(reference, seq)
    spread = (nudged(lambda: teacher_forced(reference, seq)) - ref).abs().max().item()
    reference = None  # its dequantised weights freed before the generated model loads
    log(f"{model_name} L{layers}: reference and its spread {spread:.4g} in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    generated = Model(ckpt, device=device, kernels="generated", packed_only=True)
    report = build_ahead(generated.ctx.ops, lambda: teacher_forced(generated, seq), jobs, log=log)
    before = generated.ctx.tally.snapshot()
    got = teacher_forced(generated, seq)
    served = generated.ctx.tally.since(before)
    err = (got - ref).abs()
    row = {"model": model_name, "layers": layers, "kinds": list(subset.kinds), "tokens": tokens,
           "spread": spread, "bound": 2 * spread, "max_error": err.max().item(),
           "mean_error": err.mean().item(), "logit_scale": ref.abs().max().item(),
           "greedy_differs": (got.argmax(-1) != ref.argmax(-1)).float().mean().item(),
           "reference_calls": sum(n for _g, n in served.values()),
           "generated_calls": sum(g for g, _n in served.values()),
           "builds_ahead": report.built, "generated_s": time.perf_counter() - t0}
    row["within_bound"] = row["max_error"] <= row["bound"]
    log(json.dumps(row))
    return row


def write_report(runs: list[dict], name: str = "model_agreement") -> str:
    lines = [f"# The generated model against its reference at real size ({runs[0]['date']}, {runs[0]['device']})", "",
             "`python3 benchmarks/model_agreement.py --model M --layers 4`: one random sequence teacher forced, "
             "FP32 logits at every position; bound = twice the reference's own spread under a 2^-20 relative "
             "nudge of every linear output.", "",
             "| model | layers (kinds) | tokens | max logit error | bound | within | mean error | logit scale "
             "| greedy token differs | generated / reference calls |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        r = run["row"]
        lines.append(f"| {r['model']} | {r['layers']} ({', '.join(r['kinds'])}) | {r['tokens']} | "
                     f"{r['max_error']:.4g} | {r['bound']:.4g} | {'yes' if r['within_bound'] else 'NO'} | "
                     f"{r['mean_error']:.3g} | {r['logit_scale']:.3g} | {100 * r['greedy_differs']:.1f}% | "
                     f"{r['generated_calls']} / {r['reference_calls']} |")
    text = "\n".join(lines) + "\n"
    results = Path(__file__).parent / "results"
    (results / f"{name}.md").write_text(text)
    (results / f"{name}.json").write_text(json.dumps(runs, indent=1))
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v4-flash")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48, help="length of the teacher-forced sequence")
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=15, help="build processes")
    p.add_argument("--out", default="model_agreement.json")
    p.add_argument("--report", nargs="*", help="join these JSON runs into results/model_agreement.*")
    args = p.parse_args()
    if args.report:
        print(write_report([json.loads(Path(f).read_text()) for f in args.report]))
        return 0
    row = agreement(args.model, args.layers, args.tokens, args.device, args.jobs)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": device, "row": row},
                                         indent=1))
    return 0 if row["within_bound"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
