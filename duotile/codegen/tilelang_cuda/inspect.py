"""Reads what a CUDA build really contains: the tensor-core and copy instructions in PTX / SASS.

On sm100 a GEMM must use tcgen05 (``tcgen05.mma`` in PTX, ``UTCHMMA``/``UTCQMMA`` in SASS); the
Hopper ``mma.sync`` fallback (``HMMA``) is a silent slowdown this check exists to catch.
"""

from __future__ import annotations

import re

from ..target import Artifact

PTX_CLASSES = {
    "tcgen05.mma": r"tcgen05\.mma", "tcgen05.ld": r"tcgen05\.ld", "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync", "tma": r"cp\.async\.bulk\.tensor", "cp.async": r"cp\.async\.(ca|cg)",
}
SASS_CLASSES = ("UTCHMMA", "UTCQMMA", "UTCOMMA", "LDTM", "HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDGSTS")


def ptx_counts(ptx: str) -> dict[str, int]:
    return {k: len(re.findall(p, ptx)) for k, p in PTX_CLASSES.items() if re.search(p, ptx)}


def sass_counts(sass: str) -> dict[str, int]:
    return {k: len(re.findall(rf"\b{k}\b", sass)) for k in SASS_CLASSES if re.search(rf"\b{k}\b", sass)}


def instruction_summary(a: Artifact) -> str:
    counts = sass_counts(a.stages["sass"]) if "sass" in a.stages else ptx_counts(a.stages.get("ptx", ""))
    where = "sass" if "sass" in a.stages else "ptx"
    ptxas = a.meta.get("ptxas", {})
    spills = ptxas.get("spill_stores", 0)
    tail = f"; SPILLS {spills} bytes" if spills else ""
    tail += "; WGMMA SERIALIZED" if ptxas.get("wgmma_serialized") else ""
    return f"{where}: " + " ".join(f"{k}x{v}" for k, v in sorted(counts.items())) + tail
