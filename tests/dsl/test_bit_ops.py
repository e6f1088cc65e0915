"""Bit operations of the DSL on small fragments: ``& | ^ << >>`` on integer tiles, ``t.bitcast``
(f32 <-> i32). Their meaning on the interpreter, the type rules at the spec line and in
verify_ir, and their lowerings: TileLang text for sm90 / sm100 (compiled by nvcc in the slow
test) and ascend950, whose refusals name the op."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.dsl.expr import Node
from duotile.dsl.ir import Op
from duotile.passes.verify_ir import verify_ir


@dsl.kernel
def int_bits(a: dsl.Tensor["N", dsl.i32], out: dsl.Tensor["K", "N", dsl.i32]):
    for _ in dsl.grid(1):
        v = dsl.load(a[0], (8,))
        dsl.store(out[0, 0], v >> 3)
        dsl.store(out[1, 0], v << 28)
        dsl.store(out[2, 0], v & -16)
        dsl.store(out[3, 0], v | 0x70000000)
        dsl.store(out[4, 0], v ^ 0x5A5A)
        dsl.store(out[5, 0], 0xFF & v)
        dsl.store(out[6, 0], (v >> 31) | (v << 1))


@dsl.kernel
def byte_bits(a: dsl.Tensor["N", dsl.u8], out: dsl.Tensor["K", "N", dsl.u8]):
    for _ in dsl.grid(1):
        v = dsl.load(a[0], (8,))
        dsl.store(out[0, 0], v >> 4)  # logical: u8 is unsigned
        dsl.store(out[1, 0], (v << 4) >> 4)  # the bits shifted out of the byte are gone
        dsl.store(out[2, 0], (v & 15) | ((v >> 4) << 4))


@dsl.kernel
def float_bits(x: dsl.Tensor["N", dsl.f32], bits: dsl.Tensor["N", dsl.i32], back: dsl.Tensor["N", dsl.f32],
               expo: dsl.Tensor["N", dsl.i32], pow2: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(dsl.cdiv(x.N, 16)):
        xt = dsl.load(x[i * 16], (16,))
        b = xt.bitcast(dsl.i32)
        dsl.store(bits[i * 16], b)
        dsl.store(back[i * 16], dsl.bitcast(b, dsl.f32))
        dsl.store(expo[i * 16], (b >> 23) & 0xFF)
        dsl.store(pow2[i * 16], (b & -8388608).bitcast(dsl.f32))  # sign and exponent: +-2^e, or +-0


def test_integer_bit_ops_follow_twos_complement():
    a = torch.tensor([0, 1, -1, 7, -8, 2**31 - 1, -(2**31), 0x12345678], dtype=torch.int32)
    out = torch.zeros(7, 8, dtype=torch.int32)
    codegen.compile(int_bits, "interpret")(a=a, out=out)
    want = [a >> 3, a << 28, a & -16, a | 0x70000000, a ^ 0x5A5A, a & 0xFF, (a >> 31) | (a << 1)]
    assert torch.equal(out, torch.stack(want))
    assert out[0, 4] == -1 and out[0, 2] == -1  # `>>` on a signed type is arithmetic, as in Python
    assert out[1, 3] == 7 << 28 and out[1, 7] == -(2**31)  # `<<` drops the bits shifted out


def test_byte_shifts_are_logical_and_drop_the_high_bits():
    a = torch.tensor([0, 1, 15, 16, 0x7F, 0x80, 0xA5, 0xFF], dtype=torch.uint8)
    out = torch.zeros(3, 8, dtype=torch.uint8)
    codegen.compile(byte_bits, "interpret")(a=a, out=out)
    assert out[0].tolist() == [v >> 4 for v in a.tolist()]
    assert out[1].tolist() == [v & 15 for v in a.tolist()]
    assert torch.equal(out[2], a)


def test_bitcast_reads_the_same_bits_nan_payloads_and_signed_zero_included():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 448.0, 1e-40, float("inf"), -float("inf"),
                      3.0e38, 2.0**-126, 1.5, -2.75, 1e-4, 6.0, 0.1, 65504.0])
    x[3] = -0.0
    nan = torch.tensor([0x7FC00001, -0x00400001], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, nan, torch.randn(14)])
    n = x.numel()
    bits, expo = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    back, pow2 = torch.zeros(n), torch.zeros(n)
    codegen.compile(float_bits, "interpret")(x=x, bits=bits, back=back, expo=expo, pow2=pow2)
    assert torch.equal(bits, x.view(torch.int32))
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))  # NaN payloads survive both ways
    assert torch.equal(expo, (x.view(torch.int32) >> 23) & 0xFF)
    normal = torch.isfinite(x) & (x.abs() >= 2.0**-126)
    m, e = torch.frexp(x[normal])  # x = m * 2^e, 0.5 <= |m| < 1
    assert torch.equal(pow2[normal], torch.sign(m) * torch.ldexp(torch.ones_like(m), e - 1))
    small = x.abs() < 2.0**-126  # zeros and subnormals: exponent bits 0
    assert torch.equal(pow2[small].view(torch.int32), x[small].view(torch.int32) & -(2**31))


def test_logical_and_or_on_conditions_are_unchanged():
    @dsl.kernel
    def both(a: dsl.Tensor["N", dsl.i32], out: dsl.Tensor["N", dsl.i32]):
        for _ in dsl.grid(1):
            v = dsl.load(a[0], (8,))
            dsl.store(out[0], dsl.where((v > 1) & (v < 6) | v.eq(7), v, 0))

    text = str(both.trace())
    assert "ew.and(" in text and "ew.or(" in text and "bitand" not in text
    a, out = torch.arange(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    codegen.compile(both, "interpret")(a=a, out=out)
    assert out.tolist() == [0, 0, 2, 3, 4, 5, 0, 7]


BODY = [lambda v: v]  # what the two kernels below compute: set by each refusal test


@dsl.kernel
def int_body(a: dsl.Tensor["N", dsl.i32], out: dsl.Tensor["N", dsl.i32]):
    for _ in dsl.grid(1):
        dsl.store(out[0], BODY[0](dsl.load(a[0], (8,))))


@dsl.kernel
def float_body(a: dsl.Tensor["N", dsl.f32], out: dsl.Tensor["N", dsl.f32]):
    for _ in dsl.grid(1):
        dsl.store(out[0], BODY[0](dsl.load(a[0], (8,))))


def _refused(body, match: str, kernel=int_body):
    BODY[0] = body
    with pytest.raises(DslError, match=match) as err:
        kernel.trace()
    assert err.value.loc is not None and "test_bit_ops.py" in err.value.loc.file


@pytest.mark.parametrize("body,match", [
    (lambda v: v << v, "count of `<<` must be a constant integer"),
    (lambda v: 1 << v, "the value shifted must be the tile"),
    (lambda v: v >> 32, r"count of `>>` on i32 must lie in \[0, 32\), got 32"),
    (lambda v: v << -1, r"must lie in \[0, 32\)"),
    (lambda v: v & 0xFFFFFFFF, r"constant 4294967295 of `&` does not fit i32"),
    (lambda v: v | 1.5, "takes integer tiles and integer constants"),
    (lambda v: (v > 0) ^ (v < 3), "not booleans"),
    (lambda v: v.bitcast(dsl.f16), "cannot bitcast i32 to f16: supported are f32 -> i32, i32 -> f32"),
    (lambda v: v.to(dsl.bf16).bitcast(dsl.i32).to(dsl.bf16), "cannot bitcast bf16 to i32"),
])
def test_bit_op_type_rules_name_the_spec_line(body, match):
    _refused(body, match)


def test_shifting_or_masking_a_float_tile_asks_for_a_bitcast():
    _refused(lambda v: v >> 2, "bitcast", float_body)
    _refused(lambda v: v & 3, r"not floats: compare first, or .*bitcast", float_body)
    _refused(lambda v: (v > 0) | (v.bitcast(dsl.i32) & 1), "cast the condition", float_body)


def _module():
    return verify_ir(float_bits.trace())


def test_verify_ir_checks_bit_ops_in_ew_ops_and_fused_maps():
    m = _module()
    grid = m.body.ops[0]
    shift = next(op for op in grid.walk() if op.name == "ew" and op.attrs["fn"] == "shr")
    shift.args = (shift.args[0], 40)
    with pytest.raises(DslError, match=r"shr needs a constant count in \[0, 32\), got 40"):
        verify_ir(m)
    m = _module()
    cast = next(op for op in m.body.ops[0].walk() if op.name == "ew" and op.attrs["fn"] == "bitcast")
    cast.result.type = type(cast.result.type)(cast.result.type.shape, dsl.i64, cast.result.type.role)
    with pytest.raises(DslError, match="bitcast from f32 to i64"):
        verify_ir(m)
    f = Node("arg", (8,), dsl.f32, (), 0)
    bad = [Node("bitand", (8,), dsl.f32, (f, Node("const", (), dsl.i32, (), 1))),
           Node("shl", (8,), dsl.i32, (Node("arg", (8,), dsl.i32, (), 0), Node("arg", (8,), dsl.i32, (), 1))),
           Node("bitcast", (8,), dsl.i32, (Node("arg", (8,), dsl.bf16, (), 0),))]
    for expr, match in zip(bad, ("bitand needs integer operands", "shl needs a constant count", "bitcast from bf16")):
        m = _module()
        m.body.ops[0].regions[0].ops.append(Op("map", (), {"expr": expr, "into": None}))
        with pytest.raises(DslError, match=match):
            verify_ir(m)


SIG = {"N": 64}


def _generate(kernel, target, tensors):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


def _float_tensors(n=64):
    with torch.device("meta"):
        return {"x": torch.empty(n), "bits": torch.empty(n, dtype=torch.int32), "back": torch.empty(n),
                "expo": torch.empty(n, dtype=torch.int32), "pow2": torch.empty(n)}


@pytest.mark.parametrize("target", ["sm90", "sm100", "ascend950"])
def test_targets_print_tirs_bit_intrinsics(target):
    pytest.importorskip("tilelang")
    text = _generate(float_bits, target, _float_tensors())
    assert 'T.reinterpret(' in text and '"int32")' in text and '"float32")' in text
    assert "T.shift_right(" in text and "T.bitwise_and(" in text
    with torch.device("meta"):
        ints = _generate(int_bits, target, {"a": torch.empty(8, dtype=torch.int32),
                                            "out": torch.empty(7, 8, dtype=torch.int32)})
    assert all(f"T.{fn}(" in ints for fn in ("shift_right", "shift_left", "bitwise_and", "bitwise_or", "bitwise_xor"))
    with torch.device("meta"):
        byte = _generate(byte_bits, target, {"a": torch.empty(8, dtype=torch.uint8),
                                             "out": torch.empty(3, 8, dtype=torch.uint8)})
    assert 'T.cast(T.shift_left(' in byte  # u8 results are narrowed back: `(v << 4) >> 4` is `v & 15`


@dsl.kernel
def int_max(a: dsl.Tensor["N", "D", dsl.i32], out: dsl.Tensor["N", dsl.i32]):
    for i in dsl.grid(dsl.cdiv(a.N, 4)):
        dsl.store(out[i * 4], dsl.load(a[i * 4, 0], (4, 64)).max(axis=1))


@dsl.kernel
def narrow_max(a: dsl.Tensor["N", "D", dsl.f32], out: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(dsl.cdiv(a.N, 4)):
        dsl.store(out[i * 4], dsl.load(a[i * 4, 0], (4, 32)).max(axis=1))


def test_ascend_refuses_integer_and_part_register_reductions_naming_the_op():
    pytest.importorskip("tilelang")
    with torch.device("meta"):
        ints = {"a": torch.empty(8, 64, dtype=torch.int32), "out": torch.empty(8, dtype=torch.int32)}
        narrow = {"a": torch.empty(8, 32), "out": torch.empty(8)}
    with pytest.raises(UnsupportedError, match=r"reduce.max of a i32 tile has no Ascend lowering.*\(op reduce\)"):
        _generate(int_max, "ascend950", ints)
    with pytest.raises(UnsupportedError, match=r"reduce.max over 32 f32 elements.*256-byte VRegs"):
        _generate(narrow_max, "ascend950", narrow)
    for target in ("sm90", "sm100"):  # CUDA reduces both
        assert "T.reduce_max(" in _generate(int_max, target, ints)
        assert "T.reduce_max(" in _generate(narrow_max, target, narrow)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_bit_ops_compile_with_nvcc(target, tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    for kernel, tensors in ((float_bits, _float_tensors()),):
        module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
        art = build_module(kernel, module, get_target(target), knobs, workdir=str(tmp_path / kernel.name),
                           use_cache=False)
        assert art.files["cubin"].endswith(".cubin")
        cuda = art.stages["cuda"]
        assert "(*(int *)(&(" in cuda and "(*(float *)(&(" in cuda  # reinterpret: the bits, no conversion
        assert ">> 23" in cuda


@dsl.kernel
def int_wrap(a: dsl.Tensor["N", dsl.i32], out: dsl.Tensor["K", "N", dsl.i32]):
    for _ in dsl.grid(1):
        v = dsl.load(a[0], (8,))
        dsl.store(out[0, 0], v * 0x7FEB352D)
        dsl.store(out[1, 0], v + 0x7FFFFFFF)
        dsl.store(out[2, 0], v * -2073254261 - v)


def test_integer_add_and_multiply_wrap_at_the_tiles_width():
    """docs/dsl.md: i32 ``+ - *`` are mod 2^32 (the hash of kernels_spec/sample.py relies on it)."""
    vals = [0, 1, -1, 7, 2**31 - 1, -(2**31), 0x12345678, -0x5A5A5A5A]
    out = torch.zeros(3, 8, dtype=torch.int32)
    codegen.compile(int_wrap, "interpret")(a=torch.tensor(vals, dtype=torch.int32), out=out)

    def i32(x):
        return (x + 2**31) % 2**32 - 2**31

    assert out.tolist() == [[i32(v * 0x7FEB352D) for v in vals], [i32(v + 0x7FFFFFFF) for v in vals],
                            [i32(v * -2073254261 - v) for v in vals]]
