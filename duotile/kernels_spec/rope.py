"""Interleaved rotary embedding of the last ``ROPE`` channels of every head (model.md 2.4), forward
at P or inverse at -P: the query side (V4's and V4.1's q after its norm, the indexer's q) and the
attention output's inverse rotation (2.5.6); the window and compressed KV rows take theirs fused
in ``kv_insert``.

    pair i of a row (channels nope + 2i, nope + 2i + 1) = (a, b), cos / sin = table row p, column i
    a' = a cos - b sin,   b' = a sin + b cos                 (inverse: sin -> -sin)

``x`` (T x H x D, bf16 or f32) are T tokens' H heads, ``positions`` (T) their table rows, ``cos`` /
``sin`` (P x ROPE / 2 values, f32, row by row: flattened) the layer's tables (plain or YaRN,
``runtime/layers/common.py``'s ``Rotary``), ``out`` (T x H x D, f32) the rotated rows, the nope
channels copied. A program takes BH heads of one token, a whole row a tile (one store: no channel
is written twice). A pair's partner channel is read as a column gather (``x[t, h, c ^ 1]``; D is
even) and a channel's cos / sin as a gather of the flattened table at ``p * ROPE / 2 + pair``
(a nope channel reads whatever lies there and keeps its own value). The tables are flat so that
one index tile names both the row and the column (a load takes one index tile; before, a one-hot
max over the pairs picked each channel's entry out of the row: ROPE / 2 compare-selects a
channel, 29 us a call at 64 decode tokens on an H200, 2026-12-04). Even channels take
``a cos - b sin``, odd ones ``b cos + a sin``: the reference's f32 operations, so the interpreter
is bit-exact. Elsewhere a target may fuse a multiply and an add: one f32 rounding apart (the
tolerance).

Decode path: every token is computed alone: batch dimension T, dynamic.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="T", dynamic=("T",))
def rope(x: dsl.Tensor["T", "H", "D", dsl.bf16 | dsl.f32], positions: dsl.Tensor["T", dsl.i32 | dsl.i64],
         cos: dsl.Tensor["PR", dsl.f32], sin: dsl.Tensor["PR", dsl.f32],
         out: dsl.Tensor["T", "H", "D", dsl.f32], *,
         ROPE: dsl.Const = 64, INVERSE: dsl.Const = False,
         BH: dsl.Tunable = dsl.choice(8, 1, 2, 4, 16)):
    if not (isinstance(ROPE, int) and ROPE > 0 and ROPE % 2 == 0):
        raise dsl.DslError(f"ROPE {ROPE!r} must be a positive even int: the rotated channels")
    half, nope, width = ROPE // 2, x.D - ROPE, dsl.next_pow2(x.D)
    for t, h in dsl.grid(x.T, dsl.cdiv(x.H, BH)):
        p = dsl.load(positions[t], (1,))
        k = dsl.arange(width)  # the whole row a tile (the padding reads zeros, the store clips it)
        y = dsl.load(x[t, h * BH, 0], (BH, width)).to(dsl.f32)
        partner = dsl.load(x[t, h * BH, k ^ 1], (BH, width)).to(dsl.f32)
        at = p * half + ((k - nope) >> 1)  # the channel's pair in the flat table (a nope channel: unused)
        c = dsl.load(cos[at], (width,))[None, :]
        s = dsl.load(sin[at], (width,))[None, :]
        if INVERSE:
            s = -s
        even = (k & 1).eq(0)[None, :]
        rotated = dsl.where(even, y * c - partner * s, y * c + partner * s)
        dsl.store(out[t, h * BH, 0], dsl.where((k >= nope)[None, :], rotated, y))


def rope_reference(x, positions, cos, sin, ROPE: int = 64, INVERSE: bool = False) -> dict:
    """model.md 2.4 in f32: the pairs of the last ROPE channels rotated by table row p."""
    x = x.float()
    cos, sin = cos.reshape(-1, ROPE // 2), sin.reshape(-1, ROPE // 2)  # the flat tables' rows
    c, s = cos[positions.long()][:, None, :], sin[positions.long()][:, None, :]
    if INVERSE:
        s = -s
    a, b = x[..., -ROPE:][..., 0::2], x[..., -ROPE:][..., 1::2]
    rotated = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    return {"out": torch.cat([x[..., :-ROPE], rotated], -1)}


def _tables(n: int, rope: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = base ** (-2.0 * torch.arange(rope // 2, dtype=torch.float64) / rope)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cos(angle).float(), torch.sin(angle).float()


def _inputs(case, device, seed):
    t, h, d, r = case["T"], case["H"], case["D"], case.get("ROPE", 64)
    n = case.get("P", 4096)
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    out = torch.empty(t, h, d, device=device)
    if device.type == "meta":
        return {"x": torch.empty(t, h, d, dtype=dtype, device=device),
                "positions": torch.empty(t, dtype=torch.int32, device=device),
                "cos": torch.empty(n * (r // 2), device=device), "sin": torch.empty(n * (r // 2), device=device),
                "out": out}
    g = torch.Generator().manual_seed(seed)
    cos, sin = _tables(n, r)
    x = torch.randn(t, h, d, generator=g).to(dtype)
    positions = torch.randint(0, n, (t,), generator=g, dtype=torch.int32)
    positions[0] = n - 1  # the table's last row
    return {"x": x.to(device), "positions": positions.to(device), "cos": cos.reshape(-1).to(device),
            "sin": sin.reshape(-1).to(device), "out": out}


def rope_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The attention's queries (H heads x head dim, rotated at P) and its output (rotated at -P),
    and the indexer's queries (its heads x its head dim), for the decode token counts and a
    prefill chunk; the tables of a 4,096-position window of the layer's."""
    out: dict[str, shapes.Case] = {}
    forms = (("q", m.heads, m.head_dim, False), ("o", m.heads, m.head_dim, True),
             ("index_q", m.index_heads, m.index_head_dim, False))
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        for what, h, d, inverse in forms:
            case = {"T": t, "H": h, "D": d, "ROPE": m.rope_dim, "INVERSE": inverse, "model": m.name}
            out[f"{m.short}/{what}_h{h}_d{d}/{phase}"] = case
    return out


SPEC = register(Spec(
    kernel=rope,
    reference=rope_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={
        "q_t3_h8_d128": {"T": 3, "H": 8, "D": 128},
        "inverse_t2_h5_d96": {"T": 2, "H": 5, "D": 96, "INVERSE": True},  # ragged heads of BH = 8
        "rope_only_f32": {"T": 4, "H": 2, "D": 64, "dtype": "f32", "config": {"BH": 1}},
        "r32_t5_h3_d80": {"T": 5, "H": 3, "D": 80, "ROPE": 32, "config": {"BH": 2}},
    },
    build_cases={"v41_q_prefill": {"T": 4096, "H": 64, "D": 512}},
    tolerance=lambda case, out: (1e-6, 2.0 ** -22),  # one fused multiply-add apart at most
    exact=False,
    constants_of=lambda case: {"ROPE": case.get("ROPE", 64), "INVERSE": bool(case.get("INVERSE", False))},
    bytes_moved=lambda c: c["T"] * c["H"] * c["D"] * ((4 if c.get("dtype") == "f32" else 2) + 4),
    model_shapes=shapes.for_models(rope_shapes),
    sweep={"T": Dim(1, 12, large=4099), "H": Dim(1, 20, large=64), "D": OneOf(64, 96, 128, 192),
           "ROPE": OneOf(32, 64), "INVERSE": OneOf(False, True), "dtype": OneOf("bf16", "f32"),
           "config": {"BH": OneOf(1, 2, 4, 8, 16)}},
    sweep_valid=lambda c: c["ROPE"] <= c["D"],
))
