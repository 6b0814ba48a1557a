"""On the plan, LoReFT and DiReFT run as the operations of their forwards (``_fast_path_operations.operations``), not
as their module calls: the same outputs as stock pyvene bit for bit, in eval, in training with dropout and an
activation, and in generation; and wherever a module call could do something else (a hook, a replaced or
wrapped forward, a subclass), the module is called, as stock pyvene calls it.
"""

import contextlib
import sys

import pytest
import torch

import pyvene_dist
from pyvene_dist.fixes._fast_path_operations import operations
from pyvene_dist.testing import models

S = 9


KINDS = ("LoreftIntervention", "DireftIntervention")
#: what each kind's stock call runs in pyreft/interventions.py
FORWARDS = {"LoreftIntervention": ["LoreftIntervention.forward", "LowRankRotateLayer.forward"],
            "DireftIntervention": ["DireftIntervention.forward"]}


def _reft(layers=(0, 1), kind="LoreftIntervention", **arguments):
    """A tiny Llama with pyreft's ``kind`` rank 4 at ``block_output`` of ``layers``; ``arguments``: its
    other arguments (dropout, act_fn)."""
    import pyreft

    base = models.tiny_llama()
    torch.manual_seed(1)
    representations = [{"layer": layer, "component": "block_output", "low_rank_dimension": 4,
                        "intervention": getattr(pyreft, kind)(embed_dim=32, low_rank_dimension=4,
                                                              dtype=torch.float32, **arguments)}
                       for layer in layers]
    return pyreft.get_reft_model(base, pyreft.ReftConfig(representations=representations))


def _inputs(batch=3, count=2):
    ids = torch.randint(models.VOCAB_SIZE, (batch, S), generator=torch.Generator().manual_seed(batch))
    locations = torch.randint(S, (count, batch, 3), generator=torch.Generator().manual_seed(batch + 1))
    return ids, {"sources->base": (None, locations.tolist())}


@contextlib.contextmanager
def _forwards_of_pyreft(counted: list):
    """Appends the name of each ``forward`` of pyreft's interventions module that runs inside."""
    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "forward" and frame.f_code.co_filename.endswith(
                "pyreft/interventions.py"):
            counted.append(frame.f_code.co_qualname)

    sys.setprofile(profiler)
    try:
        yield
    finally:
        sys.setprofile(None)


def _logits(reft, ids, unit_locations, train=False):
    reft.train(train)
    with torch.set_grad_enabled(train):
        torch.manual_seed(7)  # the dropout's mask
        return reft({"input_ids": ids}, unit_locations=unit_locations, labels=ids)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_on_the_plan_it_runs_its_operations_not_its_modules(kind):
    reft, (ids, locations) = _reft(kind=kind), _inputs()
    stock_forwards, fast_forwards = [], []
    with _forwards_of_pyreft(stock_forwards):
        stock = _logits(reft, ids, locations).logits
    with pyvene_dist.patched(), _forwards_of_pyreft(fast_forwards):
        fast = _logits(reft, ids, locations).logits
    assert sorted(set(stock_forwards)) == FORWARDS[kind]
    assert fast_forwards == []
    assert torch.equal(fast, stock)


def _with_function_act(reft):
    for intervention in reft.interventions.values():
        del intervention.act_fn  # a registered child: torch refuses to assign a function over it
        intervention.act_fn = torch.tanh
    return reft


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act_fn", [None, "relu", "a function"])
def test_training_with_dropout_and_an_activation_is_stock_pyvene(act_fn, kind):
    """The dropout draws its mask from the same generator at the same point, and the activation runs as its
    module (or function): the logits equal stock pyvene's bit for bit, the gradients to rounding."""
    def build(**loreft):
        if act_fn == "a function":
            return _with_function_act(_reft(kind=kind, **loreft))
        return _reft(kind=kind, act_fn=act_fn, **loreft)

    def step(reft, fast):
        with pyvene_dist.patched(fast_path=fast):
            out = _logits(reft, ids, locations, train=True)
            out.loss.backward()
        return out.logits.detach(), {name: p.grad for name, p in reft.interventions.named_parameters()}

    ids, locations = _inputs()
    (logits, grads), (fast_logits, fast_grads) = (step(build(dropout=0.5), fast) for fast in (False, True))
    assert torch.equal(fast_logits, logits)
    dropped = _logits(build(dropout=0.5), ids, locations, train=True).logits
    assert not torch.equal(dropped, _logits(build(), ids, locations, train=True).logits)
    for name in grads:
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _first(reft):
    return reft.interventions[next(iter(reft.interventions))]


def _hook_on(path):
    def change(reft):
        module = _first(reft)
        for name in path.split(".")[1:]:
            module = getattr(module, name)
        return module.register_forward_hook(lambda module, args, output: output * 2)
    return change


def _global_hook(reft):
    from torch.nn.modules.module import register_module_forward_hook

    kind = type(_first(reft))
    return register_module_forward_hook(lambda module, args, output: output * 2 if type(module) is kind else None)


def _instance_forward(reft):
    intervention = _first(reft)
    intervention.forward = lambda base, source=None, subspaces=None: base + 1.0
    return _Removed(lambda: vars(intervention).pop("forward"))


def _class_forward(reft):
    """A class-level replacement, as a user's patch makes one."""
    kind = type(_first(reft))
    original = kind.forward

    def forward(self, base, source=None, subspaces=None):
        return original(self, base, source, subspaces) + 1.0

    kind.forward = forward
    return _Removed(lambda: setattr(kind, "forward", original))


def _wrapt_forward(reft):
    """A tracer's wrapper (dd-trace-py and OpenTelemetry wrap with wrapt): the class's forward is not a plain
    function any more."""
    import wrapt

    kind = type(_first(reft))
    original = kind.forward
    wrapt.wrap_function_wrapper(kind, "forward", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1.0)
    return _Removed(lambda: setattr(kind, "forward", original))


def _subclass(reft):
    intervention = _first(reft)
    kind = type(intervention)
    intervention.__class__ = type("Scaled", (kind,), {
        "forward": lambda self, base, source=None, subspaces=None: kind.forward(self, base) * 2})
    return _Removed(lambda: setattr(intervention, "__class__", kind))


class _Removed:
    def __init__(self, undo):
        self.remove = undo


CHANGES = {
    "hook on the intervention": _hook_on("intervention"),
    "hook on its rotation": _hook_on("intervention.rotate_layer"),  # LoReFT calls it; DiReFT reads its weight
    "hook on its learned source": _hook_on("intervention.learned_source"),
    "global hook": _global_hook,
    "forward set on the instance": _instance_forward,
    "forward replaced on the class": _class_forward,
    "forward wrapped by wrapt": _wrapt_forward,
    "a subclass": _subclass,
}
CASES = [(kind, change) for kind in KINDS for change in CHANGES
         if not (kind == "DireftIntervention" and change == "hook on its rotation")]


@pytest.mark.parametrize("kind, change", CASES)
def test_an_intervention_whose_call_does_more_is_called_as_a_module(kind, change):
    reft, (ids, locations) = _reft(kind=kind), _inputs()
    plain = _logits(reft, ids, locations).logits
    handle = CHANGES[change](reft)
    try:
        stock = _logits(reft, ids, locations).logits
        with pyvene_dist.patched():
            fast = _logits(reft, ids, locations).logits
    finally:
        handle.remove()
    assert not torch.equal(stock, plain), "the change changes stock pyvene's result"
    assert torch.equal(fast, stock)
    with pyvene_dist.patched():  # removed: the operations again, and the plain result
        assert torch.equal(_logits(reft, ids, locations).logits, plain)


def test_in_a_jit_trace_the_intervention_is_called_as_a_module(monkeypatch):
    """In a jit trace ``Module._call_impl`` records each module's scope (``_slow_forward``), so the operations
    stand aside there. They ask the test ``_call_impl`` asks, ``torch._C._is_tracing()`` since torch 2.15 (before,
    ``_get_tracing_state()``, which agrees with it): a trace that only it reports sends the call to the module."""
    intervention = _first(_reft())
    in_trace = []
    torch.jit.trace(lambda x: in_trace.append(operations(intervention)) or x * 2, torch.ones(2), check_trace=False)
    assert in_trace and in_trace == [None] * len(in_trace)
    assert operations(intervention) is not None
    monkeypatch.setattr(torch._C, "_is_tracing", lambda: True)
    assert operations(intervention) is None


@pytest.mark.parametrize("kind", KINDS)
def test_every_token_generation_runs_the_operations_and_is_stock_pyvene(kind):
    reft, (ids, _) = _reft(kind=kind), _inputs()
    reft.eval()
    prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    arguments = dict(unit_locations=None, intervene_on_prompt=False, max_new_tokens=6, do_sample=False,
                     pad_token_id=0)
    forwards = []
    with torch.no_grad():
        _, stock = reft.generate(prompt, **arguments)
        with pyvene_dist.patched(), _forwards_of_pyreft(forwards):
            _, fast = reft.generate(prompt, **arguments)
    assert torch.equal(fast, stock) and forwards == []
