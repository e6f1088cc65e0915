"""An exclusive lock on a file beside the one it guards (``fcntl.flock``), for read-modify-write
updates of a file that several processes share (the tuning cache).

    with locked(path):          # path.lock is created next to path
        ... read path, change it, write it atomically ...

The lock belongs to the open file description, so it is released when the process dies: a
killed writer never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path


class LockTimeout(TimeoutError):
    """Another process held the lock for longer than the caller would wait."""


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def locked(path: str | os.PathLike, timeout: float = 120.0) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` (waiting at most ``timeout`` seconds for it)."""
    target = lock_path(Path(path))
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"{target} stayed locked by another process for {timeout:.0f} s") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
