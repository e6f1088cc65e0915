"""What a sweep reports: a summary table, a JSON file and a PNG plot of the sweep."""

from __future__ import annotations

import json
from pathlib import Path

from .tuner import TuneResult


def _fmt_cfg(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def summary(r: TuneResult) -> str:
    c = r.counts()
    unit = "modelled" if r.metric == "model" else "measured"
    lines = [f"duotile tune {r.kernel} on {r.target} ({r.device}), shapes "
             f"{' '.join(f'{k}={v}' for k, v in r.shapes.items())}",
             f"  space {r.space_size} configs; budget {r.budget}; strategy {r.strategy}; {r.wall_s:.1f} s"]
    if r.metric == "model":
        lines.append("  NOTE: times are an analytical cost model's ranking, not a measurement")
    rows = [("best config", _fmt_cfg(r.best.config) if r.best else "none (no candidate passed)"),
            (f"best time ({unit})", f"{r.best.final_ms:.4g} ms" if r.best else "-"),
            ("default config", _fmt_cfg(r.default.config) if r.default else "-"),
            (f"default time ({unit})", f"{r.default.final_ms:.4g} ms" if r.default and r.default.counts
             else (r.default.status if r.default else "-")),
            ("speed-up over default", f"{r.speedup:.3f}x" if r.speedup else "-"),
            ("candidates ok", str(c.get("ok", 0) + c.get("compiled", 0))),
            ("pruned", str(c.get("pruned", 0))),
            ("failed (compile / run / timeout)",
             f"{c.get('compile_error', 0)} / {c.get('run_error', 0)} / {c.get('timeout', 0)}"),
            ("wrong", str(c.get("wrong", 0))),
            ("spilling registers (ptxas)", str(sum(bool(t.build.get("spill_stores")) for t in r.trials)))]
    w = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{w}}  {v}" for k, v in rows]
    reasons: dict[str, int] = {}
    for t in r.trials:
        if t.status not in ("ok", "compiled"):
            head = t.reason.split(";")[0][:90]
            reasons[f"{t.status}: {head}"] = reasons.get(f"{t.status}: {head}", 0) + 1
    if reasons:
        lines.append("  reasons:")
        lines += [f"    {n:>4} x {why}" for why, n in sorted(reasons.items(), key=lambda x: -x[1])[:8]]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def to_json(r: TuneResult) -> dict:
    return {"kernel": r.kernel, "target": r.target, "device": r.device, "case": r.case, "shapes": r.shapes,
            "metric": r.metric, "budget": r.budget, "strategy": r.strategy, "space_size": r.space_size,
            "wall_s": r.wall_s, "counts": r.counts(), "speedup_over_default": r.speedup,
            "best": r.best.to_json() if r.best else None, "default": r.default.to_json() if r.default else None,
            "notes": r.notes, "trials": [t.to_json() for t in r.trials]}


def write_json(r: TuneResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(r), indent=1, default=str))
    return path


def write_all(r: TuneResult, out: str | Path, fallback: str | Path | None = None) -> list[str]:
    """The JSON report and the PNG plot, ``<out>/<kernel>_<target>.{json,png}``; lines saying where
    each went. Where ``out`` cannot be written after all (a full disk, a folder removed during the
    sweep), the files go to ``fallback`` and the line says so: a sweep's report is never lost."""
    lines = []
    for what, suffix, write in (("report", ".json", write_json), ("plot", ".png", plot)):
        path = Path(out) / f"{r.kernel}_{r.target}{suffix}"
        try:
            lines.append(f"{what + ':':<8}{write(r, path)}")
        except ImportError as err:  # the plot needs matplotlib (the dev extra)
            lines.append(f"{what + ':':<8}not drawn ({err.name or err} is not installed)")
        except OSError as err:
            if fallback is None or Path(fallback).resolve() == Path(out).resolve():
                raise
            where = write(r, Path(fallback) / path.name)
            lines.append(f"{what + ':':<8}{where} (could not write {path}: {err.strerror or err})")
    return lines


COLORS = {"ok": "tab:blue", "compiled": "tab:blue", "wrong": "tab:red", "compile_error": "tab:orange",
          "timeout": "tab:purple", "run_error": "tab:brown"}


def plot(r: TuneResult, path: str | Path) -> Path:
    """Time of every evaluated candidate in sweep order, failures on the axis, best-so-far line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    shown = [t for t in r.trials if t.status != "pruned"]
    ok = [(i, t.time_ms) for i, t in enumerate(shown) if t.counts]
    top = max((y for _, y in ok), default=1.0)
    for status, color in COLORS.items():
        if status in ("ok", "compiled"):
            pts = [(i, t.time_ms) for i, t in enumerate(shown) if t.status == status and t.counts]
        else:
            pts = [(i, top * 1.05) for i, t in enumerate(shown) if t.status == status]
        if pts:
            ax.scatter(*zip(*pts), s=18, c=color, label=status, marker="o" if status in ("ok", "compiled") else "x")
    if ok:
        best, xs, ys = float("inf"), [], []
        for i, y in ok:
            best = min(best, y)
            xs.append(i)
            ys.append(best)
        ax.step(xs, ys, where="post", c="k", lw=1, label="best so far")
    if r.default is not None and r.default.counts:
        ax.axhline(r.default.time_ms, ls="--", c="gray", lw=1, label="default config")
    what = "modelled time (cost model, not measured)" if r.metric == "model" else "median time"
    ax.set(xlabel="candidate (sweep order)", ylabel=f"{what} [ms]",
           title=f"{r.kernel} on {r.target}: {len(shown)} evaluated, {r.counts().get('pruned', 0)} pruned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
