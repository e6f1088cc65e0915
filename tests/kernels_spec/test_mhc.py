"""The mHC kernels (kernels_spec/hc_pre.py, hc_post.py, hc_head.py) on the interpreter: against the
runtime's own mHC (runtime/layers/mhc.py: HCSite.mixes, collapse, expand, HCHead) on the same
inputs within each spec's stated tolerance, bit for bit where the order of operations is the
same; model.md's rules (eps in every denominator, column-first Sinkhorn, 20 rounds, comb's
contraction over its first index) tight enough that each wrong variant fails; the measured bound
behind the Sinkhorn's rounding allowance; tokens independent of the batch; clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.hc_pre import COMB_ROUNDING, HC, mixes_f64, sinkhorn_reference
from duotile.runtime.layers.common import Ctx
from duotile.runtime.layers.mhc import HCHead, HCSite, collapse, expand
from duotile.runtime.ops import FastOps, InvariantOps

SPECS = load_all()
PRE, POST, HEAD = SPECS["hc_pre"], SPECS["hc_post"], SPECS["hc_head"]
OPS = [(FastOps(), torch.bfloat16, 1e-6), (InvariantOps(), torch.float32, 1e-20)]
OPS_IDS = ["fast_bf16_v4eps", "invariant_f32_v41eps"]


def run(spec, case, inputs, **constants):
    kernel = codegen.compile(spec.kernel, "interpret", config=spec.config_of(case),
                             constants={**spec.constants_of(case), **constants})
    kernel(**inputs)
    return inputs


def within(spec, case, out, got, want, inputs):
    """|got - want| within the spec's stated tolerance of ``out`` (evaluated at ``want``)."""
    allowed = spec.allowed_error(case, out, want.float(), inputs)
    err = (got.float() - want.float()).abs()
    return bool(((err <= allowed) | (got.float() == want.float())).all())


def config(eps):
    return SimpleNamespace(hc_mult=HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=eps)


@pytest.mark.parametrize("ops,dtype,eps", OPS, ids=OPS_IDS)
def test_hc_pre_agrees_with_the_runtimes_site(ops, dtype, eps):
    """HCSite.mixes gives pre / post / comb and collapse the site's input: the kernel's within its
    tolerance, V4's own-pre form and V4.1's pre_in form (bit for bit there under InvariantOps: the
    same f32 terms added in the same pairwise order)."""
    ctx = Ctx(ops=ops, dtype=dtype)
    case = {"T": 6, "D": 160, "EPS": eps, "dtype": "f32" if dtype == torch.float32 else "bf16"}
    for single in (False, True):
        c = {**case, "single_pass": single}
        inputs = run(PRE, c, PRE.make_inputs(c, torch.device("cpu"), 4))
        site = HCSite(config(eps), inputs["fn"], inputs["base"], inputs["scale"])
        want = dict(zip(("pre", "post", "comb"), site.mixes(ctx, inputs["x"])))
        want["y"] = collapse(ctx, inputs["x"], inputs["pre_in"] if single else want["pre"])
        for out in PRE.outputs:
            assert within(PRE, c, out, inputs[out], want[out], inputs), (out, single)
        if single and ops.invariant:
            assert torch.equal(inputs["y"], want["y"])


@pytest.mark.parametrize("ops,dtype,eps", OPS, ids=OPS_IDS)
def test_hc_post_agrees_with_the_runtimes_expand(ops, dtype, eps):
    """expand(f, R, post, comb) on hc_pre's post and comb: bit for bit under InvariantOps (the
    kernel adds the four terms in its pairwise order), within the tolerance under FastOps."""
    ctx = Ctx(ops=ops, dtype=dtype)
    site_case = {"T": 5, "D": 96, "EPS": eps, "dtype": "f32" if dtype == torch.float32 else "bf16"}
    site = run(PRE, site_case, PRE.make_inputs(site_case, torch.device("cpu"), 2))
    case = {"T": 5, "D": 96, "dtype": site_case["dtype"], "config": {"BD": 256}}
    inputs = POST.make_inputs(case, torch.device("cpu"), 3)
    inputs.update(r=site["x"], post=site["post"], comb=site["comb"])
    run(POST, case, inputs)
    want = expand(ctx, inputs["f"], inputs["r"], inputs["post"], inputs["comb"])
    assert within(POST, case, "out", inputs["out"], want, inputs)
    if ops.invariant:
        assert torch.equal(inputs["out"], want)


@pytest.mark.parametrize("ops,dtype,eps", OPS, ids=OPS_IDS)
def test_hc_head_agrees_with_the_runtimes_head(ops, dtype, eps):
    """V4: HCHead(x) with hc_head_*; V4.1: collapse by the last site's pre."""
    ctx = Ctx(ops=ops, dtype=dtype)
    case = {"T": 4, "D": 128, "EPS": eps, "dtype": "f32" if dtype == torch.float32 else "bf16"}
    for single in (False, True):
        c = {**case, "single_pass": single}
        inputs = run(HEAD, c, HEAD.make_inputs(c, torch.device("cpu"), 6))
        if single:
            want = collapse(ctx, inputs["x"], inputs["pre_in"])
        else:
            want = HCHead(config(eps), inputs["fn"], inputs["base"], inputs["scale"])(ctx, inputs["x"])
        assert within(HEAD, c, "y", inputs["y"], want, inputs), single


def _variant(c0, rule, eps, iters=20):
    """model.md 2.3.2's Sinkhorn with one rule changed."""
    if rule == "iters19":
        return sinkhorn_reference(c0, iters - 1, eps)
    m = torch.softmax(c0, -1) + (0.0 if rule == "no_softmax_eps" else eps)
    col = lambda a: a / (a.sum(-2, keepdim=True) + eps)
    row = lambda a: a / (a.sum(-1, keepdim=True) + eps)
    first, second = (row, col) if rule == "rows_first" else (col, row)
    m = first(m)
    for _ in range(iters - 1):
        m = first(second(m))
    return m.transpose(-1, -2) if rule == "transposed" else m


def test_model_md_rules_hold_and_each_wrong_variant_fails():
    """With HC_EPS magnified to 1e-2 the kernel's pre / comb match model.md's float64 formulas to
    2^-18, and differ by more than 2^-14 from each variant: pre without eps, softmax without eps,
    rows normalised first, 19 rounds, comb transposed (peaked logits: 20 rounds are short of
    convergence there, so the order and the count show)."""
    hc_eps = 1e-2
    case = {"T": 5, "D": 64, "dtype": "f32", "params": "peaked"}
    inputs = run(PRE, case, PRE.make_inputs(case, torch.device("cpu"), 9), HC_EPS=hc_eps)
    want = PRE.reference(**{k: inputs[k] for k in ("x", "fn", "base", "scale")}, HC_EPS=hc_eps)
    for out in ("pre", "post", "comb"):
        assert (inputs[out] - want[out]).abs().max() < 2.0 ** -18, out
    assert (inputs["pre"] - (want["pre"] - hc_eps)).abs().min() > 2.0 ** -10
    logits, _ = mixes_f64(inputs["x"], inputs["fn"], 1e-6)
    c0 = (logits[:, 2 * HC:] * inputs["scale"].double()[2] + inputs["base"].double()[2 * HC:]).view(-1, HC, HC)
    for rule in ("no_softmax_eps", "rows_first", "iters19", "transposed"):
        wrong = _variant(c0, rule, hc_eps).float()
        assert (inputs["comb"] - wrong).abs().max() > 2.0 ** -14, rule


def test_the_f32_sinkhorn_stays_within_its_rounding_allowance():
    """hc_pre's comb tolerance allows COMB_ROUNDING (2^-16) for the f32 Sinkhorn's own rounding:
    over logits of scale 0.1 to 40 (near uniform to near a permutation) the f32 and float64
    Sinkhorn differ by at most 2^-18, a quarter of it."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for scale in (0.1, 1.0, 4.0, 10.0, 20.0, 40.0):
        c0 = torch.randn(2000, HC, HC, generator=gen, dtype=torch.float64) * scale
        diff = (sinkhorn_reference(c0.float()).double() - sinkhorn_reference(c0)).abs().max().item()
        worst = max(worst, diff)
    assert worst <= COMB_ROUNDING / 4, worst


def test_hc_post_contracts_comb_over_its_first_index():
    """A comb with one non-zero entry [i, j] = 1 and post 0 copies stream i into stream j."""
    t, d = 1, 32
    r = torch.arange(HC * d, dtype=torch.float32).view(1, HC, d) + 1
    comb = torch.zeros(t, HC, HC)
    comb[0, 2, 1] = 1.0
    inputs = {"f": torch.ones(t, d), "r": r, "post": torch.zeros(t, HC), "comb": comb,
              "out": torch.full((t, HC, d), 7.0)}
    run(POST, {"T": t, "D": d}, inputs)
    assert torch.equal(inputs["out"][0, 1], r[0, 2]) and (inputs["out"][0, [0, 2, 3]] == 0).all()


def test_tokens_do_not_depend_on_the_batch():
    """A token's outputs are the same bits alone and among others (one build serves every T)."""
    case = {"T": 6, "D": 96, "single_pass": False}
    inputs = run(PRE, case, PRE.make_inputs(case, torch.device("cpu"), 5))
    one = {k: (v[3:4].clone() if v.shape[0] == 6 else v) for k, v in inputs.items() if k != "fn"}
    one.update(fn=inputs["fn"], base=inputs["base"], scale=inputs["scale"])
    run(PRE, {**case, "T": 1}, one)
    for out in PRE.outputs:
        assert torch.equal(one[out], inputs[out][3:4]), out


def test_invalid_calls_are_refused_clearly():
    case = {"T": 2, "D": 64, "single_pass": True}
    inputs = HEAD.make_inputs(case, torch.device("cpu"), 0)
    fn = torch.zeros(HC, HC * 64)
    with pytest.raises(DslError, match="either fn, base and scale"):
        run(HEAD, case, {**inputs, "fn": fn, "base": torch.zeros(HC), "scale": torch.ones(1)})
    with pytest.raises(DslError, match="either fn, base and scale"):
        run(HEAD, case, {"x": inputs["x"], "y": inputs["y"], "fn": fn})
    site = PRE.make_inputs({"T": 2, "D": 64}, torch.device("cpu"), 0)
    with pytest.raises(DslError, match="ITERS 0 must be a positive int"):
        run(PRE, {"T": 2, "D": 64}, site, ITERS=0)
