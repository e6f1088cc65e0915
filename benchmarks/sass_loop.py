"""What a kernel's main loop executes, read from its SASS: no GPU needed. For each phase of a spec's
build at one shape (the config a user gets unless ``--config`` overrides names of it), the loop
that holds the tensor-core instructions: how many instructions one trip issues per thread, and by
opcode. A kernel that is bound by issuing instructions (the MoE's FP4 expansion, for one) runs
about as fast as that count allows, so two variants can be compared offline.

    python3 benchmarks/sass_loop.py moe_gemm_mxfp4:v4/e256_w13/decode64 [--config BM=16] [--target sm100]
    python3 benchmarks/sass_loop.py moe_gemm_mxfp4:v4/e256_w13/decode64 --out sass_loop_moe
    python3 benchmarks/sass_loop.py --file my_edit.py:moe_gemm_mxfp4_p2_kernel   # a hand-edited TileLang file

Needs nvcc and cuobjdump (the CUDA toolkit's, Triton's, or the ``nvidia-cuda-cuobjdump`` wheel's:
`codegen/tilelang_cuda/toolchain.py` looks in that order). ``--out NAME`` writes
``results/NAME.md``. A count is per thread and per trip; which threads run which part (a warp
group may run alone what the others skip) is for the reader of ``duotile show --stage cuda``.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_kernel import spec_case  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.codegen.cli import _assignment  # noqa: E402

MMA = re.compile(r"\b(HGMMA|HMMA|UTCHMMA|UTCQMMA|UTCOMMA|IMMA|QGMMA|UTC\w*MMA)\b")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
BRANCH = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function of a cuobjdump listing: its (address, instruction) pairs."""
    out = {}
    for part in re.split(r"Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [(int(a, 16), s.strip()) for a, s in INSTRUCTION.findall(part)]
    return out


def opcode(instruction: str) -> str:
    """The opcode with its modifiers, without a predicate: ``@!P0 LDS.U8 R1, [R2]`` -> ``LDS.U8``."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def main_loop(instrs: list[tuple[int, str]]) -> list[str]:
    """The body of the largest loop (a backward conditional branch to its head) that holds a
    tensor-core instruction, else of the largest loop; empty where there is no loop."""
    loops = []
    for addr, text in instrs:
        m = BRANCH.search(text)
        if m and text.startswith("@") and int(m.group(1), 16) < addr:
            head = int(m.group(1), 16)
            loops.append([s for a, s in instrs if head <= a <= addr])
    with_mma = [b for b in loops if any(MMA.search(s) for s in b)]
    return max(with_mma or loops, key=len, default=[])


def describe(name: str, instrs: list[tuple[int, str]], top: int) -> list[str]:
    body = main_loop(instrs)
    ops = collections.Counter(opcode(s) for s in body)
    mma = sum(n for op, n in ops.items() if MMA.search(op))
    lines = [f"### `{name}`", "",
             f"{len(instrs)} instructions; main loop {len(body)} a trip a thread ({mma} tensor-core instructions)", ""]
    if body:
        lines += ["| opcode | count |", "|---|---|"] + [f"| `{op}` | {n} |" for op, n in ops.most_common(top)]
    return lines + [""]


def report(arg: str, overrides: dict, target: str, top: int) -> str:
    spec, case = spec_case(arg)
    config = {**(spec.config_of(case) or {}), **overrides} if overrides else None
    kernel = codegen.compile(spec.kernel, target, config=config, constants=spec.constants_of(case))
    artifacts = kernel.artifacts(**spec.meta_inputs(case))
    lines = [f"## {arg} on {target}", "",
             f"config {artifacts[-1].meta.get('config') or config} ({'given' if config else 'as a user gets it'})", ""]
    for art in artifacts:
        sass = art.stages.get("sass")
        if sass is None:
            raise SystemExit("no SASS in the build: cuobjdump is missing (see the module docstring), or the "
                             "build came from a cache made without it (set DUOTILE_CACHE to a fresh folder)")
        for name, instrs in functions(sass).items():
            lines += describe(name, instrs, top)
        ptxas = art.meta.get("ptxas") or {}
        if ptxas:  # what ptxas reported for the phase: a spill or a stack frame costs memory traffic
            lines[-1:-1] = [f"ptxas: {ptxas.get('registers')} registers, {ptxas.get('spill_stores', 0)} bytes "
                            f"spilled, {ptxas.get('stack', 0)} bytes of stack", ""]
    return "\n".join(lines)


def report_file(arg: str, top: int) -> str:
    """The same for a TileLang source file (a prototype edited by hand): ``PATH:FUNCTION``, built
    for sm_90a with the pass options the file asks for (its ``PASS_CONFIGS``)."""
    import tempfile

    from duotile.codegen.tilelang_cuda import toolchain

    path, _, name = arg.rpartition(":")
    func, configs = toolchain.load_generated(str(Path(path).resolve()), name)
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.cubin"
        cu.write_text(toolchain.lower_to_cuda(func, "sm_90a", configs))
        toolchain.nvcc(str(cu), "sm_90a", str(cubin), "cubin", toolchain.device_flags(configs))
        sass = toolchain.sass(str(cubin))
    if sass is None:
        raise SystemExit("no cuobjdump found (see the module docstring)")
    lines = [f"## {path}:{name} on sm90", ""]
    for fn, instrs in functions(sass).items():
        lines += describe(fn, instrs, top)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", help="SPEC:SHAPE, a model shape or build case of the spec")
    p.add_argument("--file", action="append", default=[], metavar="PATH:FUNCTION",
                   help="a TileLang source file's prim_func instead (repeatable)")
    p.add_argument("--config", nargs="*", default=[], help="NAME=VALUE over the chosen config")
    p.add_argument("--target", default="sm90", choices=("sm90", "sm100"))
    p.add_argument("--top", type=int, default=16, help="opcodes listed a loop")
    p.add_argument("--out", help="write results/OUT.md")
    args = p.parse_args(argv)
    overrides = dict(map(_assignment, args.config))
    if not args.shapes and not args.file:
        p.error("name a SPEC:SHAPE or a --file PATH:FUNCTION")
    text = "\n".join([*(report(a, overrides, args.target, args.top) for a in args.shapes),
                      *(report_file(f, args.top) for f in args.file)])
    head = (f"# Main-loop instructions from SASS ({time.strftime('%Y-%m-%d')})\n\n"
            f"`python3 benchmarks/sass_loop.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n")
    print(head + text)
    if args.out:
        (Path(__file__).parent / "results" / f"{args.out}.md").write_text(head + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
