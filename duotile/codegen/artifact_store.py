"""Entries of the artifact cache on disk: written whole, verified on every read, swept when abandoned.

An entry is a directory of files with ``meta.json`` written last. The meta holds the sha256 of
every other file in the directory (``digests``) and of its own body (``meta_digest``), so a file
emptied, replaced or edited after the build (a cubin, the PTX, the ``kernel_tilelang.py`` the sm90
launcher executes) makes the whole entry untrusted: ``read`` returns why, and the caller rebuilds.

A build writes into a temporary directory beside the entry and renames it into place
(``publish``). Several processes may build one artifact at once: the first rename wins, and a
loser uses the winner's entry once it verifies. An unverified entry in the way is moved aside and
replaced, and so is one that vanishes before the loser reads it (moved aside by a forced rebuild).
Temporary directories carry their process id and host: ``sweep`` removes those of processes of
this host that no longer run, and any older than ``STALE_AFTER_S`` (a build killed elsewhere).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

META = "meta.json"
TMP = ".duotile-tmp."  # + "<pid>.<random>.<key>@<host>": a build in progress
TRASH = ".duotile-trash."  # + "<random>": an entry being removed
STALE_AFTER_S = 30 * 60  # a temporary directory this old belongs to no live build
_ATTEMPTS = 8


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _body_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_meta(d: Path, meta: dict) -> None:
    """Write ``meta.json`` into ``d`` with the digests of every other file there: the last write
    of an entry, so an entry whose meta exists was complete."""
    digests = {p.name: _sha256(p) for p in sorted(d.iterdir()) if p.is_file() and p.name != META}
    meta = {**meta, "digests": digests}
    meta["meta_digest"] = _body_digest(meta)
    (d / META).write_text(json.dumps(meta, indent=1, default=str))


def read(d: Path) -> tuple[dict | None, str]:
    """``(meta, "")`` for an entry whose files all match its digests; ``(None, why)`` otherwise,
    ``why`` being ``"absent"`` where there is no entry at all."""
    if not (d / META).exists() and not d.exists():
        return None, "absent"
    try:
        meta = json.loads((d / META).read_text())
        if not isinstance(meta, dict):
            return None, "meta.json holds no table"
        digests = meta.get("digests")
        if not isinstance(digests, dict) or meta.get("meta_digest") != _body_digest(meta):
            return None, "meta.json has no valid digest (edited, or written by an older duotile)"
        for name, want in digests.items():
            path = d / name
            if not path.is_file():
                return None, f"{name} is missing"
            if _sha256(path) != want:
                return None, f"{name} does not match its digest (edited or damaged after the build)"
    except (OSError, ValueError, TypeError, AttributeError) as err:
        return None, f"meta.json unreadable ({type(err).__name__})"
    return meta, ""


def new_temp(parent: Path, key: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    d = parent / f"{TMP}{os.getpid()}.{secrets.token_hex(4)}.{key}@{socket.gethostname()}"
    d.mkdir()
    return d


def discard(d: Path) -> None:
    """Remove a directory by first renaming it aside (atomic), so no reader sees half of it."""
    aside = d.parent / f"{TRASH}{secrets.token_hex(6)}"
    try:
        os.rename(d, aside)
    except FileNotFoundError:
        return  # someone else moved it already
    shutil.rmtree(aside, ignore_errors=True)


def publish(tmp: Path, final: Path, replace: bool = False) -> bool:
    """Rename the complete entry ``tmp`` to ``final``. True when ``final`` is now ``tmp``'s; False
    when another writer's verified entry is there (``replace`` false). ``tmp`` is then kept: that
    entry may be moved aside by a forced rebuild before the caller reads it, and ``tmp`` is the
    caller's to publish again or remove. An unverified entry in the way, or any entry under
    ``replace``, is moved aside first."""
    for _ in range(_ATTEMPTS):
        try:
            os.rename(tmp, final)
            return True
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
        if not replace and read(final)[0] is not None:
            return False
        if final.is_dir():
            discard(final)
        else:
            final.unlink(missing_ok=True)
        replace = False  # one replacement is ours; after that, a newer verified entry stands
    raise OSError(f"could not place the artifact at {final}: other builds kept replacing it")


def sweep(parent: Path, now: float | None = None) -> list[str]:
    """Remove the temporary and half-removed directories of dead builds in ``parent``; the names
    removed."""
    now = time.time() if now is None else now
    host, removed = socket.gethostname(), []
    try:
        children = list(parent.iterdir())
    except OSError:
        return removed
    for d in children:
        if d.name.startswith(TRASH):
            stale = True
        elif d.name.startswith(TMP):
            stale = _abandoned(d, host, now)
        else:
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def _abandoned(d: Path, host: str, now: float) -> bool:
    try:
        age = now - d.stat().st_mtime
    except OSError:
        return False
    if age > STALE_AFTER_S:
        return True
    pid_text, _, rest = d.name[len(TMP):].partition(".")
    if rest.rpartition("@")[2] != host or not pid_text.isdigit():
        return False
    return not _alive(int(pid_text))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
