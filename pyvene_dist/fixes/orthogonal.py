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
torch's forward op for op, its Householder product given ``fixes.householder``'s closed-form backward
when that fix is applied. ``adopt(module, model=None)`` does the same for interventions built some other
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

**CUDA graphs.** The rotation depends on the intervention's weights only, yet eagerly it is some 35
small kernels each way: an H200 host takes about 300 us to issue its forward and 1,000 us its backward,
per application, most of what a ReFT training step issues beyond a LoRA step (docs/benchmarks.md).
Replayed from a graph, each direction is one launch. ``replayed_rotation(orthogonal, X)`` returns what
``orthogonal(X)`` returns from two graphs captured for this module and this storage of ``X``: the
forward (torch's own kernels, op for op, so the same values) and the backward (the closed form of
``fixes.householder``, chained through ``tau``, the signs and ``base``; it recomputes what it needs
from ``X``, so gradients equal eager ones to rounding). Under autocast (HF Trainer's ``bf16=True``) the
forward is captured under the caller's autocast, so it runs the eager kernels, bf16 product included, and
the backward takes that product's gradient in bf16 as autograd does, the rest in float32.

Graphs are used for tall matrices on CUDA with a float32 ``base`` (``use_trivialization=True``, torch's
default and pyreft's), outside ``torch.compile`` and another capture, for a module that is not a
DataParallel replica and a plain tensor or parameter (not a DTensor), and not inside a
gradient-checkpointed training forward or its recomputation (``checkpointing.in_checkpointed_forward``):
a rotation eager in the forward and replayed in the recomputation saves fewer tensors, which torch's
non-reentrant checkpoint refuses. A float32 matrix is read in place: its graphs are captured at
the ``WARM_CALLS``-th call with the same storage, strides and settings, and again when the storage of
``X`` or ``base`` changes (a move, an assigning load), the float32 matmul settings or the autocast state
change. In-place updates (optimizer steps, ``load_state_dict``'s copies) are seen by the next replay, as
the graphs read the storage itself; an update between a forward and its backward fails as autograd's own
check does.

**Staged graphs.** A half-precision matrix (DeepSpeed's bf16 mode) is computed from a float32 copy, and
a ZeRO-3 matrix may be gathered into new storage at every step (DeepSpeed's module hooks hand it over as
a plain tensor; a partition read directly carries ``ds_id``): neither has a storage the graphs could read,
so they ran eagerly, about 190 operator calls per rotation and step, most of what a ReFT step under
ZeRO-3 issued beyond LoRA's. Their graphs read a float32 input of their own instead, into which each
forward copies the matrix (one copy kernel, which also casts): for a half-precision matrix, a partition,
and a matrix that came in new storage at ``STAGED_AFTER_MOVES`` calls in a row (a single move, such as a
load, recaptures in place). The rotation comes back in the matrix's dtype where that is half precision,
as the eager path returns it, and so does its gradient. The backward needs the matrix its forward
loaded: a later forward that loads another while that backward may still come (autograd still holds the
forward's saved token) first keeps a snapshot of it, and the backward loads the snapshot back. The matrix
itself is not saved for the backward (DeepSpeed empties a partition's storage after its module's
forward), so an in-place change between a forward and its backward is not refused here (nor by the
eager rotation, which saves no view of the matrix either): the gradient is that of the forward's matrix.

A capture that fails (out of memory, say) warns once and leaves that rotation eager.
``patch(cuda_graphs=False)``, or ``PYVENE_DIST_CUDA_GRAPHS=0`` at ``patch()``, turns the graphs off (torch's
eager rotation).

Checked with torch 2.11 and 2.13 and deepspeed 0.19.8.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps

from .._options import Option
from .._records import Fix, Site
from .._registry import APPLIED, MODELS, OPTIONS
from . import gradient_checkpointing, householder
from ..mechanisms.wrapped_models import is_replica

FIX = Fix(
    __name__,
    sites=(Site("pyvene.models.intervenable_base:BaseModel.__init__", "_wrap_base_model_init"),),
    # gradient_checkpointing: stays eager in its checkpointed forwards, which only that fix marks.
    # (householder's backward too, where that fix is applied; it requires this one, so it cannot be `after`.)
    after=("gradient_checkpointing",),
    state="OrthogonalState",
    # off: LoReFT's rotation stays eager on CUDA (no graphs captured)
    options=(Option("cuda_graphs", "PYVENE_DIST_CUDA_GRAPHS", default=True),),
    on_patch="_configure",
    # ReftOrthogonal's eager path and graphs are its forward, op for op
    relies_on=("torch.nn.utils.parametrizations:_Orthogonal.forward",),
)


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


_HALF = (torch.bfloat16, torch.float16)
#: The call (with the same storage and settings) at which the graphs are captured: the calls before it
#: stay eager, so that a rotation used once (an evaluation, a setup) costs no capture.
WARM_CALLS = 3


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
            if FIX.name in APPLIED:
                _adopt(submodule, submodule if model is None else model)


def _adopt(rotation, model) -> None:
    """While patched: record ``rotation`` in ``model``'s state and give it this fix's class."""
    MODELS.of(model, OrthogonalState).rotations[rotation] = _Orthogonal
    _swap(rotation, _Orthogonal, ReftOrthogonal)


class ReftOrthogonal(_Orthogonal):
    """torch's orthogonal map as a pyvene intervention's rotation (see the module docstring). Its class is
    swapped in for an existing ``_Orthogonal``, never constructed."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if FIX.name not in APPLIED:  # a copy made while patched, used after unpatch()
            return super().forward(X)
        replayed = replayed_rotation(self, X) if OPTIONS.current.cuda_graphs else None
        if replayed is not None:
            return replayed
        if X.dtype in _HALF:
            return _eager(self, X.float()).to(X.dtype)
        return _eager(self, X)


def _eager(orthogonal: _Orthogonal, X: torch.Tensor) -> torch.Tensor:
    """torch's ``_Orthogonal.forward``, op for op; for the Householder map the product is
    ``fixes.householder``'s (the same forward call, a closed-form backward) when that fix is applied."""
    if householder.FIX.name not in APPLIED or orthogonal.orthogonal_map != _OrthMaps.householder:
        return _Orthogonal.forward(orthogonal, X)
    transposed = X.size(-2) < X.size(-1)
    if transposed:
        X = X.mT
    A, tau, signs = _reflectors(X)
    Q = householder.householder_product(A, tau) * signs
    if hasattr(orthogonal, "base"):
        Q = orthogonal.base @ Q
    return Q.mT if transposed else Q


#: Serialises captures (DataParallel's threads); a lock, no state: the graphs are the model's.
_lock = threading.Lock()


def graphs_of(orthogonal) -> "_Graphs | None":
    """The graphs ``rotation`` keeps for ``orthogonal`` in its model's state, or None."""
    state = MODELS.of_part(orthogonal, OrthogonalState)
    return state.graphs.get(orthogonal) if state is not None else None


def replayed_rotation(orthogonal, X: torch.Tensor) -> torch.Tensor | None:
    """``orthogonal(X)`` from CUDA graphs, or ``None`` where they do not apply (see the module docstring)."""
    staged = _applies(orthogonal, X)
    if staged is None:
        return None
    state = MODELS.of_part(orthogonal, OrthogonalState)
    if state is None:  # a copy of an adopted rotation (deepcopy): no model to keep its graphs
        return None
    settings, storage = _settings(orthogonal, X), (X.data_ptr(), X.stride())
    with _lock:
        graphs = state.graphs.get(orthogonal)
        if graphs is None or graphs.settings != settings or not (graphs.staged or graphs.storage == storage):
            # A matrix in new storage at consecutive calls (a ZeRO-3 gather) is read through a copy from then on.
            moved = graphs is not None and graphs.settings == settings and not graphs.staged
            moves = ((graphs.moves if graphs.calls <= 1 else 0) + 1) if moved else 0
            staged = staged or moves >= STAGED_AFTER_MOVES
            graphs = state.graphs[orthogonal] = _Graphs(settings, storage, staged, moves)
        graphs.calls += 1
        if graphs.forward_graph is None:
            if graphs.calls < WARM_CALLS or graphs.failed:
                return None
            try:
                graphs.capture(X, orthogonal.base)
            except RuntimeError as error:  # e.g. out of memory, or an operation capture does not allow
                graphs.failed = True
                warnings.warn(f"pyvene_dist: capturing LoReFT's rotation as CUDA graphs failed, so it runs "
                              f"eagerly ({type(error).__name__}: {error}); PYVENE_DIST_CUDA_GRAPHS=0 skips "
                              f"the attempt", RuntimeWarning, stacklevel=2)
                return None
    if graphs.staged:
        return _StagedReplay.apply(X, graphs) if torch.is_grad_enabled() and X.requires_grad else \
            graphs.replay_staged_forward(X, None)
    if torch.is_grad_enabled() and X.requires_grad:
        return _Replay.apply(X, graphs)
    return graphs.replay_forward()


#: Calls in a row at which the matrix came in new storage, after which its graphs read it through a copy.
STAGED_AFTER_MOVES = 2


def _applies(orthogonal, X) -> bool | None:
    """None where the graphs do not apply; else whether they must read a copy of ``X`` (staged: a
    half-precision matrix, computed in float32, or a DeepSpeed partition read directly) rather than its
    storage (which ``replayed_rotation`` also gives up on for a matrix that moves at every call)."""
    base = getattr(orthogonal, "base", None)
    applies = (
        X.is_cuda
        and X.dtype in _GRAPHED
        and X.dim() == 2
        and X.size(0) >= X.size(1)
        and isinstance(base, torch.Tensor)
        and base.dtype == torch.float32
        and type(X) in (torch.Tensor, torch.nn.Parameter)
        and not is_replica(orthogonal)
        and str(getattr(orthogonal, "orthogonal_map", "")).endswith("householder")
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
        and not gradient_checkpointing.in_checkpointed_forward()
    )
    return (X.dtype != torch.float32 or hasattr(X, "ds_id")) if applies else None


_GRAPHED = (torch.float32, *_HALF)


def _settings(orthogonal, X) -> tuple:
    """What the graphs were captured for, but for the storage of ``X``."""
    base = orthogonal.base
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return (X.shape, X.dtype, X.device, base.data_ptr(), base.shape, base.stride(),
            torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), autocast)


class _Graphs:
    def __init__(self, settings: tuple, storage: tuple, staged: bool = False, moves: int = 0) -> None:
        self.settings, self.storage = settings, storage  # storage: the matrix's, read in place unless staged
        self.staged = staged  # the graphs read self.X, a float32 copy of the matrix, instead of its storage
        self.moves = moves  # calls in a row, this one included, at which the matrix came in new storage
        self.calls = 0
        self.failed = False  # a capture failed for these settings (and storage): eager from then on
        self.forward_graph: torch.cuda.CUDAGraph | None = None
        self.backward_graph: torch.cuda.CUDAGraph | None = None
        self.holder: _Staging | None = None  # staged: the forward whose matrix self.X holds

    def capture(self, X: torch.Tensor, base: torch.Tensor) -> None:
        """Capture under the caller's autocast state (the forward's kernels are then the eager ones), the
        backward without autocast, as autograd runs it."""
        if self.staged:
            self.X = torch.empty(X.shape, dtype=torch.float32, device=X.device)
            self.X.copy_(X)
            X = self.X
        device = X.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        no_autocast = torch.autocast("cuda", enabled=False)
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):  # warm up on a side stream (cuSOLVER and cuBLAS workspaces), as capture requires
                grad_Q = torch.zeros_like(_forward(X, base))  # bf16 under autocast, as the gradient arrives
                with no_autocast:
                    _backward(X, base, grad_Q)
        torch.cuda.current_stream(device).wait_stream(side)
        self.grad_Q = grad_Q
        forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # Separate memory pools: with a shared one, one graph's intermediates could land on the other's
        # output. thread_local: a DataLoader or other thread using CUDA meanwhile does not break the capture.
        # Autocast's cast cache is left alone: what is cast here (base) is no leaf that requires grad.
        with torch.no_grad():
            with torch.cuda.graph(forward_graph, capture_error_mode="thread_local"):
                self.Q = _forward(X, base)
            with no_autocast, torch.cuda.graph(backward_graph, capture_error_mode="thread_local"):
                self.grad_X = _backward(X, base, self.grad_Q)
        self.forward_graph, self.backward_graph = forward_graph, backward_graph

    def replay_forward(self) -> torch.Tensor:
        self.forward_graph.replay()
        return self.Q.clone()  # the graph's buffer is overwritten by the next replay

    def replay_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.grad_Q.copy_(grad)
        self.backward_graph.replay()
        return self.grad_X.clone()

    def replay_staged_forward(self, X: torch.Tensor, staging: "_Staging | None") -> torch.Tensor:
        """The rotation of ``X`` (copied in), in ``X``'s dtype where that is half precision (as the eager
        path returns it); ``staging`` stands for the backward to come, if any."""
        with _lock:
            self._load(X, staging)
            self.forward_graph.replay()
            return self.Q.to(X.dtype if X.dtype in _HALF else self.Q.dtype, copy=True)

    def replay_staged_backward(self, staging: "_Staging", grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """d loss / d X of the forward ``staging`` stands for, in ``dtype`` (the matrix's)."""
        with _lock:
            if self.holder is not staging:  # a later forward loaded its own matrix
                self._load(staging.snapshot, staging)
            staging.snapshot = None
            self.grad_Q.copy_(grad)
            self.backward_graph.replay()
            return self.grad_X.to(dtype, copy=True)

    def _load(self, X: torch.Tensor, staging: "_Staging | None") -> None:
        """Copy ``X`` into the graphs' input. The forward whose matrix it held, if its backward may still
        come, first gets a snapshot of that matrix: its backward needs it, not the one loaded now."""
        holder = self.holder
        if holder is not None and holder is not staging and holder.snapshot is None and holder.pending():
            holder.snapshot = self.X.clone()
        self.X.copy_(X)
        self.holder = staging


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, graphs):
        ctx.save_for_backward(X)  # unpacked in backward: autograd's check that X was not changed in place
        ctx.graphs = graphs
        return graphs.replay_forward()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        _ = ctx.saved_tensors  # raises, as autograd does, if X was modified in place since the forward
        return ctx.graphs.replay_backward(grad), None


class _Staging:
    """One staged forward under autograd: whether its backward may still come, and the matrix it loaded
    once a later load has displaced it (``_Graphs._load``)."""

    __slots__ = ("token", "snapshot")

    def __init__(self, token: torch.Tensor) -> None:
        # Autograd holds the token as a saved tensor: it lets go of it once the backward has run (unless
        # the graph is retained) or the graph is freed, and only then does the weak reference die.
        self.token = weakref.ref(token)
        self.snapshot: torch.Tensor | None = None

    def pending(self) -> bool:
        return self.token() is not None


class _StagedReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, graphs):
        # X is not saved: a DeepSpeed partition is released after its module's forward (its storage
        # emptied); the matrix is kept by the graphs' input or a snapshot instead (_Graphs._load).
        token = torch.empty(0)
        ctx.save_for_backward(token)
        ctx.graphs, ctx.staging, ctx.dtype = graphs, _Staging(token), X.dtype
        return graphs.replay_staged_forward(X, ctx.staging)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return ctx.graphs.replay_staged_backward(ctx.staging, grad, ctx.dtype), None


def _reflectors(X):
    A = X.tril(diagonal=-1)
    tau = 2.0 / (1.0 + (A * A).sum(dim=-2))
    signs = X.diagonal(dim1=-2, dim2=-1).int().unsqueeze(-2)
    return A, tau, signs


def _forward(X, base):
    """torch's ``_Orthogonal.forward`` for a tall matrix with a base, op for op."""
    A, tau, signs = _reflectors(X)
    Q = torch._C._linalg.linalg_householder_product(A, tau)
    return base @ (Q * signs)


def _backward(X, base, grad_Q):
    """d loss / d X for ``_forward``, given d loss / d (its output), outside autocast. A bf16 ``grad_Q``
    means the forward ran under bf16 autocast: the last product's gradient is then taken in bf16 and
    cast up, as autograd does with that product's backward; the rest is float32."""
    from .householder import householder_product_backward

    A, tau, signs = _reflectors(X)
    grad_Qs = (base.to(grad_Q.dtype).mT @ grad_Q).to(X.dtype)  # the casts are no-ops without autocast
    grad_A, grad_tau = householder_product_backward(A, tau, grad_Qs * signs)
    grad_A.addcmul_(A, (tau.square() * grad_tau).unsqueeze(-2), value=-1)  # through tau = 2 / (1 + |a|^2)
    return grad_A.tril_(-1)  # the diagonal (signs, read with .int()) and above get no gradient
