"""The plan (fixes.fast_path) gives stock pyvene's results: a grid of interventions, layers, location forms
and batch sizes, each against unpatched pyvene on the same model object (outputs bit for bit, gradients to
fp32 rounding), with pyvene's general path shown unused; and the calls it does not take go the general way.
"""

import contextlib
import itertools

import pytest
import torch

import pyvene_dist
from pyvene_dist.fixes.fast_path import plan_of
from pyvene_dist.testing import models

S = 9
INTERVENTIONS = ("LoreftIntervention", "DireftIntervention")  # a rotation's parametrization, and none
LAYERS = ((0,), (0, 1), (1, 1))  # (1, 1): two interventions hooked on one module, applied in pyvene's order
BATCHES = (1, 3)
FORMS = {  # what the caller passes, from [interventions, batch, positions]; stock pyvene takes no tensors
    "lists": lambda locations: {"sources->base": (None, locations.tolist())},
    "tensor": lambda locations: {"sources->base": (None, locations)},
    "broadcast int": lambda locations: {"base": 3},
    "broadcast list": lambda locations: {"base": [1, 5, 7]},
}
GRID = list(itertools.product(INTERVENTIONS, LAYERS, FORMS, BATCHES))


def _reft(intervention, layers, seed=0):
    return models.reft_model(models.tiny_llama(seed=seed), layers=layers, intervention=intervention, seed=seed + 1)


def _inputs(batch, count):
    ids = torch.randint(models.VOCAB_SIZE, (batch, S), generator=torch.Generator().manual_seed(batch))
    locations = torch.randint(S, (count, batch, 3), generator=torch.Generator().manual_seed(batch + 1))
    return ids, locations


@contextlib.contextmanager
def _general_path(expected: bool):
    """Asserts whether pyvene's general path (its per-call hook registration) ran inside."""
    from pyvene.models.intervenable_base import IntervenableModel

    setter = vars(IntervenableModel)["_intervention_setter"]
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return setter.__get__(self, type(self))(*args, **kwargs)

    IntervenableModel._intervention_setter = counted
    try:
        yield
    finally:
        IntervenableModel._intervention_setter = setter
    assert bool(calls) == expected, "pyvene's general path ran" if calls else "the general path did not run"


def _train_step(reft, ids, unit_locations):
    reft.train()
    for parameter in reft.interventions.parameters():
        parameter.grad = None
    _, out = reft({"input_ids": ids}, unit_locations=unit_locations, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in reft.interventions.named_parameters()}


def _eval_logits(reft, ids, unit_locations):
    reft.eval()
    with torch.no_grad():
        return reft({"input_ids": ids}, unit_locations=unit_locations)[1].logits


@pytest.mark.parametrize("intervention, layers, form, batch", GRID)
def test_the_plan_is_stock_pyvene(intervention, layers, form, batch):
    reft = _reft(intervention, layers)
    ids, locations = _inputs(batch, len(layers))
    stock_locations = FORMS["lists" if form == "tensor" else form](locations)
    logits, grads = _train_step(reft, ids, stock_locations)
    eval_logits = _eval_logits(reft, ids, stock_locations)
    with pyvene_dist.patched(), _general_path(expected=False):
        fast_logits, fast_grads = _train_step(reft, ids, FORMS[form](locations))
        fast_eval_logits = _eval_logits(reft, ids, FORMS[form](locations))
        assert plan_of(reft).refusal is None
    assert torch.equal(fast_logits, logits) and torch.equal(fast_eval_logits, eval_logits)
    assert fast_grads.keys() == grads.keys() and all(grad.abs().sum() > 0 for grad in grads.values())
    for name in grads:  # one Householder backward instead of three (fixes.parametrizations): rounding apart
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


GENERATION_GRID = list(itertools.product(INTERVENTIONS, LAYERS[1:], ("every token", "prompt only"), BATCHES))


@pytest.mark.parametrize("intervention, layers, mode, batch", GENERATION_GRID)
def test_generation_on_the_plan_is_stock_pyvene(intervention, layers, mode, batch):
    reft = _reft(intervention, layers)
    reft.eval()
    ids, locations = _inputs(batch, len(layers))
    prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    arguments = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True)
    if mode == "every token":
        arguments.update(unit_locations=None, intervene_on_prompt=False)
    else:
        arguments.update(unit_locations={"sources->base": (None, locations.tolist())}, intervene_on_prompt=True)
    with torch.no_grad():
        _, stock = reft.generate(prompt, **arguments)
        with pyvene_dist.patched(), _general_path(expected=False):
            _, fast = reft.generate(prompt, **arguments)
    _, bare = reft.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True,
                            unit_locations={"base": 0}, intervene_on_prompt=True)  # position 0 only
    assert torch.equal(fast, stock)
    assert not torch.equal(stock, bare) or mode == "prompt only"  # every-token intervening changes the tokens


def test_a_call_whose_shape_changes_gets_its_own_indices(patched):
    reft = _reft("LoreftIntervention", (0, 1))
    results = []
    for batch in (3, 2, 3):
        ids, locations = _inputs(batch, 2)
        results.append((ids, locations, _eval_logits(reft, ids, FORMS["tensor"](locations))))
    plan = plan_of(reft)
    pyvene_dist.unpatch()
    for ids, locations, fast in results:
        assert torch.equal(fast, _eval_logits(reft, ids, FORMS["lists"](locations)))
    assert not plan.handles, "unpatch() removes the plan's hooks"


FALLBACKS = {
    "subspaces": lambda reft, ids, locations: dict(unit_locations=FORMS["lists"](locations),
                                                   subspaces=[[[0, 1]] * ids.shape[0]] * 2),
    "one intervention without locations": lambda reft, ids, locations: dict(
        unit_locations={"sources->base": (None, [locations[0].tolist(), None])}),
    "no locations": lambda reft, ids, locations: dict(unit_locations=None),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_calls_the_plan_does_not_take_go_the_general_way(case):
    reft = _reft("LoreftIntervention", (0, 1))
    reft.eval()
    ids, locations = _inputs(3, 2)
    arguments = FALLBACKS[case](reft, ids, locations)
    with torch.no_grad():
        _, stock = reft({"input_ids": ids}, **arguments)
        with pyvene_dist.patched(), _general_path(expected=True):
            _, patched = reft({"input_ids": ids}, **arguments)
    assert torch.equal(patched.logits, stock.logits)


def test_a_model_the_plan_refuses_goes_the_general_way(patched):
    import pyvene as pv

    config = pv.IntervenableConfig([{"layer": 0, "component": "block_output"}],
                                   intervention_types=pv.AdditionIntervention)
    model = pv.IntervenableModel(config, models.tiny_llama())
    ids, _ = _inputs(2, 1)
    with _general_path(expected=True):
        model({"input_ids": ids}, unit_locations={"base": 1}, source_representations=torch.ones(2, 1, 32))
    refusal = plan_of(model)
    assert refusal is None or "AdditionIntervention" in refusal.refusal


def test_a_checkpointing_training_forward_goes_the_general_way(patched):
    reft = _reft("LoreftIntervention", (0, 1))
    reft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, locations = _inputs(3, 2)
    with _general_path(expected=True):
        _train_step(reft, ids, FORMS["tensor"](locations))
    with _general_path(expected=False):
        _eval_logits(reft, ids, FORMS["tensor"](locations))


def test_the_switch_sends_every_call_the_general_way():
    reft = _reft("LoreftIntervention", (0, 1))
    ids, locations = _inputs(3, 2)
    with pyvene_dist.patched(fast_path=False), _general_path(expected=True):
        _eval_logits(reft, ids, FORMS["tensor"](locations))


def test_the_idle_hooks_leave_the_base_model_alone(patched):
    reft = _reft("LoreftIntervention", (0, 1))
    ids, locations = _inputs(3, 2)
    _eval_logits(reft, ids, FORMS["tensor"](locations))
    assert len(plan_of(reft).handles) == 2  # registered, idle outside the call
    with torch.no_grad():
        hooked = reft.model(input_ids=ids).logits
    pyvene_dist.unpatch()
    with torch.no_grad():
        assert torch.equal(hooked, reft.model(input_ids=ids).logits)


def test_locations_out_of_the_sequence_are_refused_as_on_the_general_path(patched):
    reft = _reft("LoreftIntervention", (0, 1))
    ids, locations = _inputs(3, 2)
    locations[1, 2, 0] = S
    with pytest.raises(ValueError, match=rf"unit_locations\['sources->base'\]\[1\]\[1\] holds position {S}"):
        _eval_logits(reft, ids, FORMS["tensor"](locations))


def test_an_output_autograd_saved_is_written_in_a_copy():
    """A module whose output its operation saved for backward (a sigmoid, as sdpa's output in fixes.hooks):
    the in-place write would fail backward; the plan writes into a copy, as the general path does."""
    import pyreft

    def step(fast_path):
        base = models.tiny_llama()
        base.model.layers[1].mlp.act_fn = torch.nn.Sigmoid()  # saves its result
        torch.manual_seed(1)
        representations = [
            {"layer": 0, "component": "block_output", "low_rank_dimension": 4,
             "intervention": pyreft.LoreftIntervention(embed_dim=32, low_rank_dimension=4, dtype=torch.float32)},
            {"layer": 1, "component": "model.layers[1].mlp.act_fn.output", "low_rank_dimension": 4,
             "intervention": pyreft.LoreftIntervention(embed_dim=base.config.intermediate_size, low_rank_dimension=4,
                                                       dtype=torch.float32)},
        ]
        reft = pyreft.get_reft_model(base, pyreft.ReftConfig(representations=representations))
        ids, locations = _inputs(3, 2)
        with pyvene_dist.patched(fast_path=fast_path), _general_path(expected=not fast_path):
            return _train_step(reft, ids, FORMS["tensor"](locations))

    (logits, grads), (fast_logits, fast_grads) = step(False), step(True)
    assert torch.equal(fast_logits, logits)
    for name in grads:
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)
