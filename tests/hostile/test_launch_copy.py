"""The sm90 launcher loads the cached TileLang source only through a checked, private copy."""

from __future__ import annotations

import hashlib

import pytest

from duotile.codegen.target import Artifact
from duotile.codegen.tilelang_cuda.launch import _verified_copy
from duotile.dsl.errors import UnsupportedError

SOURCE = "# generated\nx = 1\n"


def _artifact(tmp_path, text=SOURCE, digest=True):
    (tmp_path / "kernel_tilelang.py").write_text(text)
    meta = {"dir": str(tmp_path), "entry": "k"}
    if digest:
        meta["digests"] = {"kernel_tilelang.py": hashlib.sha256(SOURCE.encode()).hexdigest()}
    return Artifact("k", "sm90", stages={"tilelang": SOURCE}, meta=meta)


def test_the_copy_holds_the_verified_source(tmp_path):
    copy = _verified_copy(_artifact(tmp_path))
    assert copy.read_text() == SOURCE and copy.parent != tmp_path
    (tmp_path / "kernel_tilelang.py").write_text("import os  # edited later\n")
    assert copy.read_text() == SOURCE  # what loads is the copy, not the cache file


@pytest.mark.parametrize("digest", [True, False])
def test_an_edited_cache_file_is_refused(tmp_path, digest):
    with pytest.raises(UnsupportedError, match="edited after the build|differs from the source"):
        _verified_copy(_artifact(tmp_path, text="import os\n", digest=digest))
