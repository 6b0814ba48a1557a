"""LoReFT's ``load_state_dict`` of pyreft's compact form writes into the existing parameters, exactly, also a bf16
rotation on the CPU (fixes.checkpoints.loreft_load).

pyreft 0.1.0 built a new rotation layer (an optimizer made before kept training the old one), and a bf16 rotation
failed on the CPU: ``NotImplementedError: "geqrf_cpu" not implemented for 'BFloat16'``.
"""

import torch

from pyvene_dist.testing import models


def test_a_compact_bf16_rotation_loads_into_the_existing_parameter(patched):
    """``load_state_dict`` with pyreft's compact form (what ``load_intervention`` of a stock folder does): the
    bf16 rotation becomes the weight exactly, written into the same ``Parameter`` in its own dtype."""
    source = models.reft_model(models.tiny_llama(), rank=2)
    target = models.reft_model(models.tiny_llama(), rank=2, seed=3)
    for key, intervention in target.interventions.items():
        original = intervention.rotate_layer.parametrizations.weight.original
        state = {name: value.to(torch.bfloat16) for name, value in source.interventions[key].state_dict().items()}
        intervention.load_state_dict(state)
        assert intervention.rotate_layer.parametrizations.weight.original is original
        assert original.dtype == torch.float32  # the parameter's dtype, whatever the saved one
        torch.testing.assert_close(intervention.rotate_layer.weight, state["rotate_layer"].float(), rtol=0, atol=0)
        torch.testing.assert_close(intervention.learned_source.weight, state["weight"].float(), rtol=0, atol=0)

