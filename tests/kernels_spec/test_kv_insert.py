"""The window KV insert (kernels_spec/kv_insert.py) on the interpreter: the cache bytes bit for bit
against the reference in every case; the rows decoded by model.md's formats equal the runtime's
own window rows (runtime/layers: kv_norm, Rotary, the FP8 round trips) bit for bit; the ring slot
is P mod WINDOW and no other row is written; P = 0 leaves the rope channels as normed; one build
serves every batch, row by row; the row layouts' byte counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.kv_insert import SENTINEL, row_bytes
from duotile.runtime import quant
from duotile.runtime.layers.attention_v4 import round_kv_nope
from duotile.runtime.layers.common import Ctx, Rotary
from duotile.runtime.ops import FastOps

SPEC = load_all()["kv_insert"]


def run(inputs, fmt, window=128):
    kernel = codegen.compile(SPEC.kernel, "interpret", constants={"FORMAT": fmt, "WINDOW": window})
    kernel(**inputs)
    return inputs["cache"]


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_byte_for_byte(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=7)
    codegen.compile(SPEC.kernel, "interpret", constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)["cache"]
    assert torch.equal(inputs["cache"], want), int((inputs["cache"] != want).sum())
    assert (inputs["cache"] != SENTINEL).any()  # rows were written


def decode(row: torch.Tensor, fmt: str, d: int = 512, rope: int = 64) -> torch.Tensor:
    """A cache row's values (model.md 3.1, 3.4: value = e4m3 x 2^(code - 127); V4's rope channels bf16)."""
    if fmt == "fp8":
        values = row[:, :d].contiguous().view(torch.float8_e4m3fn).float()
        codes = row[:, d: d + d // 32].float()
        return values * torch.exp2(codes - 127).repeat_interleave(32, 1)
    nope = d - rope
    values = row[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    codes = row[:, nope + 2 * rope: nope + 2 * rope + nope // 64].float()
    ropes = row[:, nope: nope + 2 * rope].contiguous().view(torch.bfloat16).float()
    return torch.cat([values * torch.exp2(codes - 127).repeat_interleave(64, 1), ropes], 1)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_nope"])
@pytest.mark.parametrize("compressed", [False, True], ids=["base10000", "yarn160000"])
def test_decoded_rows_are_the_runtimes_window_rows(fmt, compressed):
    """The runtime's window KV path (attention_v4 / attention_v41: act(rope(act(rms_norm)))) then
    its FP8 round trip, against the kernel's row bytes decoded, with the runtime's cos / sin."""
    cfg = SimpleNamespace(qk_rope_head_dim=64, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16,
                          original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    rotary = Rotary(cfg, compressed)
    g = torch.Generator().manual_seed(5)
    b, n = 12, 700
    x = (torch.randn(b, 512, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(512, generator=g)).to(torch.bfloat16)
    pos = torch.randint(0, n, (b,), generator=g)
    pos[:3] = torch.tensor([0, 127, 128])
    cos, sin = rotary.cos_sin(torch.arange(n))
    cache = torch.full((b, 128, row_bytes(512, fmt)), SENTINEL, dtype=torch.uint8)
    run({"kv": x, "weight": w, "positions": pos.to(torch.int32), "cos": cos.contiguous(), "sin": sin.contiguous(),
         "cache": cache}, fmt)
    ctx = Ctx(ops=FastOps())
    kv = ctx.act(ctx.ops.rms_norm(x.float(), w.float(), 1e-6))
    kv = ctx.act(rotary.apply(kv, pos))
    want = round_kv_nope(ctx, kv) if fmt == "fp8_nope" else ctx.act(quant.fp8_block_round(kv, 32))
    got = decode(cache[torch.arange(b), pos % 128], fmt)
    assert torch.equal(got, want.float()), (got - want.float()).abs().max()


def test_the_ring_slot_is_p_mod_window_and_no_other_row_is_written():
    case = {"B": 6, "D": 512, "P": 1000, "FORMAT": "fp8"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=1)
    inputs["positions"] = torch.tensor([0, 127, 128, 255, 256, 999], dtype=torch.int32)
    cache = run(inputs, "fp8")
    for b, slot in enumerate([0, 127, 0, 127, 0, 999 % 128]):
        written = (cache[b] != SENTINEL).any(1).nonzero().flatten().tolist()
        assert written == [slot], (b, written)
    # a 16-row window takes P mod 16; the byte layout is unchanged
    small = {**case, "W": 16}
    inputs = SPEC.make_inputs(small, torch.device("cpu"), seed=1)
    inputs["positions"] = torch.tensor([15, 16, 17, 31, 32, 999], dtype=torch.int32)
    cache = run(inputs, "fp8", window=16)
    assert [(cache[b] != SENTINEL).any(1).nonzero().flatten().tolist() for b in range(6)] == \
        [[15], [0], [1], [15], [0], [999 % 16]]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_nope"])
def test_position_zero_leaves_the_rope_channels_as_normed(fmt):
    """cos 1, sin 0 at P = 0: the rotated channels are the normed ones, so the row equals the same
    row written with every rope pair's partner zeroed out of its rotation (sin = 0 anywhere)."""
    case = {"B": 4, "D": 512, "P": 50, "FORMAT": fmt, "positions": "zero"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    at_zero = run({**inputs, "cache": inputs["cache"].clone()}, fmt)
    moved = dict(inputs, positions=torch.full((4,), 9, dtype=torch.int32), cache=inputs["cache"].clone())
    moved["cos"], moved["sin"] = torch.ones_like(inputs["cos"]), torch.zeros_like(inputs["sin"])
    unrotated = run(moved, fmt)
    assert torch.equal(at_zero[:, 0], unrotated[:, 9])
    rotated = run(dict(inputs, positions=torch.full((4,), 9, dtype=torch.int32), cache=inputs["cache"].clone()), fmt)
    nope = 512 if fmt == "fp8" else 448
    assert not torch.equal(rotated[:, 9, 448:nope + 128], at_zero[:, 0, 448:nope + 128])  # P = 9 does rotate


def test_one_build_serves_every_batch_row_by_row():
    case = {"B": 21, "D": 512, "P": 400, "FORMAT": "fp8_nope"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=9)
    kernel = codegen.compile(SPEC.kernel, "interpret", constants={"FORMAT": "fp8_nope"})
    full = inputs["cache"].clone()
    kernel(**{**inputs, "cache": full})
    for lo, hi in ((0, 1), (4, 17), (20, 21)):
        part = torch.full((hi - lo, 128, 584), SENTINEL, dtype=torch.uint8)
        kernel(**{**inputs, "kv": inputs["kv"][lo:hi].contiguous(),
                  "positions": inputs["positions"][lo:hi].contiguous(), "cache": part})
        assert torch.equal(part, full[lo:hi]), (lo, hi)


def test_a_position_past_the_table_rotates_by_zeros():
    """Outside the contract (P < table length), but defined: the gather reads zero cos / sin rows,
    the reference likewise, and the row is still written at P mod WINDOW."""
    case = {"B": 2, "D": 512, "P": 10, "FORMAT": "fp8"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=2)
    inputs["positions"] = torch.tensor([10, 300], dtype=torch.int32)
    want = SPEC.run_reference(inputs, case)["cache"]
    cache = run(inputs, "fp8")
    assert torch.equal(cache, want)
    for b, slot in ((0, 10), (1, 300 % 128)):  # +-0 in every rope channel's byte
        assert (cache[b, slot, 448:512] & 0x7F == 0).all() and (cache[b, slot, :448] & 0x7F != 0).any()


def test_row_layouts():
    assert row_bytes(512, "fp8") == 528 and row_bytes(512, "fp8_nope") == 584  # model.md 3.4, 3.1
    shapes = SPEC.model_shapes
    assert sorted(shapes) == sorted([f"v41/window_kv528/decode{b}" for b in (1, 16, 64)]
                                    + [f"v4/window_kv584/decode{b}" for b in (1, 16, 64)])
    assert all(c["P"] == 1 << 20 and c["W"] == 128 for c in shapes.values())
