"""``duotile list``, ``duotile build`` and ``duotile show``."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from ..kernels_spec.registry import load_all
from .build import cache_root
from .driver import build_case, generate_case
from .target import target_names

BUILD_TARGETS = ("sm90", "sm100", "ascend950")


def register(sub) -> None:
    p = sub.add_parser("list", help="list the kernel specs")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("build", help="generate and compile kernels for targets")
    p.add_argument("--target", default=",".join(BUILD_TARGETS), help="comma-separated: " + ", ".join(target_names()))
    p.add_argument("--kernel", default=None, help="only this kernel (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="parallel builds (threads)")
    p.add_argument("--no-cache", action="store_true", help="rebuild even when a cached artifact exists")
    p.add_argument("--no-tuned", action="store_true", help="ignore tuned configs from `duotile tune`")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("show", help="print one stage of a kernel's build")
    p.add_argument("kernel")
    p.add_argument("--target", default="sm90")
    p.add_argument("--stage", default="tilelang", help="ir | tilelang | cuda | ptx | sass | ascend")
    p.add_argument("--case", default=None, help="which build case (default: the first)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=VALUE",
                   help="override a tunable or target knob, e.g. --config BN=64 --config overlap=true")
    p.set_defaults(func=cmd_show)


def cmd_list(args) -> int:
    rows = [("kernel", "tensors", "tunables", "batch dim", "build cases")]
    for name, spec in sorted(load_all().items()):
        k = spec.kernel
        rows.append((name, ", ".join(k.tensors), ", ".join(f"{t}={s.values()}" for t, s in k.tunables.items()),
                     k.batch_dim or "-", ", ".join(spec.build_cases)))
    _table(rows)
    return 0


def cmd_build(args) -> int:
    specs = load_all()
    if args.kernel and args.kernel not in specs:
        print(f"duotile: no kernel named {args.kernel!r}; known: {', '.join(sorted(specs))}", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    unknown = [t for t in targets if t not in target_names()]
    if unknown:
        print(f"duotile: unknown target(s) {', '.join(unknown)}; known: {', '.join(target_names())}", file=sys.stderr)
        return 2
    jobs = [(spec, cname, case, t) for name, spec in sorted(specs.items()) if not args.kernel or name == args.kernel
            for cname, case in spec.build_cases.items() for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: build_case(*j, use_cache=not args.no_cache, use_tuned=not args.no_tuned),
                                jobs))
    rows = [("kernel", "case", "target", "status", "lines", "seconds", "cache", "config", "note")]
    for r in results:
        note = r.error.splitlines()[0][:110] if r.error else _note(r)
        cache = r.artifact.meta.get("cache", "") if r.artifact else ""
        source = r.artifact.meta.get("config_source", "") if r.artifact else ""
        status = "ok" if r.ok else ("too big" if r.rejected else "FAIL")
        rows.append((r.spec, r.case, r.target, status, str(r.lines), f"{r.seconds:.1f}", cache, source, note))
    _table(rows)
    failed = sum(not r.ok and not r.rejected for r in results)
    rejected = sum(r.rejected for r in results)
    print(f"\n{len(results) - failed - rejected} built, {rejected} rejected by a capacity check (the config does "
          f"not fit that target's memories; see the note), {failed} failed; artifacts under {cache_root()}")
    return 1 if failed else 0


def _note(r) -> str:
    a = r.artifact
    if "sass" in a.stages or "ptx" in a.stages:
        from .tilelang_cuda.inspect import instruction_summary

        return instruction_summary(a)
    if "ascend" in a.stages:
        return f"ascend C++ {len(a.stages['ascend'].splitlines())} lines"
    return ""


def cmd_show(args) -> int:
    specs = load_all()
    spec = specs.get(args.kernel)
    if spec is None:
        print(f"duotile: no kernel named {args.kernel!r}; known: {', '.join(sorted(specs))}", file=sys.stderr)
        return 2
    cname = args.case or next(iter(spec.build_cases))
    if cname not in spec.build_cases:
        print(f"duotile: {args.kernel} has no case {cname!r}; cases: {', '.join(spec.build_cases)}", file=sys.stderr)
        return 2
    try:
        config = dict(_assignment(text) for text in args.config)
    except ValueError as err:
        print(f"duotile: {err}", file=sys.stderr)
        return 2
    artifacts = _stages(spec, cname, args.target, config, args.stage)
    if isinstance(artifacts, str):
        print(f"duotile: {artifacts}", file=sys.stderr)
        return 1
    if args.stage not in artifacts[0].stages:
        print(f"duotile: target {args.target} has no stage {args.stage!r}; it has: "
              f"{', '.join(sorted(artifacts[0].stages))}", file=sys.stderr)
        return 2
    for i, artifact in enumerate(artifacts):  # a kernel of several phases: each launch in turn
        if len(artifacts) > 1:
            print(f"{'' if i == 0 else chr(10)}# ---- phase {i} of {len(artifacts)}: {artifact.kernel} ----")
        print(artifact.stages[args.stage], end="")
    return 0


def _stages(spec, cname: str, target: str, config: dict, stage: str):
    """The artifacts holding ``stage``, or an error message. Where the build fails, the generated
    stages (Tile IR, TileLang source) still print: they come from generation alone."""
    case = spec.build_cases[cname]
    r = build_case(spec, cname, case, target, config=config or None)
    if r.ok:
        return r.artifacts
    try:
        generated = generate_case(spec, case, target, config=config or None)
    except Exception:  # generation itself failed: the build's error says why
        return f"build failed: {r.error}"
    return generated if stage in generated[0].stages else f"build failed: {r.error}"


def _assignment(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` with VALUE read as an int, a float, a boolean or else text."""
    if "=" not in text:
        raise ValueError(f"--config expects NAME=VALUE, got {text!r}")
    name, value = (part.strip() for part in text.split("=", 1))
    for conv in (int, float):
        try:
            return name, conv(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(value.lower(), value)


def _table(rows) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
