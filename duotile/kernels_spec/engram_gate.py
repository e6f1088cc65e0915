"""V4.1 Engram's gate (model.md 2.13 step 6): the gathered rows' projection written into the mHC
streams. Per token, with the streams ``x`` (T x 4 x D), the per-stream keys ``key`` (T x 4 x D)
and the shared value ``value`` (T x D) that ``wkv`` made of the 24 gathered rows, and
``qk = q_weight * k_weight`` (4 x D)::

    dot_s = sum_c x[s,c] qk[s,c] key[s,c] * rsqrt(mean(x[s]^2) + eps) * rsqrt(mean(key[s]^2) + eps) / sqrt(D)
    g_s   = sigmoid(sign(dot_s) * sqrt(max(|dot_s|, 1e-6)))
    out[s] = rnd(x[s] + g_s * value)

in f32, rounded to the streams' dtype (the runtime's ``Engram.__call__``; V4.1-Flash: D = 5120,
eps = rms_norm_eps = 1e-20). The split: the ids come from ``engram_hash``, the 24 rows from
``gather_rows`` and key / value from the ``wkv`` GEMM (6144 -> 5 x 5120, the existing ``gemm`` /
``gemm_blockscaled`` specs): what is left is a per-token reduction over D and an elementwise
update, one kernel reading the streams twice. Each program takes one token: ``BD`` channels of
its four streams at a time, three (4, BD) f32 lane sums (x^2, key^2, x qk key), reduced over the
lanes, then the gate and a second pass over the channels writing ``x + g v``.

Bitwise and not: the update ``x + g v`` is the runtime's expression in its order (the product
then the sum, rounded once more to the dtype), so for equal gates the outputs are equal (a GPU
contracting it into an FMA rounds once instead of twice: at most one output ulp). The three sums
over D are not in the runtime's order (torch's vectorised sum, or ``InvariantOps``' padded binary
tree, which a kernel holding lane sums over BD-wide steps does not reproduce), so the gate differs
by rounding: the tolerance below bounds it.

Tolerance, against model.md's formula in float64. With u = 2^-24 and n = D, an f32 sum of n
terms in any order (FMA or not, each term's own one or two roundings included) is within
(n + 1) u of the sum of their magnitudes; the means, the two ``rsqrt`` (at most 2 ulp on CUDA)
and the three products add a few u more, so with Q = sum |x qk key| and r c the exact
normalisation::

    |dot_f32 - dot| <= E = (2 n + 32) u Q r c
    |g_f32 - g|     <= (z(dot + E) - z(dot - E)) / 4 + 8 u      z = sign(d) sqrt(max(|d|, 1e-6))

since z is non-decreasing in d and sigmoid' <= 1/4 (a dot within E of 0 may change sign, which
this covers); the update adds |dg| |v| + 2 u (|x| + 2 |g v|), and the two roundings to the dtype
one unit in its last place (2^-7 of the value for bf16, 2^-23 for f32). The runtime's f32 gate
obeys the same bound, so kernel and runtime agree within twice it (tested on the tiny V4.1
model's Engram, D = 256; against the formula alone at D = 5120 as well).

Decode path: each token is computed on its own: batch dimension T, dynamic.
"""

from __future__ import annotations

import math

import torch

from .. import dsl
from . import model_shapes as shapes
from .hc_pre import HC, RMS_EPS, U, ulp_rtol
from .registry import Dim, OneOf, Spec, register

FLOOR = 1e-6  # the |dot| below which the gate's square root is clamped


def gate_of(sxx, skk, sxk, d, eps):
    """The gate of one token's streams (HC,) from its three sums over the D channels."""
    rstd = dsl.rsqrt(sxx / d + eps) * dsl.rsqrt(skk / d + eps)
    dot = sxk * rstd * dsl.rsqrt(dsl.full((1,), 1.0) * d)
    mag = dsl.sqrt(dsl.maximum(abs(dot), FLOOR))
    return dsl.sigmoid(dsl.where(dot < 0.0, -mag, dsl.where(dot > 0.0, mag, 0.0)))


@dsl.kernel(batch_dim="T", dynamic=("T",))
def engram_gate(x: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32], key: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32],
                value: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], qk: dsl.Tensor[4, "D", dsl.bf16 | dsl.f32],
                out: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32], *,
                EPS: dsl.Const = 1e-20,
                BD: dsl.Tunable = dsl.choice(512, 128, 256, 1024)):
    steps = dsl.cdiv(x.D, BD)
    for t in dsl.grid(x.T):
        sxx, skk, sxk = (dsl.zeros((HC, BD), dsl.f32) for _ in range(3))
        for j in dsl.range(steps):
            h = dsl.load(x[t, 0, j * BD], (HC, BD)).to(dsl.f32)
            k = dsl.load(key[t, 0, j * BD], (HC, BD)).to(dsl.f32)
            sxx[:] = sxx + h * h
            skk[:] = skk + k * k
            sxk[:] = sxk + h * dsl.load(qk[0, j * BD], (HC, BD)).to(dsl.f32) * k
        g = gate_of(sxx.sum(axis=1), skk.sum(axis=1), sxk.sum(axis=1), x.D, EPS)[:, None]
        for j in dsl.range(steps):
            h = dsl.load(x[t, 0, j * BD], (HC, BD)).to(dsl.f32)
            v = dsl.load(value[t, j * BD], (1, BD)).to(dsl.f32)
            dsl.store(out[t, 0, j * BD], (h + g * v).to(out.dtype))


def _exact_dot(x, key, qk, eps):
    """(dot, Q r c) in float64: model.md's normalised dot and its terms' magnitude."""
    h, k, w = x.double(), key.double(), qk.double()
    norm = torch.rsqrt((h * h).mean(-1) + eps) * torch.rsqrt((k * k).mean(-1) + eps) / math.sqrt(h.shape[-1])
    return (h * w * k).sum(-1) * norm, (h * w * k).abs().sum(-1) * norm


def _z(dot):
    return torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=FLOOR))


def engram_gate_reference(x, key, value, qk, EPS=1e-20) -> dict:
    """model.md 2.13 step 6 in float64, rounded to the streams' dtype."""
    dot, _ = _exact_dot(x, key, qk, EPS)
    gate = torch.sigmoid(_z(dot))
    return {"out": (x.double() + gate[..., None] * value.double()[:, None, :]).to(x.dtype)}


def gate_error(x, key, qk, eps):
    """(gate, bound on |g_f32 - g|) per token and stream, float64 (the docstring's derivation)."""
    dot, mag = _exact_dot(x, key, qk, eps)
    spread = (2 * x.shape[-1] + 32) * U * mag
    return torch.sigmoid(_z(dot)), (_z(dot + spread) - _z(dot - spread)) / 4 + 8 * U


def _extra_error(case, out, inputs):
    x, v = inputs["x"].double(), inputs["value"].double()[:, None, :]
    gate, dg = gate_error(inputs["x"], inputs["key"], inputs["qk"], case.get("EPS", 1e-20))
    f32 = dg[..., None] * v.abs() + 2 * U * (x.abs() + 2 * (gate[..., None] * v).abs())
    return (f32 * (1 + ulp_rtol(inputs["x"].dtype))).float()


def _dtype(case) -> torch.dtype:
    return torch.float32 if case.get("dtype") == "f32" else torch.bfloat16


def _keys(kind: str, x: torch.Tensor, qk: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``random`` keys; ``aligned`` keys near +-x / qk (dots far from 0: gates near 0 or 1);
    ``small`` keys whose dots cancel to near 0 (the 1e-6 clamp and the sign); ``zero`` a zero
    key in every other stream (dot exactly 0, gate 1/2)."""
    t, _, d = x.shape
    k = torch.randn(t, HC, d, generator=g)
    if kind == "aligned":
        sign = torch.where(torch.rand(t, HC, 1, generator=g) < 0.5, -1.0, 1.0)
        k = sign * x / qk + 0.3 * k
    elif kind == "small":  # k minus its component along x qk: the dot is rounding noise
        xw = x * qk
        k = k - ((xw * k).sum(-1, keepdim=True) / (xw * xw).sum(-1, keepdim=True).clamp(min=1e-30)) * xw
    elif kind == "zero":
        k[:, ::2] = 0.0
    return k * torch.exp2(torch.randint(-6, 7, (t, HC, 1), generator=g).float())


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    dtype = _dtype(case)
    if device.type == "meta":
        stream = torch.empty(t, HC, d, dtype=dtype, device=device)
        return {"x": stream, "key": torch.empty_like(stream), "value": torch.empty(t, d, dtype=dtype, device=device),
                "qk": torch.empty(HC, d, dtype=dtype, device=device), "out": torch.empty_like(stream)}
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, HC, d, generator=g) * torch.exp2(torch.randint(-8, 9, (t, 1, 1), generator=g).float()))
    x = x.to(dtype).float()
    qk = ((1 + 0.1 * torch.randn(HC, d, generator=g)) * (1 + 0.1 * torch.randn(HC, d, generator=g))).to(dtype)
    key = _keys(case.get("values", "random"), x, qk.float(), g)
    return {"x": x.to(dtype).to(device), "key": key.to(dtype).to(device), "qk": qk.to(device),
            "value": torch.randn(t, d, generator=g).to(dtype).to(device),
            "out": torch.full((t, HC, d), float("nan"), dtype=dtype, device=device)}


def gate_shapes(m: shapes.ModelDims) -> dict[str, shapes.Case]:
    """V4.1-Flash: the decode batches and a prefill chunk at D = the hidden size."""
    if m.name != "v41-flash":
        return {}  # V4 has no Engram
    tokens = [*((f"decode{b}", b) for b in shapes.DECODE_BATCHES), (f"prefill{shapes.PREFILL_CHUNK}",
                                                                     shapes.PREFILL_CHUNK)]
    return {f"{m.short}/streams_d{m.hidden}/{phase}": {"T": n, "D": m.hidden, "EPS": RMS_EPS[m.name], "model": m.name}
            for phase, n in tokens}


SPEC = register(Spec(
    kernel=engram_gate,
    reference=engram_gate_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={"v41_t3_d5120": {"T": 3, "D": 5120}, "aligned_t2_d1000": {"T": 2, "D": 1000, "values": "aligned"},
           "small_t4_d300": {"T": 4, "D": 300, "values": "small", "config": {"BD": 256}},
           "zero_f32_t5_d96": {"T": 5, "D": 96, "dtype": "f32", "values": "zero", "EPS": 1e-6}},
    build_cases={"v41_decode64": {"T": 64, "D": 5120}, "v41_prefill": {"T": 4096, "D": 5120}},
    tolerance=lambda case, out: (0.0, ulp_rtol(_dtype(case))),
    extra_error=_extra_error,
    constants_of=lambda case: {"EPS": case.get("EPS", 1e-20)},
    flops=lambda c: 12.0 * HC * c["T"] * c["D"],
    bytes_moved=lambda c: (4 * HC + 1) * c["T"] * c["D"] * (4 if c.get("dtype") == "f32" else 2),
    model_shapes=shapes.for_models(gate_shapes),
    sweep={"T": Dim(1, 9, large=4099), "D": Dim(1, 600, large=5120), "dtype": OneOf("bf16", "f32"),
           "values": OneOf("random", "aligned", "small", "zero"), "EPS": OneOf(1e-20, 1e-6),
           "config": {"BD": OneOf(128, 256, 512, 1024)}},
))
