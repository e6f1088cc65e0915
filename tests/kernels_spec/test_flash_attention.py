"""flash_attention's reference (the kernel itself is tested with the others in test_interpret.py)."""

from __future__ import annotations

import torch

from duotile.kernels_spec import get


def test_reference_in_parts_is_the_whole_reference_on_the_cpu():
    """flash_attention's reference runs one (batch, head) at a time (``reference_parts``): the
    same values as the whole batched einsum."""
    spec = get("flash_attention")
    case = {"B": 2, "H": 3, "S": 33, "D": 64, "causal": True}
    inputs = spec.make_inputs(case, torch.device("cpu"), 1)
    whole, parts = spec.run_reference(inputs, case, whole=True), spec.run_reference(inputs, case)
    for o in spec.outputs:
        torch.testing.assert_close(parts[o], whole[o].float(), atol=1e-5, rtol=1e-5, msg=o)
