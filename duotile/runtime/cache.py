"""Per-sequence decode state for every layer kind, and its byte accounting (model.md section 3).

`SequenceCache` holds, per layer: the window ring (W rows, slot = position mod W), and where the layer
owns them the compressed rows, the index keys and the compressor carry state (the FP32 values and
gate scores of the open window; for the overlapping ratio-4 compressor also the previous complete
window's A halves). V4.1 adds the Engram token history (the last max_ngram_size - 1 token ids).
Rows are stored as the dequantised values the reference computes with (BF16/FP32 tensors).

`format_bytes` reports what the same state occupies in the production formats of model.md 3.1/3.4:
V4 window / compressed rows of nope FP8 + rope BF16 + one UE8M0 byte per 64 nope channels (584 B at
the released shape), MXFP4 index keys (68 B); V4.1 window rows of FP8 + UE8M0 per 32 (528 B),
NVFP4-like compressed rows (288 B), MXFP4 index keys; FP32 compressor state; int64 Engram history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .stored import PackedRows, StoredRing


def bank_slot(p: int, ratio: int, banks: int) -> int:
    """Where position ``p`` sits in a compressor's banked state (kernels_spec/compressor.py)."""
    return ((p // ratio) % banks) * ratio + p % ratio


def _slots(positions, ratio: int, banks: int, device) -> torch.Tensor:
    from .device import ints

    return ints([bank_slot(p, ratio, banks) for p in positions], device, torch.long)


@dataclass
class CompressorState:
    """Carry state of one compressor, in one of two forms; each op converts what it finds first.

    * lists (the reference's pooling, layers/compressor.py): ``pending_c`` / ``pending_z``, the
      open window's values and scores (ape added) by position; ``prev_c`` / ``prev_z``, the last
      complete window's A halves (the overlapping form), None before the first window completes.
    * banks (the kernels' layout, kernels_spec/compressor.py): ``banked = (c, z)``, each
      [banks * ratio, width] FP32, position P at ``bank_slot(P)``, updated in place by the
      kernels: a decode step moves no state. Slots no window will read hold stale values.
    """

    pending_c: torch.Tensor | None
    pending_z: torch.Tensor | None
    prev_c: torch.Tensor | None = None
    prev_z: torch.Tensor | None = None
    banked: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, width: int, device: torch.device | str) -> CompressorState:
        z = torch.zeros(0, width, device=device)
        return cls(z, z.clone())

    def as_lists(self, start: int, ratio: int, overlap: bool) -> None:
        """Into the lists form, ``start`` tokens having entered."""
        if self.banked is None:
            return
        c, z = self.banked
        banks, w0 = 2 if overlap else 1, start // ratio
        open_slots = _slots(range(w0 * ratio, start), ratio, banks, c.device)
        self.pending_c, self.pending_z = c[open_slots], z[open_slots]
        self.prev_c = self.prev_z = None
        if overlap and w0 > 0:
            half, last = c.shape[1] // 2, _slots(range((w0 - 1) * ratio, w0 * ratio), ratio, banks, c.device)
            self.prev_c, self.prev_z = c[last, :half], z[last, :half]
        self.banked = None

    def as_banks(self, start: int, ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Into the banks form, ``start`` tokens having entered; returns ``banked``."""
        if self.banked is not None:
            return self.banked
        banks, width, dev = 2 if overlap else 1, self.pending_c.shape[1], self.pending_c.device
        c, z = torch.zeros(banks * ratio, width, device=dev), torch.zeros(banks * ratio, width, device=dev)
        n, w0 = self.pending_c.shape[0], start // ratio
        if n:
            at = _slots(range(start - n, start), ratio, banks, dev)
            c[at], z[at] = self.pending_c, self.pending_z
        if overlap and self.prev_c is not None:
            half = width // 2
            at = _slots(range((w0 - 1) * ratio, w0 * ratio), ratio, banks, dev)
            c[at, :half], z[at, :half] = self.prev_c, self.prev_z
        self.banked, self.pending_c, self.pending_z, self.prev_c, self.prev_z = (c, z), None, None, None, None
        return self.banked

    def tensors(self) -> list[torch.Tensor]:
        if self.banked is not None:
            return list(self.banked)
        return [t for t in (self.pending_c, self.pending_z, self.prev_c, self.prev_z) if t is not None]


class Rows:
    """A growing [n, width] tensor with capacity doubling."""

    planes = ("data",)

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str):
        self.data = torch.zeros(16, width, dtype=dtype, device=device)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self.data.shape[0]:
            grown = torch.zeros(max(need, 2 * self.data.shape[0]), self.data.shape[1],
                                dtype=self.data.dtype, device=self.data.device)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : need] = rows.to(self.data.dtype)
        self.n = need

    @property
    def view(self) -> torch.Tensor:
        return self.data[: self.n]

    stored = view  # the rows as kept: values (``stored.PackedRows.stored``: bytes)


@dataclass
class LayerCache:
    ring: torch.Tensor
    comp: Rows | None = None
    index_keys: Rows | None = None
    comp_state: CompressorState | None = None
    index_state: CompressorState | None = None


@dataclass
class SequenceCache:
    """All decode state of one sequence."""

    layers: list[LayerCache]
    num_tokens: int = 0
    engram_history: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
               stored: bool = False) -> SequenceCache:
        """``stored`` (quantised rows): window rings, compressed rows and index keys as their bytes
        (``stored.py``: V4.1's FP8 rings and NVFP4 rows, V4's FP8-nope rows, MXFP4 keys);
        otherwise as the values they decode to, in ``dtype``."""
        layers = []
        ring_fmt, comp_fmt = ("fp8/32", "nvfp4") if cfg.is_v41 else ("fp8_nope", "fp8_nope")
        for layer in range(cfg.num_hidden_layers):
            w, d = cfg.sliding_window, cfg.head_dim
            ring = StoredRing(w, d, dtype, device, ring_fmt) if stored else torch.zeros(w, d, dtype=dtype,
                                                                                        device=device)
            lc = LayerCache(ring)
            ratio, kind = cfg.ratio(layer), cfg.attention_kind(layer)
            owns = kind in ("csa", "hca", "full")
            if owns:
                lc.comp = PackedRows(d, comp_fmt, device) if stored else Rows(d, dtype, device)
            if kind in ("csa", "full"):
                c = cfg.index_head_dim
                lc.index_keys = PackedRows(c, "mxfp4", device) if stored else Rows(c, dtype, device)
            if kind == "csa":
                lc.comp_state = CompressorState.empty(2 * cfg.head_dim, device)
                lc.index_state = CompressorState.empty(2 * cfg.index_head_dim, device)
            elif kind == "hca" or (kind == "full" and ratio > 1):
                lc.comp_state = CompressorState.empty(cfg.head_dim, device)
            layers.append(lc)
        return cls(layers)

    def allocated_bytes(self) -> int:
        """Bytes of the tensors this reference cache holds right now."""
        total = 0
        for lc in self.layers:
            stores = [x for x in (lc.ring, lc.comp, lc.index_keys) if x is not None]
            tensors = [getattr(x, name) if hasattr(x, "planes") else x
                       for x in stores for name in getattr(x, "planes", (None,))]
            for st in (lc.comp_state, lc.index_state):
                if st is not None:
                    tensors += st.tensors()
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total + 8 * len(self.engram_history)


# ---- production-format accounting (model.md 3.2 / 3.4) --------------------------------------------

def v4_kv_row_bytes(cfg: ModelConfig) -> int:
    """nope FP8 + rope BF16 + UE8M0 per 64 nope channels, scale bytes padded to 8 (584 at 448/64)."""
    scales = -(-cfg.nope_head_dim // 64)
    return cfg.nope_head_dim + 2 * cfg.qk_rope_head_dim + -(-scales // 8) * 8


def mxfp4_row_bytes(dim: int) -> int:
    return dim // 2 + dim // 32


def v41_window_row_bytes(cfg: ModelConfig) -> int:
    return cfg.head_dim + cfg.head_dim // 32


def v41_comp_row_bytes(cfg: ModelConfig) -> int:
    return cfg.head_dim // 2 + cfg.head_dim // 16


@dataclass(frozen=True)
class CacheBytes:
    """Production-format bytes of one sequence's state: growing rows + fixed rings and carry state."""

    window: int
    compressed: int
    index_keys: int
    compressor_state: int
    engram_history: int

    @property
    def total(self) -> int:
        return self.window + self.compressed + self.index_keys + self.compressor_state + self.engram_history


def format_bytes(cfg: ModelConfig, num_tokens: int, include_nextn: bool = False) -> CacheBytes:
    """model.md section 3 byte counts for a sequence of `num_tokens` tokens.

    Window rings are counted at full size (W rows) for every attention layer (plus the MTP layer's
    when `include_nextn`, as model.md 3.2 does); compressor state at its fixed FP32 size.
    """
    n_layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_nextn and not cfg.is_v41 else 0)
    w = cfg.sliding_window
    window = comp = idx = state = 0
    if not cfg.is_v41:
        window = n_layers * w * v4_kv_row_bytes(cfg)
        for layer in range(cfg.num_hidden_layers):
            m = cfg.ratio(layer)
            if m == 0:
                continue
            comp += (num_tokens // m) * v4_kv_row_bytes(cfg)
            if m == 4:
                idx += (num_tokens // 4) * mxfp4_row_bytes(cfg.index_head_dim)
                state += 2 * 4 * 2 * cfg.head_dim * 2 * 4 + 2 * 4 * 2 * cfg.index_head_dim * 2 * 4
            else:
                state += m * cfg.head_dim * 2 * 4
        return CacheBytes(window, comp, idx, state, 0)
    window = n_layers * w * v41_window_row_bytes(cfg)
    for src in cfg.kv_source_layer_ids:
        m = cfg.ratio(src)
        comp += (num_tokens // m) * v41_comp_row_bytes(cfg)
        idx += (num_tokens // m) * mxfp4_row_bytes(cfg.index_head_dim)
        if m > 1:
            state += m * cfg.head_dim * 2 * 4
    history = 8 * (cfg.engram_max_ngram_size - 1) if cfg.engram_layer_ids else 0
    return CacheBytes(window, comp, idx, state, history)


def append_each(stores: list, rows, counts: list[int], stack: bool) -> None:
    """Store i gets the next ``counts[i]`` of ``rows`` (in order): a tensor for ``Rows``, a tuple
    a plane for a store of several (a store of several planes). With ``stack`` (a decode step: the same
    sequences step after step), in one write a plane, the stores' planes kept as views of one
    stack each (``stacked.py``) whose capacity doubles when a store outgrows it; else store by
    store."""
    from .device import ints
    from .stacked import restack, stack_of

    if not sum(counts):
        return
    parts = rows if isinstance(rows, tuple) else (rows,)
    if not stack:
        for i, s in enumerate(stores):
            at = sum(counts[:i])
            if counts[i]:
                mine = tuple(p[at : at + counts[i]] for p in parts)
                s.append(mine if isinstance(rows, tuple) else mine[0])
        return
    need = max(s.n + c for s, c in zip(stores, counts))
    at = [(i, s.n + j) for i, (s, c) in enumerate(zip(stores, counts)) for j in range(c)]
    where = None
    for name, part in zip(stores[0].planes, parts):
        base = stack_of([getattr(s, name) for s in stores])
        cap = base.shape[1] if base is not None else max(getattr(s, name).shape[0] for s in stores)
        if base is None or need > cap:
            base, views = restack([getattr(s, name) for s in stores], max(need, 2 * cap) if need > cap else cap)
            for s, v in zip(stores, views):
                setattr(s, name, v)
        where = ints(at, base.device, torch.long) if where is None else where
        base[where[:, 0], where[:, 1]] = part.to(base.dtype)
    for s, c in zip(stores, counts):
        s.n += c
