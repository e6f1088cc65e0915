"""Cache rows kept as bytes (runtime/stored.py), V4.1's and V4's: the same logits as the cache of
values, bit for bit, at a fraction of the bytes; the codecs against the round trips; what is
refused."""

from __future__ import annotations

import pytest
import torch

from duotile.kernels_spec.quantize import quantize_reference
from duotile.kernels_spec.quantize_fp4 import quantize_fp4_reference
from duotile.runtime import quant
from duotile.runtime.cache import SequenceCache, format_bytes
from duotile.runtime.engine import LLM
from duotile.runtime.layers.cache_rows import KV_ENCODE_FLOOR
from duotile.runtime.reference import Model
from duotile.runtime.sampler import SamplingParams
from duotile.runtime.stored import PackedRows, StoredRing


def _generate(ckpt: str, stored: bool, invariant: bool):
    llm = LLM(ckpt, batch_invariant=invariant)
    llm.model.stored_rows = stored
    params = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
    # a prompt past the 16-row window (the ring wraps) beside short ones
    return llm.generate([list(range(3, 43)), [2, 7], [3, 1, 4, 1, 5]], [params] * 3)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("preset", ["v41-tiny", "v4-tiny"])
def test_rows_as_bytes_give_the_logits_of_rows_as_values(ckpt_dir, preset, invariant):
    """The reference forward over rings, compressed rows and index keys kept as bytes: every
    request's logits at every step equal those over the cache of dequantised values, bit for bit
    (V4: CSA's selected rows and HCA's visible ones read from 584-byte rows as stored)."""
    ckpt = ckpt_dir(preset)
    values, stored = _generate(ckpt, False, invariant), _generate(ckpt, True, invariant)
    for a, b in zip(values, stored):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    # tiny V4's rows are 200 B against 256 in BF16 (its 64 nope channels: the BF16 rope is half a
    # row) and its FP32 compressor state is most of its cache; V4.1's rows are 132 and 72 B
    share = {"v41-tiny": 0.65, "v4-tiny": 0.9}[preset]
    assert stored[0].allocated_cache_bytes < share * values[0].allocated_cache_bytes


def test_a_v41_cache_holds_its_rows_in_the_production_formats(ckpt_dir):
    model = Model(LLM(ckpt_dir("v41-tiny")).checkpoint)
    cache, cfg = model.new_cache(), model.config
    ring = cache.layers[0].ring
    assert isinstance(ring, StoredRing) and ring.nbytes() == cfg.sliding_window * (cfg.head_dim + cfg.head_dim // 32)
    assert ring.rows.shape == (cfg.sliding_window, cfg.head_dim + cfg.head_dim // 32)  # kv_insert's row layout
    assert ring.nbytes() * cfg.num_hidden_layers == format_bytes(cfg, 0).window  # model.md 3.4's 528 B a row at 512
    sources = [lc.comp for lc in cache.layers if lc.comp is not None]
    assert sources and all(isinstance(c, PackedRows) for c in sources)
    assert sources[0].rows.shape[1] == cfg.head_dim // 2 + cfg.head_dim // 16  # model.md 3.4's 288 B at 512
    keys = [lc.index_keys for lc in cache.layers if lc.index_keys is not None]
    c = cfg.index_head_dim
    assert keys and all(isinstance(k, PackedRows) and k.fmt == "mxfp4" for k in keys)
    assert keys[0].rows.shape[1] == c // 2 + c // 32  # MXFP4 index keys: 68 B at 128


def test_a_v4_cache_holds_its_rows_in_the_production_formats(ckpt_dir):
    """V4's window rings and compressed rows: FP8 nope channels, BF16 rope channels, a UE8M0 code a
    64 nope channels, padded to whole 8-byte words (584 B at 512, model.md 3.1); MXFP4 keys."""
    from duotile.kernels_spec.kv_insert import row_bytes

    model = Model(LLM(ckpt_dir("v4-tiny")).checkpoint)
    cache, cfg = model.new_cache(), model.config
    width = row_bytes(cfg.head_dim, "fp8_nope")
    assert width == cfg.nope_head_dim + 2 * cfg.qk_rope_head_dim + 8  # kv_insert's row: one code, 7 padding bytes
    assert all(isinstance(lc.ring, StoredRing) and lc.ring.rows.shape == (cfg.sliding_window, width)
               for lc in cache.layers)
    sources = [lc.comp for lc in cache.layers if lc.comp is not None]
    assert sources and all(isinstance(c, PackedRows) and c.rows.shape[1] == width for c in sources)
    keys = [lc.index_keys for lc in cache.layers if lc.index_keys is not None]
    assert keys and all(k.fmt == "mxfp4" for k in keys)
    assert row_bytes(512, "fp8_nope") == 584


def test_stored_rows_are_refused_where_the_rows_are_not_quantised(ckpt_dir):
    for preset in ("v4-tiny", "v41-tiny"):
        with pytest.raises(ValueError, match="stored_rows: .* with quant=False they are not quantised"):
            Model(LLM(ckpt_dir(preset)).checkpoint, quant=False, stored_rows=True)
        assert not Model(LLM(ckpt_dir(preset)).checkpoint, quant=False).stored_rows
    assert isinstance(SequenceCache.create(Model(LLM(ckpt_dir("v4-tiny")).checkpoint).config, torch.bfloat16)
                      .layers[0].ring, torch.Tensor)


def _rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    x[7] = 0.0
    return x


def test_fp8_rows_decode_to_the_round_trip_and_rounded_rows_keep_their_values():
    """The bytes kv_encode stores (the quantize kernel's reference at its least floor) decode to
    kv_round's values; encoding those values again changes none (what the window ring is given)."""
    x = _rows(1)
    rounded = quant.fp8_block_round(x, 32)
    for rows in (x, rounded):
        out = quantize_reference(rows, BLOCK=32, FLOOR=KV_ENCODE_FLOOR)
        assert torch.equal(quant.decode_fp8_rows(out["q"], out["scale"]), rounded)


def test_nvfp4_rows_decode_to_the_round_trip():
    """NVFP4 bytes are encoded from the unrounded rows (rounded ones may take a smaller scale)."""
    x = _rows(2)
    out = quantize_fp4_reference(x, "nvfp4")
    assert torch.equal(quant.decode_nvfp4_rows(out["q"], out["scale"].view(torch.float8_e4m3fn)),
                       quant.nvfp4_round(x))


def test_kv_insert_writes_the_row_the_stored_ring_reads():
    """The window row kv_insert writes (its reference, at kv_encode's floor), decoded as the ring
    decodes its rows, is the runtime's window row: the normed and rotated row's FP8 round trip, bit
    for bit (a row laid out otherwise, codes first or a block of 64, decodes to other values); and
    its bytes re-encode to the same values."""
    from duotile.kernels_spec.kv_insert import kv_insert_reference
    from duotile.runtime.layers.cache_rows import kv_encode
    from duotile.runtime.layers.common import Ctx
    from duotile.runtime.ops import FastOps
    from duotile.runtime.stored import decode_rows

    g = torch.Generator().manual_seed(5)
    b, d, w, rope = 4, 512, 128, 64
    kv, weight = torch.randn(b, d, generator=g).to(torch.bfloat16), torch.rand(d, generator=g) + 0.5
    positions = torch.tensor([0, 5, 130, 1000])
    cos, sin = torch.rand(1024, rope // 2, generator=g), torch.rand(1024, rope // 2, generator=g)
    cache = kv_insert_reference(kv, weight, positions, cos, sin, WINDOW=w, FLOOR=KV_ENCODE_FLOOR)["cache"]
    rows = cache[torch.arange(b), positions % w]
    x = kv.float()
    y = (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight).to(torch.bfloat16).float()
    a, c, s = y[:, d - rope :: 2], cos[positions], sin[positions]
    bb = y[:, d - rope + 1 :: 2]
    y = torch.cat([y[:, : d - rope], torch.stack([a * c - bb * s, a * s + bb * c], -1).flatten(1)], 1)
    want = quant.fp8_block_round(y.to(torch.bfloat16).float(), 32)
    assert rows.shape == (b, d + d // 32)
    assert torch.equal(decode_rows(rows, d, "fp8/32"), want)
    assert torch.equal(decode_rows(kv_encode(Ctx(FastOps()), want, "fp8/32"), d, "fp8/32"), want)


def test_v4_rows_encode_and_decode_to_their_values():
    """V4's rows (fp8_nope) as kv_encode writes them decode to the runtime's rounding of the row
    (FP8 nope with a code a 64, BF16 rope), the same bytes again from those values; the kernel
    spec's reading of the bytes agrees."""
    from duotile.kernels_spec.sparse_mqa_decode_fp8_nope import rows_dequantised
    from duotile.runtime.layers.cache_rows import kv_encode, round_kv
    from duotile.runtime.layers.common import Ctx
    from duotile.runtime.ops import FastOps
    from duotile.runtime.stored import decode_rows

    ctx, x = Ctx(FastOps()), _rows(3).to(torch.bfloat16)
    want = round_kv(ctx, x, "fp8_nope")
    rows = kv_encode(ctx, want, "fp8_nope")
    assert rows.shape == (64, 584)
    assert torch.equal(decode_rows(rows, 512, "fp8_nope").to(torch.bfloat16), want)
    assert torch.equal(kv_encode(ctx, decode_rows(rows, 512, "fp8_nope"), "fp8_nope"), rows)
    assert torch.equal(rows_dequantised(rows, 512).float(), decode_rows(rows, 512, "fp8_nope"))
