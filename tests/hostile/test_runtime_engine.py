"""Non-finite logits, bad dtypes and missing devices: a clear error, never a sampled garbage token."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from duotile.runtime.device import DeviceError, available_devices, resolve_device
from duotile.runtime.engine import LLM, GenerationError
from duotile.runtime.sampler import SamplingParams, sample

from .runtime_support import tiny


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny("v4-tiny")))


def test_all_nan_logits_are_refused_not_sampled_as_token_0():
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"logits: not all finite at position 7 \(5 NaN of 5\)"):
            sample(torch.full((5,), float("nan")), SamplingParams(temperature=temperature), seed=1, position=7)


def test_non_finite_logits_fail_that_request_and_the_others_finish(llm, monkeypatch):
    """Request 1's logits turn NaN at its third sampled token; request 0 runs to the end."""
    forward = llm.model.forward
    target = None

    def poisoned(chunks, all_logits=False):
        out = forward(chunks, all_logits)
        for i, chunk in enumerate(chunks):
            if chunk.cache is target[0] and target[1].cache.num_tokens >= 5:
                out[i] = torch.full_like(out[i], float("nan"))
        return out

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    seqs = [llm.add_request([1, 2, 3], params), llm.add_request([4, 5, 6], params)]
    llm.scheduler.schedule(llm.model.new_cache)  # admit both so their caches exist
    target = (seqs[1].cache, seqs[1])
    monkeypatch.setattr(llm.model, "forward", poisoned)
    while llm.scheduler.has_work:
        llm.step()
    assert seqs[0].finish_reason == "length" and len(seqs[0].output) == 6
    assert seqs[1].finish_reason == "error" and len(seqs[1].output) == 2
    assert seqs[1].error.startswith(f"request {seqs[1].request_id}: ") and "NaN" in seqs[1].error
    assert "position 5" in seqs[1].error and "not sampled" in seqs[1].error


def test_generate_raises_naming_the_request_and_keeps_the_outputs(llm, monkeypatch):
    forward = llm.model.forward

    def inf_after_prompt(chunks, all_logits=False):
        out = forward(chunks, all_logits)
        return [torch.full_like(o, float("inf")) if c.cache.num_tokens > 3 else o for c, o in zip(chunks, out)]

    monkeypatch.setattr(llm.model, "forward", inf_after_prompt)
    with pytest.raises(GenerationError) as err:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert "infinite values" in str(err.value) and "position 4" in str(err.value)
    (out,) = err.value.outputs
    assert out.finish_reason == "error" and len(out.token_ids) == 1 and out.error == str(err.value)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), raise_on_error=False)
    assert outs[0].finish_reason == "error"


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "bfloat16"])
def test_non_float_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"^dtype: .* is not supported; the activation dtype must be one of"):
        LLM(str(tiny("v4-tiny")), dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_sentence_listing_the_devices():
    with pytest.raises(DeviceError) as err:
        LLM(str(tiny("v4-tiny")), device="cuda")
    msg = str(err.value)
    assert msg.startswith("device: cuda is not available") and "this machine has cpu" in msg and "\n" not in msg


@pytest.mark.parametrize(("name", "words"), [("tpu", "unknown device"), ("cuda:x", "bad device index"),
                                             ("cpu", None)])
def test_device_names(name, words):
    if words is None:
        assert resolve_device(name) == torch.device("cpu") and available_devices()[0] == "cpu"
        return
    with pytest.raises(DeviceError, match=words):
        resolve_device(name)


def test_npu_without_torch_npu_says_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails even where it is installed
    with pytest.raises(DeviceError, match=r"^device: npu needs the torch_npu package .* not installed"):
        resolve_device("npu")


def test_npu_is_accepted_where_torch_npu_imports(tmp_path):
    """A stand-in torch_npu (renames PyTorch's private backend to npu, reports one device), in a fresh
    interpreter so the rename does not leak into this one."""
    (tmp_path / "torch_npu.py").write_text(textwrap.dedent("""
        import types
        import torch
        torch.utils.rename_privateuse1_backend("npu")
        module = types.ModuleType("torch.npu")
        module.is_available = lambda: True
        module.device_count = lambda: 1
        torch._register_device_module("npu", module)
    """))
    code = ("from duotile.runtime.device import resolve_device, available_devices\n"
            "print(resolve_device('npu'), resolve_device('npu:0'), available_devices())\n"
            "try:\n    resolve_device('npu:1')\nexcept ValueError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "npu:0 npu:0 ['cpu', 'npu:0']"
    assert lines[1].startswith("device: npu:1 does not exist (1 npu device(s))")
