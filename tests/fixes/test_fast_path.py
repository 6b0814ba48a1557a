"""The fast intervention path (fixes.devices, .locations, .parametrizations, .trainer item 6) gives
pyvene's results, and no longer waits for the GPU.

Identity is checked against the unpatched code on the same model object: outputs bit for bit,
gradients to fp32 rounding (one Householder backward instead of three, see fixes.parametrizations).
"""

import collections
import contextlib
import sys
from pathlib import Path

import pytest
import pyvene
import torch

import helpers
import pyvene_dist
from pyvene_dist.testing import models

B, S = 3, 9


def _reft(seed=0, layers=(0, 1), component="block_output"):
    return models.reft_model(models.tiny_llama(seed=seed), layers=layers, component=component, seed=seed + 1)


def _forward_and_grads(reft, ids, unit_locations):
    for parameter in reft.interventions.parameters():
        parameter.grad = None
    _, out = reft({"input_ids": ids}, unit_locations=unit_locations, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in reft.interventions.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


LOCATION_FORMS = {
    "lists": lambda locations: {"sources->base": (None, locations.tolist())},
    "tensor": lambda locations: {"sources->base": (None, locations)},
    "broadcast int": lambda locations: {"base": 3},
    "broadcast list": lambda locations: {"base": [1, 5]},
}


@pytest.mark.parametrize("form", LOCATION_FORMS)
def test_patched_reft_matches_unpatched_pyvene(form):
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = torch.randint(S, (2, B, 3), generator=torch.Generator().manual_seed(1))
    reft = _reft()
    reft.train()
    stock_locations = LOCATION_FORMS["lists" if form == "tensor" else form](locations)  # stock takes no tensors
    logits, loss, grads = _forward_and_grads(reft, ids, stock_locations)
    with pyvene_dist.patched():
        fast_logits, fast_loss, fast_grads = _forward_and_grads(reft, ids, LOCATION_FORMS[form](locations))
    assert torch.equal(fast_logits, logits) and torch.equal(fast_loss, loss)
    assert fast_grads.keys() == grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_head_and_position_units_match_unpatched_pyvene():
    """``h.pos`` interchange on attention heads of GPT-2: the nested (heads, positions) locations."""
    import pyvene as pv

    base_model = models.tiny_gpt2()
    config = pv.IntervenableConfig(
        [{"layer": 1, "component": "head_attention_value_output", "unit": "h.pos"}],
        intervention_types=pv.VanillaIntervention,
    )
    model = pv.IntervenableModel(config, base_model)
    generator = torch.Generator().manual_seed(0)
    base, source = (torch.randint(models.VOCAB_SIZE, (2, 6), generator=generator) for _ in range(2))
    heads, positions = [[1, 3], [0, 2]], [[4, 5], [0, 3]]
    locations = {"sources->base": ([(heads, positions)], [(heads, positions)])}
    _, stock = model({"input_ids": base}, [{"input_ids": source}], unit_locations=locations)
    with pyvene_dist.patched():
        _, fast = model({"input_ids": base}, [{"input_ids": source}], unit_locations=locations)
    _, plain = model({"input_ids": base}, [{"input_ids": base}], unit_locations=locations)
    assert not torch.equal(stock.logits, plain.logits)  # the interchange does something here
    assert torch.equal(fast.logits, stock.logits)


def _pyvene_calls(step) -> collections.Counter:
    """The Python functions of pyvene's own code (its package's files) that ``step()`` calls, by name."""
    folder = str(Path(pyvene.__file__).parent)
    found = collections.Counter()

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(folder):
            found[frame.f_code.co_name] += 1

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return found


def test_after_the_first_call_pyvene_runs_no_python_on_the_way(patched):
    """The path the fix takes, on the CPU: the first call builds the model's plan (hooks registered once), and
    every later forward, training step and every-token generate runs none of pyvene's Python (stock pyvene's
    forward of two interventions makes 48 calls into it: state resets, hook registrations, index building)."""
    reft = _reft()
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = {"sources->base": (None, [[[1, 4, 7]] * B] * 2)}
    reft({"input_ids": ids}, unit_locations=locations)  # the plan is built here

    def forward():
        with torch.no_grad():
            reft({"input_ids": ids}, unit_locations=locations)

    def train():
        reft({"input_ids": ids}, unit_locations=locations, labels=ids)[1].loss.backward()

    def generate():
        reft.generate({"input_ids": ids[:1]}, max_new_tokens=3, do_sample=False)

    for step in (forward, train, generate):
        calls = _pyvene_calls(step)
        assert not calls, f"{step.__name__}: {sum(calls.values())} calls into pyvene: {dict(calls.most_common(6))}"


def test_an_entry_in_front_of_another_forward_than_0_1_8s_sends_every_call_there(patched):
    """The entry does the work of pyvene 0.1.8's forward: in front of a forward with another source (another
    release's), it sends each call to that forward, and the model's plan is not built."""
    from pyvene_dist.fixes import fast_path

    seen = []

    def forward(self, base, **kwargs):  # another release's forward
        seen.append(kwargs["unit_locations"])
        return "its result"

    reft = _reft()
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = {"sources->base": (None, [[[1, 4, 7]] * B] * 2)}
    assert fast_path._forward_entry(forward)(reft, {"input_ids": ids}, unit_locations=locations) == "its result"
    assert seen == [locations] and fast_path.plan_of(reft) is None


@pytest.mark.gpus(1)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_checkpointed_training_on_a_gpu_matches_training_without(attention):
    """On a GPU, backward (and so the recomputation of checkpointed layers, interventions included) runs
    on the autograd engine's device thread: the rotation must be built there as in the forward, or
    non-reentrant checkpointing raises ``CheckpointError: Recomputed values ... different metadata``."""
    helpers.patch()
    try:
        results = []
        for checkpointing in (False, True):
            reft = _reft(layers=(0, 1))
            reft.model.config._attn_implementation = attention
            if checkpointing:
                reft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            reft.set_device("cuda:0")
            reft.train()
            ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0)).cuda()
            results.append(_forward_and_grads(reft, ids, {"base": 2}))
        (logits, loss, grads), (ckpt_logits, ckpt_loss, ckpt_grads) = results
        torch.testing.assert_close(ckpt_loss, loss, rtol=1e-5, atol=0)
        for name in grads:
            torch.testing.assert_close(ckpt_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    finally:
        pyvene_dist.unpatch()


def test_data_parallel_replicas_build_their_own_rotation():
    """PyTorch's parametrization cache is keyed by the module the parametrization was registered on,
    and replicas share its class: two replicas applied at the same time must each use their own weight
    (on GPUs they live on different devices; here their weights differ)."""
    import copy
    import threading

    from pyvene.models import modeling_utils

    reft = _reft(layers=(0,))
    original = next(iter(reft.interventions.values()))
    replicas = [copy.deepcopy(original) for _ in range(2)]
    with torch.no_grad():
        replicas[1].rotate_layer.parametrizations.weight.original.mul_(-1)
    base = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    expected = [modeling_utils.do_intervention(base, None, replica, None) for replica in replicas]  # unpatched
    barrier = threading.Barrier(2, timeout=30)
    for replica in replicas:
        replica._is_replica = True  # as torch.nn.parallel.replicate marks them
        replica.learned_source.register_forward_pre_hook(lambda *_: [barrier.wait()] and None)  # both mid-way
    outputs = [None, None]

    def apply(i):
        outputs[i] = modeling_utils.do_intervention(base, None, replicas[i], None)  # looked up once patched

    helpers.patch()
    try:
        threads = [threading.Thread(target=apply, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        pyvene_dist.unpatch()
    assert not torch.equal(expected[0], expected[1])
    for i in range(2):
        assert outputs[i] is not None and torch.equal(outputs[i], expected[i]), f"replica {i} used another's weight"


class _NoLists(torch.Tensor):
    """A tensor that refuses to become lists, as a stand-in for a GPU tensor whose .tolist() stalls the host."""

    def tolist(self):
        raise AssertionError("intervention_locations were copied to the host with .tolist()")


@pytest.mark.parametrize("trainer_class", ["ReftTrainer", "ReftTrainerForSequenceClassification"])
def test_pyreft_trainers_pass_collated_locations_as_tensors(patched, trainer_class):
    pyreft = models.import_pyreft()
    classifier = trainer_class == "ReftTrainerForSequenceClassification"
    base = models.tiny_llama_classifier() if classifier else models.tiny_llama()
    reft = models.reft_model(base, layers=(0, 1))
    trainer = object.__new__(getattr(pyreft, trainer_class))  # compute_loss reads only trainer.model
    trainer.model = reft
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = torch.randint(S, (B, 2, 3), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(models.NUM_LABELS, (B,)) if classifier else ids
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    loss = trainer.compute_loss(reft, {**batch, "intervention_locations": locations.as_subclass(_NoLists)})
    with _unpatched():
        stock = trainer.compute_loss(reft, {**batch, "intervention_locations": locations})
    assert torch.equal(loss.as_subclass(torch.Tensor), stock)


@contextlib.contextmanager
def _unpatched():
    pyvene_dist.unpatch()
    try:
        yield
    finally:
        helpers.patch()


@pytest.mark.gpus(1)
def test_steady_state_step_never_waits_for_the_gpu():
    """The training step pyreft's trainer runs (locations collated on the GPU) and a no-grad forward
    with host lists make no host-device synchronisation once warm, in pyvene, pyreft or pyvene_dist.
    (transformers syncs once itself, to see that an all-ones attention mask can be skipped.)"""
    import os

    from pyvene_dist.testing.syncs import host_device_syncs, innermost_outside_torch
    pyreft = models.import_pyreft()
    with pyvene_dist.patched():
        device = torch.device("cuda:0")
        reft = _reft(layers=(0, 1))
        reft.set_device(device)
        optimizer = torch.optim.AdamW(reft.get_trainable_parameters(), lr=1e-3)
        trainer = object.__new__(pyreft.ReftTrainer)
        ids = torch.randint(models.VOCAB_SIZE, (B, S), device=device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                 "intervention_locations": torch.randint(S, (B, 2, 3), device=device)}
        listed = {"sources->base": (None, [[[1, 2]] * B] * 2)}

        def step():
            trainer.compute_loss(reft, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                reft({"input_ids": ids}, unit_locations=listed)

        step()
        stacks = host_device_syncs(step)
        ours = [stack for stack in stacks if any(f"{os.sep}{name}{os.sep}" in innermost_outside_torch(stack).filename
                                                 for name in ("pyvene", "pyreft", "pyvene_dist"))]
        print(f"{len(stacks)} syncs in the step, {len(ours)} of them asked for by pyvene, pyreft or pyvene_dist")
        assert not ours, "host-device syncs:\n" + "\n".join("".join(stack.format()[-6:]) for stack in ours)


def _graphable_reft(device):
    """The tiny ReFT model on ``device`` as the base model itself captures: sdpa attention, no cache. (transformers'
    eager attention copies a host scalar into its mask at every forward, which no capture allows.)"""
    reft = _reft(layers=(0, 1))
    reft.model.config.use_cache = False
    reft.model.config._attn_implementation = "sdpa"
    reft.set_device(device)
    return reft


def _static_inputs(device, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=generator).to(device)
    return ids, torch.randint(S, (2, B, 3), generator=generator).to(device)


@pytest.mark.gpus(1)
def test_reft_forward_is_captured_and_replayed_by_cuda_graphs():
    """The no-grad forward, with locations as a GPU tensor, captures into one CUDA graph: a capture fails at
    the first host-device sync or host-list location, as stock pyvene's ``.tolist()`` makes. Replays read
    new ids and new locations from the captured buffers and give the eager forward's logits."""
    device = torch.device("cuda:0")
    with pyvene_dist.patched():
        reft = _graphable_reft(device)
        reft.eval()
        ids, locations = _static_inputs(device, seed=0)

        def forward():
            return reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})[1].logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):  # warm up outside the capture, as CUDA graphs require
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            captured = forward()
        for seed in (1, 2, 3):
            new_ids, new_locations = _static_inputs(device, seed)
            ids.copy_(new_ids)
            locations.copy_(new_locations)
            graph.replay()
            with torch.no_grad():
                eager = forward()
            assert not torch.equal(eager, _base_logits(reft, ids)), "the interventions changed nothing"
            torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)


def _base_logits(reft, ids):
    with torch.no_grad():
        return reft.model(input_ids=ids).logits


@pytest.mark.gpus(1)
def test_reft_training_step_is_captured_and_replayed_by_cuda_graphs():
    """The whole training step (forward, backward, AdamW with ``capturable=True``) as one CUDA graph, replayed on
    new batches, trains as the same steps run eagerly on a twin of the model."""
    device = torch.device("cuda:0")
    with pyvene_dist.patched():
        twins = []
        for _ in range(2):
            reft = _graphable_reft(device)
            reft.train()
            twins.append((reft, torch.optim.AdamW(reft.get_trainable_parameters(), lr=1e-2, capturable=True)))
        (graphed, graphed_optimizer), (eager, eager_optimizer) = twins
        ids, locations = _static_inputs(device, seed=0)

        def step(reft, optimizer):
            _, out = reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)}, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            return out.loss.detach()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up steps, which train: the twin takes the same ones
                step(graphed, graphed_optimizer)
        torch.cuda.current_stream().wait_stream(side)
        for _ in range(3):
            step(eager, eager_optimizer)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = step(graphed, graphed_optimizer)
        for seed in (1, 2, 3):
            new_ids, new_locations = _static_inputs(device, seed)
            ids.copy_(new_ids)
            locations.copy_(new_locations)
            graph.replay()
            torch.testing.assert_close(loss, step(eager, eager_optimizer), rtol=1e-5, atol=0)
        weights = dict(eager.interventions.named_parameters())
        for name, parameter in graphed.interventions.named_parameters():
            torch.testing.assert_close(parameter, weights[name], rtol=1e-5, atol=1e-6, msg=name)
