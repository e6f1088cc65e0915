"""The MoE router's selection (model.md 2.6): from the gate logits to each token's experts and
their weights. The logits ``x @ w_gate^T`` (T x E, f32) are a GEMM the ``gemm`` spec serves;
this kernel takes them and the per-expert bias (E, f32):

    s       = sqrt(softplus(logits))                                  (f32)
    experts = the TOPK experts of largest s + bias, in that order     (ties: the lowest index first)
    weights = s[experts] / sum(s[experts]) * SCALE                    (the bias only picks)

TOPK = 6 and SCALE = 1.5 in both models; E = 256 (V4-Flash) or 384 (V4.1-Flash).

Hash form (V4-Flash's first ``num_hash_layers`` = 3 layers, model.md 2.6.1 and 2.14 item 9): the
experts come from a fixed table instead of the scores, ``tid2eid`` (V x K: a vocabulary row of K
experts) indexed by each token's id ``token_ids`` (T), and the weights are the same unbiased
scores of those experts, renormalised and times SCALE. Those layers have no bias, so the call
passes either ``bias`` (score form) or ``tid2eid`` and ``token_ids`` (hash form), a trace-time
choice. The experts are the table row as stored (its order, any repeat kept); each weight is
the chosen expert's ``s`` picked exactly as in the score form, summed in table order. A token id
outside ``[0, V)`` or an expert outside ``[0, E)`` is outside the contract (the kernel reads a
zero row for the former and weighs the latter 0). V4.1 has no hash layers.

The output's ``K`` must equal ``TOPK`` (a build cannot check it: ``K`` is a size, ``TOPK`` a
constant the rounds unroll over; ``constants_of`` takes TOPK from the case's K).

The selection runs TOPK rounds over one row tile holding every expert (a power of two wide;
the padding reads logits -inf, so s = 0 there, and bias -inf, so it is never picked): the
largest live biased score ``m``, then the lowest expert index whose live score equals ``m`` (a
``min`` over ``where(score == m, index, E)``), then that expert leaves (its score becomes -inf).
A real expert's biased score is finite for finite inputs, so a taken one never ties with ``m``;
this needs E >= TOPK, as in every model (256 / 384 >= 6; 128 >= 3 in V4.1's DSpark blocks).
Indices are carried as f32 (exact below 2^24) so that every reduction is a float max / min,
which every target lowers. The weight of a round is the chosen expert's unbiased ``s`` (a max
over one hit: exact); the sum runs in pick order, ``((w0 + w1) + w2) + ...``, the same on every
target, and each weight is ``w_k / total * SCALE``.

softplus, as written here and in the reference (both the same f32 operations, so the
interpreter is bit-exact against the reference)::

    softplus(x) = max(x, 0) + log1p(exp(-|x|))
    log1p(y)    = log(u) + (y - (u - 1)) / u,   u = 1 + y        (y in [0, 1])

The DSL has no log1p; ``u - 1`` is exact (Sterbenz) and ``y - (u - 1)`` is exactly the rounding
error of ``1 + y`` (Fast2Sum, |y| <= 1), so the correction restores log1p's accuracy for small y
(plain ``log(1 + y)`` loses all of it below 2^-24: softplus(-30) would be 0). torch's
``F.softplus`` (the runtime's) computes ``log1p(exp(x))`` below its threshold 20 and ``x`` above;
the two agree to a few ulp (tests/kernels_spec/test_router.py), not bit for bit.

Tolerances: experts exact everywhere (0, 0); weights exact on the interpreter (the test checks
bit equality) and within 1e-6 + 1e-5 relative elsewhere, since a GPU's expf / logf are not
torch's CPU ones (a few ulp), and the CUDA builds flush subnormals (``--ftz``). A row holding a
NaN logit or bias, or an infinite bias, has unspecified experts.

Decode path: each row is routed on its own; T is dynamic and the batch dimension. The table's
vocabulary V is static (the model's 129,280).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")


@dsl.kernel(batch_dim="T", dynamic=("T",))
def router(logits: dsl.Tensor["T", "E", dsl.f32],
           experts: dsl.Tensor["T", "K", dsl.i32], weights: dsl.Tensor["T", "K", dsl.f32],
           bias: dsl.OptionalTensor["E", dsl.f32] = None,
           tid2eid: dsl.OptionalTensor["V", "K", dsl.i32 | dsl.i64] = None,
           token_ids: dsl.OptionalTensor["T", dsl.i32 | dsl.i64] = None, *,
           TOPK: dsl.Const = 6, SCALE: dsl.Const = 1.5,
           ROWS: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    if not (isinstance(TOPK, int) and TOPK >= 1):
        raise dsl.DslError(f"TOPK {TOPK!r} must be a positive int: the rounds unroll over it")
    hashed = tid2eid is not None
    if hashed != (token_ids is not None) or hashed == (bias is not None):
        raise dsl.DslError("router takes bias (score routing) or tid2eid and token_ids (hash routing), "
                           "not both and not neither")
    n = logits.E
    # every expert in one row tile, a power of two wide: TileLang's row reductions on CUDA need a
    # power-of-two count of threads a row (a 384-wide tile fails at 512 threads); Ascend, which
    # lowers whole tiles only, then refuses 384 experts (a partial 512-wide tile)
    width = dsl.next_pow2(n)
    for t in dsl.grid(dsl.cdiv(logits.T, ROWS)):
        # padding reads logits -inf (s = 0) and bias -inf (biased score -inf): never picked
        x = dsl.load(logits[t * ROWS, 0], (ROWS, width), other=NEG_INF)
        y = dsl.exp(-abs(x))
        u = 1.0 + y
        s = dsl.sqrt(dsl.maximum(x, 0.0) + (dsl.log(u) + (y - (u - 1.0)) / u))
        ids = dsl.arange(width).to(dsl.f32)[None, :]
        picked, w = [], []  # each pick's experts (ROWS x 1) and unbiased score (ROWS)
        if hashed:
            tokens = dsl.load(token_ids[t * ROWS], (ROWS,))
            for k in range(TOPK):
                # column k of the tokens' table rows (a gather of rows by token id)
                idx = dsl.load(tid2eid[tokens, k], (ROWS, 1)).to(dsl.i32)
                w.append(dsl.where(ids.eq(idx.to(dsl.f32)), s, 0.0).max(axis=1))  # its score, exactly
                picked.append(idx)
        else:
            live = dsl.empty((ROWS, width), dsl.f32)  # the biased scores; a taken expert's is -inf
            live[:] = s + dsl.load(bias[0], (width,), other=NEG_INF)[None, :]
            for _ in range(TOPK):  # unrolled at trace time
                top = live.max(axis=1)
                idx = dsl.where(live.eq(top[:, None]), ids, n).min(axis=1)  # ties: the lowest index
                # the test is written at each use: a bool tile used twice would be materialised, which
                # TileLang's Ascend lowering cannot vectorise (int8x2); used once it fuses away
                w.append(dsl.where(ids.eq(idx[:, None]), s, 0.0).max(axis=1))  # its unbiased score, exactly
                live[:] = dsl.where(ids.eq(idx[:, None]), NEG_INF, live)
                picked.append(idx[:, None].to(dsl.i32))
        total = w[0]
        for wk in w[1:]:  # in pick order
            total = total + wk
        for k in range(TOPK):
            dsl.store(experts[t * ROWS, k], picked[k])
            dsl.store(weights[t * ROWS, k], (w[k] / total * SCALE)[:, None])


def softplus(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0) + log1p(exp(-|x|)), log1p by its compensated form (the module docstring)."""
    y = torch.exp(-x.abs())
    u = 1.0 + y
    return torch.maximum(x, torch.zeros_like(x)) + (torch.log(u) + (y - (u - 1.0)) / u)


def router_reference(logits: torch.Tensor, bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                     token_ids: torch.Tensor | None = None, TOPK: int = 6, SCALE: float = 1.5) -> dict:
    """model.md 2.6.1: top-TOPK of sqrt(softplus(logits)) + bias by a stable descending sort (ties
    keep the lower index first), or in a hash layer the table row ``tid2eid[token_id]``; weights
    the unbiased scores of those, over their sum (in pick order), times SCALE."""
    s = torch.sqrt(softplus(logits.float()))
    if tid2eid is not None:
        idx = tid2eid[token_ids.long()].long()
    else:
        idx = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :TOPK]
    w = s.gather(-1, idx)
    total = w[:, 0]
    for k in range(1, TOPK):
        total = total + w[:, k]
    return {"experts": idx.to(torch.int32), "weights": w / total[:, None] * SCALE}


def _logits(kind: str, t: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, bias) of one kind: ``normal`` (N(0, 1) logits, a small bias), ``ties`` (logits
    from five values, no bias: every pick is a tie the lowest index wins), ``bias_flip`` (a bias
    far larger than the logits' spread: it, not the scores, picks), ``equal`` (one value a row:
    experts 0..TOPK-1, equal weights), ``huge`` / ``tiny`` (magnitudes 1e30 / 1e-30), ``mixed``
    (magnitudes 2^-60 .. 2^60 in one row, either sign: softplus's tails), ``huge_pos`` (magnitudes
1e30, all positive: a table's experts never all score 0, as ``huge``'s negative ones do)."""
    x = torch.randn(t, e, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    if kind == "normal":
        return x, bias
    if kind == "ties":
        return torch.randint(-2, 3, (t, e), generator=g).float() * 0.75, torch.zeros(e)
    if kind == "bias_flip":
        return 0.1 * x, 3.0 * torch.randn(e, generator=g)
    if kind == "equal":
        return torch.randn(t, 1, generator=g).expand(t, e).contiguous(), torch.zeros(e)
    if kind == "huge":
        return x * 1e30, bias
    if kind == "tiny":
        return x * 1e-30, torch.zeros(e)
    if kind == "mixed":
        return x * torch.exp2(torch.randint(-60, 61, (t, e), generator=g).float()), bias
    if kind == "huge_pos":
        return x.abs() * 1e30 + 1e30, bias
    raise ValueError(f"unknown logits kind {kind!r}")


def _table(v: int, e: int, k: int, g: torch.Generator, repeats: bool = False) -> torch.Tensor:
    """A tid2eid table: ``k`` distinct experts a row in random order (``repeats``: some rows repeat
    an expert, which no released table does but the kernel must weigh alike)."""
    table = torch.rand(v, e, generator=g).topk(k, dim=1).indices
    if repeats:
        table[::3, -1] = table[::3, 0]
    return table


def _token_ids(kind: str, t: int, v: int, g: torch.Generator) -> torch.Tensor:
    """Token ids of one kind: ``random`` (uniform over the table), ``repeat`` (three ids for every
    token), ``ends`` (the table's first and last rows, alternately, and its second and next to last)."""
    if kind == "random":
        return torch.randint(0, v, (t,), generator=g)
    if kind == "repeat":
        return torch.randint(0, v, (3,), generator=g)[torch.randint(0, 3, (t,), generator=g)]
    if kind == "ends":
        return torch.tensor([0, v - 1, 1, v - 2])[torch.arange(t) % 4].clamp(0, v - 1)
    raise ValueError(f"unknown token id kind {kind!r}")


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    t, e, k = case["T"], case["E"], case.get("K", 6)
    out = {"experts": torch.full((t, k), -1, dtype=torch.int32, device=device),
           "weights": torch.full((t, k), float("nan"), dtype=torch.float32, device=device)}
    if device.type == "meta":  # shapes and dtypes only (a vocabulary-sized table costs seconds)
        logits, bias = torch.empty(t, e), torch.empty(e)
    else:
        logits, bias = _logits(case.get("values", "normal"), t, e, g)
    out["logits"] = logits.to(device)
    if not case.get("hash"):
        return {**out, "bias": bias.to(device)}
    v = case["V"]
    index = torch.int64 if case.get("index") == "i64" else torch.int32
    if device.type == "meta":
        table, tokens = torch.empty(v, k, dtype=index), torch.empty(t, dtype=index)
    else:
        table = _table(v, e, k, g, case.get("repeats", False))
        tokens = _token_ids(case.get("tokens", "random"), t, v, g)
    return {**out, "tid2eid": table.to(index).to(device), "token_ids": tokens.to(index).to(device)}


def _tolerance(case, out):
    return (0.0, 0.0) if out == "experts" else (1e-6, 1e-5)


def hash_router_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """V4-Flash's hash layers: the table has a row for every token of the vocabulary; the decode
    rows ``decode_t`` and a prefill chunk. V4.1 has no hash layers."""
    if m.name != shapes.V4_FLASH.name:
        return {}
    out: dict[str, shapes.Case] = {}
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        out[f"{m.short}/e{m.experts}_top{m.experts_per_token}_hash/{phase}"] = {
            "T": t, "E": m.experts, "K": m.experts_per_token, "V": m.vocab, "hash": True, "model": m.name}
    return out


def _hash(t, e=256, v=1000, **more):
    return {"T": t, "E": e, "V": v, "hash": True, **more}


def _index_bytes(c) -> int:
    return 8 if c.get("index") == "i64" else 4


SPEC = register(Spec(
    kernel=router,
    reference=router_reference,
    make_inputs=_inputs,
    outputs=("experts", "weights"),
    cases={"t5_e256": {"T": 5, "E": 256}, "t1_e384": {"T": 1, "E": 384},
           "ragged_t13_e384": {"T": 13, "E": 384, "config": {"ROWS": 4}},
           "ties_t9_e256": {"T": 9, "E": 256, "values": "ties", "config": {"ROWS": 2}},
           "bias_flip_t7_e384": {"T": 7, "E": 384, "values": "bias_flip"},
           "equal_t6_e256": {"T": 6, "E": 256, "values": "equal", "config": {"ROWS": 8}},
           "huge_t4_e256": {"T": 4, "E": 256, "values": "huge"},
           "tiny_t4_e384": {"T": 4, "E": 384, "values": "tiny"},
           "mixed_t11_e384": {"T": 11, "E": 384, "values": "mixed", "config": {"ROWS": 2}},
           "dspark_top3_e128": {"T": 3, "E": 128, "K": 3},  # V4.1's DSpark blocks: 128 experts, top 3
           "hash_t5_e256": _hash(5),
           "hash_ragged_t13": _hash(13, config={"ROWS": 4}, values="mixed"),
           "hash_repeat_t17": _hash(17, tokens="repeat", config={"ROWS": 8}),
           "hash_ends_t9": _hash(9, v=4099, tokens="ends", config={"ROWS": 2}),
           "hash_i64_ends_t6": _hash(6, v=129280, tokens="ends", index="i64"),
           "hash_repeated_experts_t12": _hash(12, v=30, repeats=True, tokens="repeat", config={"ROWS": 4}),
           "hash_tiny_t4": _hash(4, values="tiny"),
           "hash_huge_t4": _hash(4, values="huge_pos"),
           "hash_e384_t3": _hash(3, e=384)},
    build_cases={"v4_prefill": {"T": 4096, "E": 256}, "v41_decode": {"T": 64, "E": 384}},
    tolerance=_tolerance,
    constants_of=lambda case: {"TOPK": case.get("K", 6)},
    flops=lambda c: 12.0 * c["T"] * c["E"] * (1 + c.get("K", 6)),
    bytes_moved=lambda c: 4.0 * (c["T"] * c["E"] + 2 * c["T"] * c.get("K", 6))
    + (_index_bytes(c) * c["T"] * (1 + c.get("K", 6)) if c.get("hash") else 4.0 * c["E"]),
    model_shapes={**shapes.for_models(shapes.router_shapes), **shapes.for_models(hash_router_shapes)},
    sweep={"T": Dim(1, 67, large=4099), "E": OneOf(8, 64, 128, 256, 384, 300),
           "values": OneOf("normal", "ties", "bias_flip", "equal", "huge", "tiny", "mixed", "huge_pos"),
           "hash": OneOf(False, True), "V": Dim(1, 3000, large=129280), "index": OneOf("i32", "i64"),
           "tokens": OneOf("random", "repeat", "ends"), "repeats": OneOf(False, True),
           "config": {"ROWS": OneOf(1, 2, 4, 8)}},
    # a row whose picked experts all score 0 (``huge``'s -1e30 logits) has weights 0 / 0: the hash
    # form's six table experts can, and so can the score form's when every logit of a row is
    # negative (1 in 256 rows at E = 8, 2^-64 at E = 64)
    sweep_valid=lambda c: not (c["values"] == "huge" and (c["hash"] or c["E"] < 64)),
))
