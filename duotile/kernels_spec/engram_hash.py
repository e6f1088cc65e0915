"""V4.1 Engram's n-gram hash (model.md 2.13 steps 2-4, 5.7): the table rows of every token's
n-grams. For sequence ``s`` and chunk position ``c``, with ``tok[c - j]`` the token ``j`` places
back (``tokens[s, c - j]`` inside the chunk, ``history[s, L + c - j]`` before it)::

    h_1 = tok[c] * mult[0]
    h_n = h_{n-1} XOR (tok[c - n + 1] * mult[n - 1])          n = 2 .. L + 1   (int64)
    ids[s, c, (n - 2) * H + k] = (h_n mod primes[n - 2, k]) + offsets[n - 2, k]

``history`` (S x L, i32) holds each sequence's last ``L = max_ngram - 1`` tokens before the chunk,
the compressed id of the pad token where the sequence has fewer (the runtime's
``Engram.hash_ids`` pads the same way); ``tokens`` (S x C, i32) the chunk; ``mult`` (L + 1, i64)
the layer's odd multipliers; ``primes`` and ``offsets`` (L x H, i64) the per-(order, head) primes
and the exclusive prefix sums of the layer's primes (the column's first table row); ``ids``
(S x C x L*H, i32) the rows, order-major as the runtime concatenates them (V4.1-Flash: L = 3,
H = 8, 24 rows). A decode batch is S sequences with C = 1 (its history the sequence's last 3
tokens); a prefill chunk is S = 1, C = the chunk's tokens. Both S and C are dynamic.

Exactness. The hash is integer arithmetic in i64, the DSL's ``*`` and ``^`` on i64 tiles and its
floor ``%``, the same operations the runtime computes in torch int64, so the rows agree bit for
bit (tested against ``Engram.hash_ids``). No product overflows in the model: the multipliers are
drawn below ``(INT64_MAX // compressed_vocab) // 2`` and made odd, so ``mult < INT64_MAX //
compressed_vocab`` and ``tok * mult <= INT64_MAX`` for every compressed id ``tok <
compressed_vocab`` (99,092 ids); the XOR of non-negative 63-bit values is non-negative, so
``h_n mod p`` is the plain remainder. For tokens outside that range the products wrap mod 2^64 in
two's complement and ``mod`` floors (a non-negative row), on the interpreter as in the runtime's
torch int64 (the ``wrap`` values of the tests). A row fits i32: the largest table has 384,016,682
rows. The CUDA source multiplies ``int64_t`` operands (two's complement wrap in nvcc's
instructions; not yet run on a GPU).

Why a kernel of its own: the hash is integer work per token that feeds an index, not the
floating-point gate; the 24-row gather (``gather_rows``, whose index tile reads these ids
flattened) and the ``wkv`` projection 6144 -> 25600 (``gemm`` / ``gemm_blockscaled``) stay with
the existing specs, and the gate is ``engram_gate``.

Each program takes one sequence and ``BT`` positions of its chunk; the orders run in a loop that
carries ``h``. The token ``j`` back is read as two column gathers, of ``tokens`` at ``c - j`` and
of ``history`` at ``L + c - j``, each reading 0 outside its tensor: for ``0 <= c < C`` and
``1 <= j <= L`` exactly one of them is inside, so their sum is the token.

Where it lowers: the README's build table (the 3-wide history and a decode chunk's one token are
partial tiles, which a target lowering whole tiles only refuses).
"""

from __future__ import annotations

import sympy
import torch

from .. import dsl
from ..runtime.layers.engram import hash_multipliers
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NGRAM, HEADS = 4, 8  # engram_max_ngram_size, engram_n_heads (model.md 1.7)
VOCAB, COMPRESSED, PAD = 16_000_000, 99_092, 2  # engram_vocab_size, _compressed_vocab_size, pad id
LAYERS = (1, 14)  # engram_layer_ids


@dsl.kernel(batch_dim="S", dynamic=("S", "C"))
def engram_hash(history: dsl.Tensor["S", "L", dsl.i32], tokens: dsl.Tensor["S", "C", dsl.i32],
                mult: dsl.Tensor["N", dsl.i64], primes: dsl.Tensor["L", "H", dsl.i64],
                offsets: dsl.Tensor["L", "H", dsl.i64], ids: dsl.Tensor["S", "C", "K", dsl.i32], *,
                BT: dsl.Tunable = dsl.choice(128, 16, 64, 256)):
    look, heads = history.L, primes.H
    for s, t in dsl.grid(tokens.S, dsl.cdiv(tokens.C, BT)):
        pos = t * BT + dsl.arange(BT)
        h = dsl.empty((BT,), dsl.i64)
        h[:] = dsl.load(tokens[s, pos], (BT,)).to(dsl.i64) * dsl.load(mult[0], (1,))
        for o in dsl.range(look):
            back = pos - (o + 1)
            prev = dsl.load(tokens[s, back], (BT,)) + dsl.load(history[s, back + look], (BT,))
            h[:] = h ^ (prev.to(dsl.i64) * dsl.load(mult[o + 1], (1,)))
            row = h[:, None] % dsl.load(primes[o, 0], (1, heads)) + dsl.load(offsets[o, 0], (1, heads))
            dsl.store(ids[s, t * BT, o * heads], row.to(dsl.i32))


def engram_hash_reference(history, tokens, mult, primes, offsets) -> dict:
    """model.md 2.13 steps 3-4 in torch int64 (wrapping products, floor mod), one order at a time."""
    look = history.shape[1]
    ext = torch.cat([history, tokens], 1).long()
    c = tokens.shape[1]
    h = ext[:, look:] * mult[0]
    cols = []
    for n in range(2, look + 2):
        h = h ^ (ext[:, look + 1 - n : look + 1 - n + c] * mult[n - 1])
        cols.append(torch.remainder(h[:, :, None], primes[n - 2]) + offsets[n - 2])
    out = torch.cat(cols, 2) if cols else torch.zeros(*tokens.shape, 0, dtype=torch.int64)
    return {"ids": out.to(torch.int32)}


def table_primes(layer_ids, ngram: int, heads: int, vocab: int) -> list[list[int]]:
    """model.md 2.13 step 4: the successive primes from ``vocab`` on, each used once, (ngram - 1)
    x heads of them a layer, order-major."""
    out, p = [], vocab - 1
    for _ in layer_ids:
        layer = []
        for _ in range((ngram - 1) * heads):
            p = int(sympy.nextprime(p))
            layer.append(p)
        out.append(layer)
    return out


def layer_tables(layer: int, layer_ids, ngram: int, heads: int, vocab: int, compressed: int):
    """(mult, primes, offsets) of one Engram layer as the kernel takes them."""
    flat = torch.tensor(table_primes(layer_ids, ngram, heads, vocab)[list(layer_ids).index(layer)])
    primes = flat.view(ngram - 1, heads)
    offsets = (flat.cumsum(0) - flat).view(ngram - 1, heads)
    return torch.tensor(hash_multipliers(layer, ngram, compressed), dtype=torch.int64), primes, offsets


def _params(case) -> tuple[int, int, int, int]:
    """(ngram, heads, vocab, compressed vocab) of a case: V4.1-Flash's unless it names smaller."""
    return (case.get("ngram", NGRAM), case.get("heads", HEADS), case.get("vocab", VOCAB),
            case.get("compressed", COMPRESSED))


def _tokens(kind: str, shape, compressed: int, g: torch.Generator) -> torch.Tensor:
    """``random`` compressed ids; ``edges`` the pad, 0 and the largest id; ``wrap`` any
    non-negative i32 (products beyond int64 wrap: the interpreter must wrap as torch does)."""
    if kind == "wrap":
        return torch.randint(0, 2**31 - 1, shape, generator=g, dtype=torch.int32)
    toks = torch.randint(0, compressed, shape, generator=g, dtype=torch.int32)
    if kind == "edges":
        choice = torch.randint(0, 3, shape, generator=g)
        toks = torch.where(choice == 0, PAD, torch.where(choice == 1, 0, compressed - 1)).to(torch.int32)
    return toks


def _inputs(case, device, seed):
    ngram, heads, vocab, compressed = _params(case)
    s, c, look = case["S"], case["C"], ngram - 1
    out = torch.empty(s, c, look * heads, dtype=torch.int32, device=device)
    if device.type == "meta":
        i64 = dict(dtype=torch.int64, device=device)
        return {"history": torch.empty(s, look, dtype=torch.int32, device=device),
                "tokens": torch.empty(s, c, dtype=torch.int32, device=device), "mult": torch.empty(ngram, **i64),
                "primes": torch.empty(look, heads, **i64), "offsets": torch.empty(look, heads, **i64), "ids": out}
    g = torch.Generator().manual_seed(seed)
    layer = case.get("layer", LAYERS[0])
    mult, primes, offsets = layer_tables(layer, case.get("layers", LAYERS), ngram, heads, vocab, compressed)
    history = _tokens(case.get("values", "random"), (s, look), compressed, g)
    short = torch.randint(0, look + 1, (s,), generator=g)  # sequences with fewer tokens: pad-filled
    history = torch.where(torch.arange(look)[None, :] < short[:, None], PAD, history)
    return {"history": history.to(device), "tokens": _tokens(case.get("values", "random"), (s, c), compressed, g)
            .to(device), "mult": mult.to(device), "primes": primes.to(device), "offsets": offsets.to(device),
            "ids": out.fill_(-7)}


def hash_shapes(m: shapes.ModelDims) -> dict[str, shapes.Case]:
    """V4.1-Flash: decode batches of B sequences (one new token each) and one prefill chunk."""
    if m.name != "v41-flash":
        return {}  # V4 has no Engram
    what = f"ngram{NGRAM}_h{HEADS}"
    out = {f"{m.short}/{what}/decode{b}": {"S": b, "C": 1, "model": m.name, "config": {"BT": 16}}
           for b in shapes.DECODE_BATCHES}
    out[f"{m.short}/{what}/prefill{shapes.PREFILL_CHUNK}"] = {"S": 1, "C": shapes.PREFILL_CHUNK, "model": m.name}
    return out


SMALL = {"ngram": 4, "heads": 2, "vocab": 1000, "compressed": 1024, "layers": (1, 4), "layer": 4}  # v41-tiny

SPEC = register(Spec(
    kernel=engram_hash,
    reference=engram_hash_reference,
    make_inputs=_inputs,
    outputs=("ids",),
    cases={"v41_decode5": {"S": 5, "C": 1, "config": {"BT": 16}},
           "v41_prefill_l14": {"S": 1, "C": 300, "layer": 14, "values": "edges"},
           "v41_two_chunks": {"S": 2, "C": 37, "config": {"BT": 16}, "values": "wrap"},
           "tiny_prefill": {"S": 3, "C": 20, **SMALL}},
    build_cases={"v41_prefill": {"S": 1, "C": 4096}, "v41_decode64": {"S": 64, "C": 1, "config": {"BT": 16}}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    bytes_moved=lambda c: 4 * c["S"] * c["C"] * (1 + 3 * 8) + 12 * c["S"],
    model_shapes=shapes.for_models(hash_shapes),
    sweep={"S": Dim(1, 9, large=64), "C": Dim(1, 70, large=4096), "values": OneOf("random", "edges", "wrap"),
           "ngram": OneOf(2, 3, 4), "heads": OneOf(1, 2, 8), "vocab": 1000, "compressed": 1024, "layers": (1, 4),
           "layer": OneOf(1, 4), "config": {"BT": OneOf(16, 64, 128, 256)}},
))
