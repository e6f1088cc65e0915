"""mqa_decode on the H200 as a user gets it (no config given) at the model's decode shape, 64 heads
x 512: the CSA (640), window-multiple (704, 1,024) and a seeded sample of row counts from 1 to
9,000, at batches 1, 16 and 64, all from one dynamic-rows build; and bitwise batch invariance."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec.registry import get

pytestmark = pytest.mark.gpu
SEED = 20261201


def _rows():
    rng = random.Random(SEED)
    return [640, 704, 1024] + sorted(rng.sample(range(1, 9001), 50))


def _check(spec, case, inputs):
    want = spec.run_reference(inputs, case)["o"].float()
    got = inputs["o"].float()
    bad = ~((got - want).abs() <= spec.allowed_error(case, "o", want, inputs).to(got.device))
    return int(bad.sum()), (got - want).abs().max().item()


def test_every_row_count_from_one_build():
    spec = get("mqa_decode")
    kernel = codegen.compile(spec.kernel, "sm90")
    print(f"seed {SEED}")
    failures = []
    for i, rows in enumerate(_rows()):
        for batch in ((1, 16, 64) if i < 3 else ((1, 16, 64)[i % 3],)):
            case = {"B": batch, "H": 64, "R": rows, "D": 512}
            inputs = spec.make_inputs(case, torch.device("cuda"), seed=SEED + rows)
            kernel(**inputs)
            bad, err = _check(spec, case, inputs)
            print(f"R={rows} B={batch}: {bad} off, max error {err:.3g}")
            if bad:
                failures.append((rows, batch, bad, err))
    assert len(kernel._cache) == 1, f"{len(kernel._cache)} builds for one kernel"
    assert not failures, f"seed {SEED}, config {kernel._configs}: {failures}"


@pytest.mark.parametrize("batch", [2, 16, 64])
def test_a_sequence_decodes_alike_whatever_the_batch(batch):
    spec = get("mqa_decode")
    kernel = codegen.compile(spec.kernel, "sm90")
    alone = spec.make_inputs({"B": 1, "H": 64, "R": 640, "D": 512}, torch.device("cuda"), seed=1)
    kernel(**alone)
    mixed = spec.make_inputs({"B": batch, "H": 64, "R": 640, "D": 512}, torch.device("cuda"), seed=batch)
    at = batch // 2
    mixed["q"][at], mixed["kv"][at] = alone["q"][0], alone["kv"][0]
    kernel(**mixed)
    assert torch.equal(mixed["o"][at], alone["o"][0])
