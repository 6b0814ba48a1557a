"""Gradient checkpointing with any number of forwards before a backward: each recomputation applies the
interventions of the forward that recorded it, and the base model called directly sees none.

Every case runs the same steps on the same model twice, without checkpointing (the reference) and with
it, and compares what came out: intervention gradients and any logits the steps return. With a GPU
the cases run there too (backward, and so the recomputation, then runs on the autograd engine's device
thread): ``pytest tests/fixes/test_gradient_checkpointing_forwards.py -k cuda``.
"""

import warnings

import pytest
import torch

from pyvene_dist.testing import ParityCase

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.2x renames gradient_* to activation_*

MODES = ["reentrant", "non-reentrant"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpus(1))]
BATCH, LENGTH = 4, 8


def _batch(seed: int, device):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(97, (BATCH, LENGTH), generator=generator).to(device)
    locations = torch.randint(LENGTH, (2, BATCH, 1), generator=generator).tolist()  # 2 interventions, 1 position
    return input_ids, locations


def _policy(model, input_ids, locations):
    """What pyreft's trainers do: the intervened forward through the ReFT model."""
    _, out = model({"input_ids": input_ids}, unit_locations={"sources->base": (None, locations)}, labels=input_ids)
    return out


def _log_probs(logits, input_ids):
    return logits.log_softmax(-1).gather(-1, input_ids.unsqueeze(-1)).squeeze(-1).sum(-1)


def dpo(model, device):
    """pyreft's DPO trainer: policy forward, reference forward through ``model.model`` under no_grad, one
    backward of the DPO loss."""
    input_ids, locations = _batch(1, device)
    policy = _policy(model, input_ids, locations).logits
    with torch.no_grad():
        reference = model.model(input_ids=input_ids, use_cache=False).logits
    margin = _log_probs(policy, input_ids) - _log_probs(reference, input_ids)
    (-torch.nn.functional.logsigmoid(margin[: BATCH // 2] - margin[BATCH // 2:])).mean().backward()
    return {"reference logits": reference}


def two_forwards(model, device):
    """Chosen and rejected as two forwards with their own locations, one backward of a loss of both."""
    (chosen, chosen_at), (rejected, rejected_at) = _batch(1, device), _batch(2, device)
    first, second = _policy(model, chosen, chosen_at), _policy(model, rejected, rejected_at)
    (first.loss - 0.5 * second.loss + (first.logits - second.logits).pow(2).mean()).backward()
    return {}


def no_grad_between(model, device):
    """A no_grad forward (other inputs, other locations) between a training forward and its backward."""
    loss = _policy(model, *_batch(1, device)).loss
    with torch.no_grad():
        between = _policy(model, *_batch(2, device)).logits
    loss.backward()
    return {"logits between": between}


def eval_between(model, device):
    """An evaluation forward (eval mode, grad on) between a training forward and its backward."""
    loss = _policy(model, *_batch(1, device)).loss
    model.eval()
    between = _policy(model, *_batch(2, device)).logits.detach()
    model.train()
    loss.backward()
    return {"logits between": between}


def accumulation(model, device):
    """Gradient accumulation over two DPO micro-batches, each with a base-model reference forward."""
    returned = {}
    for step in range(2):
        input_ids, locations = _batch(10 + step, device)
        policy = _policy(model, input_ids, locations)
        with torch.no_grad():
            reference = model.model(input_ids=input_ids, use_cache=False).logits
        (policy.loss + (policy.logits - reference).pow(2).mean()).backward()
        returned[f"reference logits {step}"] = reference
    return returned


def retain_graph(model, device):
    """Two backwards through one forward's graph, the first keeping it."""
    loss = _policy(model, *_batch(1, device)).loss
    loss.backward(retain_graph=True)
    loss.backward()
    return {}


#: Each pattern at components inside transformers 5's checkpointed region (``mlp_output``,
#: ``attention_output``); the base-model calls also at ``block_output``, a hook on the layer itself,
#: outside the region: there the forward's own hooks would act in the base model's forward.
CASES = [
    *[(pattern, component) for pattern in (dpo, accumulation) for component in ("block_output", "mlp_output")],
    *[(pattern, component) for pattern in (two_forwards, no_grad_between, eval_between)
      for component in ("mlp_output", "attention_output")],
    (retain_graph, "mlp_output"),
]


def _run(pattern, component, checkpointing, device):
    model = ParityCase(component=component, checkpointing=checkpointing).build()
    model.set_device(device)
    model.train()
    returned = pattern(model, device)
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return {**returned, **{f"grad of {name}": g for name, g in grads.items()}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern, component", [pytest.param(p, c, id=f"{p.__name__}-{c}") for p, c in CASES])
def test_checkpointed_equals_plain(patched, pattern, component, mode, device):
    reference = _run(pattern, component, None, device)
    checkpointed = _run(pattern, component, mode, device)
    assert reference.keys() == checkpointed.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(checkpointed[name], expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_checkpointing_without_a_checkpoint_function_is_refused(patched):
    """A module flagged as checkpointing that calls torch.utils.checkpoint itself (transformers' format
    before 4.35): its recomputation cannot be told apart from another forward's, so the forward raises."""
    from torch.utils.checkpoint import checkpoint

    class OldFormatCheckpointing(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer
            self.gradient_checkpointing = True

        def forward(self, *args, **kwargs):
            return checkpoint(self.layer.__call__, *args, use_reentrant=False, **kwargs)

    model = ParityCase(component="mlp_output").build()
    layers = model.model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = OldFormatCheckpointing(layer)
    model.train()
    with pytest.raises(RuntimeError, match="OldFormatCheckpointing has gradient_checkpointing on but no "
                                           "_gradient_checkpointing_func"):
        _policy(model, *_batch(1, "cpu"))


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_equals_plain_under_accelerate_mixed_precision(patched, mode):
    """HF Trainer's ``--bf16`` goes through accelerate's native mixed precision, which rebinds the model's
    forward from its function: ``model.forward = MethodType(autocast(model.forward.__func__), model)``.
    The interventions must still follow each recomputation (without the fix: reentrant checkpointing gives
    the interventions no gradient, non-reentrant raises torch's CheckpointError)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def prepared(checkpointing):
        AcceleratorState._reset_state(True)
        model = ParityCase(component="mlp_output", checkpointing=checkpointing).build()
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
        assert "forward" in vars(model), "accelerate no longer rebinds forward: this test tests nothing"
        model.train()
        _policy(model, *_batch(1, "cpu")).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    try:
        reference, checkpointed = prepared(None), prepared(mode)
    finally:
        AcceleratorState._reset_state(True)
    assert reference and reference.keys() == checkpointed.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(checkpointed[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
