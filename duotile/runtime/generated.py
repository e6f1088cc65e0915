"""Generated kernels inside the runtime: an ops flavour that runs duotile kernels where one exists.

`GeneratedOps(base)` forwards every primitive to `base` (`FastOps` or `InvariantOps`) except
those a kernel spec covers; today that is `rms_norm` with a weight, run by the `rmsnorm` spec:

* on an sm90 GPU (compute capability 9.0) as its sm90 build, elsewhere on the interpreter (the
  same Tile IR executed with PyTorch: slow, but the same arithmetic order on any machine);
* with the config `codegen.compile` finds: the user's tuning cache, then the table shipped in
  `duotile/tuned/` (H200), else the kernel's defaults;
* in fp32 in and out, like the reference primitive. The kernel reduces each row on its own, in
  an order fixed by its config, so the result of a row never depends on the batch around it
  (`check_batch_invariance` proves the config cannot change that order with the batch size).

It is not bitwise equal to the reference primitive: the row sum is a different order of the
same additions. `duotile generate --kernels generated` selects it.
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import FastOps

_OP_OF = {"rmsnorm": "rms_norm"}  # the runtime primitive each spec serves


class GeneratedOps:
    """`base`'s primitives, with the ones a duotile kernel covers swapped in."""

    def __init__(self, base: FastOps):
        self.base = base
        self.invariant = base.invariant
        self._kernels: dict[tuple, Any] = {}
        self.calls: dict[str, int] = {}  # op name -> calls served by a generated kernel

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def report(self) -> dict[str, tuple[int, int]]:
        """Per op: (calls served by a generated kernel, builds made for them). A kernel whose
        sizes are dynamic builds once for every token count and batch (``codegen.compile``
        caches one build per call signature, dynamic sizes left out)."""
        builds: dict[str, int] = {}
        for (spec_name, *_), kernel in self._kernels.items():
            op = _OP_OF.get(spec_name, spec_name)
            builds[op] = builds.get(op, 0) + len(kernel._cache)
        return {op: (n, builds.get(op, 0)) for op, n in self.calls.items()}

    def _kernel(self, spec_name: str, device: torch.device, constants: dict) -> Any:
        from .. import codegen
        from ..kernels_spec import get

        key = (spec_name, str(device), tuple(sorted(constants.items())))
        if key not in self._kernels:
            sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            self._kernels[key] = codegen.compile(get(spec_name).kernel, "sm90" if sm90 else "interpret",
                                                 constants=constants)
        return self._kernels[key]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None or x.numel() == 0:
            return self.base.rms_norm(x, weight, eps)
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        kernel = self._kernel("rmsnorm", rows.device, {"EPS": float(eps)})
        kernel(x=rows, weight=weight.float().contiguous(), y=out)
        self.calls["rms_norm"] = self.calls.get("rms_norm", 0) + 1
        return out.reshape(x.shape)
