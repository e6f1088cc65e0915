"""sm90 ``warp_specialize="manual"``: duotile's own producer / consumer warp groups (manual_ws.py).

Checked on the CPU: the schedule in the generated TileLang (where the loads, waits and releases
go), that TileLang and nvcc accept it, and the errors for loops it cannot schedule. The GPU runs
are in tests/gpu/test_sm90_knobs.py."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from duotile import dsl
from duotile.codegen.build import build_module
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import UnsupportedError
from duotile.kernels_spec import load_all

MANUAL = {"warp_specialize": "manual"}


def _build(name, case_name, knobs, compile_it=True):
    spec = load_all()[name]
    case = spec.cases[case_name]
    sig = spec.kernel.bind(spec.make_inputs(case, torch.device("cpu"), 0))
    module, kn = specialize(spec.kernel, sig, "sm90", {**spec.config_of(case), **knobs}, spec.constants_of(case))
    target = get_target("sm90")
    return build_module(spec.kernel, module, target, kn) if compile_it else target.generate(module, kn)


def _lines(text: str, start: str, stop: str) -> list[str]:
    body = text[text.index(start):text.index(stop, text.index(start) + len(start))]
    return [ln.strip() for ln in body.splitlines() if ln.strip()]


def test_attention_rotation_keeps_the_second_gemm_in_flight_over_the_softmax():
    art = _build("flash_attention", "d128", {**MANUAL, "overlap": True})
    tl = art.stages["tilelang"]
    assert "T.Kernel(2, 2, 1, threads=384)" in tl  # 256 consumers + the producer warp group
    producer = _lines(tl, "if tx >= 256:", "else:  # consumer")
    assert producer[1] == "T.dec_max_nreg(24)"
    # q once; k for iteration n, then v (read only by the late gemm) for n - 1, FA3's order; v of the
    # last iteration after the loop
    copies = [ln for ln in producer if ln.startswith("T.tma_copy(")]
    assert [c.split("[")[0] for c in copies] == ["T.tma_copy(q", "T.tma_copy(k", "T.tma_copy(v", "T.tma_copy(v"]
    assert "k[b, h, 128 * n:" in copies[1] and "v[b, h, (128 * n - 128):" in copies[2] and "v[b, h, 128:" in copies[3]
    assert producer[producer.index(copies[2]) - 2] == "if n > 0:"
    # two key blocks: iteration 0 is peeled, the steady loop is 1..2, and so is the last P V after it
    steady = _lines(tl, "for n in T.serial(1, 2):", "for n in T.serial(1, 2):")
    issue1, issue2 = (i for i, ln in enumerate(steady) if ln.startswith("T.wgmma_gemm("))
    assert "k1_smem[n % 2" in steady[issue1] and "v2_smem[(n - 1) % 2" in steady[issue2]  # P V one behind
    wait1, wait0 = steady.index("T.wait_wgmma(1)"), steady.index("T.wait_wgmma(0)")
    first_softmax = next(i for i, ln in enumerate(steady) if ln.startswith("T.reduce_max"))
    acc_update = re.compile(r"buf\d+_frag\[i0, i1\] = \(buf\d+_frag\[i0, i1\] \*")
    rescale = next(i for i, ln in enumerate(steady) if acc_update.match(ln))
    assert issue2 < wait1 < first_softmax < wait0 < rescale  # softmax runs while P V is in flight
    assert steady.index("T.barrier_arrive(k1_smem_empty[n % 2])") == wait1 + 1
    assert steady.index("T.barrier_arrive(v2_smem_empty[(n - 1) % 2])") == wait0 + 1
    # ping-pong: each warp group waits its turn before its gemms and hands it over after
    assert steady[steady.index("T.sync_threads(8 + tx // 128, 256)") + 1].startswith("T.wgmma_gemm(")
    assert steady[issue2 + 1] == "T.named_barrier_arrive(9 - tx // 128, 256)"
    cuda = art.stages["cuda"]
    assert "__launch_bounds__(384, 1)" in cuda and "warpgroup_reg_alloc<240>" in cuda
    assert "wgmma_rs<" in cuda and "tl::wait_wgmma<1>()" in cuda


def test_gemm_mainloop_frees_a_slot_once_the_next_gemm_is_issued():
    art = _build("gemm", "bf16_ragged", MANUAL)
    loop = _lines(art.stages["tilelang"], "else:  # consumer", "T.wait_wgmma(0)")
    issue = next(i for i, ln in enumerate(loop) if ln.startswith("T.wgmma_gemm("))
    assert loop[issue + 1] == "T.wait_wgmma(1)" and loop[issue + 2] == "if k > 0:"
    assert loop[issue + 3].startswith("T.barrier_arrive(a0_smem_empty[(k - 1) %")
    assert "cp_async" not in art.stages["cuda"] and "tma_load" in art.stages["cuda"]


def test_without_overlap_each_gemm_is_waited_for_at_once():
    tl = _build("flash_attention", "d128_causal", MANUAL, compile_it=False).stages["tilelang"]
    consumer = tl[tl.index("else:  # consumer"):]
    assert "T.wgmma_gemm(" not in consumer and consumer.count("T.gemm(") == 2
    assert "named_barrier" not in consumer


def test_fp8_promotion_overlaps_the_add_with_the_next_group_under_manual():
    # K 256 in steps of 128, promoted every step: two groups, one per step fragment
    art = _build("gemm", "fp8_scaled", {**MANUAL, "fp8_promote_k": 128, "BK": 128, "BN": 128})
    consumer = _lines(art.stages["tilelang"], "else:  # consumer", "T.copy(a_scale")
    assert consumer[consumer.index("for k_unrolled in T.serial(1):") + 1] == "for k in T.serial(k_unrolled * 2 + 0, " \
        "k_unrolled * 2 + 0 + 1):"
    issues = [i for i, ln in enumerate(consumer) if ln.startswith("T.wgmma_gemm(")]
    assert len(issues) == 2 and "buf2_frag_step0" in consumer[issues[0]] and "buf2_frag_step1" in consumer[issues[1]]
    adds = [i for i, ln in enumerate(consumer) if ln.startswith("buf2_frag[i0, i1] = buf2_frag[i0, i1] + ")]
    # group 0 is added after group 1's gemm is issued and group 0's is complete; group 1 after the last wait
    assert issues[1] < consumer.index("T.wait_wgmma(1)", issues[1]) < adds[0] and "step0" in consumer[adds[0]]
    assert consumer.index("T.wait_wgmma(0)") < adds[1] and "step1" in consumer[adds[1]]
    ptxas = art.meta["ptxas"]  # the fragment each add reads is fixed in the code: ptxas keeps wgmma async
    assert ptxas["wgmma_serialized"] == 0 and ptxas["spill_stores"] == 0


def test_fp8_promotion_that_does_not_divide_the_loop_stays_synchronous():
    # K 256 in steps of 128 promoted every 256: one group, not two; the gemm is waited for, then added
    tl = _build("gemm", "fp8_scaled", {**MANUAL, "fp8_promote_k": 256, "BK": 128, "BN": 128},
                compile_it=False).stages["tilelang"]
    consumer = tl[tl.index("else:  # consumer"):]
    assert "T.gemm(" in consumer and "_step[i0, i1]" in consumer and "T.wgmma_gemm(" not in consumer


@dsl.kernel
def _reads_ring_tile(x: dsl.Tensor["N", "D", dsl.bf16], w: dsl.Tensor["D", "D", dsl.bf16],
                     y: dsl.Tensor["N", "D", dsl.f32], *, BN: dsl.Tunable = dsl.choice(64)):
    for i in dsl.grid(dsl.cdiv(x.N, BN)):
        acc = dsl.zeros((BN, x.D), dsl.f32, role="accumulator")
        for _ in dsl.pipelined(2 * dsl.cdiv(x.D, x.D), stages=2):  # two trips: a loop manual can ring
            t = dsl.load(x[i * BN, 0], (BN, x.D), role="operand")
            wt = dsl.load(w[0, 0], (x.D, x.D), role="operand")
            dsl.gemm(t, wt, acc)
            acc[:] = acc + t.to(dsl.f32)
        dsl.store(y[i * BN, 0], acc)


def test_a_ring_tile_read_by_vector_code_is_refused_with_its_line():
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    sig = _reads_ring_tile.bind({"x": x, "w": w, "y": torch.zeros(128, 64)})
    module, kn = specialize(_reads_ring_tile, sig, "sm90", {**MANUAL, "threads": 128})
    with pytest.raises(UnsupportedError, match=r"test_manual_ws\.py:\d+.*only gemms may read a tile"):
        get_target("sm90").generate(module, kn)


@pytest.mark.parametrize("threads", [128, 256, 384, 512])
def test_consumer_registers_fit_the_pool_fixed_at_launch(threads):
    # regression: 512 consumers asked for 120 registers each; with the producer's 24 that is more
    # than the 96 x 640 ptxas gives the block at launch, and setmaxnreg.inc waited forever
    from duotile.codegen.tilelang_cuda.manual_ws import PRODUCER_REGS, PRODUCER_THREADS, consumer_regs

    total = threads + PRODUCER_THREADS
    pool = min(255, 65536 // total) // 8 * 8 * total
    regs = consumer_regs(threads)
    assert regs % 8 == 0 and threads * regs + PRODUCER_THREADS * PRODUCER_REGS <= pool
    assert regs == {128: 240, 256: 240, 384: 160, 512: 112}[threads]


def test_overlap_without_a_producer_group_is_refused_before_tilelang():
    # regression: a tune sweep compiled overlap=True with warp_specialize=off four times, and
    # TileLang failed each late ("Two statements in the same order"); now the lowering refuses it
    spec = load_all()["flash_attention"]
    case = spec.cases["d128"]
    sig = spec.kernel.bind(spec.make_inputs(case, torch.device("cpu"), 0))
    with pytest.raises(UnsupportedError, match=r"flash_attention\.py:\d+.*overlap=True needs warp_specialize"):
        specialize(spec.kernel, sig, "sm90", {"overlap": True, "warp_specialize": "off"})
    specialize(spec.kernel, sig, "sm90", {"overlap": True, "warp_specialize": "manual"})


@dsl.kernel
def _work_after_second_gemm(q: dsl.Tensor["S", "D", dsl.bf16], k: dsl.Tensor["S", "D", dsl.bf16],
                            o: dsl.Tensor["S", "D", dsl.f32], *, BM: dsl.Tunable = dsl.choice(64)):
    for m in dsl.grid(dsl.cdiv(q.S, BM)):
        qt = dsl.load(q[m * BM, 0], (BM, q.D), role="operand")
        acc = dsl.full((BM, q.D), 1.0, dsl.f32, role="accumulator")  # not cleared by its first gemm
        for n in dsl.pipelined(dsl.cdiv(q.S, BM), stages=2):
            kt = dsl.load(k[n * BM, 0], (BM, q.D), role="operand")
            s = dsl.zeros((BM, BM), dsl.f32, role="accumulator")
            dsl.gemm(qt, kt, s, transpose_b=True)
            dsl.gemm(dsl.exp2(s).to(dsl.bf16), kt, acc)
            acc[:] = acc * 0.5  # reads gemm2's result in the same iteration: no rotation
        dsl.store(o[m * BM, 0], acc)


def test_a_second_gemm_whose_result_is_read_in_its_iteration_is_not_rotated():
    q = torch.zeros(128, 64, dtype=torch.bfloat16)
    sig = _work_after_second_gemm.bind({"q": q, "k": q.clone(), "o": torch.zeros(128, 64)})
    module, kn = specialize(_work_after_second_gemm, sig, "sm90", {**MANUAL, "overlap": True, "threads": 128})
    tl = get_target("sm90").generate(module, kn).stages["tilelang"]
    consumer = tl[tl.index("else:  # consumer"):]
    assert "T.wgmma_gemm(" not in consumer and consumer.count("T.gemm(") == 2  # every gemm waited for


def test_sm90_suggests_its_manual_schedule_as_a_tuning_start_point():
    from duotile.passes.check_batch_invariance import check_batch_invariance

    target, specs = get_target("sm90"), load_all()

    def points(name, case):
        spec = specs[name]
        sig = spec.kernel.bind(spec.meta_inputs(spec.build_cases[case]))
        traced = check_batch_invariance(spec.kernel, sig.dtypes, sig.present, spec.constants_of(spec.build_cases[case]))
        return target.start_points(traced)

    fa = {"warp_specialize": "manual", "overlap": True}
    assert points("flash_attention", "d128") == [fa, {**fa, "persistent": True}]
    assert points("gemm", "bf16_8192") == [MANUAL, {**MANUAL, "persistent": True}]
    assert points("rmsnorm", "hidden") == []  # no pipelined loop: nothing to specialise


def test_four_consumer_groups_lower_with_the_register_split_that_fits():
    cuda = _build("gemm", "bf16_ragged", {**MANUAL, "threads": 512}).stages["cuda"]
    assert "__launch_bounds__(640, 1)" in cuda
    assert "warpgroup_reg_dealloc<24>" in cuda and "warpgroup_reg_alloc<112>" in cuda


PERSISTENT = {**MANUAL, "overlap": True, "persistent": 1}


def test_a_persistent_grid_walks_the_tiles_with_ring_phases_carried_across_them():
    art = _build("flash_attention", "d128", PERSISTENT)  # B 1, H 2, S 256: four tiles, one block
    tl = art.stages["tilelang"]
    assert "T.Kernel(1, threads=384) as (cta,)" in tl and "T.use_swizzle" not in tl
    consumer = _lines(tl, "else:  # consumer", "ring_base[0] = ring_base[0] + 2")
    # the ping-pong's first hand-over happens once, before the tiles: each tile keeps the turn order
    assert tl.count("T.named_barrier_arrive(8, 256)") == 1
    assert consumer.index("if tx // 128 == 1:  # warp group 0 issues first") < consumer.index(
        "for tile_round in T.serial(4):")
    head = consumer.index("for tile_round in T.serial(4):")
    assert consumer[head + 1:head + 6] == [
        "tile_id = cta + tile_round * 1", "if tile_id < 4:", "m = tile_id % 2", "h = tile_id // 2 % 2",
        "b = tile_id // 4"]
    assert consumer[head + 6].startswith("T.barrier_wait(q0_smem_full, tile_round % 2)  # flash_attention.py:")
    assert "T.barrier_wait(k1_smem_full[(ring_base[0] + n) % 2], ((ring_base[0] + n) // 2) % 2)" in consumer
    # q, read only by the first gemm, is freed for the next tile's producer once the last
    # iteration's first gemm is complete: its load hides under the last second gemm and the epilogue
    assert consumer.count("T.barrier_arrive(q0_smem_empty)") == 1
    free = consumer.index("T.barrier_arrive(q0_smem_empty)")
    assert consumer[free - 2:free] == ["T.wait_wgmma(1)", "T.barrier_arrive(k1_smem_empty[(ring_base[0] + n) % 2])"]
    loop = max(i for i, ln in enumerate(consumer[:free]) if ln.startswith("for n in"))
    assert consumer[loop] == "for n in T.serial(1, 2):"  # the last iteration's own loop: no test needed
    tail = consumer.index("for n in T.serial(1, 2):", free)  # the last second gemm comes after
    assert consumer[tail + 2].startswith("T.wgmma_gemm(t12_frag, v2_smem")
    producer = _lines(tl, "if tx >= 256:", "else:  # consumer")
    assert "T.barrier_wait(q0_smem_empty, tile_round % 2 ^ 1)" in producer
    assert producer[-1] == "ring_base[0] = ring_base[0] + 2"
    assert "__launch_bounds__(384, 1)" in art.stages["cuda"]


def _truncdiv(a: int, b: int) -> int:
    """TIR's truncdiv: C's ``/`` on ints (rounds toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _truncmod(a: int, b: int) -> int:
    return a - _truncdiv(a, b) * b


def _decode(tl: str, grid_vars: list[str], sizes: dict | None = None) -> list[tuple[int, ...]]:
    """Run the generated tile decode for every tile id (TileLang's // and % on ints are Python's);
    ``sizes`` gives the dynamic sizes (``n_M``) a dynamic build's decode reads."""
    body = [ln.strip() for ln in tl[tl.index("if tile_id <"):].splitlines()[1:]]
    lines = list(itertools.takewhile(lambda ln: re.match(r"\w+ = ", ln), body))
    tl_ops = type("T", (), {"min": staticmethod(min), "ceildiv": staticmethod(lambda a, b: -(-a // b)),
                            "truncdiv": staticmethod(_truncdiv), "truncmod": staticmethod(_truncmod)})
    total = eval(re.search(r"if tile_id < (.+):", tl).group(1), {"T": tl_ops}, dict(sizes or {}))
    out = []
    for tile in range(total):
        env = {"tile_id": tile, "T": tl_ops, **(sizes or {})}
        for ln in lines:
            name, expr = ln.split(" = ", 1)
            env[name] = eval(expr, {}, env)
        out.append(tuple(env[v] for v in grid_vars))
    return out


@pytest.mark.parametrize("raster", [0, 8, 3])
def test_the_persistent_decode_visits_every_tile_once(raster):
    # attention d128_causal: B 2, H 1, S 192 with 64-row tiles, a 2 x 1 x 3 grid
    tl = _build("flash_attention", "d128_causal", {**PERSISTENT, "BM": 64, "BN": 64, "threads": 128,
                                                    "raster": raster}, compile_it=False).stages["tilelang"]
    tiles = _decode(tl, ["b", "h", "m"])
    assert sorted(tiles) == [(b, 0, m) for b in range(2) for m in range(3)]


def test_raster_panels_sweep_rows_of_blocks_together():
    spec = load_all()["gemm"]
    sig = spec.kernel.bind(spec.meta_inputs({"M": 1024, "N": 1024, "K": 128}))
    cfg = {**MANUAL, "persistent": True, "raster": 3, "BM": 128, "BN": 128, "BK": 64}
    for s, sizes in ((sig.with_static(sig.dynamic), None), (sig, {"n_M": 1024})):  # static M, and dynamic
        module, kn = specialize(spec.kernel, s, "sm90", cfg)
        tl = get_target("sm90").generate(module, kn).stages["tilelang"]
        tiles = _decode(tl, ["m", "n"], sizes)
        assert sorted(tiles) == [(m, n) for m in range(8) for n in range(8)]  # a permutation of the grid
        assert tiles[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]  # down a panel of 3 rows, then along it
        assert tiles[-2:] == [(6, 7), (7, 7)]  # the last panel has 2 rows


def test_persistent_gemm_frees_the_last_slots_for_the_next_tile():
    tl = _build("gemm", "bf16_ragged", {**MANUAL, "persistent": 1}, compile_it=False).stages["tilelang"]
    consumer = _lines(tl, "else:  # consumer", "ring_base[0] = ring_base[0] + 4")
    after = consumer[consumer.index("T.wait_wgmma(0)") + 1:]
    assert after[:2] == ["T.barrier_arrive(a0_smem_empty[(ring_base[0] + 3) % 3])",
                         "T.barrier_arrive(b1_smem_empty[(ring_base[0] + 3) % 3])"]


def test_persistent_needs_the_manual_schedule():
    spec = load_all()["gemm"]
    sig = spec.kernel.bind(spec.make_inputs(spec.cases["bf16_ragged"], torch.device("cpu"), 0))
    with pytest.raises(UnsupportedError, match=r"gemm\.py:\d+.*persistent needs warp_specialize=manual"):
        specialize(spec.kernel, sig, "sm90", {"persistent": True})
    norm = load_all()["rmsnorm"]
    sig = norm.kernel.bind(norm.make_inputs(norm.cases["t3_d4096"], torch.device("cpu"), 0))
    assert "persistent" not in get_target("sm90").knobs_for(specialize(norm.kernel, sig, "sm90", {})[0])


def test_a_ragged_tail_masks_only_the_last_iteration():
    tl = _build("flash_attention", "d128_tail", {**PERSISTENT, "BN": 64}, compile_it=False).stages["tilelang"]
    consumer = tl[tl.index("else:  # consumer"):]
    first = consumer[:consumer.index("for n in T.serial(1, 3):")]
    steady = consumer[consumer.index("for n in T.serial(1, 3):"):consumer.index("for n in T.serial(3, 4):")]
    last = consumer[consumer.index("for n in T.serial(3, 4):"):]
    assert "T.if_then_else" not in first and "T.if_then_else" not in steady
    assert "(64 * n + i1) < 200" in last
    causal = _build("flash_attention", "d128_ragged", {**PERSISTENT, "BN": 64}, compile_it=False).stages["tilelang"]
    assert causal.count("T.if_then_else") == 2  # the diagonal: masked in the peeled and the steady loop


def test_masks_are_folded_only_over_every_tile_s_range_of_the_loop():
    # the range of the loop variable is the union over tiles: a start that varies with the grid
    # counts at its least value, so a mask that some tile still needs is kept
    from duotile.codegen.tilelang_cuda.emit import Emitter
    from duotile.codegen.tilelang_cuda.manual_ws import ManualWarpSpecialization

    spec = load_all()["flash_attention"]
    case = spec.cases["d128_tail"]
    sig = spec.kernel.bind(spec.make_inputs(case, torch.device("cpu"), 0))
    module, kn = specialize(spec.kernel, sig, "sm90", {**PERSISTENT, "BN": 64}, spec.constants_of(case))
    target = get_target("sm90")
    ws = ManualWarpSpecialization(Emitter(module, target.arch, kn), module.grid.regions[0].ops)
    m = module.grid.attrs["vars"][-1]  # query blocks: 0..1 (S 200, BM 128)
    assert ws._folded(ws.body, 0, 2)  # key blocks 0..2 end at 192 < 200: the tail mask goes
    assert not ws._folded(ws.body, m, 3)  # from block m (0 or 1) to 3: block 3 is the ragged one
    assert ws._folded(ws.body, m, 2)


def test_the_last_ragged_key_block_runs_narrow_gemms():
    """S 256 in 192-key blocks: the last block has 64 keys. Its gemm1 writes 64 columns into a
    narrow fragment, copied into the scores with zeros after them (what the wide gemm computes
    from the zero rows TMA fills in), and its gemm2 reads 64 columns of P and 64 rows of V."""
    tl = _build("flash_attention", "d128", {**MANUAL, "overlap": True, "BN": 192}, compile_it=False).stages["tilelang"]
    assert 'buf6_frag_tail = T.alloc_fragment((128, 64,), "float32")' in tl
    last = _lines(tl, "for n in T.serial(1, 2):", "for n in T.serial(1, 2):")  # the last iteration's loop
    gemm1 = next(ln for ln in last if ln.startswith("T.wgmma_gemm(q0_smem"))
    assert "k1_smem[n % 2, 0:64, :], buf6_frag_tail," in gemm1 and "clear_accum=True" in gemm1
    widen = last.index("T.wait_wgmma(1)") + 2
    assert last[widen:widen + 4] == ["for i0, i1 in T.Parallel(128, 64):", "buf6_frag[i0, i1] = buf6_frag_tail[i0, i1]",
                                     "for i0, i1 in T.Parallel(128, 128):", "buf6_frag[i0, i1 + 64] = T.float32(0)"]
    tail = tl[tl.rindex("for n in T.serial(1, 2):"):]
    assert "t13_frag_tail[i0, i1] = t13_frag[i0, i1]" in tail
    assert "T.wgmma_gemm(t13_frag_tail, v2_smem[n % 2, 0:64, :], buf3_frag," in tail
    # the iterations before the last keep their full blocks
    assert tl.count("0:64, :]") == 2


def test_a_tail_block_off_the_wgmma_k_step_keeps_full_gemms():
    """S 200 in 64-key blocks leaves 8 keys: not a multiple of the 16-key wgmma step."""
    tl = _build("flash_attention", "d128_tail", {**MANUAL, "overlap": True, "BN": 64},
                compile_it=False).stages["tilelang"]
    assert "_tail" not in tl


@pytest.mark.parametrize("rows", [8192, 4000])
def test_shipped_fp8_config_decodes_every_tile_of_a_dynamic_token_count(rows):
    """Regression: with M dynamic, the persistent decode printed ``tile_id % 64 * T.ceildiv(n_M,
    128)`` for ``tile_id % (64 * ...)``; the shipped fp8 config then wrote only its first tiles on
    the H200 (the rest NaN or 0). Every tile id must decode to a distinct tile of the grid."""
    import json
    from pathlib import Path

    import duotile

    table = json.loads((Path(duotile.__file__).parent / "tuned" / "tuning.json").read_text())["entries"]
    cfg = next(e["config"] for e in table.values() if e["key"]["kernel"] == "gemm"
               and e["key"]["dtypes"]["a"] == "f8e4m3")
    spec = load_all()["gemm"]
    sig = spec.kernel.bind(spec.meta_inputs({"M": rows, "N": 8192, "K": 8192, "dtype": "f8e4m3"}))
    assert "M" in sig.dynamic
    module, kn = specialize(spec.kernel, sig, "sm90", cfg)
    tl = get_target("sm90").generate(module, kn).stages["tilelang"]
    tiles = _decode(tl, ["m", "n"], {"n_M": rows})
    bm, bn = cfg["BM"], cfg["BN"]
    assert sorted(tiles) == [(m, n) for m in range(-(-rows // bm)) for n in range(-(-8192 // bn))]


def test_block_scaled_promotion_runs_under_the_next_gemm():
    # V4.1's 32-wide blocks in a 128-wide K step: four gemms into four partials; partial j is scaled
    # and added after gemm j + 1 is issued and gemm j is complete, the last after wait_wgmma(0)
    art = _build("gemm_blockscaled", "v41_sub_blocks", {**MANUAL, "SPLIT": 1})
    consumer = _lines(art.stages["tilelang"], "else:  # consumer", "T.copy(t")
    issues = [i for i, ln in enumerate(consumer) if ln.startswith("T.wgmma_gemm(")]
    parts = [re.search(r", (buf\d+_frag), transpose", consumer[i]).group(1) for i in issues]
    adds = [next(i for i, ln in enumerate(consumer) if ln.startswith("buf") and f"+ ({p}[i0, i1]" in ln) for p in parts]
    waits = [i for i, ln in enumerate(consumer) if ln.startswith("T.wait_wgmma(")]
    assert len(issues) == 4 and len(set(parts)) == 4 and "T.gemm(" not in "\n".join(consumer)
    for j in range(3):  # under gemm j + 1: partial j's scale loads, then the wait, then its add
        assert issues[j + 1] < consumer.index("T.wait_wgmma(1)", issues[j + 1]) < adds[j] < issues[j + 2] \
            if j < 2 else issues[3] < waits[2] < adds[2]
        assert any(ln.startswith("T.copy(a_scale") for ln in consumer[issues[j + 1]:waits[j]])
    assert [consumer[w] for w in waits] == ["T.wait_wgmma(1)"] * 3 + ["T.wait_wgmma(0)"]
    assert waits[3] < adds[3]
    ptxas = art.meta["ptxas"]  # each partial is its own fragment: ptxas keeps the wgmma asynchronous
    assert ptxas["wgmma_serialized"] == 0 and ptxas["spill_stores"] == 0


def test_a_partial_read_after_the_next_gemm_is_issued_stays_synchronous():
    from duotile.codegen.tilelang_cuda import partials_in_flight

    @dsl.kernel
    def late_read(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16],
                  c: dsl.Tensor["M", "N", dsl.f32], *, BM: dsl.Const = 64, BN: dsl.Const = 64, BK: dsl.Const = 32):
        for m, n in dsl.grid(dsl.cdiv(a.M, BM), dsl.cdiv(b.N, BN)):
            acc = dsl.zeros((BM, BN), dsl.f32)
            for k in dsl.pipelined(dsl.cdiv(a.K, 2 * BK), stages=2):
                p0 = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
                dsl.gemm(dsl.load(a[m * BM, 2 * k * BK], (BM, BK), role="operand"),
                         dsl.load(b[n * BN, 2 * k * BK], (BN, BK), role="operand"), p0, transpose_b=True)
                p1 = dsl.zeros((BM, BN), dsl.f32, role="accumulator")
                dsl.gemm(dsl.load(a[m * BM, 2 * k * BK + BK], (BM, BK), role="operand"),
                         dsl.load(b[n * BN, 2 * k * BK + BK], (BN, BK), role="operand"), p1, transpose_b=True)
                acc[:] = acc + p0 * 2.0 + p1  # p0 read after gemm 1: no partial of its own
            dsl.store(c[m * BM, n * BN], acc)

    sig = late_read.bind({"a": torch.zeros(128, 128, dtype=torch.bfloat16),
                          "b": torch.zeros(128, 128, dtype=torch.bfloat16), "c": torch.zeros(128, 128)})
    module, kn = specialize(late_read, sig, "sm90", MANUAL, {})
    loop = next(op for op in module.walk() if op.name == "for" and op.attrs.get("stages"))
    body = loop.regions[0].ops
    assert partials_in_flight.segments(body, [op for op in body if op.name == "gemm"]) is None
    consumer = get_target("sm90").generate(module, kn).stages["tilelang"].split("else:  # consumer")[1]
    assert consumer.count("T.gemm(") == 2 and "T.wgmma_gemm(" not in consumer
