"""V4.1 Engram: hashed n-gram memory written into the residual streams (model.md 2.13).

For each token the n-grams ending at it (orders 2 .. max_ngram_size) are hashed with per-layer odd
64-bit multipliers (numpy `default_rng(10007 * layer)`), XOR-rolled, reduced modulo one prime per
(order, head) and offset into the layer's table. The gathered rows are projected by `wkv` to one key
per stream and a shared value; each stream gets `X[s] += sigmoid(signed_sqrt(dot_s)) * v` with a
normalised, `q_weight * k_weight`-weighted dot product. Token ids are mapped to the compressed id space
first; with `engram_compressed_vocab_size == vocab_size` (tiny models) the map is the identity - the
released tokenizer-derived map is not embedded here.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from ..device import ship
from ..model_ops import model_op
from .common import Ctx, WeightSource


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_primes(layer_ids, max_ngram: int, n_heads: int, vocab: int) -> list[list[int]]:
    """Per Engram layer, the (max_ngram-1) * n_heads primes (order-major), successive primes >= vocab."""
    out, p = [], vocab - 1
    for _ in layer_ids:
        layer = []
        for _ in range((max_ngram - 1) * n_heads):
            p += 1
            while not _is_prime(p):
                p += 1
            layer.append(p)
        out.append(layer)
    return out


def engram_table_rows(layer_ids, max_ngram: int, n_heads: int, vocab: int) -> list[int]:
    return [sum(ps) for ps in engram_primes(layer_ids, max_ngram, n_heads, vocab)]


def hash_multipliers(layer: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    values = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in values]


class Engram:
    def __init__(self, cfg: ModelConfig, ws: WeightSource, layer: int):
        if cfg.engram_compressed_vocab_size != cfg.vocab_size:
            raise ConfigError("engram_compressed_vocab_size: differs from vocab_size; the tokenizer-derived "
                              "compressed-id map is not available in this runtime")
        p, k = f"layers.{layer}.engram.", cfg.engram_layer_ids.index(layer)
        self.cfg, self.n = cfg, cfg.hc_mult
        self.table, self.wkv = ws.t(p + "embed"), ws.linear(p + "wkv")
        self.qk = ws.t(p + "q_weight") * ws.t(p + "k_weight")
        primes = engram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size)[k]
        self.primes = torch.tensor(primes, dtype=torch.int64).view(cfg.engram_max_ngram_size - 1, cfg.engram_n_heads)
        flat = self.primes.flatten()
        self.offsets = (flat.cumsum(0) - flat).view_as(self.primes)
        self.mult = torch.tensor(hash_multipliers(layer, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size))

    @model_op("engram_hash")
    def rows_of(self, ctx: Ctx, history: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """``hash_ids`` as the model op."""
        return self.hash_ids(history, tokens)

    def padded_history(self, history: list[int]) -> list[int]:
        """The last n-1 tokens before a chunk, the pad in front where the sequence has fewer."""
        look = self.cfg.engram_max_ngram_size - 1
        return [self.cfg.engram_pad_token_id] * (look - len(history)) + history[-look:] if look else []

    def hash_ids(self, history: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Table rows [S, cols] for the chunk's tokens, given the previous tokens of the sequence."""
        look = self.cfg.engram_max_ngram_size - 1
        ext = torch.tensor(self.padded_history(history) + tokens.tolist(), dtype=torch.int64)
        s = tokens.shape[0]
        cols, rolling = [], ext[look:] * self.mult[0]
        for order in range(1, look + 1):
            rolling = torch.bitwise_xor(rolling, ext[look - order : look - order + s] * self.mult[order])
            cols.append(rolling[:, None] % self.primes[order - 1] + self.offsets[order - 1])
        return torch.cat(cols, 1)

    @model_op("engram")
    def __call__(self, ctx: Ctx, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] streams, ids [T, cols] -> updated streams."""
        ops, d, eps = ctx.ops, self.cfg.hidden_size, self.cfg.rms_norm_eps
        rows = self.table[ship(ids, self.table.device)].flatten(1)
        kv = ctx.act(self.wkv(ctx, ctx.act(rows))).float()
        key, value = kv[:, : self.n * d].view(-1, self.n, d), kv[:, self.n * d :]
        h = x.float()
        rstd = ops.rsqrt(ops.mean(h * h, -1) + eps) * ops.rsqrt(ops.mean(key * key, -1) + eps)
        dot = ops.sum(h * self.qk * key, -1) * rstd * d**-0.5
        gate = ops.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return ctx.act(h + gate[..., None] * value[:, None, :])
