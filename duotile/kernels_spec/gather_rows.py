"""out[i] = table[idx[i]], with idx[i] = -1 (or any index outside the table) giving a row of
zeros: the access pattern of sparse attention's selected rows and of MoE permutation.

Model shapes: KV rows of 512 (+64 rope) bf16 gathered by top-512 / top-2048 indices;
MoE permutation of 4096-wide hidden rows by token-expert index.

Both the gathered count N (the batch dimension) and the table's row count R are dynamic: the MoE
gathers from a step's token rows (R = T), which change every step, and no tile depends on R (only
the bounds check reads it), so one build serves every table of a width.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(batch_dim="N", dynamic=("N", "R"))
def gather_rows(table: dsl.Tensor["R", "D", dsl.bf16 | dsl.f32], idx: dsl.Tensor["N", dsl.i32],
                out: dsl.Tensor["N", "D", dsl.bf16 | dsl.f32], *,
                BN: dsl.Tunable = dsl.choice(32, 16, 64, 128),
                BD: dsl.Tunable = dsl.choice(256, 128, 512)):
    for i, j in dsl.grid(dsl.cdiv(idx.N, BN), dsl.cdiv(table.D, BD)):
        rows = dsl.load(idx[i * BN], (BN,), other=-1)
        dsl.store(out[i * BN, j * BD], dsl.load(table[rows, j * BD], (BN, BD)))


def gather_rows_reference(table: torch.Tensor, idx: torch.Tensor) -> dict:
    valid = (idx >= 0) & (idx < table.shape[0])
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    rows = table.index_select(0, safe)
    return {"out": torch.where(valid[:, None], rows, torch.zeros_like(rows))}


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    r, n, d = case["R"], case["N"], case["D"]
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    table = torch.randn(r, d, generator=g).to(dtype)
    idx = torch.randint(0, r, (n,), generator=g, dtype=torch.int32)
    holes = torch.rand(n, generator=g) < 0.2
    idx[holes] = -1
    if n > 2:
        idx[1] = r  # out of range reads zeros as well
    return {"table": table.to(device), "idx": idx.to(device),
            "out": torch.full((n, d), float("nan"), dtype=dtype, device=device)}


SPEC = register(Spec(
    kernel=gather_rows,
    reference=gather_rows_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={"kv512": {"R": 300, "N": 64, "D": 512}, "ragged": {"R": 50, "N": 37, "D": 200},
           "f32": {"R": 128, "N": 100, "D": 576, "dtype": "f32"}},
    build_cases={"kv_rows": {"R": 65536, "N": 2048, "D": 512},
                 "moe_permute": {"R": 4096, "N": 24576, "D": 4096}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    bytes_moved=lambda c: 2 * 2 * c["N"] * c["D"] + 4 * c["N"],
    model_shapes=shapes.for_models(shapes.gather_shapes),
    sweep={"R": Dim(1, 500, large=300000), "N": Dim(1, 300, large=40000), "D": Dim(1, 700, large=6000),
           "dtype": OneOf("bf16", "f32")},
))
