"""mHC's expand at one site (model.md 2.3.3, 5.3): the sub-layer's output written back into the
residual streams. Per token, with the sub-layer output ``f`` (T x D), the streams the site read
``r`` (T x 4 x D) and the site's ``post`` (T x 4) and ``comb`` (T x 4 x 4, from ``hc_pre``)::

    out[j] = rnd(post_j * f + ((comb[0, j] R[0] + comb[2, j] R[2]) + (comb[1, j] R[1] + comb[3, j] R[3])))

in f32, rounded to the streams' dtype: output stream j takes column j of ``comb`` (the
contraction is over the first index: comb is not symmetric). The sum over i is model.md's, in the
pairwise order of the runtime's batch-invariant ``ops.sum`` over 4 terms (``InvariantOps``: the
first half added to the second), so that on the interpreter the kernel gives the runtime's
``expand`` under ``InvariantOps`` bit for bit (tested).

Each program takes one token and ``BD`` channels of it: the four residual rows and ``f`` once,
all four output streams as one (4, BD) tile, comb's rows i as (4,) tiles over j.

Tolerance: the reference is model.md's formula in float64. A target that contracts a multiply and
add into one FMA, or reorders the four terms, moves the f32 value by at most 8 u of the sum of
the terms' magnitudes (u = 2^-24); the two roundings to the output dtype then differ by at most
one unit in its last place (2^-7 of the value for bf16, 2^-23 for f32).

Decode path: each token is computed on its own: batch dimension T, dynamic.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .hc_pre import HC, U, phases, ulp_rtol
from .moe_combine import add_in_order, tree_order
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="T", dynamic=("T",))
def hc_post(f: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], r: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32],
            post: dsl.Tensor["T", 4, dsl.f32], comb: dsl.Tensor["T", 4, 4, dsl.f32],
            out: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32], *,
            BD: dsl.Tunable = dsl.choice(512, 256, 1024, 2048)):
    for t, n in dsl.grid(r.T, dsl.cdiv(r.D, BD)):
        ft = dsl.load(f[t, n * BD], (1, BD)).to(dsl.f32)
        terms = [dsl.load(comb[t, i, 0], (HC,))[:, None] * dsl.load(r[t, i, n * BD], (1, BD)).to(dsl.f32)
                 for i in range(HC)]
        mixed = add_in_order(tree_order(HC), terms.__getitem__)
        y = dsl.load(post[t, 0], (HC,))[:, None] * ft + mixed
        dsl.store(out[t, 0, n * BD], y.to(out.dtype))


def hc_post_reference(f, r, post, comb) -> dict:
    """model.md 2.3.3 in float64: out[j] = post_j f + sum_i comb[i, j] R[i]."""
    mixed = torch.einsum("tij,tid->tjd", comb.double(), r.double())
    return {"out": (post.double()[:, :, None] * f.double()[:, None, :] + mixed).to(r.dtype)}


def _extra_error(case, out, inputs):
    """8 u of the terms' magnitudes (FMA contraction or another order), one ulp of the dtype more."""
    mag = torch.einsum("tij,tid->tjd", inputs["comb"].double().abs(), inputs["r"].double().abs())
    mag = mag + inputs["post"].double().abs()[:, :, None] * inputs["f"].double().abs()[:, None, :]
    return (8 * U * mag * (1 + ulp_rtol(inputs["r"].dtype))).float()


def _dtype(case) -> torch.dtype:
    return torch.float32 if case.get("dtype") == "f32" else torch.bfloat16


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    dtype = _dtype(case)
    if device.type == "meta":
        return {"f": torch.empty(t, d, dtype=dtype, device=device),
                "r": torch.empty(t, HC, d, dtype=dtype, device=device),
                "post": torch.empty(t, HC, device=device), "comb": torch.empty(t, HC, HC, device=device),
                "out": torch.empty(t, HC, d, dtype=dtype, device=device)}
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (t, 1, 1), generator=gen).float())
    comb = torch.rand(t, HC, HC, generator=gen)
    if case.get("values") == "sinkhorn":  # near doubly stochastic, as hc_pre gives it
        for _ in range(20):
            comb = comb / comb.sum(-1, keepdim=True)
            comb = comb / comb.sum(-2, keepdim=True)
    return {"f": (torch.randn(t, d, generator=gen) * scale[:, 0]).to(dtype).to(device),
            "r": (torch.randn(t, HC, d, generator=gen) * scale).to(dtype).to(device),
            "post": (2 * torch.rand(t, HC, generator=gen)).to(device), "comb": comb.to(device),
            "out": torch.empty(t, HC, d, dtype=dtype, device=device)}


def post_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """Every mHC site's expand at the decode token counts and a prefill chunk: D = the hidden size."""
    return {f"{m.short}/site_d{m.hidden}/{phase}": {"T": t, "D": m.hidden, "model": m.name}
            for phase, t in phases(decode_t)}


SPEC = register(Spec(
    kernel=hc_post,
    reference=hc_post_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={"v4_t3_d4096": {"T": 3, "D": 4096, "values": "sinkhorn"},
           "v41_t2_d5120": {"T": 2, "D": 5120, "config": {"BD": 2048}},
           "ragged_t5_d300": {"T": 5, "D": 300, "config": {"BD": 256}},
           "f32_t7_d96": {"T": 7, "D": 96, "dtype": "f32", "values": "sinkhorn"}},
    build_cases={"v4_site": {"T": 4096, "D": 4096}, "v41_site": {"T": 4096, "D": 5120}},
    tolerance=lambda case, out: (0.0, ulp_rtol(_dtype(case))),
    extra_error=_extra_error,
    flops=lambda c: 10.0 * HC * c["T"] * c["D"],
    bytes_moved=lambda c: (2 * HC + 1) * c["T"] * c["D"] * (4 if c.get("dtype") == "f32" else 2) + 80 * c["T"],
    model_shapes=shapes.for_models(post_shapes),
    sweep={"T": Dim(1, 24, large=4099), "D": Dim(1, 600, large=5120), "dtype": OneOf("bf16", "f32"),
           "values": OneOf("random", "sinkhorn"), "config": {"BD": OneOf(512, 256, 1024, 2048)}},
))
