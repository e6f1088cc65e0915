"""The model benchmark's table: runs of `bench_model.py` (one JSON each) joined into
``results/NAME.{md,json}``. Needs no GPU."""

from __future__ import annotations

import json
from pathlib import Path

PEERS = ("transformers", "reference")  # the first of these a run has is every row's peer


def _peer_rows(runs: list[dict]) -> dict[tuple, float]:
    """(model, phase) -> the peer's milliseconds."""
    out: dict[tuple, float] = {}
    for peer in reversed(PEERS):
        for run in runs:
            for system in run["systems"]:
                if system["system"] == peer:
                    out.update({(run["model"], row["phase"]): row["ms"] for row in system["rows"]})
    return out


def table(runs: list[dict]) -> list[str]:
    peers = _peer_rows(runs)
    head = ["model", "system", "phase", "ms", "tokens/s", "floor ms", "x floor", "peer ms / ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for system in run["systems"]:
            for row in system["rows"]:
                tokens = row.get("tokens_per_s") or 1e3 * row.get("batch", 1) / row["ms"]
                floor = row.get("floor_ms")
                peer = peers.get((run["model"], row["phase"]))
                cells = [f"{run['model']} L{run['layers']}", system["label"], row["phase"], f"{row['ms']:.2f}",
                         f"{tokens:,.0f}", f"{floor:.3f}" if floor else "",
                         f"{row['ms'] / floor:.1f}" if floor else "", f"{peer / row['ms']:.2f}" if peer else ""]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_report(runs: list[dict], name: str, out: Path | None = None) -> Path:
    out = out or Path(__file__).parent / "results"
    (out / f"{name}.json").write_text(json.dumps(runs, indent=1) + "\n")
    notes = []
    for run in runs:
        notes.append(f"- {run['model']} on {run['layers']} layers ({', '.join(run['kinds'])}), {run['device']}, "
                     f"{run['date']}; copy bandwidth {run['copy_tbs']:.2f} TB/s; set-up: " +
                     ", ".join(f"{s['system']} {s['setup_s']:.0f} s" for s in run["systems"]))
        for s in run["systems"]:
            if s.get("ops"):  # the workload's model-op calls: (generated, reference) per op
                gen, ref = (sum(v[i] for v in s["ops"].values()) for i in (0, 1))
                notes.append(f"  - {s['system']}: {gen:,} model-op calls on generated kernels, {ref:,} on the "
                             f"reference, over the workload")
    text = "\n".join([f"# Model benchmark ({name})", "", *notes, "", *table(runs)]) + "\n"
    (out / f"{name}.md").write_text(text)
    return out / f"{name}.md"
