"""The two models' dimensions as data, and the kernel shapes each one needs.

``V4_FLASH`` and ``V41_FLASH`` hold the hyperparameters the kernels see (from the released
configs); the functions below turn them into kernel cases: dicts of a kernel's sizes (plus
``dtype`` / ``causal`` where the spec's cases use them), each tagged ``"model": "v4-flash"`` or
``"v41-flash"`` and keyed by a readable name, ``"<model>/<what>/<phase>"``, e.g.
``"v41/wq_a/decode16"`` or ``"v4/wo_b/prefill4096"``. A spec registers what it serves as
``Spec(model_shapes=...)`` and ``Spec.model_cases(model)`` selects them.

Phases: decode serves ``B`` sequences one token each (``T = B``; batches ``DECODE_BATCHES``);
prefill runs one chunk of ``PREFILL_CHUNK`` tokens of one sequence (model.md's prefill unit).
To keep the counts small (each shape is a build), GEMMs, RMSNorm and row gathers take the decode
batches ``DECODE_SAMPLE`` (1, 16 and 64: a single sequence, the largest batch where GEMV / split-K
kernels serve, and the smallest where tensor-core tiles do); the split-K GEMM serves ``SPLITK_M``
(M <= 16, its regime); decode attention, whose work grows with the batch, takes every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Case = dict[str, Any]

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNK = 4096  # tokens of one prefill chunk
DECODE_SAMPLE = (1, 16, 64)
SPLITK_M = (1, 16)
CONTEXT = 1 << 20  # 1M-token context: the longest compressed-row lists
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # head-dim-128 prefill lengths


@dataclass(frozen=True)
class ModelDims:
    """What the kernels of one model see. Sizes are per layer unless named otherwise."""

    name: str  # the tag in each case's "model"
    short: str  # the prefix of case names
    hidden: int
    layers: int
    vocab: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding-window rows (include the current token)
    compress_ratios: tuple[int, ...]  # distinct ratios of the compressed layers
    compressor_widths: tuple[tuple[str, int], ...]  # (layer kind, fused kv + gate output width)
    index_heads: int
    index_head_dim: int
    index_topk: int
    experts: int
    experts_per_token: int
    moe_intermediate: int
    hc_mult: int  # mHC residual streams
    fp8_block: int  # dense FP8 weight block scales (block x block)
    extra_gemms: tuple[tuple[str, int, int, str], ...] = ()  # (name, N, K, dtype) beyond the common set
    candidate_block: int = 0  # the candidate pool's block of compressed positions (V4.1; 0: no pool)
    candidate_topk_blocks: int = 0  # blocks the pool keeps

    @property
    def query_width(self) -> int:  # heads x head dim: wq_b's output and the attention output
        return self.heads * self.head_dim

    @property
    def mhc_width(self) -> int:  # the stream-flattened width mHC normalises over
        return self.hc_mult * self.hidden

    @property
    def attention_rows(self) -> dict[str, int]:
        """Rows one decode query attends to, by layer kind: the window, plus the top-k selected
        compressed rows, plus (ratio 128) every compressed row at 1M context."""
        rows = {"window": self.window, "topk": self.window + self.index_topk}
        if 128 in self.compress_ratios:
            rows["hca1m"] = self.window + CONTEXT // 128
        return rows


V4_FLASH = ModelDims(
    name="v4-flash", short="v4", hidden=4096, layers=43, vocab=129280, heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window=128, compress_ratios=(4, 128),
    # CSA: two 512-wide halves for kv and gate; HCA: 512 each; the indexer's own compressor 2 x 128 x 2
    compressor_widths=(("csa", 2048), ("hca", 1024), ("index", 512)),
    index_heads=64, index_head_dim=128, index_topk=512, experts=256, experts_per_token=6, moe_intermediate=2048,
    hc_mult=4, fp8_block=128,
    extra_gemms=(("mtp_proj", 4096, 4096, "f8e4m3"),),  # MTP e_proj / h_proj
)

V41_FLASH = ModelDims(
    name="v41-flash", short="v41", hidden=5120, layers=40, vocab=129280, heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window=128, compress_ratios=(2, 1),
    # KV-source layers only: ratio 2 fuses wkv + wgate (512 each), ratio 1 has wkv alone
    compressor_widths=(("ratio2", 1024), ("ratio1", 512)),
    index_heads=32, index_head_dim=128, index_topk=512, experts=384, experts_per_token=6, moe_intermediate=2304,
    hc_mult=4, fp8_block=32,
    extra_gemms=(("index_wk", 128, 512, "bf16"),  # index keys from the compressed latent
                 ("engram_proj", 25600, 6144, "f8e4m3")),  # Engram: 24 rows of 256 -> 4 keys + 1 value
    candidate_block=8, candidate_topk_blocks=2048,  # model.md 1.7, 2.13: layer 20's pool
)

MODELS = {m.name: m for m in (V4_FLASH, V41_FLASH)}


def model_named(name: str) -> ModelDims:
    """A model by tag (``v41-flash``) or short name (``v41``)."""
    for m in MODELS.values():
        if name in (m.name, m.short):
            return m
    raise KeyError(f"no model {name!r}; known: {', '.join(f'{m.name} ({m.short})' for m in MODELS.values())}")


def dense_gemms(m: ModelDims) -> dict[str, tuple[int, int, str]]:
    """The dense projections, ``name -> (N, K, dtype)``, dtype as the checkpoint stores the weight
    (FP8 block-scaled matrices as ``f8e4m3``, BF16 ones as ``bf16``). The grouped ``wo_a`` is one
    group's GEMM (the model runs ``o_groups`` of them); it is listed in both forms since the
    reference runs it in BF16 after dequantising and engines as an FP8 grouped GEMM. The mHC
    projections (FP32 weights, N = 24) are not GEMMs of this kernel."""
    d, q = m.hidden, m.q_lora_rank
    out = {
        "wq_a": (q, d, "f8e4m3"),
        "wq_b": (m.query_width, q, "f8e4m3"),
        "wkv": (m.head_dim, d, "f8e4m3"),
        "wo_a": (m.o_lora_rank, m.query_width // m.o_groups, "f8e4m3"),
        "wo_a_bf16": (m.o_lora_rank, m.query_width // m.o_groups, "bf16"),
        "wo_b": (d, m.o_groups * m.o_lora_rank, "f8e4m3"),
        "shared_w13": (2 * m.moe_intermediate, d, "f8e4m3"),  # gate and up fused
        "shared_w2": (d, m.moe_intermediate, "f8e4m3"),
        "index_wq_b": (m.index_heads * m.index_head_dim, q, "f8e4m3"),
        "index_weights": (m.index_heads, d, "bf16"),
        "router": (m.experts, d, "bf16"),
    }
    for kind, width in m.compressor_widths:
        out[f"compressor_{kind}"] = (width, d, "bf16")
    for name, n, k, dtype in m.extra_gemms:
        out[name] = (n, k, dtype)
    out["lm_head"] = (m.vocab, d, "bf16")  # decode only: prefill needs the last token's logits
    return out


def _tag(m: ModelDims, case: Case) -> Case:
    return {**case, "model": m.name}


def gemm_shapes(m: ModelDims, decode_m=DECODE_SAMPLE, prefill: bool = True,
                dtype: str | None = None) -> dict[str, Case]:
    """Every dense projection at the decode rows ``decode_m`` and (but the LM head) at a prefill
    chunk; ``dtype`` forces one dtype (the split-K kernel takes bf16 only) and then drops the
    projections listed twice."""
    out: dict[str, Case] = {}
    for name, (n, k, stored) in dense_gemms(m).items():
        if dtype is not None and name.endswith("_bf16"):
            continue
        dt = dtype or stored
        rows = [(f"decode{b}", b) for b in decode_m]
        if prefill and name != "lm_head":
            rows.append((f"prefill{PREFILL_CHUNK}", PREFILL_CHUNK))
        for phase, rows_m in rows:
            case = {"M": rows_m, "N": n, "K": k}
            if dt != "bf16":
                case["dtype"] = dt
            out[f"{m.short}/{name}/{phase}"] = _tag(m, case)
    return out


def norm_widths(m: ModelDims) -> dict[str, int]:
    """RMSNorm row widths: the hidden norms (attn, ffn, final), q_norm (q_lora rank), kv_norm and
    the compressor norm (head dim), the index-key norm (index head dim) and the mHC stream width."""
    return {"hidden": m.hidden, "q_norm": m.q_lora_rank, "kv_norm": m.head_dim,
            "index_norm": m.index_head_dim, "mhc": m.mhc_width}


def rmsnorm_shapes(m: ModelDims, decode_t=DECODE_SAMPLE) -> dict[str, Case]:
    out: dict[str, Case] = {}
    for name, width in norm_widths(m).items():
        for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{PREFILL_CHUNK}", PREFILL_CHUNK)]:
            out[f"{m.short}/{name}/{phase}"] = _tag(m, {"T": t, "D": width})
    return out


def mqa_decode_shapes(m: ModelDims, decode_b=DECODE_BATCHES) -> dict[str, Case]:
    """Decode attention: every head over the rows of one layer kind, for each decode batch."""
    out: dict[str, Case] = {}
    for kind, rows in m.attention_rows.items():
        for b in decode_b:
            out[f"{m.short}/{kind}{rows}/decode{b}"] = _tag(m, {"B": b, "H": m.heads, "R": rows, "D": m.head_dim})
    return out


def attention_shapes(m: ModelDims, lengths=ATTENTION_LENGTHS) -> dict[str, Case]:
    """Prefill attention. Head dim 512: the model's own heads over one causal chunk. Head dim 128:
    the peer shapes at the indexer's head count and width, causal and not, at each length, with
    ``16384 // S`` sequences (16K tokens a call)."""
    out: dict[str, Case] = {
        f"{m.short}/d{m.head_dim}/prefill{PREFILL_CHUNK}_causal":
            _tag(m, {"B": 1, "H": m.heads, "S": PREFILL_CHUNK, "D": m.head_dim, "causal": True})}
    for s in lengths:
        for causal in (False, True):
            case = {"B": max(1, 16384 // s), "H": m.index_heads, "S": s, "D": m.index_head_dim}
            if causal:
                case["causal"] = True
            out[f"{m.short}/d{m.index_head_dim}/s{s}" + ("_causal" if causal else "")] = _tag(m, case)
    return out


def gather_shapes(m: ModelDims, decode_b=DECODE_SAMPLE) -> dict[str, Case]:
    """Row gathers. Sparse attention: each decode sequence gathers its ``index_topk`` selected KV
    rows (head dim wide) out of the compressed rows at 1M context, one table per compress ratio.
    MoE permutation: ``experts_per_token`` copies of each token's hidden row, at the largest decode
    batch and at a prefill chunk."""
    out: dict[str, Case] = {}
    for ratio in m.compress_ratios:
        if ratio == 128:  # HCA attends to every compressed row: no gather by index
            continue
        for b in decode_b:
            out[f"{m.short}/topk_rows_r{ratio}/decode{b}"] = _tag(
                m, {"R": CONTEXT // ratio, "N": b * m.index_topk, "D": m.head_dim})
    for phase, t in ((f"decode{DECODE_BATCHES[-1]}", DECODE_BATCHES[-1]), (f"prefill{PREFILL_CHUNK}", PREFILL_CHUNK)):
        out[f"{m.short}/moe_permute/{phase}"] = _tag(m, {"R": t, "N": m.experts_per_token * t, "D": m.hidden})
    return out


def fp8_activation_widths(m: ModelDims) -> dict[int, tuple[str, ...]]:
    """The input widths (K) of the GEMMs whose activations are quantised to FP8 (model.md 2.7):
    every dense projection with an FP8 weight, and the routed experts' two grouped GEMMs (FP4 or
    FP8 weights, FP8 activations: K = hidden, then the expert width); ``K -> the GEMMs``."""
    widths: dict[int, list[str]] = {}
    for name, (_, k, dtype) in dense_gemms(m).items():
        if dtype == "f8e4m3":
            widths.setdefault(k, []).append(name)
    widths.setdefault(m.hidden, []).append("experts_w13")
    widths.setdefault(m.moe_intermediate, []).append("experts_w2")
    return {k: tuple(v) for k, v in sorted(widths.items())}


def act_quant_shapes(m: ModelDims, decode_t=DECODE_SAMPLE) -> dict[str, Case]:
    """The FP8 activation quantiser at each FP8 GEMM input width, for the decode rows ``decode_t``
    and a prefill chunk: BF16 rows of ``D`` channels, one UE8M0 scale per ``fp8_block`` channels
    (128 in V4, 32 in V4.1: the block of the weights' scales), so ``NB = D / fp8_block``."""
    out: dict[str, Case] = {}
    for width in fp8_activation_widths(m):
        for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{PREFILL_CHUNK}", PREFILL_CHUNK)]:
            out[f"{m.short}/k{width}/{phase}"] = _tag(m, {"T": t, "D": width, "NB": -(-width // m.fp8_block)})
    return out


def for_models(fn, **kwargs) -> dict[str, Case]:
    """``fn(model)`` for both models, merged (names carry the model's prefix, so none collide)."""
    out: dict[str, Case] = {}
    for m in MODELS.values():
        out.update(fn(m, **kwargs))
    return out


def router_shapes(m: ModelDims, decode_t=DECODE_SAMPLE) -> dict[str, Case]:
    """The MoE router's selection over a layer's gate logits: ``E`` experts, ``K`` picked per
    token, for the decode rows ``decode_t`` and a prefill chunk."""
    out: dict[str, Case] = {}
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{PREFILL_CHUNK}", PREFILL_CHUNK)]:
        out[f"{m.short}/e{m.experts}_top{m.experts_per_token}/{phase}"] = _tag(
            m, {"T": t, "E": m.experts, "K": m.experts_per_token})
    return out
