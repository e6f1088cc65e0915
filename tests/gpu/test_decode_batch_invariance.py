"""Bitwise batch invariance on the GPU, at the model's decode shapes, with the build a user gets (no
config given): every spec whose kernel declares a batch dimension, at each decode shape family of
both models (``v41/csa_r2_topk640``: its decode1 ... decode64 shapes are one family), runs two rows
alone, checks them against the reference, then runs each inside batches of 2, 16 and 64 of random
other rows at a random place and compares bit for bit (``kernels_spec/invariance.py``).

One build serves every batch size of a dynamic batch dimension, so this is also the check that the
config a user gets does not change with the batch. Build ahead with
``scripts/gpu_signatures.py invariance`` (the builds are one per family and batch bucket)."""

from __future__ import annotations

import contextlib
import fcntl

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import CapacityError, UnsupportedError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.invariance import NOT_ROW_WISE, check_rows

pytestmark = pytest.mark.gpu

SPECS = load_all()
BATCHES = (2, 16, 64)
KERNELS: dict = {}
# The check draws two batches of 64 rows; at a 1M context the indexer's keys are up to 32 GiB of
# them. Eight workers share one GPU, so a case above this size runs while no other such case does.
HEAVY_BYTES = 4 << 30
HEAVY_LOCK = "/tmp/duotile-gpu-heavy-case.lock"


def invariance_cases() -> list[tuple[str, str, dict]]:
    """(spec, family, case): each decode shape family's largest-batch case, its pinned config left out."""
    out = []
    for name, spec in sorted(SPECS.items()):
        if spec.kernel.batch_dim is None or name in NOT_ROW_WISE:
            continue
        families: dict[str, dict] = {}
        for label, case in spec.model_shapes.items():
            family, last = label.rsplit("/", 1)
            if last.startswith("decode"):
                families.setdefault(family, case)
        for family, case in families.items():
            out.append((name, family, {k: v for k, v in case.items() if k not in ("config", "config_for")}))
    return out


CASES = invariance_cases()


def user_kernel(spec, case):
    key = (spec.name, tuple(sorted(spec.constants_of(case).items())))
    if key not in KERNELS:
        KERNELS[key] = codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case))
    return KERNELS[key]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    torch.cuda.empty_cache()


def draw_bytes(spec, case) -> int:
    """The bytes of check_rows' two draws at the largest batch (their shapes, on the meta device)."""
    inputs = spec.make_inputs({**case, spec.kernel.batch_dim: max(BATCHES)}, torch.device("meta"), 0)
    return 2 * sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def one_heavy_case_at_a_time(nbytes: int):
    if nbytes <= HEAVY_BYTES:
        yield
        return
    with open(HEAVY_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.mark.parametrize("name,family,case", CASES, ids=[f"{n}:{f}" for n, f, _ in CASES])
def test_a_rows_outputs_do_not_depend_on_the_batch_around_it(name, family, case):
    spec = SPECS[name]
    kernel = user_kernel(spec, case)

    def run(**inputs):
        kernel(**inputs)
        torch.cuda.synchronize()

    try:
        with one_heavy_case_at_a_time(draw_bytes(spec, case)):
            lines = check_rows(spec, case, run, torch.device("cuda"), seed=11, batches=BATCHES)
    except (CapacityError, UnsupportedError) as err:
        pytest.xfail(f"{name} {family}: no build at the user's config: {type(err).__name__}: {err}")
    print(f"{name:28s} {family:32s} " + "; ".join(lines))


# A decode step pads every query's index list to the step's longest with -1 (the runtime's V4 HCA
# layers list every compressed row a query sees: their lengths differ by sequence), and the split
# kernels cut a list into SPLIT ranges of its padded length: the same live slots then fall into other
# ranges, and the ranges' FP32 partial sums differ in their last bits. On an H100 (2026-12-06) a row
# of 128 window slots and 1,000 compressed rows, padded to 3 lengths, gave 3 different LSEs (up to
# 3e-5 apart) and, at D 512, a different output. The interpreter does not show it. Until the kernels
# given each query's own length (``lens``, what the runtime passes for V4's HCA layers) the ranges cut
# that instead, and the bits must not move; without it they still follow the padding (the strict xfail).
# (sparse_mqa_decode and its V4.1 form share the split, decode(), but V4.1's lists have one length.)
PADDED = [("sparse_mqa_decode_fp8_nope", {"B": 1, "H": 64, "D": 512, "W": 128, "N": 9000, "L": 9128}, 1000)]


@pytest.mark.xfail(strict=True, reason="without lens the split ranges follow the padded list length")
@pytest.mark.parametrize("name,case,live", PADDED, ids=[p[0] for p in PADDED])
def test_a_rows_bits_follow_how_far_its_list_is_padded_without_its_length(name, case, live):
    padded_runs_agree(name, case, live, with_lens=False)


@pytest.mark.parametrize("name,case,live", PADDED, ids=[p[0] for p in PADDED])
def test_a_rows_bits_do_not_depend_on_how_far_its_list_is_padded_given_its_length(name, case, live):
    padded_runs_agree(name, case, live, with_lens=True)


def padded_runs_agree(name, case, live, with_lens):
    spec = SPECS[name]
    dev = torch.device("cuda")
    inputs = spec.make_inputs(case, dev, seed=5)
    kernel = user_kernel(spec, case)
    idx = inputs["idx"].clone()
    idx[:, 128:] = -1
    idx[:, 128:128 + live] = torch.arange(live, device=dev, dtype=idx.dtype)
    results = []
    for length in (128 + live, 128 + 2 * live + 64, case["L"]):
        run = {**inputs, "idx": idx[:, :length].contiguous(), "o": torch.empty_like(inputs["o"]),
               "lse": torch.empty(1, case["H"], device=dev)}
        if with_lens:  # the window's ring_slots part, then the live rows
            run["lens"] = torch.full((1,), 128 + live, dtype=torch.int32, device=dev)
        kernel(**run)
        torch.cuda.synchronize()
        results.append((run["o"], run["lse"]))
    for o, lse in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(lse, results[0][1])
