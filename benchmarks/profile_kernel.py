"""One launch each of duotile kernels and their torch peers, for Nsight Compute. Usage on the H200:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... -o $OUT/prof \\
        python benchmarks/profile_kernel.py gemm:v41/wq_b/prefill4096 rmsnorm:v41/hidden/prefill4096 \\
        [--config NAME=VALUE ...] [--no-peer]

Each argument is ``SPEC:SHAPE``, a spec and one of its model shapes (``duotile list`` names the
specs; ``Spec.model_cases`` the shapes) or one of its build cases. The kernel is built as a user
gets it (no config given: ``codegen.compile`` chooses one) unless ``--config`` overrides names of
it. Every kernel and peer is run and checked once outside the profiled range, then once inside it
(``cudaProfilerStart`` / ``Stop``), so the report holds exactly the launches of interest, in the
order of the arguments, each of ours followed by its peer's. ``--build-only N`` builds them in N
processes and exits: run it before ncu, whose injection would otherwise ride along every build.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import spec_peer  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.codegen.choose_config import explain_choice  # noqa: E402
from duotile.codegen.cli import _assignment  # noqa: E402
from duotile.kernels_spec.compare import mismatch  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402


def spec_case(arg: str):
    """(spec, case) of ``SPEC:SHAPE``: a model shape or a build case of the spec."""
    name, _, shape = arg.partition(":")
    spec = load_all()[name]
    cases = {**spec.build_cases, **spec.model_cases()}
    if shape not in cases:
        raise SystemExit(f"{name} has no shape {shape!r}; model shapes: {', '.join(spec.model_cases())}")
    return spec, cases[shape]


def prepare(arg: str, overrides: dict):
    """(label, our call, the peer's call or None) for ``SPEC:SHAPE``, each run and checked once."""
    spec, case = spec_case(arg)
    config = ({**(spec.config_of(case, "sm90") or {}), **overrides} or None) if overrides else None
    kernel = codegen.compile(spec.kernel, "sm90", config=config, constants=spec.constants_of(case))
    inputs = spec.make_inputs(case, torch.device("cuda"), 0)
    kernel(**inputs)
    torch.cuda.synchronize()
    off = mismatch(spec, case, inputs, spec.run_reference(inputs, case))
    sig = spec.kernel.bind(inputs)
    chosen, source, _ = explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))
    print(f"{arg}: config ({'given' if config else source}) {config or chosen}; "
          f"{'matches its reference' if off is None else 'MISMATCH ' + str(off)}", flush=True)
    try:
        label, peer = spec_peer(spec.name, inputs, config or chosen or {}, causal=bool(case.get("causal", False)))
        peer()
        print(f"  peer: {label}", flush=True)
    except KeyError:
        peer = None
    return arg, (lambda: kernel(**inputs)), peer


def build_only(shapes: list[str], jobs: int) -> int:
    from duotile.codegen import prebuild

    sigs = [prebuild.Signature.of(spec.name, spec.meta_inputs(case), spec.constants_of(case))
            for spec, case in map(spec_case, shapes)]
    for out in prebuild.prebuild(sigs, "sm90", jobs=jobs):
        print(f"{out.signature.spec}: {'built' if out.ok else out.error} in {out.seconds:.0f} s", flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", help="SPEC:SHAPE, e.g. gemm:v41/wq_b/prefill4096")
    p.add_argument("--config", nargs="*", default=[], help="NAME=VALUE over the chosen config (every shape)")
    p.add_argument("--no-peer", action="store_true", help="profile ours only")
    p.add_argument("--build-only", type=int, default=0, metavar="JOBS",
                   help="build every shape (the config a user gets) in JOBS processes, then exit")
    args = p.parse_args(argv)
    overrides = dict(map(_assignment, args.config))
    if args.build_only:
        return build_only(args.shapes, args.build_only)
    runs = [prepare(a, overrides) for a in args.shapes]
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, ours, peer in runs:
        ours()
        if peer is not None and not args.no_peer:
            peer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    sys.exit(main())
