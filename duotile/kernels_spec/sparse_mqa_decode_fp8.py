"""Sparse decode attention over FP8 cache rows: ``sparse_mqa_decode`` with the K = V rows read as
V4.1-Flash stores its window ring (model.md 3.4): each row 512 e4m3 values and 16 UE8M0 codes, one
a 32 channels (rope channels included; 528 bytes a row against 1,024 in BF16), dequantised in the
kernel. ``kv`` (B, N, D) holds the values and ``kv_scale`` (B, N, D / 32) the codes; row j's
channel c is ``kv[b, j, c] x 2^(kv_scale[b, j, c // 32] - 127)``.

Everything else is ``sparse_mqa_decode``'s: the index list (-1 or an index past N: no row), the
sink, the split over ``SPLIT`` ranges with its fixed-order combine (bitwise batch invariant), the
outputs and their tolerance. Each gathered block of rows is read as its e4m3 bytes and their codes
(one 16-byte row of codes a cache row) and turned into the bf16 operand both gemms read
(``dsl.mxfp8_values``): exact, since an e4m3 value times a power of two is a bf16 number for every
code the quantiser writes (model.md 2.10: from its amax floor up), so the kernel computes what
``sparse_mqa_decode`` computes over the dequantised rows. A dead slot reads zero bytes and a code of
0: a zero row, as there.

Model shapes: V4.1's SWA layers (0 and 1) read their ring alone, 128 rows a query, at decode batches
1, 16 and 64. Its other layers read the ring and compressed rows of another format (NVFP4-like,
288 bytes), which this kernel does not read; V4's rows keep 64 BF16 rope channels beside 448 FP8
ones (584 bytes). The runtime keeps its caches in BF16 and does not call this kernel yet.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register
from .sparse_mqa_decode import SMALL, _error_bound, _tolerance, decode, random_inputs, sparse_mqa_decode_reference

CODE_BLOCK = 32  # channels a UE8M0 code covers in V4.1's window rows


# SPLIT defaults to 16, the two-phase form, as sparse_mqa_decode's
@dsl.kernel(batch_dim="B", dynamic=("B", "L", "N"))
def sparse_mqa_decode_fp8(q: dsl.Tensor["B", "H", "D", dsl.bf16], kv: dsl.Tensor["B", "N", "D", dsl.f8e4m3],
                          kv_scale: dsl.Tensor["B", "N", "G", dsl.u8], idx: dsl.Tensor["B", "L", dsl.i32],
                          sink: dsl.Tensor["H", dsl.f32], o: dsl.Tensor["B", "H", "D", dsl.bf16],
                          lse: dsl.OptionalTensor["B", "H", dsl.f32] = None, *,
                          BN: dsl.Tunable = dsl.choice(64, 32, 128),
                          STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
                          SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32),
                          BD: dsl.Tunable = dsl.choice(128, 64, 256)):
    def rows_of(b):
        def rows(slots):
            values = dsl.load(kv[b, slots, 0], (BN, q.D), role="operand")
            codes = dsl.load(kv_scale[b, slots, 0], (BN, kv_scale.G), role="operand")
            return dsl.mxfp8_values(values, codes)
        return rows

    decode(q, kv, idx, sink, o, lse, BN, STAGES, SPLIT, BD, rows_of)


def dequantised(kv: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """The rows' values in float64: each e4m3 value times 2^(code - 127) of its 32 channels (NaN
    for code 255)."""
    scale = torch.where(kv_scale == 255, torch.nan, torch.exp2(kv_scale.double() - 127))
    return kv.double() * scale.repeat_interleave(CODE_BLOCK, -1)[..., :kv.shape[-1]]


def sparse_mqa_decode_fp8_reference(q, kv, kv_scale, idx, sink) -> dict:
    """model.md 2.5.6 over the dequantised rows (3.4's row format)."""
    return sparse_mqa_decode_reference(q, dequantised(kv, kv_scale), idx, sink)


def _dequantised_inputs(inputs: dict) -> dict:
    return {**inputs, "kv": dequantised(inputs["kv"], inputs["kv_scale"])}


def _bound(case, output, inputs):
    return _error_bound(case, output, _dequantised_inputs(inputs))


def _inputs(case, device, seed):
    """``sparse_mqa_decode``'s inputs with FP8 rows: e4m3 values of about unit size and codes around
    127 (``codes`` = (lo, hi): the range they are drawn from)."""
    b, h, d, n = case["B"], case["H"], case["D"], case["N"]
    base = random_inputs(case, device, seed, (b, h, d), (b, 0, d))
    if device.type == "meta":
        return {**base, "kv": torch.empty(b, n, d, dtype=torch.float8_e4m3fn),
                "kv_scale": torch.empty(b, n, d // CODE_BLOCK, dtype=torch.uint8)}
    g = torch.Generator(device=device).manual_seed(seed + 7)
    lo, hi = case.get("codes", (122, 132))
    kv = (torch.randn(b, n, d, generator=g, device=device) * 4).to(torch.float8_e4m3fn)
    codes = torch.randint(lo, hi + 1, (b, n, d // CODE_BLOCK), generator=g, device=device, dtype=torch.uint8)
    return {**base, "kv": kv, "kv_scale": codes}


def _model_shapes(m) -> dict:
    """V4.1's SWA layers: the window ring alone (L = N = 128) at decode batches 1, 16 and 64."""
    if m.short != "v41":
        return {}
    return {f"{m.short}/swa{m.window}/decode{b}": {"B": b, "H": m.heads, "D": m.head_dim, "L": m.window,
                                                  "N": m.window, "model": m.name}
            for b in shapes.DECODE_SAMPLE}


SPEC = register(Spec(
    kernel=sparse_mqa_decode_fp8,
    reference=sparse_mqa_decode_fp8_reference,
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        "split4_holes": {"B": 3, "H": 64, "D": 64, "N": 300, "L": 200, "holes": 0.3,
                         "config": {**SMALL, "SPLIT": 4}},
        "one_phase_ragged": {"B": 4, "H": 64, "D": 64, "N": 90, "L": 96, "config": {**SMALL, "SPLIT": 1}},
        "few_heads": {"B": 3, "H": 4, "D": 64, "N": 60, "L": 70, "holes": 0.3, "config": {**SMALL, "SPLIT": 2}},
        "all_dead": {"B": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "config": {**SMALL, "SPLIT": 2}},
        "repeats": {"B": 2, "H": 64, "D": 64, "N": 20, "L": 128, "valid": "all", "repeat": True,
                    "out_of_range": True, "config": {**SMALL, "SPLIT": 2}},
        # codes far from 127: rows of values near 2^-20 and 2^20 (still exact in bf16)
        "wide_codes": {"B": 2, "H": 64, "D": 128, "N": 64, "L": 64, "codes": (107, 147),
                       "config": {**SMALL, "SPLIT": 2}},
        "window_ring": {"B": 3, "H": 64, "D": 512, "N": 128, "L": 128, "holes": 0.1, "config": {"SPLIT": 8}},
    },
    build_cases={"v41_swa": {"B": 16, "H": 64, "D": 512, "L": 128, "N": 128}},
    tolerance=_tolerance,
    extra_error=_bound,
    flops=lambda c: 4.0 * c["B"] * c["H"] * c["L"] * c["D"],
    # a row's bytes (values and codes) for each slot, the queries and outputs in bf16, the list
    bytes_moved=lambda c: c["B"] * (c["L"] * (c["D"] + c["D"] // CODE_BLOCK) + 4 * c["H"] * c["D"] + 4 * c["L"]),
    model_shapes=shapes.for_models(_model_shapes),
    sweep={"B": Dim(1, 4, large=64), "H": OneOf(64, 4), "D": OneOf(64, 128), "L": Dim(1, 260, large=4000),
           "N": Dim(1, 300, large=100000), "holes": OneOf(0.0, 0.3, 0.9), "valid": OneOf("ragged", "all", "one"),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BN": OneOf(32, 64)}},
))
