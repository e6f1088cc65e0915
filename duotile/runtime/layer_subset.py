"""A released configuration on fewer layers: its real widths and expert counts, its layer kinds.

`layer_subset(cfg, n)` keeps `n` of the model's layers and renumbers everything that names a layer,
so that the result is a valid configuration of the same family that runs every kind of layer the
full model has (as many as `n` allows). A layer's kind is what changes the code it runs:

* V4: its attention (window only, CSA ratio 4, HCA) and whether its experts are hash-routed;
* V4.1: its attention (window only; Full, Reuse or Reindex) at its compression ratio (2 or 1), the
  layer that is the candidate pool's source, and an Engram module.

Kinds are taken in a fixed priority (the layers a compressed layer depends on first: a KV source
before the layers that reuse its rows, the candidate source before a Reindex layer), each at the
first layer of the full model that has it; further layers, beyond one of each kind, are the earliest
not yet kept. Kept layers stay in their order, so hash-routed layers stay a prefix and every layer's
KV source and candidate source stay before it.

What cannot keep its released size is said in `notes`: Engram tables (384M rows of 256 FP8 values
each, 98 GB) are shrunk to `engram_rows` rows by a smaller hashed vocabulary, and their ids are the
token ids themselves (this runtime has no tokenizer-derived compressed-id map); DSpark's target
layers become the last kept layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError, ModelConfig

ENGRAM_ROWS = 1 << 22  # rows of one shrunk Engram table: about 1.1 GB of FP8 values and scales


@dataclass(frozen=True)
class LayerSubset:
    config: ModelConfig
    sources: tuple[int, ...]  # the full model's layer each kept layer is (kept layer i = sources[i])
    kinds: tuple[str, ...]  # each kept layer's kind
    notes: tuple[str, ...]


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """What a layer runs, as this module tells layers apart."""
    attention = cfg.attention_kind(layer)
    if not cfg.is_v41:
        return attention + ("+hash" if cfg.is_hash_layer(layer) else "")
    kind = attention if attention == "swa" else f"{attention}/ratio{cfg.ratio(layer)}"
    if layer == cfg.candidate_source_layer_id:
        kind += "+candidates"
    return kind + ("+engram" if layer in cfg.engram_layer_ids else "")


_PRIORITY = {  # kinds in the order they are kept; an unlisted kind comes after these
    False: ("csa+hash", "hca", "swa+hash", "csa", "swa", "hca+hash"),
    True: ("full/ratio2", "swa+engram", "full/ratio1+candidates", "reindex/ratio1", "reuse/ratio1",
           "reuse/ratio2", "swa", "full/ratio2+engram", "full/ratio1"),
}


def choose_layers(cfg: ModelConfig, n: int) -> list[int]:
    """The `n` layers of `cfg` to keep, in order."""
    total = cfg.num_hidden_layers
    if not 1 <= n <= total:
        raise ConfigError(f"layers: {n} is not between 1 and the model's {total} layers")
    first: dict[str, int] = {}
    for layer in range(total):
        first.setdefault(layer_kind(cfg, layer), layer)
    order = _PRIORITY[cfg.is_v41]
    ranked = sorted(first, key=lambda k: (order.index(k) if k in order else len(order), first[k]))
    kept = [first[k] for k in ranked][:n]
    kept += [layer for layer in range(total) if layer not in kept][: n - len(kept)]
    return sorted(kept)


def layer_subset(cfg: ModelConfig, n: int, engram_rows: int = ENGRAM_ROWS) -> LayerSubset:
    """`cfg` on `n` of its layers (module docstring)."""
    kept = choose_layers(cfg, n)
    new = {old: i for i, old in enumerate(kept)}
    mtp = cfg.compress_ratios[cfg.num_hidden_layers:]
    changes = {"num_hidden_layers": n, "compress_ratios": tuple(cfg.ratio(s) for s in kept) + mtp}
    notes = [f"layers: {n} of {cfg.num_hidden_layers}, the full model's layers {', '.join(map(str, kept))}"]
    if not cfg.is_v41:
        changes["num_hash_layers"] = sum(1 for s in kept if cfg.is_hash_layer(s))
    else:
        changes.update(_v41_ids(cfg, kept, new))
        engram = [new[e] for e in cfg.engram_layer_ids if e in new]
        changes.update(_engram(cfg, engram, engram_rows, notes))
        if cfg.dspark_target_layer_ids:
            targets = tuple(range(n))[-len(cfg.dspark_target_layer_ids):]
            changes["dspark_target_layer_ids"] = targets
            notes.append(f"dspark_target_layer_ids: {list(targets)} (the last kept layers), for "
                         f"{list(cfg.dspark_target_layer_ids)}")
    out = cfg.replace(**changes)
    return LayerSubset(out, tuple(kept), tuple(layer_kind(out, i) for i in range(n)), tuple(notes))


def _v41_ids(cfg: ModelConfig, kept: list[int], new: dict[int, int]) -> dict:
    candidate = cfg.candidate_source_layer_id
    return {"kv_source_layer_ids": tuple(new[s] for s in cfg.kv_source_layer_ids if s in new),
            "index_source_layer_ids": tuple(new[s] for s in cfg.index_source_layer_ids if s in new),
            "candidate_source_layer_id": new.get(candidate, -1)}


def _engram(cfg: ModelConfig, layers: list[int], rows: int, notes: list[str]) -> dict:
    """Engram fields for the kept Engram layers, tables of at most `rows` rows."""
    from .layers.engram import engram_table_rows

    if not layers:
        return {"engram_layer_ids": (), "engram_num_embeddings": ()}
    heads, orders = cfg.engram_n_heads, cfg.engram_max_ngram_size - 1
    vocab = min(cfg.engram_vocab_size, max(2, rows // (heads * orders + 1)))
    sizes = tuple(engram_table_rows(layers, cfg.engram_max_ngram_size, heads, vocab))
    if vocab < cfg.engram_vocab_size or cfg.engram_compressed_vocab_size != cfg.vocab_size:
        full = engram_table_rows(cfg.engram_layer_ids, cfg.engram_max_ngram_size, heads, cfg.engram_vocab_size)
        notes.append(f"engram: tables of {', '.join(f'{s:,}' for s in sizes)} rows, not the released "
                     f"{', '.join(f'{s:,}' for s in full)} (hashed vocabulary {vocab:,} for "
                     f"{cfg.engram_vocab_size:,}); ids are the token ids (no tokenizer-derived compressed map)")
    return {"engram_layer_ids": tuple(layers), "engram_num_embeddings": sizes, "engram_vocab_size": vocab,
            "engram_compressed_vocab_size": cfg.vocab_size}
