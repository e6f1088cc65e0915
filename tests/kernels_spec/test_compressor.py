"""The KV compressors (kernels_spec/compressor_decode.py, compressor_prefill.py) on the
interpreter: the decode step's state update exact (its slot, nothing else); slots a sequence has
not seen (stale windows, window 0's missing A halves) filled with NaN change nothing; a decode
loop of several sequences and chunked prefills against the runtime's pool_windows on the same
values and scores (the rows within the pooling bound, the carried state the runtime's pending
tokens and A halves exactly); a prefill leaves the state a token-by-token decode leaves, bit for
bit; the carry in place; spare output rows; a sequence's row the same alone and in a batch; a
wrong pooling fails the bound; invalid forms refused."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.kernels_spec import compressor as cm
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs
from duotile.kernels_spec.compressor_prefill import windows_touched
from duotile.runtime.cache import CompressorState
from duotile.runtime.layers.common import Ctx
from duotile.runtime.layers.compressor import pool_windows
from duotile.runtime.ops import FastOps

DECODE, PREFILL = load_all()["compressor_decode"], load_all()["compressor_prefill"]
FORMS = ("csa", "hca", "ratio2", "ratio1")
SMALL = {"csa": 16, "index": 16, "hca": 8, "ratio2": 16, "ratio1": 16}  # pooled widths D of the tests


def kernel(spec, form):
    ratio, overlap, *_ = cm.dims({"form": form})
    return codegen.compile(spec.kernel, "interpret", constants={"RATIO": ratio, "OVERLAP": overlap})


def slot(p: int, ratio: int, overlap: bool) -> int:
    return (p // ratio % cm.banks(overlap)) * ratio + p % ratio


def test_decode_writes_its_slot_and_nothing_else():
    case = cm.form_case("csa", B=9, D=16, positions="edge")
    inputs = DECODE.make_inputs(case, torch.device("cpu"), seed=3)
    before = {k: v.clone() for k, v in inputs.items()}
    kernel(DECODE, "csa")(**inputs)
    want_c, want_z = before["state_c"].clone(), before["state_z"].clone()
    for b, p in enumerate(before["positions"].tolist()):
        s = slot(p, 4, True)
        want_c[b, s], want_z[b, s] = before["c"][b], before["z"][b] + before["ape"][p % 4]
    assert torch.equal(inputs["state_c"], want_c) and torch.equal(inputs["state_z"], want_z)
    ref = DECODE.run_reference(before, case)  # from the state before the call
    check_outputs(DECODE, case, inputs, ref)
    assert set(inputs["windows"].tolist()) - {-1}  # some windows completed


@pytest.mark.parametrize("form", ["csa", "ratio2"])
def test_slots_not_seen_are_never_read(form):
    """NaN in every slot the sequence has not filled (the open window's later slots, older windows'
    leftovers, window 0's A halves) changes no output: no reset is needed for a new sequence."""
    ratio, overlap, *_ = cm.dims({"form": form})
    case = cm.form_case(form, B=2 * ratio, D=8, positions="first")
    inputs = DECODE.make_inputs(case, torch.device("cpu"), seed=4)
    inputs["positions"] = torch.arange(2 * ratio, dtype=torch.int32)  # windows 0 and 1, every position in them
    for b, p in enumerate(inputs["positions"].tolist()):
        seen = {slot(q, ratio, overlap) for q in range(max(0, (p // ratio - 1) * ratio), p)}
        if p < ratio or not overlap:
            seen = {s for s in seen if s // ratio == p // ratio % cm.banks(overlap)}
        for s in set(range(cm.slots_of(ratio, overlap))) - seen:
            inputs["state_c"][b, s], inputs["state_z"][b, s] = float("nan"), float("nan")
    clean = {k: torch.nan_to_num(v, nan=0.0) if v.is_floating_point() else v for k, v in inputs.items()}
    kernel(DECODE, form)(**inputs)
    kernel(DECODE, form)(**clean)
    assert not inputs["out"].isnan().any()
    assert torch.equal(inputs["out"], clean["out"]) and torch.equal(inputs["windows"], clean["windows"])


def _stream(form, n, seed):
    """n tokens' values and scores (ape added, as the runtime's ``project`` returns them)."""
    ratio, overlap, has_ape, d, width = cm.dims({"form": form, "D": SMALL[form]})
    g = torch.Generator().manual_seed(seed)
    c, z = cm.draw_values(n, width, "normal", g)
    ape = torch.randn(ratio, width, generator=g) if has_ape else None
    return c, z, ape, width


def _scored(z, ape, positions, ratio):
    return z + ape[positions % ratio] if ape is not None else z


def _runtime_rows(form, c, z, ape, chunks):
    """pool_windows over the chunks: every completed window's row, by window index."""
    ratio, overlap, *_ = cm.dims({"form": form})
    st, ctx, rows, start = CompressorState.empty(c.shape[1], "cpu"), Ctx(FastOps()), {}, 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        pooled, first = pool_windows(ctx, st, c[start:start + n], _scored(z[start:start + n], ape, pos, ratio),
                                     start, ratio, overlap)
        rows.update({first + i: r for i, r in enumerate(pooled)})
        start += n
    return rows, st


def _close(got, want, bound):
    assert torch.all((got - want).abs() <= 2 * bound), (got - want).abs().max()


@pytest.mark.parametrize("form", FORMS)
def test_decode_loop_matches_the_runtimes_pool_windows(form):
    """Three sequences decoded token by token in one batch from positions 0, m - 2 and 2 m - 1
    (the state before them from a prefill), each completing a window, one of them two, against
    pool_windows fed the same tokens one at a time."""
    ratio, overlap, *_ = cm.dims({"form": form})
    starts, steps = [0, max(ratio - 2, 1), 2 * ratio - 1], ratio + 2
    streams = [_stream(form, s + steps, seed) for seed, s in enumerate(starts)]
    ape, width = streams[0][2], streams[0][3]
    streams = [(c, z, ape) for c, z, _, _ in streams]  # one layer: one ape
    state_c, state_z = torch.zeros(3, cm.slots_of(ratio, overlap), width), torch.zeros(3, cm.slots_of(ratio, overlap),
                                                                                        width)
    for b, ((c, z, _), s) in enumerate(zip(streams, starts)):
        if s:
            _prefill(form, c[:s], z[:s], ape, 0, state_c[b], state_z[b])
    run = kernel(DECODE, form)
    got = [{} for _ in starts]
    for i in range(steps):
        pos = torch.tensor([s + i for s in starts], dtype=torch.int32)
        out, win = torch.zeros(3, width // 2 if overlap else width), torch.zeros(3, dtype=torch.int32)
        args = {"c": torch.stack([st[0][p] for st, p in zip(streams, pos)]),
                "z": torch.stack([st[1][p] for st, p in zip(streams, pos)]), "positions": pos,
                "state_c": state_c, "state_z": state_z, "out": out, "windows": win}
        run(**args, **({"ape": ape} if ape is not None else {}))
        for b in range(3):
            if win[b] >= 0:
                got[b][int(win[b])] = out[b].clone()
    for b, ((c, z, _), s) in enumerate(zip(streams, starts)):
        want, _ = _runtime_rows(form, c, z, ape, [s, *([1] * steps)] if s else [1] * steps)
        assert set(got[b]) == {w for w in want if (w + 1) * ratio > s}
        for w, row in got[b].items():
            _close(row, want[w], _bound(form, c, z, ape, w))


def _bound(form, c, z, ape, w):
    """The pooling bound of window w from its slots in float64 (compressor.py)."""
    ratio, overlap, *_ = cm.dims({"form": form})
    pos = torch.arange(c.shape[0])
    s = _scored(z, ape, pos, ratio)
    d = c.shape[1] // 2 if overlap else c.shape[1]
    v, sc = c[w * ratio:(w + 1) * ratio, -d:], s[w * ratio:(w + 1) * ratio, -d:]
    if overlap and w:
        v, sc = torch.cat([c[(w - 1) * ratio:w * ratio, :d], v]), torch.cat([s[(w - 1) * ratio:w * ratio, :d], sc])
    return cm.pool64(v, sc)[1]


def _prefill(form, c, z, ape, start, state_c, state_z, carry=None):
    """One prefill chunk; the carry in place unless ``carry`` names other tensors."""
    ratio, overlap, *_ = cm.dims({"form": form})
    n = windows_touched(c.shape[0], ratio)
    out = torch.zeros(n, c.shape[1] // 2 if overlap else c.shape[1])
    win = torch.zeros(n, dtype=torch.int32)
    carry_c, carry_z = carry if carry is not None else (state_c, state_z)
    kernel(PREFILL, form)(c=c, z=z, start=torch.tensor([start]), state_c=state_c, state_z=state_z, out=out,
                          windows=win, carry_c=carry_c, carry_z=carry_z, **({"ape": ape} if ape is not None else {}))
    return out, win


@pytest.mark.parametrize("form", FORMS)
def test_chunked_prefill_matches_the_runtime_rows_and_state(form):
    ratio, overlap, *_ = cm.dims({"form": form})
    chunks = [ratio + 1, 1, 3 * ratio - 2, ratio, 2, 2 * ratio + 1]
    c, z, ape, width = _stream(form, sum(chunks), seed=11)
    want, st = _runtime_rows(form, c, z, ape, chunks)
    state_c, state_z = torch.zeros(cm.slots_of(ratio, overlap), width), torch.zeros(cm.slots_of(ratio, overlap), width)
    got, start = {}, 0
    for n in chunks:
        out, win = _prefill(form, c[start:start + n], z[start:start + n], ape, start, state_c, state_z)
        assert (out[win < 0] == 0).all()
        got.update({int(w): out[i] for i, w in enumerate(win) if w >= 0})
        start += n
    assert set(got) == set(want)
    for w, row in got.items():
        _close(row, want[w], _bound(form, c, z, ape, w))
    pending = torch.arange(start - st.pending_c.shape[0], start)  # the runtime's open window
    slots = torch.tensor([slot(int(p), ratio, overlap) for p in pending], dtype=torch.long)
    assert torch.equal(state_c[slots], st.pending_c) and torch.equal(state_z[slots], st.pending_z)
    if overlap:  # the last complete window's A halves
        last = torch.tensor([slot(int(p), ratio, overlap) for p in range(start // ratio * ratio - ratio,
                                                                        start // ratio * ratio)])
        d = width // 2
        assert torch.equal(state_c[last, :d], st.prev_c) and torch.equal(state_z[last, :d], st.prev_z)


@pytest.mark.parametrize("form", ["csa", "ratio2"])
def test_prefill_leaves_the_state_of_a_decode_loop(form):
    """A 3 m + 2-token chunk from position m - 1 after a decode loop to there, against decoding
    every token: the same state bit for bit, and the carry written apart equals it in place."""
    ratio, overlap, *_ = cm.dims({"form": form})
    n0, n = ratio - 1, 3 * ratio + 2
    c, z, ape, width = _stream(form, n0 + n, seed=5)
    shape = (1, cm.slots_of(ratio, overlap), width)
    dec_c, dec_z = torch.full(shape, 3.0), torch.full(shape, -2.0)
    run = kernel(DECODE, form)
    for p in range(n0 + n):
        run(c=c[p:p + 1], z=z[p:p + 1], positions=torch.tensor([p]), state_c=dec_c, state_z=dec_z,
            out=torch.zeros(1, width // 2 if overlap else width), windows=torch.zeros(1, dtype=torch.int32), ape=ape)
        if p == n0 - 1:
            pre_c, pre_z = dec_c[0].clone(), dec_z[0].clone()
    sep = (torch.full_like(pre_c, 9.0), torch.full_like(pre_z, 9.0))
    _prefill(form, c[n0:], z[n0:], ape, n0, pre_c.clone(), pre_z.clone(), carry=sep)
    _prefill(form, c[n0:], z[n0:], ape, n0, pre_c, pre_z)  # in place
    assert torch.equal(pre_c, dec_c[0]) and torch.equal(pre_z, dec_z[0])
    assert torch.equal(sep[0], dec_c[0]) and torch.equal(sep[1], dec_z[0])


def test_spare_output_rows_are_zero_and_name_no_window():
    c, z, ape, width = _stream("csa", 8, seed=6)
    state = torch.zeros(8, width), torch.zeros(8, width)
    out, win = torch.full((6, width // 2), 5.0), torch.full((6,), 5, dtype=torch.int32)
    kernel(PREFILL, "csa")(c=c, z=z, start=torch.tensor([4]), state_c=state[0], state_z=state[1], out=out,
                           windows=win, carry_c=state[0].clone(), carry_z=state[1].clone(), ape=ape)
    assert win.tolist() == [1, 2, -1, -1, -1, -1] and (out[2:] == 0).all() and (out[:2] != 0).all()


def test_a_sequence_pools_the_same_alone_and_in_a_batch():
    case = cm.form_case("hca", B=12, D=24, positions="close")
    inputs = DECODE.make_inputs(case, torch.device("cpu"), seed=8)
    alone = {k: v[5:6].clone() if k != "ape" else v for k, v in inputs.items()}
    kernel(DECODE, "hca")(**inputs)
    kernel(DECODE, "hca")(**alone)
    assert torch.equal(inputs["out"][5:6], alone["out"]) and torch.equal(inputs["state_c"][5:6], alone["state_c"])


@pytest.mark.parametrize("wrong", ["no_ape", "no_prev_window", "f32_mean"])
def test_a_wrong_pooling_fails_the_bound(wrong):
    """References that drop ape, drop window w - 1's A halves, or average instead of weighting are
    caught by the tolerance (it is far below what such slips move)."""
    case = cm.form_case("csa", B=16, D=32, positions="close")
    inputs = DECODE.make_inputs(case, torch.device("cpu"), seed=9)
    kernel(DECODE, "csa")(**inputs)
    args = {k: v for k, v in inputs.items() if k not in DECODE.outputs}
    if wrong == "no_ape":
        args["ape"] = torch.zeros_like(args["ape"])
    elif wrong == "no_prev_window":
        args["positions"] = args["positions"] % 4  # every window taken as window 0
    else:
        args["z"] = torch.zeros_like(args["z"])
        args["state_z"] = torch.zeros_like(args["state_z"])
        args["ape"] = torch.zeros_like(args["ape"])
    ref = DECODE.reference(**args, RATIO=4, OVERLAP=True)
    with pytest.raises(AssertionError, match="compressor_decode/out"):
        check_outputs(DECODE, case, inputs, {**ref, "windows": inputs["windows"]})


@pytest.mark.parametrize("consts,match", [({"RATIO": 0, "OVERLAP": False}, "RATIO 0"),
                                          ({"RATIO": 4, "OVERLAP": 1}, "OVERLAP 1")])
def test_invalid_forms_are_refused(consts, match):
    inputs = DECODE.make_inputs(cm.form_case("ratio2", B=2, D=8), torch.device("cpu"), seed=1)
    with pytest.raises(dsl.DslError, match=match):
        codegen.compile(DECODE.kernel, "interpret", constants=consts)(**inputs)


def test_windows_touched_is_the_most_a_chunk_reaches():
    for ratio in (1, 2, 4, 128):
        for n in (1, 2, ratio, ratio + 1, 3 * ratio + 1):
            most = max(len({p // ratio for p in range(s, s + n)}) for s in range(2 * ratio))
            assert windows_touched(n, ratio) == most, (ratio, n)
