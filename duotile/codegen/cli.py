"""``duotile list``, ``duotile build`` and ``duotile show``."""

from __future__ import annotations

import shutil
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

from ..kernels_spec.registry import load_all
from .build import cache_root
from .driver import build_case, generate_case
from .target import get_target, target_names

BUILD_TARGETS = ("sm90", "sm100", "ascend950")


def register(sub) -> None:
    known = ", ".join(target_names())
    p = sub.add_parser("list", help="list the kernel specs",
                       description="The kernel specs: their tensors, tunables, batch dimension and build cases.")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("build", help="generate and compile kernels for targets",
                       description="Generate and compile every build case of the kernels for the targets; one "
                       f"row per kernel x case x target. Artifacts are cached under {cache_root()} "
                       "($DUOTILE_CACHE).")
    p.add_argument("--target", default=",".join(BUILD_TARGETS), metavar="T[,T...]",
                   help=f"comma-separated targets, of: {known}")
    p.add_argument("--kernel", default=None, metavar="NAME", help="only this kernel (default: all; see `duotile list`)")
    p.add_argument("--jobs", type=int, default=2, metavar="N",
                   help="parallel builds: threads, or processes with --signatures (default: %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="rebuild even when a cached artifact exists")
    p.add_argument("--no-tuned", action="store_true", help="ignore tuned configs from `duotile tune`")
    p.add_argument("--model", default=None, choices=("v41-flash", "v4-flash"),
                   help="build every shape this model needs (the specs' model shapes) instead of the build cases")
    p.add_argument("--signatures", default=None, metavar="FILE",
                   help="build the call signatures listed in FILE (`duotile generate --kernels generated "
                        "--save-builds FILE` writes one) with the config a user gets, in --jobs processes, "
                        "into the artifact cache a later run reads (default: the build cases)")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("show", help="print one stage of a kernel's build",
                       description="Print one stage of a kernel's build for a target and config. Where the "
                       "toolchain fails, the generated stages (ir, tilelang) still print.")
    p.add_argument("kernel", help="a kernel spec name (see `duotile list`)")
    p.add_argument("--target", default="sm90", choices=target_names(), help="the target to build for")
    p.add_argument("--stage", default="tilelang", metavar="STAGE",
                   help="ir | tilelang | cuda | ptx | sass | ascend (which exist depends on the target; sass "
                        "needs cuobjdump)")
    p.add_argument("--case", default=None, metavar="CASE",
                   help="a build case or test case of the spec (default: the first build case)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=VALUE",
                   help="override a tunable or target knob, e.g. --config BN=64 --config overlap=true "
                        "(repeatable)")
    p.set_defaults(func=cmd_show)


def cmd_list(args) -> int:
    rows = [("kernel", "tensors", "tunables", "batch dim", "build cases")]
    for name, spec in sorted(load_all().items()):
        k = spec.kernel
        rows.append((name, ", ".join(k.tensors), ", ".join(f"{t}={s.values()}" for t, s in k.tunables.items()),
                     k.batch_dim or "-", ", ".join(spec.build_cases)))
    _table(rows)
    return 0


def _spec(name: str):
    specs = load_all()
    if name not in specs:
        raise KeyError(f"no kernel named {name!r}; known: {', '.join(sorted(specs))}")
    return specs[name]


def cmd_build(args) -> int:
    specs = load_all()
    if args.kernel:
        _spec(args.kernel)
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    unknown = [t for t in targets if t not in target_names()]
    if unknown or not targets:
        raise KeyError(f"unknown target(s) {', '.join(unknown) or repr(args.target)}; known: "
                       f"{', '.join(target_names())}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be 1 or more, got {args.jobs}")
    if args.signatures:
        return _build_signatures(args.signatures, targets, args.jobs)
    jobs = [(spec, cname, case, t) for name, spec in sorted(specs.items()) if not args.kernel or name == args.kernel
            for cname, case in (spec.model_cases(args.model) if args.model else spec.build_cases).items()
            for t in targets]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda j: build_case(*j, use_cache=not args.no_cache, use_tuned=not args.no_tuned),
                                jobs))
    rows = [("kernel", "case", "target", "status", "lines", "seconds", "cache", "config", "note")]
    notes: list[tuple[str, str]] = []  # (row, whole note) of the notes too long for the column
    for r in results:
        note = r.error if r.error else _note(r)
        if len(note) > NOTE_WIDTH or "\n" in note:
            notes.append((f"{r.spec} {r.case} {r.target}", note))
            kind = note.split(":", 1)[0] if r.error else ""
            note = f"[{len(notes)}] {kind}".rstrip()
        cache = r.artifact.meta.get("cache", "") if r.artifact else ""
        source = r.artifact.meta.get("config_source", "") if r.artifact else ""
        status = "ok" if r.ok else ("too big" if r.rejected else ("refused" if r.unsupported else "FAIL"))
        rows.append((r.spec, r.case, r.target, status, str(r.lines), f"{r.seconds:.1f}", cache, source, note))
    _table(rows)
    if notes:
        print("\nnotes:")
        print(_numbered(notes))
    rejected = sum(r.rejected for r in results)
    refused = sum(r.unsupported for r in results)
    failed = sum(not r.ok for r in results) - rejected - refused
    print(f"\n{len(results) - failed - rejected - refused} built, {rejected} rejected by a capacity check (the config "
          f"does not fit that target's memories), {refused} refused by the target (an op it does not lower, named in "
          f"the note), {failed} failed; artifacts under {cache_root()}")
    return 1 if failed else 0


def _build_signatures(path: str, targets: list[str], jobs: int) -> int:
    """``duotile build --signatures FILE``: each listed signature for each target, a row each."""
    from . import prebuild

    sigs = prebuild.load(path)
    rows = [("kernel", "shapes", "target", "status", "seconds", "cache", "config / error")]
    failed = 0
    for target in targets:
        for r in prebuild.prebuild(sigs, target, jobs):
            shapes = " ".join(f"{n}{list(s)}" for n, s, _ in r.signature.tensors)
            detail = " ".join(f"{k}={v}" for k, v in r.config.items()) if r.ok else r.error
            rows.append((r.signature.spec, shapes[:60], target, "ok" if r.ok else "FAIL", f"{r.seconds:.1f}",
                         r.cache, detail[:NOTE_WIDTH]))
            failed += not r.ok
    _table(rows)
    hits = sum(row[5] == "hit" for row in rows[1:])
    print(f"\n{len(rows) - 1 - failed} built ({hits} found in the cache), {failed} failed ({len(sigs)} signatures "
          f"from {path}); artifacts under {cache_root()}")
    return 1 if failed else 0


NOTE_WIDTH = 64  # longer notes get a number in the table and are printed whole under it


def _numbered(notes: list[tuple[str, str]]) -> str:
    """``[n] kernel case target: note``, each line of a note wrapped to the terminal, never cut."""
    width = max(60, min(shutil.get_terminal_size((120, 24)).columns, 120))
    out = []
    for i, (row, text) in enumerate(notes, 1):
        head, indent = f"  [{i}] {row}: ", " " * len(f"  [{i}] ")
        lines = [line for line in text.splitlines() if line.strip()] or [""]
        for j, line in enumerate(lines):
            out.append(textwrap.fill(line, width=width, initial_indent=head if j == 0 else indent,
                                     subsequent_indent=indent, break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


def _note(r) -> str:
    a = r.artifact
    if "sass" in a.stages or "ptx" in a.stages:
        from .tilelang_cuda.inspect import instruction_summary

        return instruction_summary(a)
    if "ascend" in a.stages:
        return f"ascend C++ {len(a.stages['ascend'].splitlines())} lines"
    return ""


def cmd_show(args) -> int:
    spec = _spec(args.kernel)
    cname = args.case or next(iter(spec.build_cases))
    case = spec.build_cases.get(cname, spec.cases.get(cname, spec.model_shapes.get(cname)))
    if case is None:
        models = sorted(spec.model_shapes)
        raise KeyError(f"{args.kernel} has no case {cname!r}; build cases: {', '.join(spec.build_cases)}; "
                       f"test cases: {', '.join(spec.cases) or '-'}; model shapes: "
                       f"{', '.join(models[:4]) + (f' ... ({len(models)})' if len(models) > 4 else '') or '-'}")
    tgt = get_target(args.target)
    if args.stage not in tgt.stages:
        raise KeyError(f"target {args.target} has no stage {args.stage!r}; it has: {', '.join(tgt.stages)}")
    config = dict(_assignment(text) for text in args.config)
    _check_config(spec, tgt, config)
    artifacts = _stages(spec, cname, case, args.target, config, args.stage)
    if isinstance(artifacts, str):  # the toolchain failed: not a mistake on the command line
        print(f"duotile show: {artifacts}", file=sys.stderr)
        return 1
    if args.stage not in artifacts[0].stages:
        why = " (no cuobjdump on this machine)" if args.stage == "sass" else ""
        raise KeyError(f"target {args.target} has no stage {args.stage!r} here{why}; it has: "
                       f"{', '.join(sorted(artifacts[0].stages))}")
    for i, artifact in enumerate(artifacts):  # a kernel of several phases: each launch in turn
        if len(artifacts) > 1:
            print(f"{'' if i == 0 else chr(10)}# ---- phase {i} of {len(artifacts)}: {artifact.kernel} ----")
        print(artifact.stages[args.stage], end="")
    return 0


def _check_config(spec, tgt, config: dict) -> None:
    """Every ``--config`` name is a tunable of the kernel or a knob of the target."""
    tunables, knobs = list(spec.kernel.tunables), list(tgt.knobs)
    for name in config:
        if name not in tunables and name not in knobs:
            raise KeyError(f"--config {name}: {spec.name} has no tunable {name!r} and {tgt.name} no such knob; "
                           f"tunables: {', '.join(tunables) or '-'}; {tgt.name} knobs: {', '.join(knobs) or '-'}")


def _stages(spec, cname: str, case: dict, target: str, config: dict, stage: str):
    """The artifacts holding ``stage``, or an error message. Where the build fails, the generated
    stages (Tile IR, TileLang source) still print: they come from generation alone."""
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
