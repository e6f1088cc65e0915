"""RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w, fp32 math.

Model shapes (model.md 2.2): rows of width 4096 (hidden), 1024 (q_lora), 512 (kv);
16384 is the mHC-expanded width (4 x 4096). Decode path: rows are tokens, so the batch
dimension is T and each row is reduced on its own: the result never depends on T.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="T", dynamic=("T",))
def rmsnorm(x: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], weight: dsl.Tensor["D", dsl.bf16 | dsl.f32],
            y: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32], *,
            EPS: dsl.Const = 1e-6,
            ROWS: dsl.Tunable = dsl.choice(1, 2, 4, 8),
            ALIGN: dsl.Tunable = dsl.choice(2048, 1024, 65536)):
    # One tile covers the row (the padding reads zeros): the row rounded up to a multiple of ALIGN,
    # or to a power of two where that is narrower. 5,120 -> 6,144 rather than 8,192 at ALIGN 2048;
    # ALIGN 65536 is the power of two at every model width.
    width = dsl.minimum(dsl.next_pow2(x.D), dsl.cdiv(x.D, ALIGN) * ALIGN)
    for t in dsl.grid(dsl.cdiv(x.T, ROWS)):
        xt = dsl.load(x[t * ROWS, 0], (ROWS, width)).to(dsl.f32)
        mean_sq = (xt * xt).sum(axis=1) / x.D
        w = dsl.load(weight[0], (width,)).to(dsl.f32)
        dsl.store(y[t * ROWS, 0], (xt * dsl.rsqrt(mean_sq + EPS)[:, None] * w[None, :]).to(y.dtype))


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> dict:
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return {"y": (xf * inv * weight.float()).to(x.dtype)}


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    t, d = case["T"], case["D"]
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    x = torch.randn(t, d, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    return {"x": x.to(device), "weight": w.to(device), "y": torch.empty(t, d, dtype=dtype, device=device)}


def _tolerance(case, out):
    if case.get("dtype") == "f32":  # fp32 throughout: only the summation order differs
        return (1e-5, 1e-5)
    return (1.6e-2, 1.6e-2)  # one bf16 ulp of the output


SPEC = register(Spec(
    kernel=rmsnorm,
    reference=lambda x, weight, EPS=1e-6: rmsnorm_reference(x, weight, EPS),
    make_inputs=_inputs,
    outputs=("y",),
    cases={"t3_d4096": {"T": 3, "D": 4096}, "t17_d16384": {"T": 17, "D": 16384},
           "t5_d1000": {"T": 5, "D": 1000}, "t64_d512": {"T": 64, "D": 512},
           "f32_t7_d96": {"T": 7, "D": 96, "dtype": "f32"}},  # the runtime's fp32 activations
    build_cases={"hidden": {"T": 4096, "D": 4096}, "mhc": {"T": 4096, "D": 16384}},
    tolerance=_tolerance,
    bytes_moved=lambda c: 2 * 2 * c["T"] * c["D"] + 2 * c["D"],
    model_shapes=shapes.for_models(shapes.rmsnorm_shapes),
    sweep={"T": Dim(1, 67, large=4099), "D": Dim(1, 777, large=20480), "dtype": OneOf("bf16", "f32")},
))
