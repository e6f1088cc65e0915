"""Value checks of stored tensors: NaN / Inf codes where the format has them, integer ranges, all zeros.

What each storage format can reveal:

* F8_E4M3 (`e4m3fn`): no infinities; NaN is the code with all exponent and mantissa bits set
  (0x7F and 0xFF). Such a code is an error.
* F8_E8M0 (UE8M0 scales): 0xFF is NaN; every other code is a power of two. 0xFF is an error.
* FP4 e2m1 (two codes per I8 byte): all 16 codes are finite numbers, so a corrupted or flipped byte
  is another valid value and cannot be detected from the data; only a checksum could.
* BF16 / F32: NaN and +-Inf are errors.
* I32 / I64 expert tables (`gate.tid2eid`): an id outside [0, n_routed_experts) is an error.
* A tensor whose values are all zero is a warning (legitimate for a bias, suspicious for a weight),
  and an error for the three tensors that would make the logits independent of the input: the
  embedding, the final norm and the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_NAN = 0x7F  # with the sign bit masked off
UE8M0_NAN = 0xFF
FATAL_IF_ZERO = ("embed.weight", "norm.weight", "head.weight")


@dataclass(frozen=True, slots=True)
class Finding:
    level: str  # "error" | "warning"
    tensor: str
    message: str


def _first(mask: torch.Tensor, shape: tuple[int, ...]) -> str:
    flat = int(mask.flatten().nonzero()[0])
    index = []
    for dim in reversed(shape):
        index.append(flat % dim)
        flat //= dim
    return f"{int(mask.sum())} of {mask.numel()} values, first at {list(reversed(index))}"


def scan(name: str, t: torch.Tensor, *, n_experts: int | None = None) -> list[Finding]:
    """Findings for one stored tensor `name` (a safetensors entry, e.g. `layers.0.attn.wq_a.scale`)."""
    if t.numel() == 0:
        return []
    out: list[Finding] = []
    shape = tuple(t.shape)
    if t.dtype == torch.float8_e4m3fn:
        codes = t.view(torch.uint8) & 0x7F
        nan = codes == E4M3_NAN
        if nan.any():
            out.append(Finding("error", name, f"NaN e4m3 codes (0x7F/0xFF): {_first(nan, shape)}"))
        zero = bool((codes == 0).all())
    elif t.dtype == torch.float8_e8m0fnu:
        nan = t.view(torch.uint8) == UE8M0_NAN
        if nan.any():
            out.append(Finding("error", name, f"NaN UE8M0 scale codes (0xFF): {_first(nan, shape)}"))
        zero = False  # UE8M0 has no zero
    elif t.dtype == torch.int8:  # packed e2m1 pairs: every code is finite
        zero = bool(((t.view(torch.uint8) & 0x77) == 0).all())
    elif t.dtype in (torch.int32, torch.int64):
        if n_experts is not None:
            bad = (t < 0) | (t >= n_experts)
            if bad.any():
                out.append(Finding("error", name, f"expert ids outside [0, {n_experts}): {_first(bad, shape)}"))
        zero = False
    else:
        bad = ~torch.isfinite(t)
        if bad.any():
            out.append(Finding("error", name, f"non-finite values (NaN/Inf): {_first(bad, shape)}"))
        zero = bool((t == 0).all())
    if zero:
        fatal = name in FATAL_IF_ZERO
        why = "the logits would not depend on the input" if fatal else "a trained weight is rarely all zero"
        out.append(Finding("error" if fatal else "warning", name, f"all values are zero ({why})"))
    return out
