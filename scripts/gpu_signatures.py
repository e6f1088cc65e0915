"""Lists the build signatures a GPU test run will meet, for ``duotile build --signatures`` to build
ahead, on any machine with nvcc, into caches the GPU machine then reads (a GPU test otherwise
spends most of its time compiling, one build at a time):

    python3 scripts/gpu_signatures.py sweep gemm_f32 quantize --out sigs.json   # the shape sweep's cases
    python3 scripts/gpu_signatures.py runtime v41-tiny v4-tiny --out sigs.json  # the runtime's GPU tests
    python3 scripts/gpu_signatures.py invariance --out sigs.json          # the decode batch-invariance test

``sweep`` lists what ``tests/gpu/test_shape_sweep.py`` builds for the named specs (every model
shape and random draw at ``DUOTILE_SWEEP_SEED``); ``invariance`` what
``tests/gpu/test_decode_batch_invariance.py`` builds (each family at every batch it runs);
``runtime`` runs the per-op agreement test's generation of each tiny model on the interpreter
(minutes on a CPU) and lists its kernels' calls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duotile.codegen import prebuild  # noqa: E402


def sweep(names: list[str]) -> list[prebuild.Signature]:
    from tests.gpu.test_shape_sweep import CASES, SPECS

    unknown = set(names) - set(SPECS)
    if unknown:
        raise SystemExit(f"unknown spec(s): {', '.join(sorted(unknown))}")
    out = []
    for name, _label, case, _seed in CASES:
        if names and name not in names:
            continue
        spec = SPECS[name]
        out.append(prebuild.Signature.of(name, spec.meta_inputs(case), spec.constants_of(case)))
    return list(dict.fromkeys(out))


def invariance(names: list[str]) -> list[prebuild.Signature]:
    from tests.gpu.test_decode_batch_invariance import BATCHES, CASES, SPECS

    out = []
    for name, _family, case in CASES:
        if names and name not in names:
            continue
        spec = SPECS[name]
        for n in (1, *BATCHES):  # a bucketed batch dimension builds once a bucket
            batch = {**case, spec.kernel.batch_dim: n}
            out.append(prebuild.Signature.of(name, spec.meta_inputs(batch), spec.constants_of(batch)))
    keys = {}  # calls that differ only in a dynamic size share a build
    for sig in out:
        keys.setdefault(prebuild.key_of(sig), sig)
    return list(keys.values())


def runtime(models: list[str]) -> list[prebuild.Signature]:
    import torch

    from duotile.runtime.engine import LLM
    from duotile.runtime.presets import get_preset
    from duotile.runtime.weights import write_random_checkpoint
    from tests.runtime.test_generated import each_op_agrees

    torch.set_num_threads(1)
    out = []
    for name in models:  # the checkpoint the tests write (conftest.py: seed 1234)
        ckpt = write_random_checkpoint(get_preset(name), Path(tempfile.mkdtemp()) / name, seed=1234)
        # test_gpu.py also runs V4.1 with wo_a on FP8 codes (fused into the decode kernels' output)
        for fp8_wo_a in (False, True) if name == "v41-tiny" else (False,):
            llm = LLM(str(ckpt), kernels="generated", fp8_wo_a=fp8_wo_a)
            each_op_agrees(llm, name)
            out += llm.model.ctx.ops.signatures()
    return list(dict.fromkeys(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("sweep", "invariance", "runtime"))
    p.add_argument("names", nargs="*", help="specs (sweep, invariance; default: all) or tiny presets (runtime)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args()
    if args.what == "runtime":
        sigs = runtime(args.names or ["v41-tiny", "v4-tiny"])
    else:
        sigs = (sweep if args.what == "sweep" else invariance)(args.names)
    prebuild.save(sigs, args.out)
    print(f"{len(sigs)} signatures written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
