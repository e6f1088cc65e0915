"""The output tile through shared memory and a TMA store (sm90 knob ``tma_store``, manual schedule).

The default epilogue writes a gemm's output from the accumulator fragment straight to global
memory: each thread stores the two-element pieces it holds, 16 of every 32 bytes of a sector
(Nsight Compute on the fp8 gemm, benchmarks/README.md). With this knob the consumer warp groups
copy the tile into shared memory instead and one elected thread hands it to the TMA engine, which
writes whole lines and lets the consumers move on before the bytes reach L2.

Shared memory left beside the load rings rarely holds the whole tile (128 x 256 bf16 is 64 KiB;
an fp8 ring of four 48 KiB stages leaves 35 KiB), so the tile goes out in chunks of whole rows
through one buffer, the tallest chunk that fits, in multiples of 64 rows (one wgmma tile of rows).
Per chunk, among the consumer threads only (named barrier ``STORE_BARRIER``; the producer group
never joins):

1. wait until the previous TMA store has finished reading the buffer (``tma_store_wait``);
2. all threads copy their part of the chunk into it, then fence the generic proxy's writes
   against the async proxy's reads (``fence_proxy_async``);
3. one elected thread issues the store (``T.tma_copy`` shared -> global, no wait).

The consumer branch ends with a last ``tma_store_wait``: a block may not exit while the TMA engine
still reads its shared memory. A chunk is a constant slice of the fragment: a loop over chunks made
TileLang index the fragment at run time, which ptxas puts on the stack; and a slice of columns
does not lower (TileLang 0.1.15 cannot invert the sliced accumulator layout), rows do.
"""

from __future__ import annotations

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Op
from .capacity import usage

STORE_BARRIER = 10  # named barrier id: TileLang's own syncs use the low ids, the ping-pong 8 and 9


def chunk_rows(e, op: Op) -> int:
    """The tallest chunk of whole rows of the stored tile (all of them, then halves...), a multiple
    of 64, whose buffer fits in the shared memory the kernel leaves free; refused when none does.
    Under ``full_row`` with more than 64 rows a warp group, only the whole tile: TileLang 0.1.15
    cannot invert a row slice of that layout (256 x 128 and 256 x 192 tiles, every chunk height)."""
    rows, cols = (int(d) for d in op.attrs["shape"][-2:])
    nbytes = op.args[0].type.dtype.bits // 8
    threads = int(e.knobs.get("threads", 128))
    free = e.arch.smem_bytes - usage(e.m, e.arch, threads)["shared"]
    group_rows = rows // max(1, threads // 128)
    whole_only = bool(e.knobs.get("full_row")) and group_rows > 64
    for parts in (1,) if whole_only else (1, 2, 4, 8):
        chunk = rows // parts
        if rows % parts == 0 and chunk % 64 == 0 and chunk * cols * nbytes <= free:
            return chunk
    why = (f"with full_row each warp group holds {group_rows} rows, a layout TileLang "
           f"0.1.15 cannot slice by rows, and the whole {rows}x{cols} output tile does not fit"
           if whole_only else f"no chunk of 64-row multiples of the {rows}x{cols} output tile fits")
    raise UnsupportedError(f"{e.arch.name}: tma_store: {why} the {free} bytes of shared memory the loads leave "
                           f"(config {e.m.config})", op.loc)


def emit(e, op: Op, src_buf: str, tensor: str, offsets: list[str], threads: int) -> None:
    """The chunked store of fragment ``src_buf`` to ``tensor`` at ``offsets`` (index strings)."""
    rows, cols = (int(d) for d in op.attrs["shape"][-2:])
    height = chunk_rows(e, op)
    buf = f"{src_buf}_out"
    e.src.decl(f'{buf} = T.alloc_shared(({height}, {cols}), "{op.args[0].type.dtype.tilelang_name}")')
    lead, (row0, col0) = offsets[:-2], offsets[-2:]
    for r in range(0, rows, height):
        at = row0 if r == 0 else f"{row0} + {r}"
        region = ", ".join([*lead, f"{at}:{at} + {height}", f"{col0}:{col0} + {cols}"])
        e.src.line("T.tma_store_wait()", op.loc)
        e.src.line(f"T.sync_threads({STORE_BARRIER}, {threads})", op.loc)
        e.src.line(f"T.copy({src_buf}[{r}:{r + height}, 0:{cols}], {buf})", op.loc)
        e.src.line("T.fence_proxy_async()", op.loc)
        e.src.line(f"T.sync_threads({STORE_BARRIER}, {threads})", op.loc)
        e.src.line(f"T.tma_copy({buf}, {tensor}[{region}])", op.loc)


def check(module, arch_name: str, knobs: dict, ws_mode: str) -> None:
    """``tma_store`` is written into duotile's own warp specialisation only."""
    if knobs.get("tma_store") and ws_mode != "manual":
        raise UnsupportedError(f"{arch_name}: tma_store needs warp_specialize=manual "
                               f"(got {ws_mode}; config {module.config})", module.grid.loc)
