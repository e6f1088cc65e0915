"""mHC's final collapse of the streams into the hidden row before the final RMSNorm (model.md 2.1,
2.3.4, 2.13, 5.3). Per token, streams ``X[s]`` (``x``: T x 4 x D)::

    V4:    m = (fn @ v) * rsqrt(sum(v^2) / 4D + EPS)     fn: hc_head_fn [4, 4D]
           w_s = sigmoid(m[s] * scale[0] + base[s]) + HC_EPS   (no Sinkhorn)
    V4.1:  w = the last site's pre (``pre_in``): the model has no hc_head parameters
    y    = rnd(sum_s w_s * X[s])                           f32, rnd = round to y's dtype

Its own spec rather than a form of ``hc_pre``: the head has other parameters (4 rows of ``fn``,
one scale) and one output, so one signature would need optional outputs and a row count that
changes with the form, and the call could check neither; here each form's tensors are checked
at the call, and the loops are ``hc_pre``'s helpers (``mix_sums``, ``collapse_pass``). V4.1's
final collapse (2.13: ``h = sum_s pre_prev[s] X[s]``) is the same sum with given weights, so it
is this kernel with ``pre_in`` and without ``fn`` / ``base`` / ``scale``, in one read of the
streams.

Tolerance: as ``hc_pre``'s ``pre`` and ``y`` (its module docstring): the float64 reference from
model.md, the mixes' summation-depth bound through sigmoid's slope, 5 u of the f32 sum and one
unit in the last place of y's dtype; with ``pre_in`` only the last two.

Decode path: each token is computed on its own: batch dimension T, dynamic.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .hc_pre import (
    HC,
    HC_EPS,
    RMS_EPS,
    check_constants,
    collapse_bound,
    collapse_pass,
    mix_bounds,
    mix_sums,
    mixes_f64,
    phases,
    pick,
    previous_pre,
    sigmoid_bound,
    site_params,
    streams,
    ulp_rtol,
)
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="T", dynamic=("T",))
def hc_head(x: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32], y: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32],
            fn: dsl.OptionalTensor[4, "K", dsl.f32] = None, base: dsl.OptionalTensor[4, dsl.f32] = None,
            scale: dsl.OptionalTensor[1, dsl.f32] = None, pre_in: dsl.OptionalTensor["T", 4, dsl.f32] = None, *,
            EPS: dsl.Const = 1e-6, HC_EPS: dsl.Const = HC_EPS, BK: dsl.Tunable = dsl.choice(256, 128, 512, 64)):
    check_constants(EPS, HC_EPS)
    if (pre_in is None) == (fn is None or base is None or scale is None):
        raise dsl.DslError("hc_head takes either fn, base and scale (V4's hc_head_*) or pre_in (V4.1)")
    for t in dsl.grid(x.T):
        if pre_in is not None:
            collapse_pass(x, y, t, [dsl.load(pre_in[t, s], (1,))[:, None] for s in range(HC)], BK)
        else:
            dots, ss = mix_sums(x, fn, t, HC, BK)
            m = dots * dsl.rsqrt(ss / (HC * x.D) + EPS)
            w = dsl.sigmoid(m * dsl.load(scale[0], (1,)) + dsl.load(base[0], (HC,))) + HC_EPS
            collapse_pass(x, y, t, [pick(w, s, 1)[:, None] for s in range(HC)], BK)


def head_weights(x, fn, base, scale, eps, hc_eps) -> torch.Tensor:
    """model.md 2.3.4's sigmoid weights in float64."""
    m, _ = mixes_f64(x, fn, eps)
    return torch.sigmoid(m * scale.double()[0] + base.double()) + hc_eps


def hc_head_reference(x, fn=None, base=None, scale=None, pre_in=None, EPS=1e-6, HC_EPS=HC_EPS) -> dict:
    """model.md 2.3.4 (V4) or 2.13's final collapse by the last site's pre (V4.1), in float64."""
    w = pre_in.double() if pre_in is not None else head_weights(x, fn, base, scale, EPS, HC_EPS)
    return {"y": (w[:, :, None] * x.double()).sum(1).to(x.dtype)}


def _extra_error(case, out, inputs):
    x, eps = inputs["x"], case.get("EPS", 1e-6)
    if "pre_in" in inputs:
        return (collapse_bound(x, inputs["pre_in"], None) * (1 + ulp_rtol(x.dtype))).float()
    fn, base, scale = inputs["fn"], inputs["base"].double(), inputs["scale"].double()
    m, _ = mixes_f64(x, fn, eps)
    dw = sigmoid_bound(m, mix_bounds(x, fn, eps), scale[0], base)
    w = head_weights(x, fn, base, scale, eps, HC_EPS)
    return (collapse_bound(x, w, dw) * (1 + ulp_rtol(x.dtype))).float()


def _dtype(case) -> torch.dtype:
    return torch.float32 if case.get("dtype") == "f32" else torch.bfloat16


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    dtype = _dtype(case)
    out = {"y": torch.empty(t, d, dtype=dtype, device=device)}
    if device.type == "meta":
        out["x"] = torch.empty(t, HC, d, dtype=dtype, device=device)
        if case.get("single_pass"):
            out["pre_in"] = torch.empty(t, HC, device=device)
        else:
            out.update(fn=torch.empty(HC, HC * d, device=device), base=torch.empty(HC, device=device),
                       scale=torch.empty(1, device=device))
        return out
    gen = torch.Generator().manual_seed(seed)
    out["x"] = streams(case.get("values", "normal"), t, d, gen).to(dtype).to(device)
    if case.get("single_pass"):
        out["pre_in"] = previous_pre(t, gen).to(device)
    else:
        fn, base, scale = site_params(case.get("params", "normal"), HC * d, HC, 1, gen)
        out.update(fn=fn.to(device), base=base.to(device), scale=scale.to(device))
    return out


def _reads(case) -> int:
    """Rows of D moved a token: the streams once (V4.1) or twice (V4: the mixes, then the sum), and y."""
    return HC * (1 if case.get("single_pass") else 2) + 1


def head_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The final collapse at the decode token counts and a prefill chunk (every token: the
    reference collapses them all before picking the rows it needs logits of): V4 with hc_head_*,
    V4.1 by the last site's pre."""
    out: dict[str, shapes.Case] = {}
    for phase, t in phases(decode_t):
        case = {"T": t, "D": m.hidden, "EPS": RMS_EPS[m.name], "model": m.name}
        if m.name == "v41-flash":
            case["single_pass"] = True
        out[f"{m.short}/head_d{m.hidden}/{phase}"] = case
    return out


SPEC = register(Spec(
    kernel=hc_head,
    reference=hc_head_reference,
    make_inputs=_inputs,
    outputs=("y",),
    cases={"v4_t3_d4096": {"T": 3, "D": 4096},
           "v41_t2_d5120_single": {"T": 2, "D": 5120, "EPS": 1e-20, "single_pass": True},
           "ragged_t5_d200": {"T": 5, "D": 200, "config": {"BK": 64}},
           "zeros_t4_d128_f32": {"T": 4, "D": 128, "values": "zeros", "dtype": "f32", "EPS": 1e-20},
           "flat_t3_d96_single_f32": {"T": 3, "D": 96, "dtype": "f32", "single_pass": True}},
    build_cases={"v4_head": {"T": 4096, "D": 4096}, "v41_head": {"T": 4096, "D": 5120, "single_pass": True}},
    tolerance=lambda case, out: (0.0, ulp_rtol(_dtype(case))),
    extra_error=_extra_error,
    constants_of=lambda case: {"EPS": case.get("EPS", 1e-6)},
    flops=lambda c: (2.0 if c.get("single_pass") else 10.0) * HC * c["T"] * c["D"],
    bytes_moved=lambda c: _reads(c) * c["T"] * c["D"] * (4 if c.get("dtype") == "f32" else 2)
    + (0 if c.get("single_pass") else 4 * HC * HC * c["D"]),
    model_shapes=shapes.for_models(head_shapes),
    sweep={"T": Dim(1, 12, large=4099), "D": Dim(1, 300, large=5120), "dtype": OneOf("bf16", "f32"),
           "EPS": OneOf(1e-6, 1e-20), "single_pass": OneOf(True, False), "params": OneOf("normal", "flat"),
           "values": OneOf("normal", "zeros", "same"), "config": {"BK": OneOf(256, 128, 512, 64)}},
))
