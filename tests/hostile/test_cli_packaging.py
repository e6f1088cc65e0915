"""The install script asks only the configured package index for versions it serves, and the
package carries its licence."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pip_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]


def test_install_needs_no_other_index_and_no_local_version_label():
    script = (ROOT / "scripts" / "install").read_text()
    lines = pip_lines(script)
    assert lines, "scripts/install installs nothing"
    for line in lines:
        assert not re.search(r"--(extra-)?index-url|--find-links|-f\s|https?://", line), line
        assert not re.search(r"==[\w.]+\+", line), f"a local version label no index serves: {line}"
    # a torch that imports is kept; a pinned version first, then the index's own
    assert 'if ! "$PY" -c "import torch"' in script
    assert '"torch==2.13.0" || "$PY" -m pip install -q torch' in script


def test_install_script_parses():
    for name in ("install", "test", "build"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)]).returncode == 0, name


def test_licence_file_and_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 The duotile authors" in text
    assert "[yyyy]" not in text
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^license = "Apache-2.0"$', project, re.M)
    assert re.search(r'^license-files = \[.*"LICENSE".*\]$', project, re.M)
    assert re.search(r'^requires = \["setuptools>=77"\]', pyproject, re.M)  # 77 reads an SPDX licence string
