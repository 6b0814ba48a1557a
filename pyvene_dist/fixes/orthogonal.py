"""LoReFT's orthogonal rotation: it works when a framework casts it to half precision, and on a GPU its
forward and backward replay from CUDA graphs.

LoReFT keeps its rotation orthogonal with ``torch.nn.utils.parametrizations.orthogonal``: a tall matrix
``X`` (hidden x rank) becomes the Householder product of the reflectors under its diagonal, each
column's sign read from the diagonal, times a fixed orthogonal ``base`` buffer. That map is torch's
``_Orthogonal`` module, which pyvene and pyreft do not own: this concern has no upstream diff
(``docs/upstreaming.md``).

**Only pyvene's interventions.** torch stays untouched: when pyvene builds a model
(``BaseModel.__init__``, which ``IntervenableModel`` and pyreft's ``ReftModel`` run), each ``_Orthogonal``
among its interventions becomes a ``ReftOrthogonal`` (its class is swapped; nothing else about the module
changes, its state dict included), whose forward holds both fixes below and, where they do not apply,
torch's forward op for op (see **Eager rotation**). ``adopt(module, model=None)`` does the same for interventions built some other
way, and for a model built before ``patch()`` (``adopt(model.interventions, model=model)``), whose
rotations are otherwise torch's: eager, and under DeepSpeed's bf16 mode failing as below.

**State.** The adopted rotations and their graphs are the model's runtime state
(``OrthogonalState``) of the pyvene model that adopted them (of the rotation itself when ``adopt``
names no model). A rotation finds that state at forward time through the registry's weak map
``MODELS.of_part(rotation, OrthogonalState)``, not through an
attribute: a reference written on the module would be copied into a ``deepcopy`` or a DataParallel
replica (which copies ``__dict__``) and, given torch's class back, left on torch's object. When the
model is collected, and for every model at ``unpatch()``, the state's ``close`` gives its rotations
torch's class back and drops their graphs (and memory pools). The registry's map (rotation -> model,
weak both ways) outlives ``unpatch()``: a later ``patch()`` records each rotation of a live model in a
new state and swaps its class again. A copy made while patched
(``deepcopy``, a DataParallel replica) keeps the class but has no state: it runs the fixes below eagerly
while patched, torch's forward while unpatched. A user's own orthogonal layer keeps torch's eager path,
double backward included. The graphs' switch is configuration, read from ``patch()``'s options
(``OPTIONS.current.cuda_graphs``). The module keeps no state of its own (its ``_lock`` only serialises
captures).

**Half precision.** DeepSpeed's ``bf16`` (and ``fp16``) mode casts every parameter, the rotation's raw
matrix included (not the float32 ``base``), and ``torch.linalg.householder_product`` has no
half-precision kernel: ``NotImplementedError: "orgqr_cpu" not implemented for 'BFloat16'`` at the first
forward. A half-precision matrix is orthogonalised in float32 and returned in its own dtype.

**CUDA graphs.** On a GPU the rotation's forward and backward replay from two CUDA graphs per rotation
(``mechanisms.rotation_graphs`` says when and how; the graphs are kept in ``OrthogonalState``): eagerly it
is some 35 small kernels each way, most of what a ReFT training step issues beyond a LoRA step. The graphs'
backward is the closed form of ``mechanisms.householder_backward``. A capture that fails warns once and
leaves that rotation eager. ``patch(cuda_graphs=False)``, or ``PYVENE_DIST_CUDA_GRAPHS=0`` at ``patch()``,
turns the graphs off.

**Eager rotation.** Where no graph replays it, the rotation is torch's forward op for op, its Householder
product given the closed-form backward (``mechanisms.householder_backward.closed_form_orthogonal``) where the
``householder`` fix is applied: that fix is this one's option of the eager backward, read at each forward
(``_registry.applied``), so this record names it in ``after``; it has no code or site of its own to require this one.

**Loads.** ``IntervenableModel.load`` builds a model whose state gives its rotations this fix's class
(``BaseModel.__init__``); the fix adopts them again once the load returns (``_load_entry``), so that a load
that replaces the interventions (pyreft's, the checkpoints fixes') leaves none of torch's class.
"""

from __future__ import annotations

import weakref

import torch
from pyvene.models.intervenable_base import BaseModel, IntervenableModel
from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps

from .._options import Option
from .._records import Fix, Site
from .._registry import MODELS, OPTIONS, applied
from ..mechanisms.householder_backward import closed_form_orthogonal
from ..mechanisms.rotation_graphs import HALF, replayed


class OrthogonalState:
    """The rotations a model adopted, each -> torch's class, which it is given back at close (its class is
    ``ReftOrthogonal`` while patched); and rotation -> its captured CUDA graphs (and their memory pool)."""

    def __init__(self) -> None:
        self.rotations: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def close(self) -> None:
        for rotation, torchs in list(self.rotations.items()):
            if type(rotation) is not torchs:
                rotation.__class__ = torchs
        self.rotations = weakref.WeakKeyDictionary()
        self.graphs = weakref.WeakKeyDictionary()


def _configure(options) -> None:
    """Give every rotation adopted so far (while unpatched, or before an ``unpatch()``) this fix's class,
    recording it again in its model's state."""
    for part, model in MODELS.parts():
        if type(part) in (_Orthogonal, ReftOrthogonal):
            _adopt(part, model)


def _swap(module, found: type, to: type) -> None:
    if type(module) is found:
        module.__class__ = to


def _wrap_base_model_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    adopt(instance.interventions, model=instance)


def _load_entry(load):
    """``IntervenableModel.load`` (a static method), then the loaded rotations adopted again, each owned by
    itself: pyreft's ``ReftModel.load`` hands the interventions to a new ``ReftModel`` and drops the model the
    load built, whose state gave them this fix's forward (torch's has no half-precision kernel on the CPU:
    ``"orgqr_cpu" not implemented for 'BFloat16'`` at the first forward). ``adopt`` twice records them once."""
    load = load.__get__(None, IntervenableModel)  # as the class gives it: a wrap of it then binds as it expects

    def load_and_adopt(*args, **kwargs):
        loaded = load(*args, **kwargs)
        adopt(loaded.interventions)
        return loaded

    return load_and_adopt


def adopt(module: torch.nn.Module, model=None) -> None:
    """Give every torch orthogonal parametrization in ``module`` (pyvene's interventions) this fix's
    forward: now if patched, else from the next ``patch()`` on. Each belongs to ``model`` (pyvene's model,
    when it builds one), else to itself: it is recorded in that owner's state, and given torch's class
    back when the owner is collected and at ``unpatch()`` (a later ``patch()`` swaps it again)."""
    for submodule in module.modules():
        if type(submodule) in (_Orthogonal, ReftOrthogonal):
            previous = MODELS.of_part(submodule, OrthogonalState)
            if previous is not None:  # adopted before, maybe for another owner: recorded once
                previous.rotations.pop(submodule, None)
                previous.graphs.pop(submodule, None)
            MODELS.add_part(submodule, submodule if model is None else model)
            if applied(FIX.name, by=FIX):
                _adopt(submodule, submodule if model is None else model)


def _adopt(rotation, model) -> None:
    """While patched: record ``rotation`` in ``model``'s state and give it this fix's class."""
    MODELS.of(model, OrthogonalState).rotations[rotation] = _Orthogonal
    _swap(rotation, _Orthogonal, ReftOrthogonal)


class ReftOrthogonal(_Orthogonal):
    """torch's orthogonal map as a pyvene intervention's rotation (see the module docstring). Its class is
    swapped in for an existing ``_Orthogonal``, never constructed."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not applied(FIX.name, by=FIX):  # a copy made while patched, used after unpatch()
            return super().forward(X)
        rotation = replayed_rotation(self, X) if OPTIONS.current.cuda_graphs else None
        if rotation is not None:
            return rotation
        if X.dtype in HALF:
            return _eager(self, X.float()).to(X.dtype)
        return _eager(self, X)


def _eager(orthogonal: _Orthogonal, X: torch.Tensor) -> torch.Tensor:
    """torch's ``_Orthogonal.forward``, op for op; for the Householder map the product is the closed form's (the
    same forward call, another backward) where the ``householder`` fix is applied."""
    if not applied("householder", by=FIX) or orthogonal.orthogonal_map != _OrthMaps.householder:
        return _Orthogonal.forward(orthogonal, X)
    return closed_form_orthogonal(orthogonal, X)


def graphs_of(orthogonal):
    """The graphs ``orthogonal``'s model keeps for it in its state, or None."""
    state = MODELS.of_part(orthogonal, OrthogonalState)
    return state.graphs.get(orthogonal) if state is not None else None


def replayed_rotation(orthogonal, X: torch.Tensor) -> torch.Tensor | None:
    """``orthogonal(X)`` from the CUDA graphs its model's state keeps, or ``None`` where they do not apply."""
    if torch.compiler.is_compiling():  # first: traced, the lookup below made dynamo guard on every model's parts
        return None
    state = MODELS.of_part(orthogonal, OrthogonalState)
    if state is None:  # a copy of an adopted rotation (deepcopy): no model to keep its graphs
        return None
    return replayed(state.graphs, orthogonal, X)


FIX = Fix(
    __name__,
    sites=(
        Site((BaseModel, "__init__"), _wrap_base_model_init),
        Site((IntervenableModel, "load"), _load_entry, kind="entry",
             any_form=True),  # calls whatever load is, then adopts: upstream's load (saved_dtypes.diff) too
    ),
    # householder: the eager rotation takes the closed-form backward where that fix is applied (applied() says
    # so); householder requires nothing, so the dependency runs one way. (The rotation stays eager in checkpointed
    # forwards, which mechanisms.checkpoint_functions tells, set where gradient_checkpointing is applied.)
    after=("householder",
           # saved_dtypes: its wrap of IntervenableModel.load, which this fix's entry stacks on (applied first)
           "saved_dtypes"),
    state=OrthogonalState,
    # off: LoReFT's rotation stays eager on CUDA (no graphs captured)
    options=(Option("cuda_graphs", "PYVENE_DIST_CUDA_GRAPHS", default=True),),
    on_patch=_configure,
    # ReftOrthogonal's eager path and graphs are its forward, op for op
    relies_on=(_Orthogonal.forward,),
)
