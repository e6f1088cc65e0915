"""`duotile check-model [PATH|PRESET]`: everything the runtime can verify about a checkpoint, in one report.

Config (types, ranges, consistency), headers and index (offsets, overlaps, coverage), the inventory
(every tensor with its dtype and shape), then every stored value (scan.py: NaN / Inf codes, expert ids,
all-zero tensors), the embedded preset's SHA-256 digests, and the memory the reference would need here.
Exit 0: no errors (warnings allowed); 1: errors found in the values; 2: the checkpoint cannot be opened.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .config import ConfigError
from .footprint import available_bytes, gib, step_bytes, weight_bytes
from .presets import DEFAULT_PRESET, PRESETS, TINY_PRESETS, get_preset, written_preset
from .weights import CheckpointError

MAX_LINES = 20
UNDETECTABLE = ("note: FP4 e2m1 codes are all finite, so a flipped or corrupted expert byte is another valid "
                "value and cannot be found from the data; nor can a partly zeroed or otherwise wrong weight of "
                "a valid format. Only a digest of the files detects those (checked for the embedded presets).")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-model", help="check a checkpoint's config, headers and stored values",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_PRESET, metavar="PATH|PRESET",
                   help=f"checkpoint directory or preset {sorted(PRESETS)} (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .cli import fail

    try:
        return check(args.model)
    except (ConfigError, CheckpointError, ValueError) as err:
        return fail(args, err)


def check(model: str) -> int:
    from .loader import open_model, preset_dir, preset_problem

    name = str(model)
    if not Path(name).is_dir() and name in PRESETS and name not in TINY_PRESETS:
        cfg = get_preset(name)
        print(f"config: ok ({cfg.model_type}, {cfg.num_hidden_layers} layers); {name} is config only (no "
              "embedded weights): pass its checkpoint directory to check the weights")
        _memory(cfg)
        return 0
    ckpt = open_model(name)
    cfg = ckpt.config
    shards = sorted({e.file.name for e in ckpt.entries.values()})
    print(f"config: ok ({cfg.model_type}, {cfg.num_hidden_layers} layers)")
    print(f"headers and inventory: ok ({len(ckpt.entries)} stored tensors in {len(shards)} shard(s))")
    errors = 0
    if not Path(name).is_dir() and written_preset(name):
        problem = preset_problem(preset_dir(name), name, deep=True)
        print(f"preset digest: {problem or 'ok'}")
        errors += problem is not None
    findings = ckpt.findings()
    errors += sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warning" for f in findings)
    for f in findings[:MAX_LINES]:
        print(f"{f.level}: tensor {f.tensor} in {ckpt.entries[f.tensor].file.name}: {f.message}")
    if len(findings) > MAX_LINES:
        print(f"... and {len(findings) - MAX_LINES} more findings")
    print(f"values: {errors} error(s), {warnings} warning(s) over {len(ckpt.entries)} stored tensors")
    if any(e.dtype == torch.int8 for e in ckpt.entries.values()):
        print(UNDETECTABLE)
    _memory(cfg)
    return 1 if errors else 0


def _memory(cfg) -> None:
    weights = sum(weight_bytes(cfg).values())
    need = weights + step_bytes(cfg, 256)
    have = available_bytes(torch.device("cpu"))
    verdict = "fits" if need <= 0.9 * have else "does NOT fit"
    print(f"memory: the reference needs about {gib(need)} (FP32 weights {gib(weights)}); {gib(have)} available "
          f"on cpu: {verdict}")
