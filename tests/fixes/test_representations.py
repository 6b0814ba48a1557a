"""A representation naming a layer the model lacks fails at setup, saying what exists (fixes.representations)."""

import pytest

from pyvene_dist.testing.models import reft_model, tiny_llama


def test_a_layer_the_model_lacks_is_named_at_setup(patched):
    with pytest.raises(ValueError, match=r"layer=7 component='block_output' names no module of LlamaForCausalLM "
                                         r".*LlamaForCausalLM has 2 layers \(0 to 1\)"):
        reft_model(tiny_llama(), layers=(0, 7))
