"""The persistent tuning cache: the best config found for a kernel, a shape bucket and a target.

One JSON file (``$DUOTILE_CACHE/tuning.json`` unless told otherwise)::

    {"schema": 1, "checksum": "<sha256 of the canonical entries>",
     "entries": {"<key hash>": {"key": {...}, "config": {...}, "time_ms": 0.41, "metric": "measured", ...}}}

The key holds everything that can make a tuned config wrong:
- ``kernel_hash``: a hash of the kernel's traced Tile IR text (without source lines) and of its
  tunables' spaces, so editing the kernel body or its space invalidates it;
- ``bucket``: each size rounded up to a power of two; the batch dimension of a batch-invariant
  kernel is left out, so one config serves every batch size;
- ``shape``: the exact value of each static size of the bucket (a dynamic size is its bucket alone),
  so two shapes of one bucket keep entries of their own (V4.1's router at N 384 and a compressor at
  N 512 share a bucket and want different tiles). A lookup takes the entry of the exact shape, else
  the one of its bucket whose shape is nearest; entries written before keys held shapes are found
  by their bucket.
- the dtypes and constants of the call, the target, the device name and the toolchain versions.

A file that cannot be parsed, has another schema, or whose checksum does not match is reported
(``TuningCache.problems`` and a warning), moved aside as ``*.corrupt-<time>`` and rebuilt empty:
its entries are never trusted.

Lookups (``best_config``) read the user's cache first, then the table shipped with duotile
(``duotile/tuned/tuning.json``: sweeps measured on our H200, same format, read-only). Its keys
hold the device name and toolchain versions, so it answers only on that GPU with those tools,
and only while the kernel is unchanged; a damaged shipped table is reported and ignored.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ...dsl.kernel import KernelDef
from ...dsl.printer import canonical_text
from .filelock import locked

SCHEMA = 1
SHIPPED = Path(__file__).resolve().parents[2] / "tuned" / "tuning.json"


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir) / "tuning.json"
    from ...codegen.build import cache_root

    return cache_root() / "tuning.json"


def kernel_hash(kernel: KernelDef, dtypes: dict | None = None, present: dict | None = None,
                constants: dict | None = None) -> str:
    """A hash of the kernel's traced IR at its default config, plus its tunables' spaces."""
    spaces = {k: [type(s).__name__, s.values(), repr(s.default)] for k, s in kernel.tunables.items()}
    blob = _traced_text(kernel, dtypes, present, constants) + json.dumps(spaces, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# the canonical text of each kernel's trace at its defaults, by call, beside its kernel (an id is not
# reused while the kernel lives): every config choice keys its lookups by it (a model's shapes on
# three targets: thousands of traces of a few calls); a trace is a pure function of the kernel and
# the call, as the constraint checker's shared traces assume (``constraints._SYMBOLIC``)
_TEXTS: dict[tuple, tuple[KernelDef, str]] = {}
_TEXTS_MAX = 1024


def _traced_text(kernel: KernelDef, dtypes: dict | None, present: dict | None, constants: dict | None) -> str:
    key = (id(kernel), tuple(sorted((k, getattr(v, "name", str(v))) for k, v in (dtypes or {}).items())),
           tuple(sorted((present or {}).items())), tuple(sorted((k, repr(v)) for k, v in (constants or {}).items())))
    hit = _TEXTS.get(key)
    if hit is None or hit[0] is not kernel:
        if len(_TEXTS) >= _TEXTS_MAX:
            _TEXTS.clear()
        hit = _TEXTS[key] = (kernel, canonical_text(kernel.trace(dtypes, present, None, constants)))
    return hit[1]


def shape_bucket(kernel: KernelDef, shapes: dict[str, int]) -> dict[str, int]:
    """Each size rounded up to a power of two. Dropped: a batch-invariant kernel's batch dim (one
    config for every batch) and a dynamic size that is not bucketed (one build for every value)."""
    unkeyed = {kernel.batch_dim} | (set(kernel.dynamic) - set(kernel.bucketed))
    return {k: 1 << max(0, int(v) - 1).bit_length() for k, v in sorted(shapes.items()) if k not in unkeyed}


def static_shape(kernel: KernelDef, shapes: dict[str, int]) -> dict[str, int]:
    """The exact sizes of a call's bucket that are static (one build each)."""
    bucket = shape_bucket(kernel, shapes)
    return {k: int(shapes[k]) for k in bucket if k not in kernel.dynamic}


def shape_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Octaves between two exact shapes, summed over the sizes they both name."""
    return sum(abs(math.log2(max(a[k], 1)) - math.log2(max(b[k], 1))) for k in a if k in b)


def entry_shape(entry: dict) -> dict[str, int]:
    """The exact static sizes an entry was tuned at: its key's, else the sizes it recorded."""
    key = entry.get("key", {})
    if isinstance(key.get("shape"), dict):
        return key["shape"]
    shapes = entry.get("shapes") if isinstance(entry.get("shapes"), dict) else {}
    return {k: int(v) for k, v in shapes.items() if k in key.get("bucket", {})} or dict(key.get("bucket", {}))


def device_name(target: str) -> str:
    """The GPU's name where the target's kernels run and are measured here, else ``model:<target>``
    (cost-model rankings, and the interpreter). A modelled target is never keyed by the local GPU:
    an sm100 ranking made on an H200 machine is still a model of sm100."""
    from ...codegen.target import get_target

    tgt = get_target(target)
    if tgt.runs_on == "cuda" and not tgt.modelled:
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - a broken driver means "no device"
            pass
    return f"model:{target}"


def make_key(kernel: KernelDef, target: str, shapes: dict[str, int], device: str | None = None,
             toolchain: dict[str, str] | None = None, dtypes: dict | None = None,
             present: dict | None = None, constants: dict | None = None) -> dict[str, Any]:
    if toolchain is None:
        from ...codegen.target import get_target

        toolchain = get_target(target).toolchain()
    return {
        "kernel": kernel.name,
        "kernel_hash": kernel_hash(kernel, dtypes, present, constants),
        "bucket": shape_bucket(kernel, shapes),
        "shape": static_shape(kernel, shapes),
        "dtypes": {k: getattr(v, "name", str(v)) for k, v in sorted((dtypes or {}).items())},
        "constants": {k: repr(v) for k, v in sorted(kernel.resolve_constants(constants).items())},
        "target": target,
        "device": device or device_name(target),
        "toolchain": dict(sorted(toolchain.items())),
    }


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _newest_first(entry: dict) -> float:
    """A sort key putting the most recently created entry first (an entry without a time last)."""
    try:
        return -time.mktime(time.strptime(str(entry.get("created")), "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return math.inf


def _checksum(entries: dict) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()


# digests of file contents that passed ``TuningCache._parse``'s checks (a pure function of the bytes):
# the shipped table is read at every config choice, and its checksum and key hashes cost more than
# the parse
_VERIFIED: set[bytes] = set()


class TuningCacheError(OSError):
    """The tuning cache cannot be written where it was asked to be."""


class TuningCache:
    """The entries of one tuning file. Updates (``put``, ``save``) happen under the file's lock
    (``filelock.py``) and merge into what is on disk then, so processes that record results at
    the same time keep each other's entries; the file is replaced atomically."""

    def __init__(self, path: str | os.PathLike | None = None, read_only: bool = False):
        self.path = Path(path) if path is not None else cache_path()
        self.read_only = read_only
        self.problems: list[str] = []
        self._raw: bytes | None = None  # the file's bytes where they parsed
        self.entries: dict[str, dict] = self._load()
        # as loaded: what save() changes on disk is the difference (parsed again: a deep copy, faster)
        self._base = json.loads(self._raw)["entries"] if self._raw is not None else copy.deepcopy(self.entries)

    def _parse(self, raw: bytes) -> dict[str, dict]:
        data = json.loads(raw)
        if hashlib.sha256(raw).digest() in _VERIFIED:  # these very bytes passed every check below
            return data["entries"]
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("no entries table")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA} (stale file)")
        if data.get("checksum") != _checksum(data["entries"]):
            raise ValueError("checksum mismatch (edited or truncated)")
        for h, entry in data["entries"].items():
            if key_hash(entry["key"]) != h:
                raise ValueError(f"entry {h} does not match its key")
        if len(_VERIFIED) >= 64:
            _VERIFIED.clear()
        _VERIFIED.add(hashlib.sha256(raw).digest())
        return data["entries"]

    def _load(self) -> dict[str, dict]:
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # no file yet (or no folder to hold one)
            return {}
        except OSError as err:
            self._report(f"tuning cache {self.path} cannot be read ({type(err).__name__}: {err}); ignoring it")
            return {}
        try:
            entries = self._parse(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._quarantine(f"{err.__class__.__name__}: {err}", raw)
            return {}
        self._raw = raw
        return entries

    def _current(self) -> dict[str, dict]:
        """The file's entries as they are now (under the lock); a damaged file is moved aside."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            return self._parse(raw)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time() * 1000)}")
            os.replace(self.path, aside)
            self._report(f"tuning cache {self.path} is not trusted ({type(err).__name__}: {err}); moved to "
                         f"{aside.name}, keeping only this process's entries")
            return {}

    def _report(self, msg: str) -> None:
        self.problems.append(msg)
        warnings.warn(msg, stacklevel=4)

    def _quarantine(self, why: str, raw: bytes) -> None:
        if self.read_only:
            self._report(f"tuning table {self.path} is not trusted ({why}); ignoring it")
            return
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time() * 1000)}")
        try:
            with locked(self.path):
                # another process may have replaced the damaged file meanwhile: move only what was judged
                if self.path.read_bytes() != raw:
                    self._report(f"tuning cache {self.path} was not trusted ({why}) but has been rewritten "
                                 "since; left in place")
                    return
                os.replace(self.path, aside)
            where = f"moved to {aside.name}"
        except OSError:
            where = "left in place"
        self._report(f"tuning cache {self.path} is not trusted ({why}); {where}, rebuilding it empty")

    # -- lookups and updates --------------------------------------------------------------------
    def get(self, key: dict[str, Any]) -> dict | None:
        entry = self.entries.get(key_hash(key))
        if entry is None or entry.get("key") != key:
            return None
        return entry

    def nearest_in_bucket(self, key: dict[str, Any]) -> dict | None:
        """The entry of ``key``'s bucket (everything else in the key equal) whose exact shape is
        nearest to ``key``'s, the newest of equals; None where the bucket has none."""
        want = {k: v for k, v in key.items() if k != "shape"}
        found = [(shape_distance(entry_shape(e), key.get("shape", {})), _newest_first(e), h, e)
                 for h, e in self.entries.items()
                 if {k: v for k, v in e.get("key", {}).items() if k != "shape"} == want]
        return min(found, key=lambda f: f[:3])[3] if found else None

    def put(self, key: dict[str, Any], config: dict[str, Any], **fields) -> dict:
        entry = {"key": key, "config": config, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
        json.dumps(entry)  # fail here, not half-way through writing the file
        self.entries[key_hash(key)] = entry
        self.save()
        return entry

    def check_writable(self) -> None:
        """A ``TuningCacheError`` now, rather than after a sweep, if this file cannot be updated."""
        if self.read_only:
            raise TuningCacheError(f"{self.path} is a read-only tuning table")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with locked(self.path):
                fd, probe = tempfile.mkstemp(prefix=".tuning.probe.", dir=self.path.parent)
                os.close(fd)
                os.unlink(probe)
                if self.path.exists() and not os.access(self.path, os.W_OK):
                    raise PermissionError(f"{self.path.name} is not writable")
        except OSError as err:
            raise TuningCacheError(f"cannot write the tuning cache {self.path} ({type(err).__name__}: "
                                   f"{getattr(err, 'strerror', None) or err}); choose a writable folder "
                                   "(--cache-dir, $DUOTILE_CACHE) or tune without saving (--no-cache)") from err

    def save(self) -> None:
        """Write the entries added, changed or removed since this cache was loaded, merged under the
        lock into the file as it is now (another process may have written it meanwhile)."""
        if self.read_only:
            raise PermissionError(f"{self.path} is a read-only tuning table")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with locked(self.path):
            current = self._current()
            changed = {h: e for h, e in self.entries.items() if self._base.get(h) != e}
            removed = set(self._base) - set(self.entries)
            merged = {h: e for h, e in current.items() if h not in removed}
            merged.update(changed)
            data = {"schema": SCHEMA, "checksum": _checksum(merged), "entries": merged}
            fd, tmp = tempfile.mkstemp(prefix=".tuning.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self.entries, self._base = merged, copy.deepcopy(merged)


def best_config(kernel: KernelDef, target: str, shapes: dict[str, int], device: str | None = None, *,
                dtypes: dict | None = None, present: dict | None = None, constants: dict | None = None,
                cache_dir: str | os.PathLike | None = None, toolchain: dict[str, str] | None = None,
                shipped: str | os.PathLike | None = SHIPPED) -> dict[str, Any] | None:
    """The tuned config for this call from the user's cache, else from the shipped table (what
    ``duotile build`` and the runtime use); None when neither has one. An entry today's kernel or
    target refuses is skipped with a warning (``lookup``)."""
    config, skipped = lookup(kernel, target, shapes, device, dtypes=dtypes, present=present, constants=constants,
                             cache_dir=cache_dir, toolchain=toolchain, shipped=shipped)
    for msg in skipped:
        warnings.warn(msg, stacklevel=2)
    return config


def lookup(kernel: KernelDef, target: str, shapes: dict[str, int], device: str | None = None, *,
           dtypes: dict | None = None, present: dict | None = None, constants: dict | None = None,
           cache_dir: str | os.PathLike | None = None, toolchain: dict[str, str] | None = None,
           shipped: str | os.PathLike | None = SHIPPED) -> tuple[dict[str, Any] | None, list[str]]:
    """(the first valid tuned config or None, one line per entry skipped). Each entry found, in the
    user's cache and then the shipped table, is checked against today's kernel and target
    (``entry_problem``): a table written by another version may name a tunable that no longer
    exists, a value outside its space, or a config over the target's capacity."""
    caches = [TuningCache(cache_path(cache_dir))]
    if shipped is not None and Path(shipped).exists():
        caches.append(TuningCache(shipped, read_only=True))
    caches = [c for c in caches if c.entries]
    if not caches:
        return None, []
    key = make_key(kernel, target, shapes, device, toolchain, dtypes, present, constants)
    skipped: list[str] = []
    for cache in caches:
        entry = cache.get(key) or cache.nearest_in_bucket(key)
        if not entry:
            continue
        why = entry_problem(kernel, target, shapes, entry.get("config"), dtypes, present, constants)
        if why is None:
            return dict(entry["config"]), skipped
        skipped.append(f"tuned config for {kernel.name} on {target} in {cache.path} skipped: {why}")
    return None, skipped


def entry_problem(kernel: KernelDef, target: str, shapes: dict[str, int], config: Any,
                  dtypes: dict | None = None, present: dict | None = None,
                  constants: dict | None = None) -> str | None:
    """Why today's code would refuse a cached ``config`` for this call (one line), or None: its
    names and values against the kernel's tunables and the target's knobs, then the target's
    lowering and capacity checks on the specialised kernel."""
    from ...codegen.compile import check_config, specialize_phases
    from ...codegen.target import get_target
    from ...dsl.kernel import Signature

    if not isinstance(config, dict):
        return f"its config is {type(config).__name__}, not a table"
    tgt = get_target(target)
    try:
        check_config(kernel, tgt, config)
        sig = Signature(dict(dtypes or {}), dict(present or {}), dict(shapes))
        specialize_phases(kernel, sig, tgt, config, constants)
    except Exception as err:  # noqa: BLE001 - whatever today's code refuses, the entry is not used
        return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
    return None
