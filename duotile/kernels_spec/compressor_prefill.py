"""The KV compressor over a prefill chunk (model.md 2.5.4's chunked rule, 2.13, 3.1, 5.4, 5.7):
T tokens of one sequence at positions start .. start + T - 1, its carried state, every form of
``compressor.py`` by its constants.

The chunk's tokens join the carried open window (and, with OVERLAP, the previous window's A
halves); every window that completes is pooled; the remainder is carried::

    out[i], windows[i] = pool(window w), w      w = start // m + i, if its last token is in the chunk
                       = 0, -1                  otherwise (i < N; N >= windows_touched(T, m))
    carry = state with slot(P) = (c[t], z[t] + ape[P mod m]) for each P = start + t (the last wins)

so that ``carry`` is the state a token-by-token run of ``compressor_decode`` would leave. Two
phases: phase 0 pools (grid N x D / BD: one window's channel block a program; a window's tokens
before ``start`` come from ``state``, the others from the chunk, by gathers with -1 where a token
is not there), phase 1 writes the carry (grid C / BC: every slot of a channel block, the chunk's
last token of that slot or the state's value). ``carry_c`` / ``carry_z`` may be the tensors passed
as ``state_c`` / ``state_z`` (an update in place): phase 1 runs after phase 0, each program
touches its own channels, and an element it writes is either the value it reads there or one
that ignores it, so no order of its reads and writes matters. T and N are dynamic: one build
serves every chunk length.

Tolerances (``compressor.py``): ``out`` within the pooling bound, ``windows`` and the carry exact.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import compressor as cm
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


def windows_touched(t: int, ratio: int) -> int:
    """The most windows a chunk of t >= 1 tokens reaches (one it completes or leaves open): a
    chunk from offset a of a window reaches (a + t - 1) // m + 1, the most at a = m - 1."""
    return (t + ratio - 2) // ratio + 1


def _window_part(c, z, state_c, state_z, ape, t, first, col, ratio, bd, valid=None):
    """Values and scores (m x BD) of the m tokens at chunk indices ``t`` (one a slot): those before
    the chunk (t < 0) from the state's slots ``first ..``, the others from the chunk plus ape; a
    token past the chunk, or any where ``valid`` (a one-element tile) is false, scores -inf."""
    k = dsl.arange(ratio)
    in_chunk = (t >= 0) & (t < c.T)
    rows = dsl.where(in_chunk, t, -1)
    vc, sc = dsl.load(c[rows, col], (ratio, bd)), dsl.load(z[rows, col], (ratio, bd))
    if ape is not None:
        sc = sc + dsl.load(ape[0, col], (ratio, bd))
    before = t < 0
    srows = dsl.where(before, first + k, -1)
    vs, ss = dsl.load(state_c[srows, col], (ratio, bd)), dsl.load(state_z[srows, col], (ratio, bd))
    keep = (t < c.T) if valid is None else (t < c.T) & valid
    keep = keep[:, None]
    return dsl.where(before[:, None], vs, vc), dsl.where(keep, dsl.where(before[:, None], ss, sc), cm.NEG_INF)


@dsl.kernel(dynamic=("T", "N"))
def compressor_prefill(c: dsl.Tensor["T", "C", dsl.f32], z: dsl.Tensor["T", "C", dsl.f32],
                       start: dsl.Tensor[1, dsl.i32 | dsl.i64],
                       state_c: dsl.Tensor["S", "C", dsl.f32], state_z: dsl.Tensor["S", "C", dsl.f32],
                       out: dsl.Tensor["N", "D", dsl.f32], windows: dsl.Tensor["N", dsl.i32],
                       carry_c: dsl.Tensor["S", "C", dsl.f32], carry_z: dsl.Tensor["S", "C", dsl.f32],
                       ape: dsl.OptionalTensor["M", "C", dsl.f32] = None, *,
                       RATIO: dsl.Const = 4, OVERLAP: dsl.Const = True,
                       BD: dsl.Tunable = dsl.choice(128, 64, 256, 32, 512),
                       BC: dsl.Tunable = dsl.choice(128, 64, 256, 32)):
    cm.check_form(RATIO, OVERLAP)
    nb, d = cm.banks(OVERLAP), out.D
    b_col = d if OVERLAP else 0  # where a token's own-window (B) half starts
    part = lambda t, first, col, valid=None: _window_part(c, z, state_c, state_z, ape, t, first, col, RATIO, BD, valid)
    for i, cb in dsl.grid(out.N, dsl.cdiv(d, BD)):
        s0 = dsl.load(start[0], (1,))
        w = s0 // RATIO + i
        t = w * RATIO + dsl.arange(RATIO) - s0  # the window's tokens as chunk indices
        complete = w * RATIO + (RATIO - 1) - s0 < c.T
        parts = [part(t, (w % nb) * RATIO, b_col + cb * BD)]
        if OVERLAP:  # window w - 1's A halves, none for window 0
            parts.append(part(t - RATIO, ((w + 1) % nb) * RATIO, cb * BD, w > 0))
        dsl.store(out[i, cb * BD], dsl.where(complete[:, None], cm.pool(parts), 0.0))
        dsl.store(windows[i], dsl.where(complete, w, -1).to(dsl.i32))
    for cb in dsl.grid(dsl.cdiv(c.C, BC)):
        s0 = dsl.load(start[0], (1,))
        end, slot = s0 + (c.T - 1), dsl.arange(nb * RATIO)
        t = end - (end - slot) % (nb * RATIO) - s0  # the chunk's last token of each slot (< 0: none)
        rows = dsl.where(t >= 0, t, -1)
        vc, sc = dsl.load(c[rows, cb * BC], (nb * RATIO, BC)), dsl.load(z[rows, cb * BC], (nb * RATIO, BC))
        if ape is not None:
            sc = sc + dsl.load(ape[slot % RATIO, cb * BC], (nb * RATIO, BC))
        new = (t >= 0)[:, None]
        dsl.store(carry_c[0, cb * BC], dsl.where(new, vc, dsl.load(state_c[0, cb * BC], (nb * RATIO, BC))))
        dsl.store(carry_z[0, cb * BC], dsl.where(new, sc, dsl.load(state_z[0, cb * BC], (nb * RATIO, BC))))


def compressor_prefill_reference(c, z, start, state_c, state_z, ape=None, RATIO: int = 4,
                                 OVERLAP: bool = True) -> dict:
    """From model.md 2.5.4's chunked rule: the carried tokens (the open window's, and with
    OVERLAP the previous window's) joined with the chunk's (scores + ape of each position in its
    window), every completed window pooled in float64 (softmax per channel over its m B halves
    and window w - 1's m A halves, none for window 0), the latest token of each slot carried."""
    return _reference(c, z, start, state_c, state_z, ape, RATIO, OVERLAP)[0]


def _reference(c, z, start, state_c, state_z, ape, ratio, overlap, n_out=None):
    dev = c.device
    c, z, start, state_c, state_z = (t.cpu() for t in (c, z, start, state_c, state_z))
    ape = ape.cpu() if ape is not None else None
    n_tok, width = c.shape
    s0, nb = int(start[0]), cm.banks(overlap)
    d = width // 2 if overlap else width
    pos = s0 + torch.arange(n_tok)
    scores = z.float() + (ape.float()[pos % ratio] if ape is not None else 0.0)
    base = max((s0 // ratio - nb + 1) * ratio, 0)  # the first carried position
    slot = lambda p: (p // ratio % nb) * ratio + p % ratio
    carried = torch.arange(base, s0)
    vals = torch.cat([state_c.float()[slot(carried)], c.float()])  # by position, from ``base``
    scs = torch.cat([state_z.float()[slot(carried)], scores])
    n_out = windows_touched(n_tok, ratio) if n_out is None else n_out
    out, bound = torch.zeros(n_out, d), torch.zeros(n_out, d)
    windows = torch.full((n_out,), -1, dtype=torch.int32)
    for i in range(n_out):
        w = s0 // ratio + i
        if (w + 1) * ratio > s0 + n_tok:
            continue
        lo = w * ratio - base
        v, s = vals[lo:lo + ratio, -d:], scs[lo:lo + ratio, -d:]
        if overlap:
            pv, ps = (vals[lo - ratio:lo, :d], scs[lo - ratio:lo, :d]) if w > 0 else (
                torch.zeros(ratio, d), torch.full((ratio, d), cm.NEG_INF))
            v, s = torch.cat([pv, v]), torch.cat([ps, s])
        row, err = cm.pool64(v, s)
        out[i], bound[i], windows[i] = row.float(), err, w
    last = torch.arange(max(n_tok - nb * ratio, 0), n_tok)  # distinct slots, each its latest token
    carry_c, carry_z = state_c.float().clone(), state_z.float().clone()
    carry_c[slot(pos[last])], carry_z[slot(pos[last])] = c.float()[last], scores[last]
    outs = {"out": out, "windows": windows, "carry_c": carry_c, "carry_z": carry_z}
    return {k: v.to(dev) for k, v in outs.items()}, bound


def _inputs(case, device, seed):
    ratio, overlap, has_ape, d, width = cm.dims(case)
    n_tok, s = case["T"], cm.slots_of(ratio, overlap)
    n_out = case.get("N", windows_touched(n_tok, ratio))
    index = torch.int64 if case.get("index") == "i64" else torch.int32
    outs = {"out": torch.full((n_out, d), 7.0), "windows": torch.full((n_out,), 7, dtype=torch.int32),
            "carry_c": torch.full((s, width), 7.0), "carry_z": torch.full((s, width), 7.0)}
    if device.type == "meta":
        t = {"c": torch.empty(n_tok, width), "z": torch.empty(n_tok, width), "start": torch.empty(1, dtype=index),
             "state_c": torch.empty(s, width), "state_z": torch.empty(s, width)}
    else:
        g = torch.Generator().manual_seed(seed)
        vals, scores = cm.draw_values(n_tok + s, width, case.get("values", "normal"), g)
        t = {"c": vals[:n_tok], "z": scores[:n_tok], "start": _start(case.get("start", "random"), ratio, g, index),
             "state_c": vals[n_tok:].contiguous(), "state_z": scores[n_tok:].contiguous()}
    if has_ape:
        t["ape"] = torch.empty(ratio, width) if device.type == "meta" else torch.randn(ratio, width, generator=g)
    return {k: v.to(device) for k, v in {**t, **outs}.items()}


def _start(kind, ratio, g, index):
    """``zero`` (a prompt's first chunk: window 0, no A halves), ``aligned`` (a window's first
    token), ``mid`` (inside a window: carried tokens), ``last`` (a window's last token), ``random``."""
    w = int(torch.randint(1, 5000, (1,), generator=g))
    offset = {"zero": -w * ratio, "aligned": 0, "mid": ratio // 2, "last": ratio - 1,
              "random": int(torch.randint(0, ratio, (1,), generator=g))}[kind]
    return torch.tensor([w * ratio + offset], dtype=index)


def _extra_error(case, output, inputs):
    if output != "out":
        return torch.zeros(())
    ratio, overlap, *_ = cm.dims(case)
    args = {k: inputs[k] for k in ("c", "z", "start", "state_c", "state_z")}
    return _reference(**args, ape=inputs.get("ape"), ratio=ratio, overlap=overlap, n_out=inputs["out"].shape[0])[1]


def prefill_shapes(m: shapes.ModelDims) -> dict[str, shapes.Case]:
    """Each compressor form of ``m`` over one prefill chunk (T and N are dynamic: one build)."""
    return cm.model_cases(m, lambda form: {f"prefill{shapes.PREFILL_CHUNK}": cm.form_case(
        form, T=shapes.PREFILL_CHUNK, N=windows_touched(shapes.PREFILL_CHUNK, cm.FORMS[form][0]))})


def _traffic(case) -> tuple[float, float]:
    ratio, overlap, _, d, width = cm.dims(case)
    n = cm.slots_of(ratio, overlap)
    return 6.0 * n * d * case["T"] / ratio, 4.0 * (2 * width * case["T"] * n / ratio + d * case["T"] / ratio
                                                   + 4 * n * width)


CASES = {
    "csa_t37_mid": cm.form_case("csa", T=37, D=64, start="mid"),
    "csa_t9_zero": cm.form_case("csa", T=9, D=64, start="zero", index="i64"),
    "csa_t1_last": cm.form_case("csa", T=1, D=32, start="last"),
    "csa_t3_zero": cm.form_case("csa", T=3, D=32, start="zero"),
    "index_t20_aligned": cm.form_case("index", T=20, start="aligned", values="peaked"),
    "hca_t300_mid": cm.form_case("hca", T=300, D=48, start="mid"),
    "hca_t130_last": cm.form_case("hca", T=130, D=40, start="last", values="ties"),
    "ratio2_t33_random": cm.form_case("ratio2", T=33, D=72),
    "ratio2_t1_zero": cm.form_case("ratio2", T=1, D=24, start="zero", values="zeros"),
    "ratio1_t17": cm.form_case("ratio1", T=17, D=40),
}

SPEC = register(Spec(
    kernel=compressor_prefill,
    reference=compressor_prefill_reference,
    make_inputs=_inputs,
    outputs=("out", "windows", "carry_c", "carry_z"),
    cases=CASES,
    build_cases={"v4_csa_prefill4096": cm.form_case("csa", T=4096), "v4_hca_prefill4096": cm.form_case("hca", T=4096),
                 "v41_ratio2_prefill4096": cm.form_case("ratio2", T=4096)},
    tolerance=lambda case, out: (0.0, 0.0),
    extra_error=_extra_error,
    constants_of=cm.constants_of,
    flops=lambda c: _traffic(c)[0],
    bytes_moved=lambda c: _traffic(c)[1],
    model_shapes=shapes.for_models(prefill_shapes),
    sweep={"T": Dim(1, 300, large=8192), "form": OneOf(*cm.FORMS), "D": Dim(8, 136, multiple=8),
           "values": OneOf("normal", "peaked", "ties", "zeros"),
           "start": OneOf("zero", "aligned", "mid", "last", "random"), "index": OneOf("i32", "i64"),
           "config": {"BD": OneOf(32, 64, 128), "BC": OneOf(32, 64, 128)}},
))
