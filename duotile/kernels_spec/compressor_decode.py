"""The KV compressor's decode step (model.md 2.5.4, 2.13, 3.1, 5.4, 5.7): B sequences, one new
token each, every form of ``compressor.py`` (V4 CSA / indexer / HCA, V4.1 ratio 2 / ratio 1) by
its constants.

Per sequence b, token P = ``positions[b]``, w = P // m, j = P mod m (``compressor.py`` for the
forms, the state layout and the pooling)::

    state[b, slot(P)]  = (c[b], z[b] + ape[j])              the token enters its slot
    if j == m - 1:     out[b] = pool(window w),  windows[b] = w     the window completes
    else:              out[b] = 0,               windows[b] = -1

The state (``state_c``, ``state_z``: B x S x C) is read and updated in place: no host logic
between steps, and no reset for a new sequence. Window w pools bank w mod BANKS (the new token
taken from c / z, not read back) and, with OVERLAP and w > 0, the other bank's A halves. Rows are
gathered with index -1 (no read) where no window completes, so a step that completes none reads
no state and writes one slot: HCA reads its 128 x 512 x 2 floats once a window.

Grid: (B, D / BD), each program one channel block of one sequence, reading and writing only its
own channels; its write of the new slot and its read of the bank meet only at that slot, whose
read value is replaced by the new token, so the order of the two does not matter. Decode path:
B is dynamic and the batch dimension; each sequence's row is computed alone.

Tolerances (``compressor.py``): ``out`` within the pooling bound of its 2 m (OVERLAP) or m slots,
``windows`` exact. The state is checked exactly by tests/kernels_spec/test_compressor.py (it is
an input the call updates, so the generic tests see it after the call; ``out`` and ``windows``
computed from the updated state are the same, as the one slot written holds the token the
reference writes there).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import compressor as cm
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="B", dynamic=("B",))
def compressor_decode(c: dsl.Tensor["B", "C", dsl.f32], z: dsl.Tensor["B", "C", dsl.f32],
                      positions: dsl.Tensor["B", dsl.i32 | dsl.i64],
                      state_c: dsl.Tensor["B", "S", "C", dsl.f32], state_z: dsl.Tensor["B", "S", "C", dsl.f32],
                      out: dsl.Tensor["B", "D", dsl.f32], windows: dsl.Tensor["B", dsl.i32],
                      ape: dsl.OptionalTensor["M", "C", dsl.f32] = None, *,
                      RATIO: dsl.Const = 4, OVERLAP: dsl.Const = True,
                      BD: dsl.Tunable = dsl.choice(128, 64, 256, 32, 512)):
    cm.check_form(RATIO, OVERLAP)
    nb, d = cm.banks(OVERLAP), out.D
    b_col = d if OVERLAP else 0  # where a token's own-window (B) half starts
    for b, cb in dsl.grid(c.B, dsl.cdiv(d, BD)):
        p = dsl.load(positions[b], (1,))
        w, j = p // RATIO, p % RATIO
        cur, closing = (w % nb) * RATIO, j.eq(RATIO - 1)
        k = dsl.arange(RATIO)
        new = (k.eq(j))[:, None]

        def token(col, b=b, j=j):  # the new token's value and score at columns col .. col + BD
            v = dsl.load(c[b, col], (BD,))[None, :]  # a 1 x BD row of this sequence, not a B axis
            s = dsl.load(z[b, col], (BD,))[None, :]
            if ape is not None:
                s = s + dsl.load(ape[j, col], (1, BD))
            return v, s

        def bank(first, col, valid, b=b, k=k):  # the m slots from ``first`` at col .. col + BD
            rows = dsl.where(valid, first + k, -1)
            return dsl.load(state_c[b, rows, col], (RATIO, BD)), dsl.load(state_z[b, rows, col], (RATIO, BD))

        vb, sb = token(b_col + cb * BD)
        parts = [(vb, sb)]  # RATIO 1: the token is its window
        if RATIO > 1:  # the window's other slots, read where it completes (else the row is 0)
            ob, zb = bank(cur, b_col + cb * BD, closing & k.ne(j))
            parts = [(dsl.where(new, vb, ob), dsl.where(new, sb, zb))]
        if OVERLAP:  # window w - 1's A halves: the other bank, none for window 0
            has_prev = closing & (w > 0)
            oa, za = bank(((w + 1) % nb) * RATIO, cb * BD, has_prev)
            parts.append((oa, dsl.where(has_prev[:, None], za, cm.NEG_INF)))
            va, sa = token(cb * BD)
            dsl.store(state_c[b, cur + j, cb * BD], va)
            dsl.store(state_z[b, cur + j, cb * BD], sa)
        dsl.store(state_c[b, cur + j, b_col + cb * BD], vb)
        dsl.store(state_z[b, cur + j, b_col + cb * BD], sb)
        dsl.store(out[b, cb * BD], dsl.where(closing[:, None], cm.pool(parts), 0.0))
        dsl.store(windows[b], dsl.where(closing, w, -1).to(dsl.i32))


def compressor_decode_reference(c, z, positions, state_c, state_z, ape=None, RATIO: int = 4,
                                OVERLAP: bool = True) -> dict:
    """From model.md 2.5.4: the token's value and score (+ ape of its position in the window)
    enter the open window; a window completes at its m-th token and pools, per channel, the
    softmax over its m tokens' B halves and the previous window's m A halves (none for window 0),
    in float64. Written against the slot layout of ``compressor.py``."""
    return _reference(c, z, positions, state_c, state_z, ape, RATIO, OVERLAP)[0]


def _reference(c, z, positions, state_c, state_z, ape, ratio, overlap):
    dev = c.device
    c, z, positions, state_c, state_z = (t.cpu() for t in (c, z, positions, state_c, state_z))
    ape = ape.cpu() if ape is not None else None
    bsz, width = c.shape
    d = width // 2 if overlap else width
    nb = cm.banks(overlap)
    out, bound = torch.zeros(bsz, d), torch.zeros(bsz, d)
    windows = torch.full((bsz,), -1, dtype=torch.int32)
    for b in range(bsz):
        p = int(positions[b])
        w, j = divmod(p, ratio)
        if j != ratio - 1:
            continue
        score = z[b].float() + (ape[j].float() if ape is not None else 0.0)
        vals = state_c[b, (w % nb) * ratio:(w % nb + 1) * ratio].float().clone()
        scores = state_z[b, (w % nb) * ratio:(w % nb + 1) * ratio].float().clone()
        vals[j], scores[j] = c[b].float(), score
        vals, scores = vals[:, -d:], scores[:, -d:]  # the B halves (all of it without overlap)
        if overlap:
            prev = ((w + 1) % nb) * ratio
            pv, ps = state_c[b, prev:prev + ratio, :d].float(), state_z[b, prev:prev + ratio, :d].float()
            if w == 0:
                pv, ps = torch.zeros_like(pv), torch.full_like(ps, cm.NEG_INF)
            vals, scores = torch.cat([pv, vals]), torch.cat([ps, scores])
        row, err = cm.pool64(vals, scores)
        out[b], bound[b], windows[b] = row.float(), err, w
    return {"out": out.to(dev), "windows": windows.to(dev)}, bound


def _inputs(case, device, seed):
    b = case["B"]
    r, ov, has_ape, d, width = cm.dims(case)
    s = cm.slots_of(r, ov)
    index = torch.int64 if case.get("index") == "i64" else torch.int32
    outs = {"out": torch.full((b, d), 7.0, device=device), "windows": torch.full((b,), 7, dtype=torch.int32,
                                                                                 device=device)}
    if device.type == "meta":
        t = {"c": torch.empty(b, width), "z": torch.empty(b, width), "positions": torch.empty(b, dtype=index),
             "state_c": torch.empty(b, s, width), "state_z": torch.empty(b, s, width)}
        if has_ape:
            t["ape"] = torch.empty(r, width)
        return {**{k: v.to(device) for k, v in t.items()}, **outs}
    g = torch.Generator().manual_seed(seed)
    kind = case.get("values", "normal")
    vals, scores = cm.draw_values(b * (1 + s), width, kind, g)
    pos = _positions(case.get("positions", "random"), b, r, case.get("P", 1 << 20), g)
    t = {"c": vals[:b], "z": scores[:b], "positions": pos.to(index),
         "state_c": vals[b:].view(b, s, width), "state_z": scores[b:].view(b, s, width)}
    if has_ape:
        t["ape"] = torch.randn(r, width, generator=g)
    return {**{k: v.to(device) for k, v in t.items()}, **outs}


def _positions(kind, b, ratio, n, g):
    """``random`` (anywhere below n), ``close`` (every token completes its window), ``edge``
    (around window edges: m w - 1, m w, m w + 1, cycling), ``first`` (window 0: P < m, the
    CSA's window without A halves)."""
    if kind == "random":
        return torch.randint(0, n, (b,), generator=g)
    w = torch.randint(0, max(n // ratio, 1), (b,), generator=g)
    if kind == "close":
        return w * ratio + ratio - 1
    if kind == "edge":
        return ((w + 1) * ratio + torch.tensor([-1, 0, 1])[torch.arange(b) % 3]).clamp(min=0)
    if kind == "first":
        return torch.arange(b) % ratio
    raise ValueError(f"unknown position kind {kind!r}")


def _extra_error(case, output, inputs):
    if output != "out":
        return torch.zeros(())
    args = {k: inputs[k] for k in ("c", "z", "positions", "state_c", "state_z")}
    ratio, overlap, *_ = cm.dims(case)
    return _reference(**args, ape=inputs.get("ape"), ratio=ratio, overlap=overlap)[1]


def _traffic(case) -> tuple[float, float]:
    """(flops, bytes) a step averages: the token's value and score in and its slot out, one
    window's pooling (6 flops a slot and channel) and its bank reads every m-th token."""
    ratio, overlap, _, d, width = cm.dims(case)
    n = cm.slots_of(ratio, overlap)
    return (case["B"] * 6.0 * n * d / ratio,
            case["B"] * 4.0 * (4 * width + d + 2 * n * d / ratio))


def decode_shapes(m: shapes.ModelDims, decode_b=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """Each compressor form of ``m`` at the decode batches ``decode_b`` (B is dynamic: one build
    serves every batch 1 .. 64, so three points span them)."""
    return cm.model_cases(m, lambda form: {f"decode{b}": cm.form_case(form, B=b) for b in decode_b})


CASES = {
    "csa_b7": cm.form_case("csa", B=7, D=64),
    "csa_close_b6": cm.form_case("csa", B=6, D=64, positions="close"),
    "csa_window0_b4": cm.form_case("csa", B=4, D=64, positions="first", index="i64"),
    "csa_peaked_edge_b6": cm.form_case("csa", B=6, D=96, positions="edge", values="peaked"),
    "index_close_b5": cm.form_case("index", B=5, positions="close"),
    "hca_close_b3": cm.form_case("hca", B=3, D=80, positions="close", values="ties"),
    "hca_edge_b5": cm.form_case("hca", B=5, D=64, positions="edge"),
    "ratio2_b6": cm.form_case("ratio2", B=6, D=72, positions="edge"),
    "ratio2_zeros_b4": cm.form_case("ratio2", B=4, D=40, values="zeros", positions="close"),
    "ratio1_b5": cm.form_case("ratio1", B=5, D=48),
}

SPEC = register(Spec(
    kernel=compressor_decode,
    reference=compressor_decode_reference,
    make_inputs=_inputs,
    outputs=("out", "windows"),
    cases=CASES,
    build_cases={"v4_csa_decode64": cm.form_case("csa", B=64), "v4_hca_decode64": cm.form_case("hca", B=64),
                 "v41_ratio2_decode64": cm.form_case("ratio2", B=64)},
    tolerance=lambda case, out: (0.0, 0.0),
    extra_error=_extra_error,
    constants_of=cm.constants_of,
    flops=lambda c: _traffic(c)[0],
    bytes_moved=lambda c: _traffic(c)[1],
    model_shapes=shapes.for_models(decode_shapes),
    sweep={"B": Dim(1, 24, large=4099), "form": OneOf(*cm.FORMS), "D": Dim(8, 136, multiple=8),
           "values": OneOf("normal", "peaked", "ties", "zeros"),
           "positions": OneOf("random", "close", "edge", "first"), "index": OneOf("i32", "i64"),
           "P": OneOf(8, 300, 1 << 20), "config": {"BD": OneOf(32, 64, 128)}},
))
