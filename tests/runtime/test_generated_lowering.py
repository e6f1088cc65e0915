"""Every kernel call the generated runtime makes on the tiny models lowers for the GPU targets with
the config a user gets. The runtime tests run the interpreter on a CPU, which takes any tile; the
GPU generators do not (a 4-head decode's 4-row accumulator cannot be split over sm90's warps), so
each call signature seen here is also specialised and generated for sm90 and sm100."""

from __future__ import annotations

import pytest
import torch

from duotile.codegen.choose_config import choose_config
from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.runtime.engine import LLM
from duotile.runtime.sampler import SamplingParams


def _signatures(llm: LLM) -> list[tuple[str, object, dict, dict]]:
    """(spec, kernel, meta tensors, constants) for every build the engine's kernels made: one call
    of each signature with its dynamic sizes left out (a GPU target builds those once too)."""
    out, keys = [], set()
    for kernel in llm.model.ctx.ops._kernels.values():
        for seen in kernel._calls:
            with torch.device("meta"):
                tensors = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype, _ in seen}
            consts = tuple(sorted((kernel.constants or {}).items()))
            key = (kernel.kernel.name, kernel.kernel.bind(tensors).key(), consts)
            if key not in keys:
                keys.add(key)
                out.append((kernel.kernel.name, kernel.kernel, tensors, kernel.constants or {}))
    return out


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_every_call_of_the_generated_runtime_lowers_for_the_gpu_targets(ckpt_dir, name):
    llm = LLM(ckpt_dir(name), kernels="generated")
    llm.generate([[3, 1, 4, 1, 5], [2, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    calls = _signatures(llm)
    assert {spec for spec, *_ in calls} >= {"sparse_mqa_decode", "rmsnorm", "topk", "moe_gemm_mxfp4"}
    failed = []
    for target in ("sm90", "sm100"):
        tgt = get_target(target)
        for spec, kernel, tensors, constants in calls:
            sig = kernel.bind(tensors)
            try:
                config = choose_config(kernel, target, sig, constants)
                phases, knobs = specialize_phases(kernel, sig, tgt, config, constants)
                for m in phases:
                    tgt.generate(m, tgt.phase_knobs(m, knobs))
            except Exception as err:  # noqa: BLE001 - every failing call is listed
                failed.append(f"{target} {spec} {dict(sig.sizes) if hasattr(sig, 'sizes') else ''}: "
                              f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    assert not failed, "\n".join(failed)
