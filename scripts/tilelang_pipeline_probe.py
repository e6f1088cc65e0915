"""Which gather loops TileLang 0.1.15 software-pipelines on sm90, shown on any machine (lowering
only, no GPU): a loop over 64-row blocks named by an index list, each block gathered into shared
memory by cp.async and read by a gemm, with ``T.Pipelined(num_stages=2)``. A pipelined loop issues
block n + 1's copies before it waits for block n's (``cp_async_wait<1>`` in the loop); one that is
not waits for every copy it just issued (``cp_async_wait<0>``), a global-memory latency a block.

    python3 scripts/tilelang_pipeline_probe.py            # every form, one line each

Forms (``--form``): the trip count static or dynamic (``n_L``), a dequantising stage between the
gather and the gemm or not, TileLang's own schedule or an explicit ``order=`` / ``stage=`` (the
gather, and the index tile it reads, stage 0; the rest stage 1), and the block's row indices read
in the gather's address or staged in shared memory first (the generator's form). Found 2026-12-05:
a masked gather (``T.if_then_else`` with ``parallel_prefer_async``, the generator's form) is not
pipelined by TileLang's own schedule in any of these forms, and is with the explicit annotation,
index tile staged or not. sparse decode's loops are of that kind: their generated CUDA waits for
each block's rows where it issues them.
"""

from __future__ import annotations

import argparse
import re
import sys

FORMS = {  # name: (dynamic trip count, dequantising stage, explicit schedule, index tile in shared memory)
    "static": (False, True, False, False),
    "dynamic": (True, True, False, False),
    "dynamic-annotated": (True, True, True, False),
    "dynamic-no-stage": (True, False, False, False),
    "dynamic-annotated-shared-index": (True, True, True, True),
}

trips, extra = 10, {}  # the form's trip count and T.Pipelined keywords: set by source() for TileLang's parser


def source(dynamic: bool, stage: bool, annotated: bool, shared_index: bool) -> str:
    """The CUDA TileLang generates for one form (raises where TileLang does)."""
    import tilelang
    import tilelang.language as T
    from tilelang import tvm

    # TileLang's parser reads names from the function's globals: the form's are put there
    n_L = T.dynamic("n_L")
    globals().update(T=T, n_L=n_L, trips=T.ceildiv(n_L, 64) if dynamic else 10, stage=stage, shared_index=shared_index,
                     extra=({"order": [0, 1, 2, 3], "stage": [0, 0, 1, 1]} if shared_index else
                            {"order": [0, 1, 2], "stage": [0, 1, 1]}) if annotated else {})

    @T.prim_func
    def k(kv: T.Tensor((4096, 512), "bfloat16"), idx: T.Tensor((n_L,), "int32"),
          q: T.Tensor((64, 512), "bfloat16"), o: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=256) as _:
            q_s = T.alloc_shared((64, 512), "bfloat16")
            rows = T.alloc_shared((64, 512), "bfloat16")
            vals = T.alloc_shared((64, 512), "bfloat16")
            at = T.alloc_shared((64,), "int32")
            acc = T.alloc_fragment((64, 64), "float32")
            T.copy(q, q_s)
            T.clear(acc)
            for n in T.Pipelined(trips, num_stages=2, **extra):
                if shared_index:  # the generator's form: the block's row indices staged in shared memory
                    for i in T.Parallel(64):
                        at[i] = T.if_then_else(n * 64 + i < n_L, idx[n * 64 + i], -1)
                    for i, j in T.Parallel(64, 512, annotations={"parallel_prefer_async": True}):
                        rows[i, j] = T.if_then_else(T.And(at[i] >= 0, at[i] < 4096), kv[at[i], j],
                                                    T.cast(0.0, "bfloat16"))
                else:
                    for i, j in T.Parallel(64, 512, annotations={"parallel_prefer_async": True}):
                        rows[i, j] = T.if_then_else(T.And(idx[n * 64 + i] >= 0, idx[n * 64 + i] < 4096),
                                                    kv[idx[n * 64 + i], j], T.cast(0.0, "bfloat16"))
                if stage:
                    for i, j in T.Parallel(64, 512):
                        vals[i, j] = rows[i, j] * T.cast(2.0, "bfloat16")
                    T.gemm(q_s, vals, acc, transpose_B=True)
                else:
                    T.gemm(q_s, rows, acc, transpose_B=True)
            T.copy(acc, o)

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        return tilelang.lower(k, target=target, enable_device_compile=False).kernel_source


def verdict(*form: bool) -> str:
    try:
        src = source(*form)
    except Exception as err:  # noqa: BLE001 - TileLang's own failure is the finding
        return f"TileLang fails: {type(err).__name__}: {str(err).splitlines()[-1][:100]}"
    # a wait that leaves groups in flight (cp_async_wait<k>, k > 0) is the pipelined loop's
    waits = sorted(set(re.findall(r"cp_async_wait<(\d+)>", src)))
    ahead = [w for w in waits if w != "0"]
    return (f"pipelined (cp_async_wait<{ahead[0]}> in the loop)" if ahead else "not pipelined (every copy awaited "
            "where it is issued: cp_async_wait<0>)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--form", choices=sorted(FORMS), action="append", help="the forms to lower (default: all)")
    args = p.parse_args(argv)
    for name in args.form or FORMS:
        print(f"{name}: {verdict(*FORMS[name])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
