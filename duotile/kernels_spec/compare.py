"""One comparison of a kernel's outputs with its reference, for every level of the ladder: the
interpreter's tests on the CPU, the shape sweep on the GPU and the benchmarks' check call the same
function, so no two of them judge the same outputs differently.

An exact spec is compared bit for bit, but for NaN: a NaN matches a NaN whatever its payload (a
non-finite block's values), and a NaN against a number, either way, is a difference. Other specs
are compared within ``spec.allowed_error``, a NaN matching a NaN and equal infinities matching
(a NaN against a number is off). The autotuner's correctness check takes the exact rule from here
too (``exact_mismatch``)."""

from __future__ import annotations

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's elements (float outputs compared on their bits, -0 != +0)."""
    if t.dtype.is_floating_point and t.element_size() in (2, 4, 8):
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def exact_mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if got.dtype.is_floating_point:
        gnan, wnan = got.isnan(), want.isnan()
        diff = (gnan != wnan) | (~gnan & ~wnan & (_bits(got) != _bits(want)))
    else:
        diff = got != want
    if not diff.any():
        return None
    first = int(torch.nonzero(diff.flatten())[0])
    return (f"{name} differs in {int(diff.sum())}/{diff.numel()} elements; first at flat index {first}: "
            f"got {got.flatten()[first].item()!r}, want {want.flatten()[first].item()!r}")


def mismatch(spec, case, inputs: dict, ref: dict) -> str | None:
    """None when every output of ``spec`` in ``inputs`` matches ``ref`` (module docstring), and each
    derived output the call has (``spec.derived``) is bit for bit the function of the kernel's own
    outputs it names; else what is off, naming the output, the count and the worst element."""
    off = _outputs_mismatch(spec, case, inputs, ref)
    if off is not None:
        return off
    for out, of in spec.derived.items():
        if inputs.get(out) is not None:
            off = exact_mismatch(f"{spec.name}/{out}", inputs[out], of(case, inputs).to(inputs[out].device))
            if off:
                return f"{off} (a function of the kernel's own outputs)"
    return None


def _outputs_mismatch(spec, case, inputs: dict, ref: dict) -> str | None:
    for out in spec.outputs:
        got, want = inputs[out], ref[out].to(inputs[out].device)
        if spec.exact:
            off = exact_mismatch(f"{spec.name}/{out}", got, want.to(got.dtype))
            if off:
                return off
            continue
        got, want = got.float(), want.float()
        allowed = spec.allowed_error(case, out, want, inputs).to(got.device)
        err = (got - want).abs()
        bad = ~((err <= allowed) | (got == want) | (got.isnan() & want.isnan()))
        if bad.any():
            worst = int(torch.argmax(torch.where(bad, err - allowed, torch.zeros_like(err))))
            return (f"{spec.name}/{out}: {int(bad.sum())}/{bad.numel()} elements off, max error "
                    f"{err.max().item():.3g}; worst at flat index {worst}: got {got.flatten()[worst].item():.6g}, "
                    f"want {want.flatten()[worst].item():.6g}, allowed {allowed.flatten()[worst].item():.3g}")
    return None


def check_outputs(spec, case, inputs: dict, ref: dict) -> None:
    """``mismatch`` as an assertion."""
    off = mismatch(spec, case, inputs, ref)
    assert off is None, off
