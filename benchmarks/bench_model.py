"""The model on the GPU: decode milliseconds a step and prefill speed of a released configuration on a
few layers (real widths and expert counts, random weights), duotile's runtime against its peers.

    python3 benchmarks/bench_model.py --model v4-flash --layers 4 --runs generated,reference,transformers

Systems (``--runs``), each on the same random weights (`runtime/random_weights.py`, drawn on the GPU):

* ``generated``: duotile's runtime on its generated kernels (sm90 builds, no config given), built
  ahead in parallel processes (`runtime/generated/ahead.py`) before anything is timed;
* ``generated-graphs``: the same with each layer's attention projections and FFN half of a decode
  step replayed from CUDA graphs (`runtime/graphs.py`, ``duotile generate --graphs``);
* ``reference``: the same runtime on its PyTorch reference ops (dequantised weights where they fit
  in half the GPU's memory, else the released codes dequantised at each use: the label says which);
* ``transformers``: Hugging Face transformers' ``DeepseekV4ForCausalLM`` (V4 only), eager attention,
  BF16, the same weights dequantised (`runtime/hf_port.py`).

Workload, the same for every system: one request whose ``--prompt`` tokens are prefilled in one
step (time to first token: that step and its greedy token on the host; prefill tokens/s from it),
then for each batch of ``--batches``, that many requests of ``--context`` prompt tokens each,
prefilled, then ``--steps`` greedy decode steps timed one by one (median; each step ends with its
tokens on the host, as a serving loop's does). The floor of a decode step is the weight bytes it
reads (every weight but the routed experts and the tables it gathers a few rows of: the embedding,
V4.1's Engram table, V4's hash routing table; plus the experts a batch of that size routes to,
counted for uniform routing) over the copy bandwidth measured in the run.

Each system's rows go to ``--out`` (JSON) as they are measured; ``--report A.json B.json ...
--name NAME`` joins runs made in separate processes into ``results/NAME.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duotile.runtime.inventory import tensor_specs  # noqa: E402
from duotile.runtime.layer_subset import layer_kind, layer_subset  # noqa: E402
from duotile.runtime.layers.step import StepSeq  # noqa: E402
from duotile.runtime.presets import PRESETS  # noqa: E402
from duotile.runtime.random_weights import RandomCheckpoint  # noqa: E402

CHUNK = 4096  # prompt tokens a prefill step takes at most, when a batch's prompts are filled


class Ours:
    """duotile's runtime: one `Model`, requests as `StepSeq`s over their caches."""

    def __init__(self, ckpt, kernels: str, dequantised: bool, device: str, graphs: bool = False):
        from duotile.runtime.reference import Model

        self.model = Model(ckpt, device=device, kernels=kernels, packed_only=not dequantised, graphs=graphs)
        if kernels == "reference" and not dequantised:
            self.label = "reference (codes dequantised at each use)"
        elif self.model.ctx.sections is not None:
            self.label = f"{kernels} (layer sections from CUDA graphs)"
        else:
            self.label = kernels

    def prefill(self, prompts: list[torch.Tensor]) -> tuple[list, list[int]]:
        caches = [self.model.new_cache() for _ in prompts]
        last, per_step = [], max(1, CHUNK // len(prompts[0]))
        for at in range(0, len(prompts), per_step):
            last += self.model.forward([StepSeq(c, p) for c, p in zip(caches[at:at + per_step],
                                                                       prompts[at:at + per_step])])
        return caches, torch.stack(last).argmax(-1).tolist()

    def step(self, caches, tokens: list[int]) -> list[int]:
        logits = self.model.forward([StepSeq(c, torch.tensor([t])) for c, t in zip(caches, tokens)])
        return torch.stack(logits).argmax(-1).tolist()


class Transformers:
    """transformers' DeepseekV4ForCausalLM in BF16 with eager attention, our weights copied in."""

    def __init__(self, cfg, ckpt, device: str):
        import transformers

        from duotile.runtime.hf_port import hf_config, hf_tensors

        hcfg = hf_config(cfg, dtype="bfloat16")
        hcfg._attn_implementation = "eager"
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                self.model = transformers.DeepseekV4ForCausalLM(hcfg).eval()
        finally:
            torch.set_default_dtype(default)
        params = self.model.state_dict()
        for name, value in hf_tensors(cfg, ckpt.get):
            params[name].copy_(value)
        experts = getattr(hcfg, "_experts_implementation", None)
        self.label = f"transformers {transformers.__version__} (eager attention, experts: {experts})"
        self.device = device

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor]):
        out = self.model(input_ids=torch.stack(prompts).to(self.device), use_cache=True)
        return out.cache, out.logits[:, -1].argmax(-1).tolist()

    @torch.no_grad()
    def step(self, cache, tokens: list[int]) -> list[int]:
        ids = torch.tensor(tokens, device=self.device)[:, None]
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[:, -1].argmax(-1).tolist()


def prompts(cfg, n: int, length: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, cfg.vocab_size, (length,), generator=g) for _ in range(n)]


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def workload(system, cfg, args, record=None) -> None:
    """The benchmark's calls (module docstring); ``record(row)`` gets each measurement."""
    ttft = []
    for r in range(args.repeats + 1):
        _, s = timed(lambda: system.prefill(prompts(cfg, 1, args.prompt, seed=1)))
        ttft += [s] if r else []  # the first is a warm-up
    if record and ttft:
        t = statistics.median(ttft)
        record({"phase": f"prefill {args.prompt}", "ms": 1e3 * t, "tokens_per_s": args.prompt / t})
    for batch in args.batches:
        caches, tokens = system.prefill(prompts(cfg, batch, args.context, seed=2 + batch))
        times = []
        for i in range(args.steps + 2):
            tokens, s = timed(functools.partial(system.step, caches, tokens))
            times += [s] if i >= 2 else []
        if record:
            record({"phase": f"decode batch {batch}", "ms": 1e3 * statistics.median(times), "batch": batch})
        caches = None
        gc.collect()


def profile_step(system, cfg, args) -> None:
    """torch.profiler over one decode step at batch ``--profile`` (after two steps): where the
    step's time goes, by op and kernel, printed and written beside ``--out`` (``.profile.txt``)."""
    from torch.profiler import ProfilerActivity, profile

    caches, tokens = system.prefill(prompts(cfg, args.profile, args.context, seed=2 + args.profile))
    for _ in range(2):
        tokens, _s = timed(functools.partial(system.step, caches, tokens))
    gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=[ProfilerActivity.CPU, *gpu]) as prof:
        _, wall = timed(functools.partial(system.step, caches, tokens))
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    text = (f"decode step, batch {args.profile}: {1e3 * wall:.1f} ms wall (profiled), {gpu:.1f} ms of GPU work, "
            f"{launches} GPU kernels and copies\n"
            + events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60) + "\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(text)
    Path(args.out).with_suffix(".profile.txt").write_text(text)


def floor_bytes(cfg, batch: int) -> int:
    """Weight bytes a decode step reads at ``batch`` (module docstring), as stored."""
    block, per_expert, total = cfg.weight_block_size[0], 0, 0
    for spec in tensor_specs(cfg):
        size = sum(torch.Size(s).numel() * d.itemsize for s, d in spec.stored(block).values())
        if (spec.name.startswith("mtp.") or spec.name == "embed.weight" or ".gate.tid2eid" in spec.name
                or spec.name.endswith(".engram.embed")):  # tables a step reads a few rows of
            continue
        if ".experts." in spec.name and ".shared_experts." not in spec.name:
            per_expert += size if ".experts.0." in spec.name and spec.name.startswith("layers.0.") else 0
            continue
        total += size
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    return int(total + cfg.num_hidden_layers * touched * per_expert)


def build(name: str, cfg, ckpt, args, log):
    if name == "transformers":
        return Transformers(cfg, ckpt, args.device)
    from duotile.runtime.footprint import weight_bytes

    memory = torch.cuda.mem_get_info()[1] if args.device == "cuda" else float("inf")
    dequantised = name == "reference" and sum(weight_bytes(cfg).values()) < 0.5 * memory
    kernels = "generated" if name.startswith("generated") else name
    system = Ours(ckpt, kernels, dequantised, args.device, graphs=name == "generated-graphs")
    if kernels == "generated":
        from duotile.codegen import prebuild
        from duotile.runtime.generated.ahead import build_ahead

        if not args.ahead and not args.signatures:
            return system  # every build made at its first call
        sigs = []
        if args.signatures and Path(args.signatures).is_file():  # a list met before: built at once
            sigs = prebuild.load(args.signatures)
            t0 = time.perf_counter()
            failed = sum(not o.ok for o in prebuild.prebuild(sigs, "sm90", args.jobs))
            log(f"prebuilt {len(sigs)} signature(s) of {args.signatures} ({failed} failed) in "
                f"{time.perf_counter() - t0:.0f} s")
            if not args.ahead:
                system.label += f" ({len(sigs)} builds made ahead from a list)"
                return system
        # the rounds run a short form of the workload: one prefill, one decode step a batch
        short = argparse.Namespace(**{**vars(args), "steps": 1, "repeats": 0})
        save = (lambda sigs: prebuild.save(sigs, args.save_signatures)) if args.save_signatures else None
        report = build_ahead(system.model.ctx.ops, lambda: workload(system, cfg, short), args.jobs, log=log,
                             save=save, built=sigs)
        listed = f"{len(sigs)} builds from a list, " if sigs else ""
        system.label += f" ({listed}{report.built} built ahead in {len(report.rounds)} rounds)"
    return system


def run(args) -> None:
    from benchmarks.common import copy_bandwidth

    cfg = PRESETS[args.model]()
    kinds = [layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)]
    if args.layers:
        subset = layer_subset(cfg, args.layers)
        cfg, kinds = subset.config, list(subset.kinds)
    ckpt = RandomCheckpoint(cfg, seed=0, device=args.device)
    gpu = args.device == "cuda"
    copy = copy_bandwidth(1 << 30) if gpu else None
    out = {"model": args.model, "layers": args.layers, "kinds": kinds,
           "device": torch.cuda.get_device_name() if gpu else "cpu",
           "copy_tbs": copy, "date": time.strftime("%Y-%m-%d"), "args": vars(args), "systems": []}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    for name in args.runs:
        t0 = time.perf_counter()
        system = build(name, cfg, ckpt, args, log)
        entry = {"system": name, "label": system.label, "setup_s": time.perf_counter() - t0, "rows": []}
        out["systems"].append(entry)

        def record(row, entry=entry, name=name):
            if "batch" in row and copy:
                row["floor_ms"] = 1e3 * floor_bytes(cfg, row["batch"]) / (copy * 1e12)
            entry["rows"].append(row)
            log(f"{name}: {row}")
            Path(args.out).write_text(json.dumps(out, indent=1))

        generated = name.startswith("generated")
        before = system.model.ctx.tally.snapshot() if generated else None
        workload(system, cfg, args, record)
        if generated:  # which ops of the workload ran where, and the builds in all (ahead, at calls)
            entry["ops"] = system.model.ctx.tally.since(before)
            entry["builds"] = system.model.ctx.ops.builds()
            if system.model.ctx.sections is not None:
                entry["graphs"] = system.model.ctx.sections.report()
            Path(args.out).write_text(json.dumps(out, indent=1))
        if args.profile:
            profile_step(system, cfg, args)
        del system
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="v4-flash")
    p.add_argument("--layers", type=int, default=4, help="the released model on N of its layers; 0: all")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (a tiny model, to try the script)")
    p.add_argument("--runs", type=lambda s: s.split(","), default=["generated", "reference", "transformers"])
    p.add_argument("--prompt", type=int, default=2048, help="prefill prompt tokens")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=8, help="timed decode steps a batch")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills")
    p.add_argument("--jobs", type=int, default=15, help="build processes (generated)")
    p.add_argument("--out", default="bench_model.json")
    p.add_argument("--signatures", help="generated: build this signature list first, in parallel")
    p.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="generated: find the builds by running the workload in rounds (with --signatures: "
                        "--no-ahead builds that list alone, and the rest at their calls)")
    p.add_argument("--save-signatures", help="generated: write the signatures met ahead here, each round")
    p.add_argument("--profile", type=int, default=0, metavar="BATCH",
                   help="after the workload, profile one decode step at this batch")
    p.add_argument("--report", nargs="*", help="join these JSON runs into results/NAME (no GPU needed)")
    p.add_argument("--name", default="bench_model")
    args = p.parse_args()
    if args.report:
        from benchmarks.model_report import write_report

        print(write_report([json.loads(Path(f).read_text()) for f in args.report], args.name))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
