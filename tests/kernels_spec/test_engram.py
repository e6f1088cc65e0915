"""V4.1 Engram's kernels against the runtime's ``Engram`` on the same inputs: ``engram_hash`` bit for
bit with ``Engram.hash_ids`` (the tiny V4.1 model's layers and V4.1-Flash's multipliers and
primes), and ``engram_hash`` -> ``gather_rows`` -> the runtime's ``wkv`` -> ``engram_gate``
within the gate's derived bound of ``Engram.__call__`` (both within it of the float64 formula)."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.kernels_spec.engram_gate import HC
from duotile.kernels_spec.engram_hash import layer_tables
from duotile.runtime.layers.common import Ctx, Linear
from duotile.runtime.layers.engram import Engram, engram_primes, hash_multipliers
from duotile.runtime.ops import FastOps, InvariantOps
from duotile.runtime.presets import get_preset

SPECS = load_all()


class Weights:
    """The tensors an ``Engram`` reads, random, under their checkpoint names (a stand-in for the
    loader's WeightSource: ``t`` and ``linear`` only)."""

    def __init__(self, cfg, layer: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        d, rows, width = cfg.hidden_size, cfg.engram_num_embeddings, cfg.engram_head_dim
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        p = f"layers.{layer}.engram."
        k = cfg.engram_layer_ids.index(layer)
        self.tensors = {
            p + "embed": torch.randn(rows[k], width, generator=g).to(torch.bfloat16),
            p + "wkv": (torch.randn((HC + 1) * d, cols * width, generator=g) * (cols * width) ** -0.5)
            .to(torch.bfloat16).float(),  # a dequantised weight: f32 holding bf16 values
            p + "q_weight": (1 + 0.1 * torch.randn(HC, d, generator=g)).to(torch.bfloat16),
            p + "k_weight": (1 + 0.1 * torch.randn(HC, d, generator=g)).to(torch.bfloat16),
        }

    def t(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def linear(self, name: str) -> Linear:
        return Linear(self.tensors[name], None)


def _hash(engram: Engram, history: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``engram_hash`` on the interpreter with the runtime layer's own tables."""
    s, c = tokens.shape
    ids = torch.full((s, c, engram.primes.numel()), -7, dtype=torch.int32)
    codegen.compile(SPECS["engram_hash"].kernel, "interpret", config={"BT": 16})(
        history=history, tokens=tokens, mult=engram.mult, primes=engram.primes, offsets=engram.offsets, ids=ids)
    return ids


def _padded(cfg, hist: list[int]) -> list[int]:
    look = cfg.engram_max_ngram_size - 1
    return ([cfg.engram_pad_token_id] * look + hist)[-look:]


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("v41-tiny")
    return cfg, {layer: Engram(cfg, Weights(cfg, layer, seed=layer), layer) for layer in cfg.engram_layer_ids}


@pytest.mark.parametrize("layer_index", [0, 1])
def test_hash_is_the_runtime_hash_ids_bit_for_bit(tiny, layer_index):
    """A decode batch (histories of 0 .. 5 tokens, one new token each) and a 50-token prefill chunk
    after 0, 2 and 7 tokens, on each Engram layer of the tiny V4.1 model."""
    cfg, layers = tiny
    engram = layers[cfg.engram_layer_ids[layer_index]]
    g = torch.Generator().manual_seed(3)
    hists = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in range(6)]
    new = torch.randint(0, cfg.vocab_size, (6, 1), generator=g, dtype=torch.int32)
    got = _hash(engram, torch.tensor([_padded(cfg, h) for h in hists], dtype=torch.int32), new)
    want = torch.stack([engram.hash_ids(h, new[i].long()) for i, h in enumerate(hists)])
    assert torch.equal(got, want.to(torch.int32))
    for before in (0, 2, 7):
        seq = torch.randint(0, cfg.vocab_size, (before + 50,), generator=g)
        hist, chunk = seq[:before].tolist(), seq[before:]
        got = _hash(engram, torch.tensor([_padded(cfg, hist)], dtype=torch.int32), chunk[None].to(torch.int32))
        assert torch.equal(got[0], engram.hash_ids(hist, chunk).to(torch.int32))


def test_hash_at_v41_flash_tables_is_hash_ids():
    """V4.1-Flash's multipliers and 48 primes above 16,000,000 (layers 1 and 14): the spec's
    tables are the runtime's, and the rows of compressed ids up to 99,091 are ``hash_ids``'s (the
    method run on those tables: the runtime builds no Flash ``Engram``, whose tokenizer map it lacks)."""
    cfg = get_preset("v41-flash")
    primes = engram_primes(cfg.engram_layer_ids, 4, 8, cfg.engram_vocab_size)
    assert [sum(p) for p in primes] == list(cfg.engram_num_embeddings)
    g = torch.Generator().manual_seed(5)
    for k, layer in enumerate(cfg.engram_layer_ids):
        mult, spec_primes, offsets = layer_tables(layer, cfg.engram_layer_ids, 4, 8, cfg.engram_vocab_size,
                                                  cfg.engram_compressed_vocab_size)
        assert mult.tolist() == hash_multipliers(layer, 4, cfg.engram_compressed_vocab_size)
        assert spec_primes.flatten().tolist() == primes[k]
        engram = object.__new__(Engram)  # hash_ids reads only these
        engram.cfg, engram.mult, engram.primes, engram.offsets = cfg, mult, spec_primes, offsets
        toks = torch.randint(0, cfg.engram_compressed_vocab_size, (1, 200), generator=g, dtype=torch.int32)
        toks[0, :3] = cfg.engram_compressed_vocab_size - 1  # the largest products
        hist = [cfg.engram_compressed_vocab_size - 1, 0]
        got = _hash(engram, torch.tensor([_padded(cfg, hist)], dtype=torch.int32), toks)
        want = engram.hash_ids(hist, toks[0].long())
        assert torch.equal(got[0], want.to(torch.int32))
        assert int(want.max()) < cfg.engram_num_embeddings[k] and int(want.min()) >= 0


def _gate_inputs(engram: Engram, ctx: Ctx, x: torch.Tensor, ids: torch.Tensor):
    """key and value through the kernels' path: the rows by ``gather_rows``, ``wkv`` the runtime's."""
    t, cols = ids.shape
    table = engram.table
    rows = torch.empty(t * cols, table.shape[1], dtype=table.dtype)
    codegen.compile(SPECS["gather_rows"].kernel, "interpret", config={"BN": 16, "BD": 128})(
        table=table, idx=ids.flatten().to(torch.int32), out=rows)
    assert torch.equal(rows.view(t, -1), table[ids].flatten(1))
    kv = ctx.act(engram.wkv(ctx, ctx.act(rows.view(t, -1))))
    d = x.shape[-1]
    return kv[:, : HC * d].reshape(t, HC, d).contiguous(), kv[:, HC * d :].contiguous()


@pytest.mark.parametrize("ops", [FastOps, InvariantOps])
def test_kernels_give_the_runtime_engram(tiny, ops):
    """Hash -> gather -> wkv -> gate on 37 tokens of three sequences against ``Engram.__call__``:
    each within the spec's bound of the float64 formula, each other within twice it."""
    cfg, layers = tiny
    engram, ctx = layers[cfg.engram_layer_ids[1]], Ctx(ops=ops(), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, cfg.vocab_size, (37,), generator=g)
    ids = torch.cat([engram.hash_ids([], tokens[:20]), engram.hash_ids(tokens[:20].tolist(), tokens[20:])])
    x = (torch.randn(37, HC, cfg.hidden_size, generator=g) * 3).to(torch.bfloat16)
    want = engram(ctx, x, ids)
    key, value = _gate_inputs(engram, ctx, x, ids)
    got = torch.empty_like(x)
    spec = SPECS["engram_gate"]
    eps = cfg.rms_norm_eps
    codegen.compile(spec.kernel, "interpret", config={"BD": 128}, constants={"EPS": eps})(
        x=x, key=key, value=value, qk=engram.qk, out=got)
    inputs = {"x": x, "key": key, "value": value, "qk": engram.qk}
    case = {"T": 37, "D": cfg.hidden_size, "EPS": eps}
    exact = spec.run_reference(inputs, case)["out"].float()
    allowed = spec.allowed_error(case, "out", exact, inputs)
    for out in (got, want):
        assert ((out.float() - exact).abs() <= allowed).all()
    assert ((got.float() - want.float()).abs() <= 2 * allowed).all()
    assert (got == want).float().mean() > 0.99  # the gates differ by f32 rounding only
