"""LoReFT's rotation replayed from CUDA graphs: ``fixes.orthogonal``'s fast path on a GPU.

**CUDA graphs.** The rotation depends on the intervention's weights only, yet eagerly it is some 35
small kernels each way: an H200 host takes about 300 us to issue its forward and 1,000 us its backward,
per application, most of what a ReFT training step issues beyond a LoRA step (docs/benchmarks.md).
Replayed from a graph, each direction is one launch. ``replayed(kept, orthogonal, X)`` returns what
``orthogonal(X)`` returns from two graphs captured for this module and this storage of ``X``: the
forward (torch's own kernels, op for op, so the same values) and the backward (the closed form of
``householder_backward``, chained through ``tau``, the signs and ``base``; it recomputes what it needs
from ``X``, so gradients equal eager ones to rounding). Under autocast (HF Trainer's ``bf16=True``) the
forward is captured under the caller's autocast, so it runs the eager kernels, bf16 product included, and
the backward takes that product's gradient in bf16 as autograd does, the rest in float32.

Graphs are used for tall matrices on CUDA with a float32 ``base`` (``use_trivialization=True``, torch's
default and pyreft's), outside ``torch.compile`` and another capture, for a module that is not a
DataParallel replica and a plain tensor or parameter (not a DTensor), and not inside a
gradient-checkpointed training forward or its recomputation (``checkpoint_functions.in_checkpointed_forward``):
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
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from .checkpoint_functions import in_checkpointed_forward
from .householder_backward import householder_product_backward, reflectors
from .wrapped_models import is_replica

#: Half precision: a matrix computed in float32 and returned in its dtype.
HALF = (torch.bfloat16, torch.float16)
#: The call (with the same storage and settings) at which the graphs are captured: the calls before it
#: stay eager, so that a rotation used once (an evaluation, a setup) costs no capture.
WARM_CALLS = 3
#: Serialises captures (DataParallel's threads); a lock, no state: the graphs are the model's.
_lock = threading.Lock()


def replayed(kept: "weakref.WeakKeyDictionary", orthogonal, X: torch.Tensor) -> torch.Tensor | None:
    """``orthogonal(X)`` from CUDA graphs, or ``None`` where they do not apply (see the module docstring).
    ``kept`` maps each rotation to its graphs (its model's state): they are captured into it, and read from it."""
    staged = _applies(orthogonal, X)
    if staged is None:
        return None
    settings, storage = _settings(orthogonal, X), (X.data_ptr(), X.stride())
    with _lock:
        graphs = kept.get(orthogonal)
        if graphs is None or graphs.settings != settings or not (graphs.staged or graphs.storage == storage):
            # A matrix in new storage at consecutive calls (a ZeRO-3 gather) is read through a copy from then on.
            moved = graphs is not None and graphs.settings == settings and not graphs.staged
            moves = ((graphs.moves if graphs.calls <= 1 else 0) + 1) if moved else 0
            staged = staged or moves >= STAGED_AFTER_MOVES
            graphs = kept[orthogonal] = _Graphs(settings, storage, staged, moves)
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
        and not in_checkpointed_forward()
    )
    return (X.dtype != torch.float32 or hasattr(X, "ds_id")) if applies else None


_GRAPHED = (torch.float32, *HALF)


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
            return self.Q.to(X.dtype if X.dtype in HALF else self.Q.dtype, copy=True)

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


def _forward(X, base):
    """torch's ``_Orthogonal.forward`` for a tall matrix with a base, op for op."""
    A, tau, signs = reflectors(X)
    Q = torch._C._linalg.linalg_householder_product(A, tau)
    return base @ (Q * signs)


def _backward(X, base, grad_Q):
    """d loss / d X for ``_forward``, given d loss / d (its output), outside autocast. A bf16 ``grad_Q``
    means the forward ran under bf16 autocast: the last product's gradient is then taken in bf16 and
    cast up, as autograd does with that product's backward; the rest is float32."""
    A, tau, signs = reflectors(X)
    grad_Qs = (base.to(grad_Q.dtype).mT @ grad_Q).to(X.dtype)  # the casts are no-ops without autocast
    grad_A, grad_tau = householder_product_backward(A, tau, grad_Qs * signs)
    grad_A.addcmul_(A, (tau.square() * grad_tau).unsqueeze(-2), value=-1)  # through tau = 2 / (1 + |a|^2)
    return grad_A.tril_(-1)  # the diagonal (signs, read with .int()) and above get no gradient
