"""Quantisation formats: scales, rounding rules, packing (model.md 2.10 and 4)."""

from __future__ import annotations

import torch

from duotile.runtime import quant


def test_ue8m0_scale_is_the_smallest_sufficient_power_of_two():
    amax = torch.tensor([448.0, 448.0001, 224.0, 1.0, 3.0, 6.0, 7.0])
    qmax = torch.tensor([448.0, 448.0, 448.0, 448.0, 448.0, 6.0, 6.0])
    got = torch.stack([quant.ue8m0_scale(a, q) for a, q in zip(amax, qmax)])
    assert got.tolist() == [1.0, 2.0, 0.5, 2.0**-8, 2.0**-7, 1.0, 2.0]
    assert torch.all(amax / got <= qmax)


def test_fp4_round_to_nearest_ties_to_even_code():
    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -5.0, -9.0])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, -6.0]
    assert quant.fp4_round(x).tolist() == want
    assert torch.equal(quant.fp4_round(quant.FP4_GRID), quant.FP4_GRID)


def test_fp4_packing_puts_the_even_element_in_the_low_nibble():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 0.5, -6.0
    packed, scale = quant.quantize_fp4_rows(w)
    assert packed.shape == (1, 16) and scale.shape == (1, 1)
    assert scale.float().item() == 1.0
    assert packed.view(torch.uint8)[0, 0].item() == 0x1 | (0xF << 4)
    assert torch.equal(quant.dequantize_fp4_rows(packed, scale), w)


def test_fp8_block_codec_round_trips_grid_values_and_bounds_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 2, 300)[None, :]
    q, s = quant.quantize_fp8_blocks(w, 128)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    deq = quant.dequantize_fp8_blocks(q, s, 128)
    q2, s2 = quant.quantize_fp8_blocks(deq, 128)
    assert torch.equal(q2.float(), q.float()) and torch.equal(s2.float(), s.float())
    tile_max = s.float().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 448
    assert torch.all((deq - w).abs() <= tile_max * 2.0**-4)


def test_act_quant_is_idempotent_and_blockwise():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g)
    x[:, :128] *= 1000
    y = quant.act_quant(x)
    assert torch.equal(quant.act_quant(y), y)
    small = quant.act_quant(x[:, 128:])
    assert torch.equal(y[:, 128:], small)  # blocks are independent
    assert torch.all((y - x).abs() <= x.abs() * 2**-4 + 1e-2)  # e4m3 keeps 3 mantissa bits


def test_mxfp4_nvfp4_and_hadamard():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=g)
    for fn in (quant.mxfp4_round, quant.nvfp4_round):
        y = fn(x)
        assert torch.equal(fn(y), y)
        assert (y - x).abs().max() < x.abs().max() / 2
    h = quant.hadamard(128)
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6) and torch.equal(h, h.t())


def test_fp8_row_codec_for_engram_tables():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(10, 64, generator=g)
    q, s = quant.quantize_fp8_rows(w)
    assert q.shape == (10, 64) and s.shape == (10, 2)
    deq = quant.dequantize_fp8_rows(q, s)
    assert torch.equal(quant.dequantize_fp8_rows(*quant.quantize_fp8_rows(deq)), deq)


def test_ue8m0_scale_of_a_non_finite_block_is_nan():
    """A block holding Inf or NaN has no power-of-two scale: UE8M0's NaN, as the quantiser
    kernel writes (code 255), so the block dequantises to NaN instead of passing as scale 1."""
    from duotile.runtime.quant import ue8m0_scale

    amax = torch.tensor([float("inf"), float("nan"), 448.0, 1e-4])
    s = ue8m0_scale(amax, 448.0)
    assert torch.isnan(s[:2]).all() and s[2] == 1.0 and s[3] == 2.0 ** -22
