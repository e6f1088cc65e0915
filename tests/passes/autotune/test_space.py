import random

import pytest

from duotile import dsl
from duotile.dsl.errors import DslError
from duotile.passes.autotune.space import ConfigSpace, config_key


@dsl.kernel
def every_kind(x: dsl.Tensor["N", dsl.f32], *,
               C: dsl.Tunable = dsl.choice(64, 128, 256),
               P: dsl.Tunable = dsl.pow2(16, 128, default=32),
               B: dsl.Tunable = dsl.boolean(True),
               E: dsl.Tunable = dsl.enum("none", "cooperative", "pingpong"),
               R: dsl.Tunable = dsl.int_range(1, 7, step=2, default=3)):
    for i in dsl.grid(dsl.cdiv(x.N, C)):
        dsl.store(x[i * C], dsl.load(x[i * C], (C,)))


SPACE = ConfigSpace.from_kernel(every_kind)


def test_default_and_size():
    assert SPACE.default() == {"C": 64, "P": 32, "B": True, "E": "none", "R": 3}
    assert SPACE.size == 3 * 4 * 2 * 3 * 4
    assert len({config_key(c) for c in SPACE.enumerate()}) == SPACE.size


def test_sample_stays_in_space_and_covers_it():
    rng = random.Random(1)
    samples = [SPACE.sample(rng) for _ in range(400)]
    assert all(SPACE.contains(s) for s in samples)
    for name, space in SPACE.params.items():
        assert {s[name] for s in samples} == set(space.values()), name


@pytest.mark.parametrize("name,value,expected", [
    ("C", 128, {64, 256}), ("C", 64, {128}),          # choice: adjacent in declared order
    ("P", 32, {16, 64}), ("P", 128, {64}),            # pow2: one doubling / halving
    ("B", True, {False}),                             # boolean: flipped
    ("E", "none", {"cooperative", "pingpong"}),       # enum: unordered, every other option
    ("R", 3, {1, 5}), ("R", 7, {5}),                  # int range: one step
])
def test_neighbours_per_type(name, value, expected):
    config = {**SPACE.default(), name: value}
    changed = [n for n in SPACE.neighbours(config) if n[name] != value]
    assert {n[name] for n in changed} == expected
    for n in SPACE.neighbours(config):  # each neighbour changes exactly one parameter
        assert sum(n[k] != config[k] for k in config) == 1


def test_numeric_choices_step_in_numeric_order_whatever_the_declared_order():
    """Regression: threads = choice(256, 128, 512) made 512's only neighbour 128, so a pattern
    search at threads=512 could never step back to 256 (the H200 bf16 sweep stopped there)."""
    threads = dsl.choice(256, 128, 512)
    assert threads.default == 256
    assert set(threads.neighbours(512)) == {256} and set(threads.neighbours(256)) == {128, 512}
    assert threads.encode(128) == 0.0 and threads.encode(512) == 1.0
    words = dsl.choice("b", "a")  # not numbers: as written
    assert words.neighbours("b") == ["a"]


def test_encode_is_in_unit_interval_and_ordered():
    lo = SPACE.encode({"C": 64, "P": 16, "B": False, "E": "none", "R": 1})
    hi = SPACE.encode({"C": 256, "P": 128, "B": True, "E": "pingpong", "R": 7})
    assert lo == [0.0] * 5 and hi == [1.0] * 5
    assert SPACE.encode({**SPACE.default(), "P": 32})[1] == pytest.approx(1 / 3)


def test_pinning_from_text_and_errors():
    pinned = SPACE.pin(C="128", B="false", E="pingpong")
    assert pinned.size == 4 * 4
    assert pinned.default()["C"] == 128 and pinned.default()["B"] is False
    assert all(c["E"] == "pingpong" for c in pinned.enumerate())
    assert all(n["C"] == 128 for n in pinned.neighbours(pinned.default()))
    rng = random.Random(0)
    assert all(pinned.sample(rng)["C"] == 128 for _ in range(20))
    with pytest.raises(DslError, match="not one of"):
        SPACE.pin(C="100")
    with pytest.raises(DslError, match="cannot pin"):
        SPACE.pin(ZZ=1)


def test_target_knobs_join_the_space():
    from duotile.codegen.target import Target

    class Fake(Target):
        name = "fake"
        knobs = {"threads": dsl.choice(128, 256)}

    space = ConfigSpace.from_kernel(every_kind, Fake())
    assert space.owners["threads"] == "target" and space.size == SPACE.size * 2
    kern, knobs = space.split(space.default())
    assert knobs == {"threads": 128} and "threads" not in kern


def test_cuda_knobs_that_cannot_change_a_kernel_are_left_out():
    import torch

    from duotile.codegen.target import get_target
    from duotile.kernels_spec import registry

    tgt = get_target("sm90")
    gemm = registry.get("gemm")
    fp8 = gemm.kernel.bind(gemm.meta_inputs({"M": 64, "N": 64, "K": 64, "dtype": "f8e4m3"}))
    bf16 = gemm.kernel.bind(gemm.meta_inputs({"M": 64, "N": 64, "K": 64}))
    fa = registry.get("flash_attention")
    fa_sig = fa.kernel.bind(fa.meta_inputs({"B": 1, "H": 1, "S": 64, "D": 64}))

    def knobs(spec, sig):
        module = spec.kernel.trace(sig.dtypes, sig.present)
        return set(ConfigSpace.from_kernel(spec.kernel, tgt, module=module).params) - set(spec.kernel.tunables)

    assert knobs(gemm, fp8) == {"threads", "raster", "fp8_promote_k", "warp_specialize", "persistent", "full_row",
                                "cluster", "tma_store"}
    assert knobs(gemm, bf16) == {"threads", "raster", "warp_specialize", "persistent", "full_row", "cluster",
                                 "tma_store"}
    # attention's accumulators are split by rows already (row reductions, rescaling): no full_row
    assert knobs(fa, fa_sig) == {"threads", "raster", "overlap", "warp_specialize", "persistent", "cluster",
                                 "tma_store"}
    norm = registry.get("rmsnorm")  # no pipelined loop: nothing to specialise warps for
    norm_sig = norm.kernel.bind(norm.meta_inputs({"T": 4, "D": 64}))
    assert knobs(norm, norm_sig) == {"threads", "raster"}
    assert torch.is_tensor(gemm.meta_inputs({"M": 1, "N": 1, "K": 1})["a"])


def test_a_start_config_moves_the_default_but_not_the_pins():
    from duotile.kernels_spec import registry

    space = ConfigSpace.from_kernel(registry.get("gemm").kernel, "sm90").pin(STAGES=4)
    started = space.starting_at({"BN": 128, "BK": 128, "STAGES": 2, "raster": 16, "unknown": 1, "BM": 7})
    d = started.default()
    assert (d["BN"], d["BK"], d["raster"]) == (128, 128, 16)
    assert d["STAGES"] == 4  # a pin outranks the start
    assert d["BM"] == space.default()["BM"]  # 7 is not in BM's space: ignored
    assert "unknown" not in d
