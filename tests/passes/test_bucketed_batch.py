"""A batch dimension that is bucketed: a config per power-of-two bucket of T (the activation
quantisers: a decode step's 4 x 32 tiles left a 4,096-token prefill chunk at 0.3-0.45 TB/s on the
H200, where the cost model, asked at that size, takes 16 x 256). Allowed only where no bit of a row
depends on the config: every reduction a max or a min."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.choose_config import explain_choice
from duotile.kernels_spec import load_all
from duotile.passes.check_batch_invariance import check_batch_invariance

SPECS = load_all()


@dsl.kernel(batch_dim="T", bucketed=("T",))
def _bucketed_rowsum(x: dsl.Tensor["T", "D", dsl.f32], y: dsl.Tensor["T", dsl.f32], *,
                     ROWS: dsl.Tunable = dsl.choice(1, 2, 4)):
    for t in dsl.grid(dsl.cdiv(x.T, ROWS)):
        dsl.store(y[t * ROWS], dsl.load(x[t * ROWS, 0], (ROWS, 64)).sum(axis=1))


def test_a_bucketed_batch_with_a_sum_is_refused_naming_the_line():
    with pytest.raises(dsl.DslError, match=r"buckets its batch dimension T .* reduce.sum") as err:
        check_batch_invariance(_bucketed_rowsum, {"x": dsl.f32, "y": dsl.f32}, constants={})
    assert "test_bucketed_batch.py" in str(err.value)


@pytest.mark.parametrize("name", ["quantize", "quantize_fp4", "swiglu_quant"])
def test_the_quantisers_choose_larger_tiles_for_a_prefill_chunk_than_for_a_decode_step(name):
    pytest.importorskip("tilelang")
    spec = SPECS[name]
    shape = next(s for s in spec.model_shapes if s.startswith("v41/") and s.endswith("prefill4096"))
    configs = {}
    for t in (1, 4096):
        case = {**spec.model_shapes[shape], "T": t}
        sig = spec.kernel.bind(spec.meta_inputs(case))
        chosen, _, _ = explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))
        configs[t] = {**spec.kernel.resolve_config(None), **(chosen or {})}
    tile = {t: c["ROWS"] * c["BLOCKS"] for t, c in configs.items()}
    assert tile[4096] >= 16 * tile[1], configs


@pytest.mark.parametrize("name", ["quantize", "quantize_fp4"])
def test_a_row_is_bitwise_the_same_under_every_config(name):
    spec = SPECS[name]
    case = next(c for c in spec.cases.values() if c.get("T", 0) >= 5)
    base = spec.make_inputs(case, torch.device("cpu"), seed=11)
    results = []
    for rows, blocks in ((1, 1), (4, 2), (16, 8)):
        inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in base.items()}
        codegen.compile(spec.kernel, "interpret", config={"ROWS": rows, "BLOCKS": blocks},
                        constants=spec.constants_of(case))(**inputs)
        results.append({o: inputs[o] for o in spec.outputs})
    for other in results[1:]:
        assert all(torch.equal(other[o], results[0][o]) for o in spec.outputs)
