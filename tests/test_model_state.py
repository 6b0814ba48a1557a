"""What the fixes keep about a model is found from the model, each fix its own part, torn down by unpatch() and
by the model's garbage collection (``pyvene_dist._state``)."""

import copy
import gc
import pickle
import weakref

import pytest
import torch

import helpers
import pyvene_dist
from pyvene_dist import fixes
from pyvene_dist._registry import MODELS
from pyvene_dist._state import ATTRIBUTE
from pyvene_dist.fixes.data_parallel import DataParallelState
from pyvene_dist.fixes.hooks import HookState
from pyvene_dist.fixes.orthogonal import OrthogonalState
from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.models import reft_model, tiny_llama

LOCATIONS = {"sources->base": (None, [[[3]] * 2] * 2)}


def _inputs():
    return {"input_ids": torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(0))}


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.model.modules()]


def _handles_during_forward(model) -> list:
    """How many hook handles the model's state holds while its base model runs, forward after forward."""
    seen = []
    model.model.lm_head.register_forward_hook(
        lambda module, args, output: seen.append(len(MODELS.get(model, HookState).handles))
    )
    model(_inputs(), unit_locations=LOCATIONS)
    return seen


@pytest.fixture
def general_path(monkeypatch):
    """pyvene's general path (its hooks registered per forward, which these tests follow), not the plan."""
    monkeypatch.setenv("PYVENE_DIST_FAST_PATH", "0")


def test_the_state_is_found_from_the_model(general_path, patched):
    """pyvene's hook handles are in the model's own state while it runs, and gone from it after."""
    stranger = torch.nn.Linear(2, 2)
    assert MODELS.get(stranger, HookState) is None and ATTRIBUTE not in vars(stranger)  # reading makes none
    model = reft_model(tiny_llama())
    assert MODELS.get(model, HookState) is None  # made at first use
    assert _handles_during_forward(model) == [2]  # one setter per intervention (layers 0 and 1)
    assert MODELS.get(model, HookState) is MODELS.of(model, HookState)
    assert MODELS.get(model, HookState).handles == []


def test_two_models_have_separate_states(general_path, patched):
    """A model's cleanup removes its own handles only, even when another model's forward runs inside."""
    first, second = reft_model(tiny_llama()), reft_model(tiny_llama(seed=1))
    inner = []
    first.model.lm_head.register_forward_hook(
        lambda module, args, output: inner.append(second(_inputs(), unit_locations=LOCATIONS))
    )
    seen = []
    first.model.lm_head.register_forward_hook(
        lambda module, args, output: seen.append(len(MODELS.get(first, HookState).handles))
    )
    first(_inputs(), unit_locations=LOCATIONS)
    assert inner and seen == [2]  # the second model's forward and cleanup left the first's handles alone
    assert MODELS.of(first, HookState) is not MODELS.of(second, HookState)


def test_unpatch_removes_the_hooks_kept_for_a_pending_backward(patched):
    """A checkpointing training forward keeps its intervening hooks until its backward; unpatch() removes
    them with the rest of the model's state."""
    case = ParityCase(component="mlp_output", checkpointing="non-reentrant")
    model = case.build()
    model.train()
    baseline = _hook_counts(model)
    batch = case.batches()[0]
    loss = model(base={"input_ids": batch["input_ids"]}, labels=batch["labels"],
                 unit_locations={"sources->base": (None, batch["locations"].tolist())})[1].loss
    assert _hook_counts(model) != baseline  # kept for the recomputation
    pyvene_dist.unpatch()
    assert _hook_counts(model) == baseline, "unpatch() left the kept hooks registered"
    assert len(MODELS) == 0 and ATTRIBUTE not in vars(model), "unpatch() left the state on the model"
    del loss


def test_the_state_is_closed_when_the_model_is_collected(patched):
    """A model's state is torn down (the hooks it holds removed) when the model goes, not at unpatch()."""
    model = reft_model(tiny_llama())
    survivor = torch.nn.Linear(2, 2)  # a module that outlives the model, holding a hook in its state
    state = MODELS.of(model, HookState)
    state.handles.append(survivor.register_forward_hook(lambda module, args, output: None))
    collected = []
    model_ref = weakref.finalize(model, collected.append, True)
    del model
    gc.collect()
    assert collected and not model_ref.alive
    assert not survivor._forward_hooks, "the state of a collected model kept its hooks"
    assert state.handles == []


def test_a_models_rotations_are_torchs_again_and_their_graphs_dropped_when_it_is_collected(patched):
    """The rotations pyvene's model adopted (``orthogonal``) are in its state; when the model goes, a rotation
    that outlives it gets torch's class back and its graphs are dropped, while still patched."""
    from torch.nn.utils.parametrizations import _Orthogonal

    from pyvene_dist.fixes.orthogonal import ReftOrthogonal, graphs_of

    model = reft_model(tiny_llama())
    rotations = [m for m in model.interventions.modules() if isinstance(m, _Orthogonal)]
    state = MODELS.get(model, OrthogonalState)
    assert rotations and set(state.rotations) == set(rotations)
    assert all(type(rotation) is ReftOrthogonal for rotation in rotations)
    for rotation in rotations:
        state.graphs[rotation] = object()  # what a capture on a GPU leaves: its graphs and their pool
        assert MODELS.of_part(rotation, OrthogonalState) is state and graphs_of(rotation) is not None
    del model
    gc.collect()
    assert [type(rotation) for rotation in rotations] == [_Orthogonal] * len(rotations)
    assert len(state.graphs) == 0 and len(state.rotations) == 0
    assert all(MODELS.of_part(rotation, OrthogonalState) is None for rotation in rotations)


def test_a_data_parallel_replica_has_a_state_of_its_own(patched):
    """A replica's device is kept in the replica's state; its original's state and ``__dict__`` are untouched."""
    from pyvene_dist.fixes.data_parallel import _make_independent

    model = reft_model(tiny_llama())
    replica = model._replicate_for_data_parallel()  # as torch's replicate makes it: a shallow copy
    _make_independent(replica, model, torch.device("meta"))
    assert replica.get_device() == torch.device("meta")
    assert MODELS.get(replica, DataParallelState).replica_device == torch.device("meta")
    assert MODELS.get(model, DataParallelState).replica_device is None
    assert vars(replica)[ATTRIBUTE] is not vars(model)[ATTRIBUTE]  # the copied entry was the original's


@pytest.mark.world_size(1)
def test_fsdp_averaging_goes_with_the_model():
    """The hooks fully_shard put on a model's interventions go when the model is collected, even while a
    parameter lives on (a user's reference, an optimizer's)."""
    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    try:
        model = fully_shard_model(ParityCase().build())
        trainable = [p for p in model.interventions.parameters() if p.requires_grad]
        assert trainable and all(p._post_accumulate_grad_hooks for p in trainable)
        from pyvene_dist.fixes.fsdp import FsdpState

        assert {id(p) for p in MODELS.get(model, FsdpState).reduced.keys()} == {id(p) for p in trainable}
        del model
        gc.collect()
        assert not any(p._post_accumulate_grad_hooks for p in trainable), "a collected model's hooks stayed"
    finally:
        pyvene_dist.unpatch()


def test_a_copy_of_a_model_starts_with_no_state(patched):
    """``copy.copy`` carries the original's entry, which answers for the original only; ``deepcopy`` and pickle
    carry an empty dict. Either way the copy's fixes keep their own state."""
    model = reft_model(tiny_llama())
    original = MODELS.of(model, HookState)
    shallow = copy.copy(model)
    assert MODELS.get(shallow, HookState) is None
    assert MODELS.of(shallow, HookState) is not original
    assert MODELS.get(model, HookState) is original  # the copy's state did not replace the original's
    duplicate = copy.deepcopy(model)
    assert vars(duplicate)[ATTRIBUTE] == {} and MODELS.get(duplicate, HookState) is None
    assert pickle.loads(pickle.dumps(vars(model)[ATTRIBUTE])) == {}  # torch.save of a whole model pickles it so


def test_every_state_type_is_declared_by_one_fix_and_closes():
    """Each fix that keeps state says so in its record; ``_state`` knows none of them by name."""
    import ast
    import pathlib

    import pyvene_dist._state as state_module

    declared = {}
    for fix in fixes.fixes():
        if fix.state is not None:
            kind = fix.state
            assert callable(getattr(kind, "close", None)), fix.name
            declared[kind] = fix.name
    assert {HookState, DataParallelState, OrthogonalState} <= declared.keys()
    tree = ast.parse(pathlib.Path(state_module.__file__).read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {part for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for part in (node.module or "").split(".")}
    named = names & ({fix.name for fix in fixes.fixes()} | {kind.__name__ for kind in declared})
    assert not named, f"pyvene_dist/_state.py's code names fixes: {sorted(named)}"
