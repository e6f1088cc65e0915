"""Configs are refused, not silently built, when a name or a value is outside what the kernel's
tunables and the target's knobs declare; the error is one line and lists the allowed values."""

from __future__ import annotations

import pytest

from duotile import codegen
from duotile.codegen.compile import specialize_phases
from duotile.codegen.driver import build_case
from duotile.dsl.errors import DslError
from duotile.dsl.tunables import ConfigValueError, choice
from duotile.kernels_spec import get
from duotile.passes.autotune.space import ConfigSpace

GEMM_CASE = {"M": 256, "N": 256, "K": 256}


def _gemm_sig():
    spec = get("gemm")
    return spec, spec.kernel.bind(spec.meta_inputs(GEMM_CASE))


@pytest.mark.parametrize("config, says", [
    ({"warp_specialize": "bogus"}, "warp_specialize='bogus' is not allowed: warp_specialize takes one of "
                                   "['auto', 'manual', 'off']"),
    ({"BM": 100}, "BM=100 is not allowed: BM takes one of [128, 64, 256]"),
    ({"STAGES": 9}, "STAGES=9 is not allowed: STAGES takes one of [2, 3, 4, 5]"),
    ({"threads": 256.0}, "threads=256.0 is not allowed"),  # a float is not the int 256
    ({"cluster": True}, "cluster=True is not allowed"),  # nor True the int 1
    ({"fp8_promote_k": 100}, "fp8_promote_k=100 is not allowed"),
    ({"persistent": 0}, "a block count >= 1"),
    ({"BQ": 64}, "kernel 'gemm' has no tunable 'BQ'"),
])
def test_a_value_outside_the_declared_space_is_refused_naming_the_allowed_ones(config, says):
    spec, sig = _gemm_sig()
    with pytest.raises(ConfigValueError) as info:
        specialize_phases(spec.kernel, sig, "sm90", config)
    msg = str(info.value)
    assert says in msg and "\n" not in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, DslError)


def test_codegen_compile_refuses_at_once_and_build_reports_the_error():
    spec = get("gemm")
    with pytest.raises(ConfigValueError, match="warp_specialize='bogus'"):
        codegen.compile(spec.kernel, "sm90", config={"warp_specialize": "bogus"})
    r = build_case(spec, "c", GEMM_CASE, "sm90", config={"warp_specialize": "bogus"}, use_tuned=False)
    assert not r.ok and r.error.startswith("ConfigValueError: ") and "'manual'" in r.error
    r = build_case(get("rmsnorm"), "c", {"T": 8, "D": 64}, "interpret", config={"ROWS": 3}, use_tuned=False)
    assert not r.ok and "ROWS=3 is not allowed: ROWS takes one of [1, 2, 4, 8]" in r.error


@pytest.mark.parametrize("config", [{"warp_specialize": "manual", "persistent": 2},  # a block count
                                    {"warp_specialize": False},  # older tables' spelling of "off"
                                    {"raster": 3},  # any panel height
                                    {"cores": 16}])  # another target's knob: not this target's to judge
def test_what_a_knob_declares_beyond_its_searched_values_is_accepted(config):
    spec, sig = _gemm_sig()
    specialize_phases(spec.kernel, sig, "sm90", config)


def test_values_a_kernels_spec_pins_in_its_cases_are_accepted_others_not():
    spec = get("gemm_splitk")
    sig = spec.kernel.bind(spec.meta_inputs(spec.cases["split4"]))
    assert not spec.kernel.tunables["BK"].accepts(32)  # the case pins a tile the search never proposes
    specialize_phases(spec.kernel, sig, "interpret", spec.config_of(spec.cases["split4"]))
    with pytest.raises(ConfigValueError, match=r"BK=48 .*one of \[64, 128\], or as the spec's cases pin it: \[32\]"):
        specialize_phases(spec.kernel, sig, "interpret", {"BK": 48})


def test_pins_and_start_points_are_checked_against_the_same_space():
    spec = get("gemm")
    space = ConfigSpace.from_kernel(spec.kernel, "sm90")
    with pytest.raises(ConfigValueError, match="cannot pin warp_specialize='bogus'"):
        space.pin(warp_specialize="bogus")
    assert space.pin(persistent="2").pinned["persistent"] == 2  # parsed, then accepted as a block count
    assert space.pin(persistent="2").encode(space.pin(persistent="2").default())  # encodes off its axis


def test_a_space_checks_type_as_well_as_value():
    space = choice(1, 2)
    assert space.accepts(1) and not space.accepts(True) and not space.accepts(1.0)
    extended = choice(False, True, also=(lambda v: type(v) is int and v >= 1, "a count >= 1"))
    assert extended.accepts(5) and not extended.accepts(-1) and not extended.accepts("5")
    assert not extended.contains(5)  # accepted, never searched
    assert extended.allowed() == "one of [False, True], or a count >= 1"
