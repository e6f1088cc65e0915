"""An attention output's columns in groups, each its own accumulator (the ``DG`` tunable of the
attention specs: ``sparse_mqa_decode`` and its stored-row forms, ``sparse_mqa_prefill``,
``mqa_decode``, ``flash_attention``). The scores of a block are the sum of every group's
``q . k`` products and each group's ``P V`` goes into its own accumulator, so the groups change
which gemms run, not what is computed. A target whose accumulators live in registers takes one
group; sm100 keeps an online softmax's output in registers too, but every gemm into it first
multiplies into a fresh TMEM tile, which the groups of one width share
(``codegen/tilelang_cuda/plan.py``, ``product_tile``): a 64 x 512 output as one group needs all
512 of TMEM's columns beside its score tile and is refused, as two groups it takes 256."""

from __future__ import annotations

from .. import dsl


def column_groups(D, DG):
    """The output's columns in ``DG`` groups of D / DG (``_attend``'s ``columns``: an accumulator, a
    query tile and a gathered tile each), or None for one group. A target whose accumulators live
    in a small memory (sm100's TMEM: 512 columns of 32 bits, which one 64 x 512 output fills) takes
    groups; one where they live in registers need not. A block's scores are the sum of every
    group's products, so ``DG`` changes which gemms run, not what is summed."""
    if not (isinstance(DG, int) and DG >= 1):
        raise dsl.DslError(f"DG {DG!r} must be a positive int: the output's column groups")
    if DG == 1:
        return None
    for cond in (D >= DG, DG * (D // DG) >= D):  # sizes compare as symbols: % would decide before binding
        dsl.require(cond, f"DG {DG} must divide the output's D columns")
    width = D // DG
    return tuple((g * width, width) for g in range(DG))
