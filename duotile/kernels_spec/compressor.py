"""What the two KV-compressor specs share (``compressor_decode.py``, ``compressor_prefill.py``;
model.md 2.5.4, 2.13, 3.1, 3.4, 5.4, 5.7): the forms, the state layout, the pooling tile math, the
float64 pooling of the references, the tolerance, inputs and model shapes. Registers no spec.

Forms (``RATIO`` m, ``OVERLAP``; ``ape`` passed or not):

=============  =====  =======  ====  ==========================================================
form           RATIO  OVERLAP  ape   C (value / score width) -> D (pooled row)
=============  =====  =======  ====  ==========================================================
V4 CSA         4      True     yes   1024 -> 512: A half c[:D] (next window), B half c[D:] (own)
V4 indexer     4      True     yes   256 -> 128 (the CSA layers' index-key compressor)
V4 HCA         128    False    yes   512 -> 512
V4.1 ratio 2   2      False    no    512 -> 512
V4.1 ratio 1   1      False    no    512 -> 512: one token a window, the row is c itself
=============  =====  =======  ====  ==========================================================

Pooling (per channel): window w pools the slots {A halves of window w - 1's m tokens (OVERLAP;
none for w = 0: weight 0)} U {B halves (the whole vector without OVERLAP) of window w's m
tokens}, ``row[ch] = sum_slot softmax(score)[slot] * value[slot]``, scores ``z + ape[P mod m]``
(model.md 2.5.4: the ape row of each token's own position in its window). With RATIO 1 the one
weight is exp(0) / exp(0) = 1, so the row is c bit for bit (any finite score); V4.1's ratio-1
layers have no gate, and a caller passes zeros.

State, preallocated per sequence, FP32 like the reference's (model.md 3.1): ``state_c`` /
``state_z`` [S, C] with S = BANKS x m slots, BANKS = 2 with OVERLAP (the ring of model.md's two
banks) and 1 without: token P lives at slot ``((P // m) mod BANKS) x m + P mod m``, its value
vector c and its score z + ape (ape added once, as the token enters). Window w's tokens are bank
w mod BANKS; with OVERLAP window w - 1's are the other bank, intact until window w + 1 begins,
so no bank is ever copied. A bank is read only as its window completes, when every slot holds
one of that window's tokens, and window 0's missing A halves are not read (w = 0), so a new
sequence needs no reset: any contents will do.

Pooling in the kernels: ``m = max`` over the slots, ``e = exp(s - m)``, ``row = sum(e v) /
sum(e)`` in f32. The rows are not normalised, rotated or quantised here: RMSNorm, RoPE at m w and
the row format (V4's 584-byte FP8 rows, V4.1's NVFP4 288-byte rows) follow in other kernels
(rmsnorm, quantize / quantize_fp4; kv_insert writes ring slots at P mod 128, not row w, and
rotates at P), with ``windows`` naming the row each pooled row becomes (-1: none).

Tolerance of a pooled channel (the references pool in float64), with n slots, u = 2^-24, p the
slots' weights, x = s - max their exponents, ``mag = sum p |v|``, ``mag_x = sum p |x| |v|`` and
``X = sum p |x|``: ``u ((2 n + 8 + 4 X) mag + 4 mag_x) + n 2^-126``. Derivation (first order):
the exponent s - m rounds once (e moves by |x| u relative); exp within (4 + 2.32 |x|) u (CUDA's
fast exp: 2 + 1.16 |x| ulp, an ulp up to 2u; the interpreter's libm within 1 ulp); the product
e v (u) and the n-term f32 sum (n - 1) u: the numerator within (n + 4 + 3.32 |x_j|) u of each
term's e |v|; the denominator within (n + 3) u + 3.32 X u relative, which moves the row by that
times mag; the division u. Flush-to-zero of subnormal products adds up to 2^-126 each.
``windows`` and the state are exact: copies, and the one f32 add z + ape, the reference's own.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes

NEG_INF = float("-inf")
U = 2.0 ** -24
FORMS = {  # name -> (RATIO, OVERLAP, ape, pooled width D, value width C) at the models' sizes
    "csa": (4, True, True, 512, 1024), "index": (4, True, True, 128, 256), "hca": (128, False, True, 512, 512),
    "ratio2": (2, False, False, 512, 512), "ratio1": (1, False, False, 512, 512),
}
MODEL_FORMS = {"v4-flash": ("csa", "index", "hca"), "v41-flash": ("ratio2", "ratio1")}


def banks(overlap: bool) -> int:
    return 2 if overlap else 1


def check_form(ratio, overlap) -> None:
    if not (isinstance(ratio, int) and ratio >= 1):
        raise dsl.DslError(f"RATIO {ratio!r}: expected a positive integer (tokens a window)")
    if not isinstance(overlap, bool):
        raise dsl.DslError(f"OVERLAP {overlap!r}: expected True (V4's ratio-4 CSA) or False")


def pool(parts):
    """``parts``: (values, scores) tiles (n x BD, f32; a slot not pooled scores -inf); the pooled
    1 x BD row ``sum(e v) / sum(e)``, ``e = exp(s - max)`` (the module docstring)."""
    m = parts[0][1].max(axis=0)
    for _, s in parts[1:]:
        m = dsl.maximum(m, s.max(axis=0))
    num, den = None, None
    for v, s in parts:
        e = dsl.exp(s - m[None, :])
        n_, d_ = (e * v).sum(axis=0), e.sum(axis=0)
        num, den = (n_, d_) if num is None else (num + n_, den + d_)
    return (num / den)[None, :]


def pool64(values: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """model.md's pooling in float64 over dim -2 (the n slots): the rows, and the tolerance of each
    channel (the module docstring)."""
    s, v = scores.double(), values.double()
    p = torch.softmax(s, -2)
    x = torch.where(p > 0, s - s.amax(-2, keepdim=True), 0.0).abs()  # |exponent| of each weight
    mag, mag_x, big_x = (p * v.abs()).sum(-2), (p * x * v.abs()).sum(-2), (p * x).sum(-2)
    n = values.shape[-2]
    bound = U * ((2 * n + 8 + 4 * big_x) * mag + 4 * mag_x) + n * 2.0 ** -126
    return (p * v).sum(-2), bound.float()


def slots_of(ratio: int, overlap: bool) -> int:
    """Slots a window pools: its m tokens, plus window w - 1's m A halves with OVERLAP."""
    return ratio * banks(overlap)


def draw_values(n: int, width: int, kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, raw scores) of ``n`` tokens: ``normal`` (values of 2^-8..2^8 a token, scores of
    scale 1..8), ``peaked`` (scores 30..60 apart: one slot takes nearly all the weight, others
    underflow), ``ties`` (every score equal: the mean), ``zeros`` (values 0 and -0)."""
    v = torch.randn(n, width, generator=g)
    s = torch.randn(n, width, generator=g)
    if kind == "normal":
        return v * torch.exp2(torch.randint(-8, 9, (n, 1), generator=g).float()), s * torch.randint(1, 9, (1,),
                                                                                                   generator=g)
    if kind == "peaked":
        return v, s * 30.0
    if kind == "ties":
        return v, torch.full_like(s, 0.25)
    if kind == "zeros":
        return torch.where(torch.rand(n, width, generator=g) < 0.5, -0.0, 0.0), s
    raise ValueError(f"unknown value kind {kind!r}")


def form_case(form: str, **sizes) -> dict:
    """A case of form ``form`` (``FORMS``) at the model's widths, or at a pooled width ``D``."""
    return {"form": form, **sizes}


def dims(case: dict) -> tuple[int, bool, bool, int, int]:
    """(RATIO, OVERLAP, ape, D, C) of a case: its form's, at the case's D if it names one."""
    ratio, overlap, ape, d, _ = FORMS[case["form"]]
    d = case.get("D", d)
    return ratio, overlap, ape, d, 2 * d if overlap else d


def constants_of(case: dict) -> dict:
    ratio, overlap, *_ = dims(case)
    return {"RATIO": ratio, "OVERLAP": overlap}


def model_cases(m: shapes.ModelDims, make) -> dict[str, shapes.Case]:
    """``make(form) -> {phase: case}`` for each compressor form of model ``m``, named
    ``<model>/<form>_pool/<phase>`` (``compressor_<form>`` names the GEMM's shapes) and tagged."""
    out: dict[str, shapes.Case] = {}
    for form in MODEL_FORMS[m.name]:
        for phase, case in make(form).items():
            out[f"{m.short}/{form}_pool/{phase}"] = {**case, "model": m.name}
    return out
