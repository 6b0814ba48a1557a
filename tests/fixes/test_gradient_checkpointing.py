"""Gradient checkpointing: interventions survive the recomputation, at every component, both modes."""

import functools
import warnings

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, train

COMPONENTS = ["block_output", "mlp_output", "attention_output", "mlp_input", "attention_input", "block_input"]
MODES = ["reentrant", "non-reentrant"]

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.2x renames gradient_* to activation_*


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("component", COMPONENTS)
def test_checkpointed_training_equals_plain_training(patched, component, mode):
    plain = ParityCase(component=component, steps=2)
    checkpointed = ParityCase(component=component, steps=2, checkpointing=mode)
    assert_parity(train(plain, "single"), train(checkpointed, "single"), plain.tolerance)


@pytest.mark.parametrize("model", ["gpt2"])
def test_gpt2_components_inside_the_layer(patched, model):
    for component in ("mlp_output", "attention_output"):
        plain = ParityCase(model=model, component=component, steps=2)
        assert_parity(train(plain, "single"), train(ParityCase(model=model, component=component, steps=2,
                                                               checkpointing="non-reentrant"), "single"),
                      plain.tolerance)


def test_hooks_are_gone_after_backward_and_after_no_grad(patched):
    model = ParityCase(component="mlp_output", checkpointing="non-reentrant").build()
    model.train()
    baseline = helpers.hook_counts(model)
    batch = ParityCase().batches()[0]
    arguments = dict(base={"input_ids": batch["input_ids"]},
                     unit_locations={"sources->base": (None, batch["locations"].tolist())}, labels=batch["labels"])
    loss = model(**arguments)[1].loss
    assert helpers.hook_counts(model) != baseline  # kept for the recomputation
    loss.backward()
    assert helpers.hook_counts(model) == baseline
    with torch.no_grad():
        model(**arguments)
    assert helpers.hook_counts(model) == baseline
    model(**arguments)  # a forward whose backward never comes: its hooks go with its graph
    model.eval()
    with torch.no_grad():
        model(**arguments)
    assert helpers.hook_counts(model) == baseline


@pytest.mark.parametrize("component", ["block_output", "block_input"])
def test_call_boundary_as_transformers_4_checkpoints_it(patched, component):
    """transformers 4.x and 5.x up to at least 5.17 checkpoint a layer's __call__, so hooks on the layer
    itself are inside too: the forward hook of block_output, the pre-hook of block_input, whose in-place
    write then lands on the checkpoint's input (the same tensor in the forward and its recomputation)."""
    from torch.utils.checkpoint import checkpoint

    case = ParityCase(component=component, steps=2)
    reference = train(case, "single")

    class CheckpointedCall(torch.nn.Module):
        """What transformers 4.x's model forward does for each layer, through the attributes it sets."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer
            self.gradient_checkpointing = True
            self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

        def forward(self, *args, **kwargs):
            return self._gradient_checkpointing_func(self.layer.__call__, *args, **kwargs)

    original_build = ParityCase.build

    def build_with_call_checkpointing(self):
        model = original_build(self)  # pyvene's hooks are bound to the real layers ...
        model.model.config.use_cache = False  # as transformers turns it off for checkpointing: no cache to refill
        layers = model.model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = CheckpointedCall(layer)  # ... which now run inside checkpoint(layer.__call__)
        return model

    ParityCase.build = build_with_call_checkpointing
    try:
        candidate = train(case, "single")
    finally:
        ParityCase.build = original_build
    assert_parity(reference, candidate, case.tolerance)


def test_interchange_intervention_with_sources_under_checkpointing(patched):
    import pyvene as pv

    from pyvene_dist.testing.models import tiny_llama

    def build(checkpointed):
        torch.manual_seed(0)
        config = pv.IntervenableConfig([{"layer": 1, "component": "mlp_output",
                                         "intervention_type": pv.RotatedSpaceIntervention}])
        model = pv.IntervenableModel(config, tiny_llama())
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    generator = torch.Generator().manual_seed(1)
    base, source = (torch.randint(97, (4, 8), generator=generator) for _ in range(2))
    grads = []
    for checkpointed in (False, True):
        model = build(checkpointed)
        _, out = model({"input_ids": base}, [{"input_ids": source}],
                       unit_locations={"sources->base": ([[[3]] * 4], [[[5]] * 4])}, labels=base)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.get_trainable_parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


STRATEGY_CASES = [
    pytest.param("ddp", "non-reentrant", id="ddp-non-reentrant"),
    pytest.param("ddp", "reentrant", id="ddp-reentrant"),
    pytest.param("fsdp2", "non-reentrant", id="fsdp2-non-reentrant"),
    pytest.param("zero3", "non-reentrant", id="zero3-non-reentrant"),
]


@pytest.mark.world_size(2, timeout=600)
@pytest.mark.parametrize("strategy, mode", STRATEGY_CASES)
def test_checkpointing_under_strategies_matches_plain_single(strategy, mode):
    helpers.patch()
    plain = ParityCase(component="mlp_output")
    candidate = train(ParityCase(component="mlp_output", checkpointing=mode), strategy)
    if dist.get_rank() == 0:
        assert_parity(train(plain, "single"), candidate, plain.tolerance)
