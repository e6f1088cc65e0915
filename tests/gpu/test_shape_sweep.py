"""Every kernel spec's sm90 build, at the config a user gets (``codegen.compile(kernel, "sm90")``
with no config: a tuned one where the tuning cache has it, else the kernel's defaults), against
its PyTorch reference at every model shape (``Spec.model_shapes``, their pinned configs left
out) and at seeded random shapes of the spec's sweep: small, ragged, prime and large. Each input
lies between fences of 0xFF bytes (``fences.py``): a read past a tensor meets NaN, a write past
one is named.

Seeds: random case i of a spec is drawn from ``random.Random(BASE * 1000 + i)`` and its inputs
made with the same seed; BASE is 0 unless ``DUOTILE_SWEEP_SEED`` sets it (every xdist worker must
collect the same cases, so it is never drawn from the clock). A failure names the spec, the case,
the config and the seed; each case logs one line (``-s`` or ``-rA`` shows them).

One build serves each distinct call signature (the compiled kernel's own cache), so the number of
builds is the number of distinct shapes: about 300 model shapes and ``RANDOM_PER_SPEC`` random
ones per spec. Run on the H200 with 8 xdist workers (``benchmarks/gpu_run.sh tests``).

A run cut short (a time limit) goes on where it stopped: ``DUOTILE_SWEEP_SKIP`` names the logs
(``DUOTILE_SWEEP_LOG`` files, comma-separated) whose matched cases are left out; the cases it
failed, and those it never reached, run. Only for logs of the same code and seed."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import CapacityError, UnsupportedError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import mismatch

from .fences import Fenced

pytestmark = pytest.mark.gpu

BASE = int(os.environ.get("DUOTILE_SWEEP_SEED", "0"))
RANDOM_PER_SPEC = 16  # half small (the interpreter's bounds), half large
SPECS = load_all()
PINNED = ("config", "config_for")  # the user's build takes none


def sweep_cases() -> list[tuple[str, str, dict, int]]:
    """(spec, label, case, seed) for every model shape and random draw."""
    out = []
    for name, spec in sorted(SPECS.items()):
        for i, (shape, case) in enumerate(spec.model_shapes.items()):
            out.append((name, shape, {k: v for k, v in case.items() if k not in PINNED}, BASE * 1000 + i))
        for i in range(RANDOM_PER_SPEC):
            seed = BASE * 1000 + i
            large = i >= RANDOM_PER_SPEC // 2
            case = {k: v for k, v in spec.random_case(random.Random(seed), large=large).items() if k not in PINNED}
            out.append((name, f"random{'-large' if large else ''}-seed{seed}", case, seed))
    return out


def matched_in(logs: str) -> set[tuple[str, str]]:
    """(spec, label) of every case the sweep logs ``logs`` (comma-separated paths) record as
    matched: a line ``spec label {case} config {...}: ok (seed N)``."""
    done = set()
    for path in filter(None, logs.split(",")):
        for line in Path(path).read_text().splitlines():
            if line.rstrip().endswith(")") and ": ok (seed " in line:
                name, label = line.split()[:2]
                done.add((name, label))
    return done


CASES = [c for c in sweep_cases() if (c[0], c[1]) not in matched_in(os.environ.get("DUOTILE_SWEEP_SKIP", ""))]
KERNELS: dict = {}


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Eight workers share one GPU: each gives its cached blocks back after a case."""
    yield
    torch.cuda.empty_cache()


def user_kernel(spec, case):
    """One compiled kernel per spec and constants: it builds once per call signature."""
    key = (spec.name, tuple(sorted(spec.constants_of(case).items())))
    if key not in KERNELS:
        KERNELS[key] = codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case))
    return KERNELS[key]


@pytest.fixture(scope="module", autouse=True)
def _announce_seed(request):
    line = (f"shape sweep: DUOTILE_SWEEP_SEED={BASE} ({len(CASES)} cases: "
            f"{sum(1 for c in CASES if not c[1].startswith('random'))} model shapes, "
            f"{RANDOM_PER_SPEC} random per spec)")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    print(line)


@pytest.mark.parametrize("name,label,case,seed", CASES, ids=[f"{n}:{lbl}" for n, lbl, _, _ in CASES])
def test_user_build_matches_reference(name, label, case, seed):
    spec = SPECS[name]
    kernel = user_kernel(spec, case)
    fenced = Fenced(spec.make_inputs(case, torch.device("cuda"), seed))
    inputs = fenced.inputs
    where = f"{name} {label} at {case} (seed {seed})"
    try:
        config = kernel.artifacts(**inputs)[0].meta.get("config")
    except (CapacityError, UnsupportedError) as err:  # the default config does not fit this shape
        pytest.xfail(f"{where}: no build at the user's config: {type(err).__name__}: {err}")
    kernel(**inputs)
    torch.cuda.synchronize()
    off = "; ".join(fenced.breaches()) or mismatch(spec, case, inputs, spec.run_reference(inputs, case))
    line = f"{name:16s} {label:36s} {case} config {config}: {'ok' if off is None else 'WRONG'}"
    print(line)
    if os.environ.get("DUOTILE_SWEEP_LOG"):
        with open(os.environ["DUOTILE_SWEEP_LOG"], "a") as log:  # one write a line: workers interleave whole lines
            log.write(f"{line} (seed {seed}){'' if off is None else ': ' + off}\n")
    assert off is None, f"{where}, config {config}: {off}"


def test_reference_in_parts_is_the_whole_reference():
    spec = SPECS["flash_attention"]
    case = {"B": 2, "H": 3, "S": 70, "D": 64, "causal": True}
    inputs = spec.make_inputs(case, torch.device("cuda"), 1)
    whole, parts = spec.run_reference(inputs, case, whole=True), spec.run_reference(inputs, case)
    for o in spec.outputs:  # the same math; cuBLAS may sum a batched einsum in another order
        atol, rtol = spec.tolerance(case, o)
        torch.testing.assert_close(parts[o], whole[o].float(), atol=atol / 4, rtol=rtol / 4, msg=o)


def test_sweep_covers_every_spec_and_its_model_shapes():
    """The sweep's cases, those a resumed run leaves out (``DUOTILE_SWEEP_SKIP``) included."""
    every = sweep_cases()
    for name, spec in SPECS.items():
        labels = [lbl for n, lbl, _, _ in every if n == name]
        assert set(spec.model_shapes) <= set(labels) and sum(lbl.startswith("random") for lbl in labels) == \
            RANDOM_PER_SPEC
    assert not any(k in case for _, _, case, _ in every for k in PINNED)
