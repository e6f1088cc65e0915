"""The GPU shape sweep goes on where a run cut short stopped (``DUOTILE_SWEEP_SKIP``), on the CPU."""

from __future__ import annotations

from tests.gpu import test_shape_sweep as sweep


def test_a_cut_sweep_resumes_without_the_cases_its_log_matched(tmp_path):
    cases = sweep.sweep_cases()[:3]
    lines = [f"{n:16s} {lbl:36s} {c} config {{'BM': 64}}: ok (seed {s})" for n, lbl, c, s in cases[:2]]
    n, lbl, c, s = cases[2]
    lines.append(f"{n:16s} {lbl:36s} {c} config {{'BM': 64}}: WRONG (seed {s}): 3 of 8 outputs differ")
    log = tmp_path / "sweep.log"
    log.write_text("# -- code abc --\n" + "\n".join(lines) + "\n")
    assert sweep.matched_in(f"{log},") == {(n, lbl) for n, lbl, _, _ in cases[:2]}  # the failed one runs again
    assert sweep.matched_in("") == set()
