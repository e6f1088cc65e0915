"""mHC at one site (model.md 2.3.1, 2.3.2, 5.3; V4.1's single-pass wiring in 2.13): the site's mixes
from the residual streams, and the collapsed sub-layer input, in one kernel.

Per token, with streams ``X[s]`` (s = 0..3, ``x`` is T x 4 x D) and ``v`` = the 4D streams
flattened (index ``s * D + c``), all in f32::

    rinv   = rsqrt(sum(v^2) / 4D + EPS)                         EPS = rms_norm_eps
    m      = (fn @ v) * rinv                                    fn: 24 x 4D (f32), m: 24
    z      = m * scale[g] + base                                g = 0, 1, 2 for m[0:4], m[4:8], m[8:24]
    pre_s  = sigmoid(z[s]) + HC_EPS          post_s = 2 * sigmoid(z[4 + s])
    comb   = Sinkhorn(C0),  C0[i, j] = z[8 + 4i + j]:  M = softmax_j(C0) + HC_EPS, then M / (column
             sums + HC_EPS), then ITERS - 1 times rows / (row sums + HC_EPS), columns likewise
    y      = rnd(sum_s w_s * X[s])                              rnd = round to y's dtype

Outputs: ``pre`` (T x 4), ``post`` (T x 4), ``comb`` (T x 4 x 4, [i, j] as HCPost contracts it
over i), all f32, and ``y`` (T x D), the site's collapsed input before its RMSNorm. The collapse
weights ``w``: V4 (two-pass, ``pre_in`` left out) collapses with this site's own ``pre``, so the
kernel reads the streams twice (the mixes, then the sum); V4.1 (single-pass) collapses with the
previous site's ``pre``, passed as ``pre_in`` (T x 4; layer 0's attention site passes one-hot
stream 0), and the sum is taken in the same read of the streams as the mixes (model.md 2.13:
"in one read of the streams"). ``fn`` is the checkpoint's [24, 4D] matrix as stored (``K`` must
be 4 x D: the call cannot check a product of sizes; the runtime's ``hc_*_fn`` always is).

Each program takes one token: it walks the D channels in chunks of ``BK`` for every stream,
accumulating ``fn``'s 24 rows times the chunk and the squares lane by lane (one (24, BK) tile),
reduces them, and does the 4 x 4 Sinkhorn in registers (``ITERS`` = 20 as model.md's 1 + 19
rounds, a loop). The (24,) logits are split into pre / post / comb rows by masked sums (one term
and zeros: exact). The collapse adds the four weighted streams in the pairwise order of the
runtime's batch-invariant sum, ``(s0 + s2) + (s1 + s3)``. The program reads all of ``fn``
(1.6 MB in V4, 2 MB in V4.1) per token; a form sharing ``fn`` tiles across tokens (a prefill
chunk) or splitting K over programs (a decode step of one token) is not written yet.

Tolerance (``mix_bounds``, ``_extra_error``): the reference is model.md's math in float64. The
kernel's f32 dot products of 4D terms are summed lane by lane then by a tree, at most ``depth``
= 4 ceil(D / 64) + 10 roundings deep for every ``BK`` of the space, so ``|dm| <= depth u
sum|fn v| rinv + |m| (depth / 2 + 5) u`` (u = 2^-24; rsqrt within 2 ulp). Through sigmoid (slope
at most 1/4) that gives ``pre``'s and ``post``'s bounds plus 8 u of their own rounding; ``comb``'s
is the float64 Sinkhorn's Jacobian (per token, exact derivative) applied to the logits' bound,
doubled for the second-order terms, plus 2^-16 for the f32 Sinkhorn's own rounding: a measured
bound (the f32 and float64 Sinkhorn differ by at most 2^-18 over logits of scale 0.1 to 40,
``test_mhc``), not a proof. ``y`` gets one unit in the last place of its dtype (two roundings of
nearby values) plus the weights' bound times |X| and 5 u of the f32 sum. Where ``pre_in`` is given
the collapse takes exact inputs in the same order as the runtime's ``collapse`` under
``InvariantOps``, and the interpreter matches it bit for bit (tested).

Decode path: each token is computed on its own: batch dimension T, dynamic.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .moe_combine import add_in_order, tree_order
from .registry import Dim, OneOf, Spec, register

HC = 4  # hc_mult (model.md 1.1, 1.7)
MIX = (2 + HC) * HC  # 24 mix logits: pre, post, comb
HC_EPS = 1e-6  # hc_eps
ITERS = 20  # hc_sinkhorn_iters
RMS_EPS = {"v4-flash": 1e-6, "v41-flash": 1e-20}  # rms_norm_eps (model.md 1.1, 1.7)
U = 2.0 ** -24  # f32 unit roundoff
BK_SPACE = (128, 64, 256, 512)


def check_constants(EPS, HC_EPS, ITERS=1) -> None:
    for name, eps in (("EPS", EPS), ("HC_EPS", HC_EPS)):
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 <= eps < 1):
            raise dsl.DslError(f"{name} {eps!r} must be a number in [0, 1)")
    if not (isinstance(ITERS, int) and not isinstance(ITERS, bool) and ITERS >= 1):
        raise dsl.DslError(f"ITERS {ITERS!r} must be a positive int: the Sinkhorn rounds")


def pick(v, lo: int, n: int):
    """Entries ``lo .. lo + n`` of the 1-d tile ``v`` as an (n,) tile: a masked sum of one term."""
    q = dsl.arange(v.shape[0])
    return dsl.where(q[None, :].eq(lo + dsl.arange(n)[:, None]), v[None, :], 0.0).sum(axis=1)


def weighted_sum(weights, rows):
    """sum_s weights[s] * rows[s], (1, 1) weights times (1, BK) rows, added in the runtime's
    batch-invariant pairwise order (``InvariantOps.sum``: (t0 + t2) + (t1 + t3))."""
    return add_in_order(tree_order(len(rows)), lambda s: weights[s] * rows[s])


def mix_sums(x, fn, t, rows: int, BK, weights=None, y=None):
    """One token's ``fn[:rows] @ v`` (rows,) and ``sum(v^2)`` (1,), walking D in chunks of BK for
    every stream; with ``weights`` (one (1, 1) tile a stream) the collapse goes to ``y`` in the
    same pass."""
    acc = dsl.zeros((rows, BK), dsl.f32)
    sq = dsl.zeros((1, BK), dsl.f32)
    for k in dsl.range(dsl.cdiv(x.D, BK)):
        streams = []
        for s in range(HC):
            xs = dsl.load(x[t, s, k * BK], (1, BK)).to(dsl.f32)
            acc[:] = acc + dsl.load(fn[0, s * x.D + k * BK], (rows, BK)) * xs
            sq[:] = sq + xs * xs
            streams.append(xs)
        if weights is not None:
            dsl.store(y[t, k * BK], weighted_sum(weights, streams).to(y.dtype))
    return acc.sum(axis=1), sq.sum(axis=1)


def collapse_pass(x, y, t, weights, BK):
    """A second read of the token's streams: ``y = sum_s weights[s] * X[s]``."""
    for k in dsl.range(dsl.cdiv(x.D, BK)):
        streams = [dsl.load(x[t, s, k * BK], (1, BK)).to(dsl.f32) for s in range(HC)]
        dsl.store(y[t, k * BK], weighted_sum(weights, streams).to(y.dtype))


def sinkhorn(c0, iters: int, eps: float):
    """model.md 2.3.2 on a (4, 4) tile: row softmax + eps, a column normalisation, then
    ``iters - 1`` rounds of rows then columns, eps in every denominator."""
    e = dsl.exp(c0 - c0.max(axis=1)[:, None])
    m = dsl.zeros((HC, HC), dsl.f32)
    m[:] = e / e.sum(axis=1)[:, None] + eps
    m[:] = m / (m.sum(axis=0)[None, :] + eps)
    for _ in dsl.range(iters - 1):
        m[:] = m / (m.sum(axis=1)[:, None] + eps)
        m[:] = m / (m.sum(axis=0)[None, :] + eps)
    return m


def comb_logits(z):
    """C0[i, j] = z[8 + 4i + j] as a (4, 4) tile."""
    row = dsl.arange(HC)[:, None]
    c0 = pick(z, 2 * HC + HC * (HC - 1), HC)[None, :]
    for i in range(HC - 2, -1, -1):
        c0 = dsl.where(row.eq(i), pick(z, 2 * HC + HC * i, HC)[None, :], c0)
    return c0


@dsl.kernel(batch_dim="T", dynamic=("T",))
def hc_pre(x: dsl.Tensor["T", 4, "D", dsl.bf16 | dsl.f32], fn: dsl.Tensor[24, "K", dsl.f32],
           base: dsl.Tensor[24, dsl.f32], scale: dsl.Tensor[3, dsl.f32],
           pre: dsl.Tensor["T", 4, dsl.f32], post: dsl.Tensor["T", 4, dsl.f32],
           comb: dsl.Tensor["T", 4, 4, dsl.f32], y: dsl.Tensor["T", "D", dsl.bf16 | dsl.f32],
           pre_in: dsl.OptionalTensor["T", 4, dsl.f32] = None, *,
           EPS: dsl.Const = 1e-6, HC_EPS: dsl.Const = HC_EPS, ITERS: dsl.Const = ITERS,
           BK: dsl.Tunable = dsl.choice(*BK_SPACE)):
    check_constants(EPS, HC_EPS, ITERS)
    for t in dsl.grid(x.T):
        given = None
        if pre_in is not None:  # V4.1: the previous site's pre, collapsed in the same pass
            given = [dsl.load(pre_in[t, s], (1,))[:, None] for s in range(HC)]
        dots, ss = mix_sums(x, fn, t, MIX, BK, given, y)
        q = dsl.arange(MIX)
        group = dsl.where(q < HC, dsl.load(scale[0], (1,)),
                          dsl.where(q < 2 * HC, dsl.load(scale[1], (1,)), dsl.load(scale[2], (1,))))
        z = dots * dsl.rsqrt(ss / (HC * x.D) + EPS) * group + dsl.load(base[0], (MIX,))
        p = dsl.sigmoid(pick(z, 0, HC)) + HC_EPS
        dsl.store(pre[t, 0], p[None, :])
        dsl.store(post[t, 0], (2.0 * dsl.sigmoid(pick(z, HC, HC)))[None, :])
        dsl.store(comb[t, 0, 0], sinkhorn(comb_logits(z), ITERS, HC_EPS))
        if pre_in is None:  # V4: this site's own pre, a second read of the streams
            collapse_pass(x, y, t, [pick(p, s, 1)[:, None] for s in range(HC)], BK)


# -- reference and tolerance ---------------------------------------------------------------------

def mixes_f64(x: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """model.md 2.3.1's ``m = (fn @ v) * rsqrt(mean(v^2) + eps)`` in float64, and ``rinv``."""
    v = x.double().flatten(1)
    rinv = torch.rsqrt((v * v).mean(-1) + eps)
    return (v @ fn.double().T) * rinv[:, None], rinv


def sinkhorn_reference(c0: torch.Tensor, iters: int = ITERS, eps: float = HC_EPS) -> torch.Tensor:
    """model.md 2.3.2 over [..., 4, 4] in c0's dtype."""
    m = torch.softmax(c0, -1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_pre_reference(x, fn, base, scale, pre_in=None, EPS=1e-6, HC_EPS=HC_EPS, ITERS=ITERS) -> dict:
    """model.md 2.3.1 / 2.3.2 (2.13's single-pass collapse where ``pre_in`` is given) in float64."""
    m, _ = mixes_f64(x, fn, EPS)
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(m[:, :HC] * s[0] + b[:HC]) + HC_EPS
    post = 2 * torch.sigmoid(m[:, HC:2 * HC] * s[1] + b[HC:2 * HC])
    comb = sinkhorn_reference((m[:, 2 * HC:] * s[2] + b[2 * HC:]).view(-1, HC, HC), ITERS, HC_EPS)
    w = pre if pre_in is None else pre_in.double()
    y = (w[:, :, None] * x.double()).sum(1)
    return {"pre": pre.float(), "post": post.float(), "comb": comb.float(), "y": y.to(x.dtype)}


def mix_bounds(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """|f32 m - exact m| for every token and row (T x rows): the module docstring's bound."""
    m, rinv = mixes_f64(x, fn, eps)
    d = x.shape[-1]
    depth = HC * -(-d // min(BK_SPACE)) + 10
    mag = (x.double().flatten(1).abs() @ fn.double().abs().T) * rinv[:, None]
    return depth * U * mag + (depth / 2 + 5) * U * m.abs()


def sigmoid_bound(m, dm, s, b) -> torch.Tensor:
    """|f32 sigmoid(m s + b) - exact| given |dm|: slope 1/4, the two roundings of z, 8 u."""
    z = m * s + b
    return 0.25 * (s.abs() * dm + U * ((m * s).abs() + z.abs())) + 8 * U


def _sinkhorn_jacobian(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """d comb / d C0 per token (T x 16 x 16), float64."""
    f = lambda c: sinkhorn_reference(c.view(HC, HC), iters, eps).flatten()
    return torch.func.vmap(torch.func.jacrev(f))(c0.reshape(-1, HC * HC))


COMB_ROUNDING = 2.0 ** -16  # the f32 Sinkhorn's own rounding (measured: at most 2^-18)


_LAST: list = []  # the latest call's (inputs held, their versions, constants, bounds)


def site_bounds(inputs: dict, eps: float, hc_eps: float, iters: int) -> dict[str, torch.Tensor]:
    """``pre``'s, ``post``'s and ``comb``'s elementwise bounds (the module docstring), kept for
    the same input tensors (held, so never another's) at the same versions: one check asks for
    each output in turn."""
    held = tuple(inputs[k] for k in ("x", "fn", "base", "scale"))
    state = (tuple(t._version for t in held), eps, hc_eps, iters)
    if not (_LAST and all(a is b for a, b in zip(_LAST[0], held)) and _LAST[1] == state):
        _LAST[:] = [held, state, _site_bounds(inputs, eps, hc_eps, iters)]
    return _LAST[2]


def _site_bounds(inputs: dict, eps: float, hc_eps: float, iters: int) -> dict[str, torch.Tensor]:
    x, fn, b, s = inputs["x"], inputs["fn"], inputs["base"].double(), inputs["scale"].double()
    m, _ = mixes_f64(x, fn, eps)
    dm = mix_bounds(x, fn, eps)
    pre = sigmoid_bound(m[:, :HC], dm[:, :HC], s[0], b[:HC])
    post = 2 * sigmoid_bound(m[:, HC:2 * HC], dm[:, HC:2 * HC], s[1], b[HC:2 * HC])
    c0 = m[:, 2 * HC:] * s[2] + b[2 * HC:]
    dc0 = s[2].abs() * dm[:, 2 * HC:] + U * ((m[:, 2 * HC:] * s[2]).abs() + c0.abs())
    jac = _sinkhorn_jacobian(c0, iters, hc_eps).abs()
    comb = (2 * (jac @ dc0[:, :, None])[:, :, 0] + COMB_ROUNDING).view(-1, HC, HC)
    return {"pre": pre, "post": post, "comb": comb}


def collapse_bound(x: torch.Tensor, w: torch.Tensor, dw: torch.Tensor | None) -> torch.Tensor:
    """|f32 sum_s w_s X[s] - exact| plus the weights' own error, before rounding to y's dtype."""
    xa = x.double().abs()
    out = 5 * U * (w.double().abs()[:, :, None] * xa).sum(1)
    return out if dw is None else out + (dw[:, :, None] * xa).sum(1)


def ulp_rtol(dtype: torch.dtype) -> float:
    """One unit in the last place relative to the value: 2^-7 for bf16, 2^-23 for f32."""
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23


def _extra_error(case, out, inputs):
    eps = case.get("EPS", 1e-6)
    bounds = site_bounds(inputs, eps, HC_EPS, ITERS) if out != "y" or "pre_in" not in inputs else {}
    if out != "y":
        return bounds[out].float()
    x = inputs["x"]
    w = inputs.get("pre_in")
    if w is None:
        w = hc_pre_reference(x, inputs["fn"], inputs["base"], inputs["scale"], EPS=eps)["pre"]
    err = collapse_bound(x, w, bounds.get("pre"))
    return (err * (1 + ulp_rtol(x.dtype))).float()


def _tolerance(case, out):
    """Bounds are elementwise (``_extra_error``); ``y`` adds one ulp of its dtype."""
    return (0.0, ulp_rtol(torch.float32 if case.get("dtype") == "f32" else torch.bfloat16) if out == "y" else 0.0)


# -- inputs, cases, shapes -----------------------------------------------------------------------

def site_params(kind: str, k: int, rows: int, groups: int, gen: torch.Generator):
    """(fn, base, scale) of one kind: ``normal`` logits of order 1 (fn ~ 1 / sqrt(K)), ``peaked``
    comb logits of order 20-40 (a softmax near one-hot, Sinkhorn near a permutation), ``flat``
    logits near 0.1 (comb near uniform)."""
    fn = torch.randn(rows, k, generator=gen) / k ** 0.5
    base = torch.randn(rows, generator=gen) * 0.5
    scale = torch.rand(groups, generator=gen) + 0.5
    if kind == "peaked":
        scale[-1], base = 20.0, base * 20
    elif kind == "flat":
        scale, base = scale * 0.1, base * 0.1
    elif kind != "normal":
        raise ValueError(f"unknown parameter kind {kind!r}")
    return fn, base, scale


def streams(kind: str, t: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """X (T x 4 x D): ``normal`` rows of magnitude 2^-10 .. 2^10 a token; ``zeros`` every other
    token zero (rinv = 1 / sqrt(EPS)); ``same`` four identical streams (the embedding's)."""
    x = torch.randn(t, HC, d, generator=gen)
    if kind == "zeros":
        x[::2] = 0.0
    elif kind == "same":
        x = x[:, :1].expand(-1, HC, -1).contiguous()
    elif kind != "normal":
        raise ValueError(f"unknown stream kind {kind!r}")
    return x * torch.exp2(torch.randint(-10, 11, (t, 1, 1), generator=gen).float())


def previous_pre(t: int, gen: torch.Generator) -> torch.Tensor:
    """A previous site's pre (sigmoid + eps, in (0, 1)); the first token's one-hot stream 0 (layer 0)."""
    w = torch.sigmoid(torch.randn(t, HC, generator=gen)) + HC_EPS
    w[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    return w


def _dtype(case) -> torch.dtype:
    return torch.float32 if case.get("dtype") == "f32" else torch.bfloat16


def _inputs(case, device, seed):
    t, d = case["T"], case["D"]
    dtype = _dtype(case)
    out = {"pre": torch.empty(t, HC, device=device), "post": torch.empty(t, HC, device=device),
           "comb": torch.empty(t, HC, HC, device=device), "y": torch.empty(t, d, dtype=dtype, device=device)}
    if device.type == "meta":
        out.update(x=torch.empty(t, HC, d, dtype=dtype, device=device), fn=torch.empty(MIX, HC * d, device=device),
                   base=torch.empty(MIX, device=device), scale=torch.empty(3, device=device))
        if case.get("single_pass"):
            out["pre_in"] = torch.empty(t, HC, device=device)
        return out
    gen = torch.Generator().manual_seed(seed)
    fn, base, scale = site_params(case.get("params", "normal"), HC * d, MIX, 3, gen)
    out.update(x=streams(case.get("values", "normal"), t, d, gen).to(dtype).to(device), fn=fn.to(device),
               base=base.to(device), scale=scale.to(device))
    if case.get("single_pass"):
        out["pre_in"] = previous_pre(t, gen).to(device)
    return out


def phases(decode_t=shapes.DECODE_SAMPLE):
    """(phase name, tokens): the decode token counts and a prefill chunk."""
    return [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]


def site_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """Every mHC site (attention and FFN alike) at the decode token counts and a prefill chunk:
    D = the hidden size, 4 streams; V4 two-pass, V4.1 single-pass (``pre_in``)."""
    v41 = m.name == "v41-flash"
    out: dict[str, shapes.Case] = {}
    for phase, t in phases(decode_t):
        case = {"T": t, "D": m.hidden, "EPS": RMS_EPS[m.name], "model": m.name}
        if v41:
            case["single_pass"] = True
        out[f"{m.short}/site_d{m.hidden}/{phase}"] = case
    return out


CASES = {
    "v4_t3_d4096": {"T": 3, "D": 4096},
    "v41_t2_d5120_single": {"T": 2, "D": 5120, "EPS": 1e-20, "single_pass": True, "config": {"BK": 256}},
    "ragged_t5_d200": {"T": 5, "D": 200, "config": {"BK": 64}},  # a last chunk of 8 channels
    "ragged_t7_d100_single_f32": {"T": 7, "D": 100, "dtype": "f32", "single_pass": True},
    "peaked_t6_d256": {"T": 6, "D": 256, "params": "peaked", "config": {"BK": 512}},
    "flat_t4_d96_single": {"T": 4, "D": 96, "params": "flat", "single_pass": True},
    "zeros_t4_d128": {"T": 4, "D": 128, "values": "zeros", "EPS": 1e-20},
    "same_t3_d160_f32": {"T": 3, "D": 160, "values": "same", "dtype": "f32"},
}

SPEC = register(Spec(
    kernel=hc_pre,
    reference=hc_pre_reference,
    make_inputs=_inputs,
    outputs=("pre", "post", "comb", "y"),
    cases=CASES,
    build_cases={"v4_site": {"T": 4096, "D": 4096},
                 "v41_site": {"T": 4096, "D": 5120, "EPS": 1e-20, "single_pass": True}},
    tolerance=_tolerance,
    extra_error=_extra_error,
    constants_of=lambda case: {"EPS": case.get("EPS", 1e-6)},
    flops=lambda c: 2.0 * MIX * HC * c["T"] * c["D"] + 4.0 * HC * c["T"] * c["D"],
    bytes_moved=lambda c: (HC * (1 if c.get("single_pass") else 2) + 1) * c["T"] * c["D"]
    * (4 if c.get("dtype") == "f32" else 2) + 4 * MIX * HC * c["D"] + 4 * (2 * HC + HC * HC) * c["T"],
    model_shapes=shapes.for_models(site_shapes),
    sweep={"T": Dim(1, 12, large=4099), "D": Dim(1, 300, large=5120), "dtype": OneOf("bf16", "f32"),
           "EPS": OneOf(1e-6, 1e-20), "single_pass": OneOf(True, False),
           "params": OneOf("normal", "peaked", "flat"), "values": OneOf("normal", "zeros", "same"),
           "config": {"BK": OneOf(*BK_SPACE)}},
))
