"""Carries a kernel's shipped tuning entries over a change that adds tunables and leaves the kernel's
traced IR at its defaults as it was:

    python3 scripts/rekey_tuned.py flash_attention --added DG

An entry's key holds ``kernel_hash`` (``passes/autotune/cache.py``): the traced IR at the default
config plus the tunables' spaces, so adding a tunable makes every entry of the kernel miss, measured
configs included. This script recomputes, for each entry, the hash the kernel would have without the
``--added`` tunables (their ``NAME=default`` dropped from the trace's config line and their spaces
dropped); only where that equals the entry's hash (the IR is unchanged but for the new tunables at
their defaults, so the measured config builds the same code) is the entry re-keyed to today's hash.
Any other entry is left as it is and named. The table's checksum is rewritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duotile.dsl import dtypes as dt  # noqa: E402
from duotile.kernels_spec import load_all  # noqa: E402
from duotile.passes.autotune import cache  # noqa: E402


def hash_without(kernel, added: list[str], dtypes: dict, constants: dict) -> str:
    """``cache.kernel_hash`` as it was before ``added`` joined the kernel's tunables."""
    text = cache._traced_text(kernel, dtypes, {}, constants)
    for name in added:
        default = kernel.tunables[name].default
        text, n = re.subn(rf"(, )?\b{re.escape(name)}={re.escape(str(default))}\b", "", text, count=1)
        if n != 1:
            raise SystemExit(f"{name}={default} is not in the trace's config line")
    spaces = {k: [type(s).__name__, s.values(), repr(s.default)] for k, s in kernel.tunables.items() if k not in added}
    blob = text + json.dumps(spaces, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel")
    p.add_argument("--added", action="append", required=True, help="a tunable the change added (repeatable)")
    p.add_argument("--table", default=str(cache.SHIPPED))
    args = p.parse_args()
    kernel = load_all()[args.kernel].kernel
    data = json.loads(Path(args.table).read_text())
    out, moved, left = {}, 0, []
    for eid, entry in data["entries"].items():
        key = entry["key"]
        if key["kernel"] != args.kernel:
            out[eid] = entry
            continue
        dtypes = {k: getattr(dt, v) for k, v in key["dtypes"].items()}
        constants = {k: eval(v, {}) for k, v in key["constants"].items()}  # noqa: S307 - reprs of numbers and bools
        if hash_without(kernel, args.added, dtypes, constants) != key["kernel_hash"]:
            out[eid] = entry
            left.append(f"{eid} ({key['constants']}, bucket {key['bucket']})")
            continue
        key = {**key, "kernel_hash": cache.kernel_hash(kernel, dtypes, {}, constants)}
        out[cache.key_hash(key)] = {**entry, "key": key}
        moved += 1
    data = {**data, "entries": out, "checksum": cache._checksum(out)}
    Path(args.table).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{args.kernel}: {moved} entries re-keyed; {len(left)} left as they were")
    for line in left:
        print(f"  left: {line}")
    return 0 if not left else 1


if __name__ == "__main__":
    raise SystemExit(main())
