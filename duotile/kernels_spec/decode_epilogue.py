"""The sparse attention kernels' epilogue (``sparse_mqa_decode``, its stored-row forms and
``sparse_mqa_prefill``, whose T chunk tokens are the B queries below): the
output's rope channels rotated by -P, what the grouped output projection ``wo_a`` takes (model.md
2.4, 2.5.6). The kernel side (``Epilogue``, ``epilogue_of``, ``rope_phase``) and its reference,
bound and inputs (``inverse_rope``, ``rotated_bound``, ``epilogue_inputs``)."""

from __future__ import annotations

import sympy
import torch

from .. import dsl


class Epilogue:
    """The output's inverse rotation at the query's position (model.md 2.4, 2.5.6): what the
    grouped output projection ``wo_a`` takes. ``positions`` (B) are the queries' table rows,
    ``cos`` / ``sin`` (P x ROPE / 2, f32) the layer's tables, the last ``ROPE`` of the D channels
    rotated in pairs (2i, 2i + 1) of them. A rope channel's partner lies in another column: the
    combine reads ``part_o`` at the partner's columns too (a column gather) and adds it up as it
    adds its own; the one-phase form stores its rope channels' bf16 output into a workspace
    (``rope_o``, B x H x ROPE) and rotates them in a phase of its own (``rope_phase``): an
    accumulator's columns cannot be gathered, and ``o`` read back where it was stored would race
    with the stores of other threads."""

    def __init__(self, q, positions, cos, sin, rope):
        self.q, self.positions, self.cos, self.sin, self.rope = q, positions, cos, sin, rope
        self.nope = q.D - rope
        self.rope_o = None

    def one_phase(self) -> None:
        """Declare the one-phase form's workspace (at the kernel's top level)."""
        self.rope_o = dsl.workspace("rope_o", (self.q.shape[0], self.q.H, self.rope), dsl.bf16)

    def keep(self, b, first, width, y) -> None:
        """Store the rope channels among a column group's output ``y`` (bf16, columns ``first`` ..
        ``first + width - 1``) into the workspace; a group wholly before them stores nothing."""
        if sympy.sympify(first + width <= self.nope) == sympy.true:
            return
        dsl.store(self.rope_o[b, 0, first - self.nope + dsl.arange(width)], y)  # a nope column: dropped

    def partner(self, cols):
        """The partner column of each column of ``cols`` (an index tile), -1 for a nope channel."""
        return dsl.where(cols >= self.nope, self.nope + ((cols - self.nope) ^ 1), -1)

    def rotated(self, b, cols, y, mate):
        """``y`` (bf16, rows x columns ``cols``) with its rope channels rotated by -P: even channel
        ``a cos + b sin``, odd ``b cos - a sin`` over the bf16 values in f32, bf16 out (the runtime's
        ``Rotary.apply(..., inverse=True)`` of its BF16 output, the same f32 operations: its
        ``a cos - b (-sin)`` and ``a (-sin) + b cos`` are these bits). ``mate`` holds each
        column's partner (bf16). A position outside the table reads cos = sin = 0 there."""
        row = dsl.scalar(dsl.load(self.positions[b], (1,)))
        n = cols.shape[0]
        pair = dsl.where(cols >= self.nope, (cols - self.nope) >> 1, -1)
        c = dsl.load(self.cos[row, pair], (1, n))
        s = dsl.load(self.sin[row, pair], (1, n))
        a, m = y.to(dsl.f32), mate.to(dsl.f32)
        even = ((cols - self.nope) & 1).eq(0)[None, :]
        turned = dsl.where(even, a * c + m * s, a * c - m * s)
        return dsl.where((cols >= self.nope)[None, :], turned, a).to(dsl.bf16)


def epilogue_of(name, q, positions, cos, sin, ROPE=None):
    """The epilogue of a decode kernel's call (``Epilogue``), or None without one; refuses a
    partial or misshapen one. The rope channels are ``ROPE`` where the kernel has that constant
    (V4's rows, whose layout it sets), else twice the tables' columns."""
    given = [t is not None for t in (positions, cos, sin)]
    if not any(given):
        return None
    if not all(given):
        raise dsl.DslError(f"{name}: give positions, cos and sin together (the output's inverse rope at the "
                           f"query's position, model.md 2.5.6), or none")
    rope = 2 * cos.HALF if ROPE is None else ROPE
    dsl.require(q.D >= rope, f"{name}: D must hold the rope channels (2 x cos's columns)")
    for what, table in (("cos", cos), ("sin", sin)):
        for cond in (2 * table.HALF >= rope, 2 * table.HALF <= rope):
            dsl.require(cond, f"{name}: {what} must have ROPE / 2 columns, one a pair of rope channels "
                              f"(model.md 2.4)")
    return Epilogue(q, positions, cos, sin, rope)


def rope_phase(q, o, epilogue):
    """The one-phase form's rotation: each query's rope channels from the workspace, and their
    partners by a column gather of it, rotated into ``o``'s last ROPE columns."""
    rope_o, width = epilogue.rope_o, epilogue.rope
    for b in dsl.grid(q.shape[0]):  # the queries: B of a decode step, T of a prefill chunk
        k = dsl.arange(width)
        y = dsl.load(rope_o[b, 0, 0], (q.H, width))
        mate = dsl.load(rope_o[b, 0, k ^ 1], (q.H, width))
        dsl.store(o[b, 0, epilogue.nope], epilogue.rotated(b, epilogue.nope + k, y, mate))


def _table_rows(table, positions):
    """Rows ``positions`` of a cos / sin table (P x ROPE / 2) in float64, zeros for a position
    outside it (as the kernel reads them), shaped (B, 1, ROPE / 2) over the heads."""
    pos = positions.long()
    inside = ((pos >= 0) & (pos < table.shape[0]))[:, None]
    rows = torch.where(inside, table[pos.clamp(0, table.shape[0] - 1)].double(), 0.0)
    return rows[:, None, :]


def inverse_rope(o, positions, cos, sin):
    """model.md 2.4 / 2.5.6: the last 2 x cos's columns of ``o`` (B, H, D; bf16, as the kernel
    rounds its output first) rotated by -P in float64, then rounded to bf16: pair (a, b) ->
    (a cos + b sin, b cos - a sin)."""
    x, rope = o.double(), 2 * cos.shape[-1]
    c, s = _table_rows(cos, positions), _table_rows(sin, positions)
    a, b = x[..., -rope::2], x[..., 1 - rope::2]
    rotated = torch.stack([a * c + b * s, b * c - a * s], -1).flatten(-2)
    return torch.cat([x[..., :-rope], rotated], -1).to(torch.bfloat16)


def rotated_bound(size, inputs):
    """The output's bound with the epilogue: a rope channel of plain bound E = 2^-8 A (its own
    ``size`` A) becomes 2^-7 (|cos| A_c + |sin| A_partner): the plain bounds of both channels
    carried through the rotation (|cos| E_c + |sin| E_p), plus the second bf16 rounding of kernel
    and reference (2^-9 each of |a cos| + |b sin|) and the f32 products and sum (2^-23 each);
    the nope channels keep 2^-8 A. A position outside the table rotates to zeros: bound 0."""
    rope = 2 * inputs["cos"].shape[-1]
    c = _table_rows(inputs["cos"], inputs["positions"]).abs().repeat_interleave(2, -1)
    s = _table_rows(inputs["sin"], inputs["positions"]).abs().repeat_interleave(2, -1)
    own = size[..., -rope:]
    mate = own.view(*own.shape[:-1], rope // 2, 2).flip(-1).flatten(-2)
    return torch.cat([2.0 ** -8 * size[..., :-rope], 2.0 ** -7 * (c * own + s * mate)], -1)


def epilogue_inputs(case, device, seed) -> dict:
    """The epilogue's inputs where the case names a ``rope`` kind (``_positions``): a table of
    ``P`` rows (default 300) at base ``base`` (10000; 160000 for a compressed layer's, without
    its YaRN frequencies, which change no arithmetic), ``ROPE`` rope channels; else none."""
    kind = case.get("rope")
    if kind is None:
        return {}
    b, n, rope = case["B"], case.get("P", 300), case.get("ROPE", 64)
    if device.type == "meta":
        return {"positions": torch.empty(b, dtype=torch.int32), "cos": torch.empty(n, rope // 2),
                "sin": torch.empty(n, rope // 2)}
    from .kv_insert import rope_tables

    cos, sin = rope_tables(n, case.get("base", 10000.0), rope)
    pos = _positions(kind, b, n, torch.Generator().manual_seed(seed + 2))
    return {"positions": pos.to(torch.int32).to(device), "cos": cos.to(device), "sin": sin.to(device)}


def _positions(kind, b, n, g):
    """Query positions: ``random`` (anywhere in the table), ``zero`` (every query at 0), ``past``
    (the table's last row, then rows past it: their rope channels rotate to zeros), ``wrap``
    (around multiples of the 128-row window ring and the 64-row table blocks: k 128 - 1, k 128,
    k 128 + 1)."""
    if kind == "random":
        return torch.randint(0, n, (b,), generator=g)
    if kind == "zero":
        return torch.zeros(b, dtype=torch.long)
    if kind == "past":
        return n - 1 + torch.arange(b) * 5
    if kind == "wrap":
        k = torch.randint(1, max(n // 128, 1) + 1, (b,), generator=g) * 128
        return (k + torch.tensor([-1, 0, 1])[torch.arange(b) % 3]).clamp(0, n - 1)
    raise ValueError(f"unknown position kind {kind!r}: random, zero, past or wrap")
