"""torch.compile traces the intervened forward whole (fixes.fast_path): no graph break in the intervention
path, and the compiled training step equals the eager one. Before the plan, the same step broke into 16
graphs (the locations' value checks, the scatter's ``.tolist()``, the hooks registered inside the forward)."""

import pytest
import torch

from pyvene_dist.testing import models

B, S = 2, 9


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh, and leaves no compiled code holding its model alive for later tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_training_step_compiles_whole_and_equals_eager(patched, attention):
    reft = models.reft_model(models.tiny_llama(seed=0, attention=attention), layers=(0, 1), seed=1)
    reft.train()
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = torch.randint(S, (2, B, 3), generator=torch.Generator().manual_seed(1))

    def step(ids, locations):
        _, out = reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)}, labels=ids)
        return out.loss

    def loss_and_grads(run):
        for parameter in reft.interventions.parameters():
            parameter.grad = None
        loss = run(ids, locations)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in reft.interventions.named_parameters()}

    explained = torch._dynamo.explain(step)(ids, locations)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    loss, grads = loss_and_grads(step)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    with torch.no_grad():
        assert not torch.equal(reft.model(input_ids=ids, labels=ids).loss, loss)  # the interventions act
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert grads and grads.keys() == compiled_grads.keys()
    for name in grads:  # the compiled graph builds the rotation at each read: rounding apart
        torch.testing.assert_close(compiled_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)



def test_a_model_compiled_before_its_first_call_builds_its_plan_outside_the_graph(patched):
    """Where the first call is compiled (HF Trainer's ``torch_compile=True``), the plan is built there: its
    hook registrations, traced, broke the graph at ``RemovableHandle``'s class counter (``setattr() on
    unsupported type``; on the H200's torch 2.11 dynamo could not resume there: 'Failed to handle graph break
    gracefully. Skipping the function and falling back to eager'). The build is left to eager code, so the
    only break is the call that builds it."""
    from torch._dynamo.utils import counters

    reft = models.reft_model(models.tiny_llama(seed=0), layers=(0, 1), seed=1)
    reft.train()
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = torch.randint(S, (2, B, 3), generator=torch.Generator().manual_seed(1)).tolist()  # as pyreft

    def step(ids, locations):
        _, out = reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)}, labels=ids)
        return out.loss

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(3):
        compiled(ids, locations).backward()
    reasons = list(counters["graph_break"])
    assert reasons and all("torch.compiler.disable" in reason and "_build" in reason for reason in reasons), reasons


def test_the_compiled_forward_guards_on_the_model_not_on_other_models(patched):
    """The compiled step finds the model's plan from the model. Found in a process-wide weak map, dynamo
    guarded on the model's position among the map's keys: a guard that changed with every model made or
    collected elsewhere, and failed to build (``IndexError``, CI at 68ad82a) when one was collected during
    the compile."""
    others = [models.reft_model(models.tiny_llama(seed=0), layers=(0,), seed=2) for _ in range(2)]
    reft = models.reft_model(models.tiny_llama(seed=0), layers=(0, 1), seed=1)
    ids = torch.randint(models.VOCAB_SIZE, (B, S), generator=torch.Generator().manual_seed(0))
    locations = torch.randint(S, (2, B, 3), generator=torch.Generator().manual_seed(1))

    def step(ids, locations):
        _, out = reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)}, labels=ids)
        return out.loss

    step(ids, locations)  # the plan built, as by a first eager step
    explained = torch._dynamo.explain(step)(ids, locations)
    guards = [str(guard).split("\n")[0] for guard in explained.out_guards]
    on_the_map = [guard for guard in guards if "MODELS." in guard]  # the map's contents (_registry.MODELS)
    assert guards and not on_the_map, on_the_map
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    expected = compiled(ids, locations)
    del others  # collected after the compile: its guards do not name them
    import gc

    gc.collect()
    torch.testing.assert_close(compiled(ids, locations), expected, rtol=0, atol=0)
