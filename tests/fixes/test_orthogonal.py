"""pyvene_dist.fixes.orthogonal: LoReFT's rotation replayed from CUDA graphs (its half-precision fix is
tested with DeepSpeed's bf16 engine in test_deepspeed.py).

On CPU: the two functions the graphs capture equal torch's forward (bit for bit) and its gradient (to
rounding), in float32, float64 and under bf16 autocast; the switch. On a GPU: a step is two graph
launches; replays equal eager results, see in-place updates, recapture on a new storage and a new
autocast state, equal eager results under autocast, refuse an update between forward and backward as
autograd does, and stand aside inside another capture; ReFT training matches eager training. Staged graphs
(a half-precision matrix, or one in new storage at every step, read through a copy): on CPU, with stand-in
replays, when a matrix is staged and that each backward gets its own forward's matrix; on a GPU, one
capture and eager results at every step.
Everywhere: only pyvene's interventions get the fixes; a user's own orthogonal layer keeps torch's path.
"""

import warnings

import pytest
import torch

import helpers
import pyvene_dist
from pyvene_dist._registry import MODELS, OPTIONS
from pyvene_dist.fixes import orthogonal as graphed
from pyvene_dist.fixes.orthogonal import OrthogonalState
from pyvene_dist.mechanisms import rotation_graphs


def _rotation(device="cpu", hidden=64, rank=4, seed=0):
    """pyreft's LoReFT rotation (its parametrized layer), moved off its initial point below the diagonal,
    adopted as pyvene's model adopts its interventions' rotations when it is built."""
    import pyreft

    torch.manual_seed(seed)
    intervention = pyreft.LoreftIntervention(embed_dim=hidden, low_rank_dimension=rank, dtype=torch.float32)
    graphed.adopt(intervention)
    rotate = intervention.rotate_layer.to(device)
    original = rotate.parametrizations.weight.original
    with torch.no_grad():
        noise = torch.randn(original.shape, generator=torch.Generator().manual_seed(seed))
        original.add_(0.1 * noise.tril(-1).to(device))
    return rotate


def _parts(rotate):
    return rotate.parametrizations.weight[0], rotate.parametrizations.weight.original


def _loss(weight):
    """A loss whose gradient differs in every entry (not a plain sum)."""
    return (weight.square() * torch.arange(weight.numel(), device=weight.device).view_as(weight)).sum()


def _second_order_grads(layer, x):
    """d/dW of the squared norm of d loss/dW, W the layer's raw weight: needs double backward."""
    original = layer.parametrizations.weight.original
    (grad,) = torch.autograd.grad(layer(x).square().sum(), original, create_graph=True)
    (grad_of_grad,) = torch.autograd.grad(grad.square().sum(), original)
    return grad, grad_of_grad


def test_a_users_orthogonal_layer_keeps_torchs_eager_path_and_double_backward():
    """Patched, with a ReFT model built in the process: the model's rotations are the fix's, a plain
    ``orthogonal`` layer keeps torch's parametrization, Householder product and double backward (its
    second derivatives equal those computed before ``patch()``, bit for bit)."""
    from torch.nn.utils.parametrizations import _Orthogonal, orthogonal

    from pyvene_dist.testing import models

    torch.manual_seed(0)
    layer = orthogonal(torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    expected = _second_order_grads(layer, x)
    assert expected[1].abs().max() > 0.1
    pyvene_dist.patch()
    try:
        reft = models.reft_model(models.tiny_llama(hidden=64), layers=(0,), seed=1)
        got = _second_order_grads(layer, x)
        for name, value, reference in zip(("grad of grad", "grad"), got[::-1], expected[::-1]):
            difference = (value - reference).abs().max().item()
            assert torch.equal(value, reference), f"{name}: max difference {difference:.3g}"
        assert type(layer.parametrizations.weight[0]) is _Orthogonal
        assert torch.linalg.householder_product is torch._C._linalg.linalg_householder_product
        names = helpers.backward_names(layer.weight.grad_fn)
        assert "LinalgHouseholderProductBackward0" in names and "_HouseholderProductBackward" not in names, names
        rotations = {type(m) for m in reft.interventions.modules() if isinstance(m, _Orthogonal)}
        assert rotations == {graphed.ReftOrthogonal}
    finally:
        pyvene_dist.unpatch()


@pytest.mark.parametrize("shape", [(64, 4), (4, 64), (6, 6), (3, 7, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use_trivialization", [True, False])
def test_the_adopted_rotations_forward_is_torchs_bit_for_bit(patched, shape, dtype, use_trivialization):
    """The eager path of ``ReftOrthogonal`` (torch's forward, op for op, with the closed-form product):
    tall, wide, square and batched weights, with and without ``base``; gradients equal torch's to rounding."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import orthogonal

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
    orthogonal(module, orthogonal_map="householder", use_trivialization=use_trivialization)
    original = module.parametrizations.weight.original
    with torch.no_grad():
        original.add_(0.1 * torch.randn(shape, dtype=dtype))
    graphed.adopt(module)
    assert type(module.parametrizations.weight[0]) is graphed.ReftOrthogonal
    grad_Q = torch.randn(module.weight.shape, dtype=dtype)
    got = module.weight
    assert "_HouseholderProductBackward" in helpers.backward_names(got.grad_fn)
    (got_grad,) = torch.autograd.grad(got, original, grad_Q)
    pyvene_dist.unpatch()
    assert type(module.parametrizations.weight[0]) is not graphed.ReftOrthogonal
    with parametrize.cached():
        expected = module.weight
    (expected_grad,) = torch.autograd.grad(expected, original, grad_Q)
    assert torch.equal(got, expected)
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got_grad, expected_grad, **tolerance)


def test_unpatch_gives_torchs_class_back_and_patch_swaps_it_again():
    """A weak record of the adopted rotations; a copy made while patched runs torch's forward unpatched."""
    import copy

    from torch.nn.utils.parametrizations import _Orthogonal

    orthogonal, X = _parts(_rotation())
    with pyvene_dist.patched():
        assert type(orthogonal) is graphed.ReftOrthogonal
        duplicate = copy.deepcopy(orthogonal)
    assert type(orthogonal) is _Orthogonal
    assert type(duplicate) is graphed.ReftOrthogonal
    names = helpers.backward_names(duplicate(X).grad_fn)
    assert "LinalgHouseholderProductBackward0" in names and "_HouseholderProductBackward" not in names, names
    with pyvene_dist.patched():
        assert type(orthogonal) is graphed.ReftOrthogonal
    with pyvene_dist.patched(exclude=("householder",)):  # the rotation's own fix, torch's product
        names = helpers.backward_names(orthogonal(X).grad_fn)
        assert "LinalgHouseholderProductBackward0" in names and "_HouseholderProductBackward" not in names


def test_captured_forward_is_torchs_op_for_op():
    orthogonal, X = _parts(_rotation())
    with torch.no_grad():  # unpatched: orthogonal(X) is torch's own forward
        assert torch.equal(rotation_graphs._forward(X, orthogonal.base), orthogonal(X))


def test_captured_backward_is_the_gradient_of_torchs_forward():
    orthogonal, X = _parts(_rotation())
    grad_Q = torch.randn(X.shape, generator=torch.Generator().manual_seed(3))
    (expected,) = torch.autograd.grad(orthogonal(X), X, grad_Q)  # unpatched: torch's own backward
    with torch.no_grad():
        got = rotation_graphs._backward(X, orthogonal.base, grad_Q)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("value", "graphs"), [("0", False), ("1", True)])
def test_the_switch(monkeypatch, value, graphs):
    monkeypatch.setenv("PYVENE_DIST_CUDA_GRAPHS", value)
    with pyvene_dist.patched():
        assert OPTIONS.current.cuda_graphs is graphs


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_patchs_cuda_graphs_overrides_the_switch_and_reaches_the_rotation(monkeypatch, cuda_graphs):
    """``patch(cuda_graphs=...)`` wins over the environment, and the rotation asks for graphs only when on."""
    monkeypatch.setenv("PYVENE_DIST_CUDA_GRAPHS", "0" if cuda_graphs else "1")
    asked = []
    monkeypatch.setattr(graphed, "replayed_rotation", lambda orthogonal, X: asked.append(X) and None)
    rotate = _rotation()
    with pyvene_dist.patched(cuda_graphs=cuda_graphs):
        assert OPTIONS.current.cuda_graphs is cuda_graphs
        rotate.weight
    assert bool(asked) is cuda_graphs


def test_unpatch_releases_captured_rotations():
    orthogonal, _ = _parts(_rotation())
    with pyvene_dist.patched():
        state = MODELS.of_part(orthogonal, OrthogonalState)
        state.graphs[orthogonal] = object()  # what a capture on a GPU leaves: its graphs and their pool
    assert orthogonal not in state.graphs and graphed.graphs_of(orthogonal) is None


def test_a_bad_cuda_graphs_argument_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"cuda_graphs='0': expected True, False or None"):
        pyvene_dist.patch(cuda_graphs="0")
    assert not pyvene_dist.is_patched()


def test_a_bad_switch_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("PYVENE_DIST_CUDA_GRAPHS", "2")
    with pytest.raises(ValueError, match=r"PYVENE_DIST_CUDA_GRAPHS='2': expected one of 1, true, yes, on"):
        pyvene_dist.patch()
    assert not pyvene_dist.is_patched()


def test_captured_backward_at_the_benchmarks_shape_in_float64():
    """The closed form's arithmetic at a Llama-1B hidden size, where float64 leaves no room for rounding."""
    orthogonal, X = _parts(_rotation(hidden=2048).double())
    grad_Q = torch.randn(X.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (expected,) = torch.autograd.grad(orthogonal(X), X, grad_Q)
    with torch.no_grad():
        got = rotation_graphs._backward(X, orthogonal.base, grad_Q)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_failed_capture_warns_once_and_leaves_the_rotation_eager(patched, monkeypatch):
    rotate = _rotation()
    attempts = []

    def capture(graphs, X, base):
        attempts.append(X)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(rotation_graphs, "_applies", lambda orthogonal, X: True)  # as on a GPU
    monkeypatch.setattr(rotation_graphs._Graphs, "capture", capture)
    monkeypatch.setattr(rotation_graphs, "WARM_CALLS", 1)
    with pytest.warns(RuntimeWarning, match="runs eagerly .*operation not permitted"):
        first = rotate.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = rotate.weight
    assert len(attempts) == 1
    pyvene_dist.unpatch()
    expected = rotate.weight
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_captured_functions_under_bf16_autocast_are_torchs():
    """Under autocast the forward's last product runs in bf16 (and so its gradient): the captured forward
    runs the same kernels, the backward takes that product's gradient in bf16 as autograd does."""
    orthogonal, X = _parts(_rotation(hidden=256))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = orthogonal(X)
        with torch.no_grad():
            got = rotation_graphs._forward(X, orthogonal.base)
    assert expected.dtype == torch.bfloat16 and torch.equal(got, expected)
    grad_Q = torch.randn(X.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    (expected_grad,) = torch.autograd.grad(expected, X, grad_Q)
    with torch.no_grad():
        got_grad = rotation_graphs._backward(X, orthogonal.base, grad_Q)
    assert got_grad.dtype == torch.float32
    assert _relative_error(got_grad, expected_grad) < 1e-5


def _relative_error(got, expected):
    return ((got - expected).norm() / expected.norm()).item()


@pytest.mark.gpus(1)
def test_replays_follow_optimizer_updates_with_torchs_results(monkeypatch):
    """Each SGD step: the replayed rotation equals torch's own float32 forward bit for bit, and its gradient
    equals torch's own float32 gradient to rounding (normwise relative 1e-5), at the benchmarks' shape."""
    rotate = _rotation("cuda", hidden=2048)
    orthogonal, X = _parts(rotate)
    optimizer = torch.optim.SGD([X], lr=0.1)
    monkeypatch.setattr(rotation_graphs, "WARM_CALLS", 1)
    start = X.detach().clone()
    for step in range(4):
        expected = orthogonal(X)  # unpatched: torch's forward and backward
        (expected_grad,) = torch.autograd.grad(_loss(expected), X)
        with pyvene_dist.patched():
            weight = rotate.weight
            _loss(weight).backward()
            assert graphed.graphs_of(orthogonal).forward_graph is not None, f"step {step}: not replayed"
        assert torch.equal(weight, expected), f"step {step}: forward differs"
        error = _relative_error(X.grad, expected_grad)
        print(f"step {step}: gradient relative error {error:.2e}")
        assert error < 1e-5, f"step {step}: gradient relative error {error:.2e}"
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(X, start), "the steps did not change the rotation"


@pytest.mark.gpus(1)
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_step_is_two_graph_launches(patched, staged):
    rotate = _rotation("cuda", hidden=256)
    if staged:
        _parts(rotate)[1].ds_id = 0  # a DeepSpeed partition read directly: through a copy
    for _ in range(rotation_graphs.WARM_CALLS + 1):
        _loss(rotate.weight).backward()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        _loss(rotate.weight).backward()
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    assert names.count("cudaGraphLaunch") == 2, sorted(set(names))
    assert names.count("aten::linalg_householder_product") == 0
    assert graphed.graphs_of(_parts(rotate)[0]).staged is staged


@pytest.mark.gpus(1)
def test_a_new_storage_is_captured_again(patched):
    rotate = _rotation("cuda", hidden=256)
    orthogonal, original = _parts(rotate)
    for _ in range(rotation_graphs.WARM_CALLS + 1):
        rotate.weight
    first = graphed.graphs_of(orthogonal)
    assert first.forward_graph is not None
    original.data = original.data.clone()  # a new storage, as a move or an assigning load gives
    with torch.no_grad():
        original.data[1, 0] += 0.5
    for _ in range(rotation_graphs.WARM_CALLS + 1):
        weight = rotate.weight
    assert graphed.graphs_of(orthogonal) is not first
    assert graphed.graphs_of(orthogonal).forward_graph is not None
    pyvene_dist.unpatch()
    assert torch.equal(weight, orthogonal(original))  # torch's own forward of the changed matrix


@pytest.mark.gpus(1)
def test_an_update_between_forward_and_backward_is_refused_as_eager(patched):
    rotate = _rotation("cuda", hidden=256)
    orthogonal, original = _parts(rotate)
    for _ in range(rotation_graphs.WARM_CALLS + 1):
        weight = rotate.weight
    assert graphed.graphs_of(orthogonal).forward_graph is not None, "not captured"
    with torch.no_grad():
        original.add_(0.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _loss(weight).backward()


@pytest.mark.gpus(1)
def test_under_autocast_replays_equal_eager_and_a_new_state_is_captured_again(patched):
    rotate = _rotation("cuda", hidden=2048)
    orthogonal, X = _parts(rotate)
    results = {}
    for autocast in (True, False):  # captured under autocast, then again without
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            for _ in range(rotation_graphs.WARM_CALLS + 1):
                weight = rotate.weight
        _loss(weight.float()).backward()
        results[autocast] = weight.detach().clone(), X.grad.clone()
        X.grad = None
        assert graphed.graphs_of(orthogonal).forward_graph is not None, f"autocast={autocast}: not replayed"
    pyvene_dist.unpatch()
    for autocast, (weight, grad) in results.items():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            expected = orthogonal(X)  # torch's own forward and backward
        (expected_grad,) = torch.autograd.grad(_loss(expected.float()), X)
        assert weight.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert torch.equal(weight, expected), f"autocast={autocast}: forward differs"
        error = _relative_error(grad, expected_grad)
        assert error < 1e-5, f"autocast={autocast}: gradient relative error {error:.2e}"


@pytest.mark.gpus(1)
def test_no_graph_inside_a_capture(patched):
    orthogonal, X = _parts(_rotation("cuda", hidden=256))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(rotation_graphs.WARM_CALLS + 1):
            graphed.replayed_rotation(orthogonal, X)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        assert graphed.replayed_rotation(orthogonal, X) is None
        captured = orthogonal(X)  # torch's kernels, captured into the caller's graph
    graph.replay()
    with torch.no_grad():
        assert torch.equal(captured, rotation_graphs._forward(X, orthogonal.base))


@pytest.mark.gpus(1)
def test_reft_training_with_graphed_rotations_matches_eager(patched, monkeypatch):
    """The parity harness's ReFT training on one GPU: per-step losses, intervention gradients and final
    weights with the rotations replayed from graphs equal those of the eager rotations."""
    from pyvene_dist.testing import ParityCase, Strategy, assert_parity, train

    case = ParityCase(steps=4)
    captured = []  # the models' states go with the models: count the captures as they happen
    capture = rotation_graphs._Graphs.capture
    monkeypatch.setattr(rotation_graphs._Graphs, "capture", lambda graphs, *args: captured.append(capture(graphs, *args)))
    pyvene_dist.unpatch()
    pyvene_dist.patch(cuda_graphs=False)
    eager = train(case, Strategy("cuda:0"))
    assert not captured
    pyvene_dist.unpatch()
    pyvene_dist.patch(cuda_graphs=True)
    monkeypatch.setattr(rotation_graphs, "WARM_CALLS", 1)
    replayed = train(case, Strategy("cuda:0"))
    assert captured, "no rotation was captured"
    assert_parity(eager, replayed, case.tolerance)


class _Replayable:
    """A stand-in for a captured CUDA graph on CPU: ``replay()`` runs what was captured."""

    def __init__(self, function):
        self.replay = function


def _capture_on_cpu(graphs, X, base):
    """``_Graphs.capture`` on CPU: the 'graphs' run the captured functions on the buffers a capture reads
    (the matrix's storage, or the staged input), as replays do."""
    if graphs.staged:
        graphs.X = X.detach().float().clone()
        X = graphs.X
    X = X.detach()  # a view of the same storage: its later values are read, as a graph reads them
    graphs.grad_Q = torch.zeros(X.shape)

    def forward():
        graphs.Q = rotation_graphs._forward(X, base)

    def backward():
        graphs.grad_X = rotation_graphs._backward(X, base, graphs.grad_Q)

    graphs.forward_graph, graphs.backward_graph = _Replayable(forward), _Replayable(backward)


def _staged_graphs_on_cpu(orthogonal, X):
    """Staged graphs on CPU: the bookkeeping of the staged path (what its input holds at each backward)."""
    graphs = rotation_graphs._Graphs(settings=(), storage=(), staged=True)
    _capture_on_cpu(graphs, X, orthogonal.base)
    return graphs


def _torchs_gradient(orthogonal, X, grad_Q):
    """torch's own forward and backward, whether the rotation's class is torch's or the fix's."""
    from torch.nn.utils.parametrizations import _Orthogonal

    X = X.detach().float().requires_grad_()
    (grad,) = torch.autograd.grad(_Orthogonal.forward(orthogonal, X), X, grad_Q)
    return grad


@pytest.mark.parametrize(("moved_at", "staged"), [
    (range(8), [False, False] + [True] * 6),  # a ZeRO-3 gather's new storage at every call: staged from the 3rd
    ([2, 5], [False] * 8),  # moves apart (a load, say): read in place again, recaptured
])
def test_a_matrix_in_new_storage_at_consecutive_calls_is_read_through_a_copy(patched, monkeypatch, moved_at, staged):
    """How DeepSpeed's hooks hand a ZeRO-3 rotation its matrix (a plain float32 tensor whose storage
    changes at every step): after two calls in a row in new storage the graphs read a copy; every call's
    rotation is torch's bit for bit, its gradient torch's to rounding."""
    from torch.nn.utils.parametrizations import _Orthogonal

    rotate = _rotation()
    orthogonal, X = _parts(rotate)
    monkeypatch.setattr(rotation_graphs, "_applies", lambda orthogonal, X: False)  # as for a float32 matrix on a GPU
    monkeypatch.setattr(rotation_graphs._Graphs, "capture", _capture_on_cpu)
    found, captured = [], []
    for call in range(8):
        if call in moved_at:
            X.data = X.data.clone()
        with torch.no_grad():
            X.data[call + 1, 0] += 0.01
        weight = rotate.weight
        _loss(weight).backward()
        graphs = graphed.graphs_of(orthogonal)
        found.append(graphs.staged)
        captured.append(graphs.forward_graph is not None)
        with torch.no_grad():
            assert torch.equal(weight, _Orthogonal.forward(orthogonal, X)), f"call {call}: forward differs"
        detached = weight.detach().requires_grad_()
        (grad_Q,) = torch.autograd.grad(_loss(detached), detached)
        error = _relative_error(X.grad, _torchs_gradient(orthogonal, X, grad_Q))
        assert error < 1e-5, f"call {call}: gradient relative error {error:.2e}"
        X.grad = None
    assert found == staged
    assert captured[-1], "never replayed"


@pytest.mark.parametrize("order", ["last forward first", "first forward first"])
def test_a_staged_backward_gets_the_matrix_of_its_own_forward(order):
    """Staged graphs read one input buffer: two forwards of different matrices (and a no-grad forward of a
    third) before their backwards, in either order, each get torch's gradient of their own matrix; a
    second backward of a retained graph too."""
    orthogonal, X = _parts(_rotation())
    graphs = _staged_graphs_on_cpu(orthogonal, X)
    matrices = [(X + 0.05 * torch.randn(X.shape).tril(-1)).detach().requires_grad_() for _ in range(3)]
    weights = [torch.randn(X.shape, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    rotations = [rotation_graphs._StagedReplay.apply(matrix, graphs) for matrix in matrices[:2]]
    with torch.no_grad():
        third = graphs.replay_staged_forward(matrices[2], None)
        assert torch.equal(third, rotation_graphs._forward(matrices[2].float(), orthogonal.base))
    for i, rotation in enumerate(rotations):
        assert torch.equal(rotation, rotation_graphs._forward(matrices[i].detach(), orthogonal.base)), f"forward {i}"
    for i in ([1, 0] if order == "last forward first" else [0, 1]):
        (rotations[i] * weights[i]).sum().backward(retain_graph=True)
        (rotations[i] * weights[i]).sum().backward()  # the retained graph, again: the same gradient twice
    for i in range(2):
        expected = _torchs_gradient(orthogonal, matrices[i], weights[i])
        error = _relative_error(matrices[i].grad, 2 * expected)
        assert error < 1e-5, f"forward {i}: gradient relative error {error:.2e}"


def test_a_staged_forward_keeps_no_snapshot_once_its_backward_has_run():
    """A training step's forward and backward, then the next forward, with the first step's graph still
    referenced (as a loss kept for logging keeps it): no copy of the first matrix is made."""
    orthogonal, X = _parts(_rotation())
    graphs = _staged_graphs_on_cpu(orthogonal, X)
    X = X.detach().clone().requires_grad_()
    first = rotation_graphs._StagedReplay.apply(X, graphs)
    loss = first.square().sum()
    loss.backward()
    staging = first.grad_fn.staging
    assert not staging.pending()
    rotation_graphs._StagedReplay.apply(X, graphs)
    assert staging.snapshot is None
    second = rotation_graphs._StagedReplay.apply(X, graphs)  # the second's backward may still come: it is kept
    rotation_graphs._StagedReplay.apply(X, graphs)
    assert second.grad_fn.staging.snapshot is not None


def test_a_staged_rotation_of_a_half_precision_matrix_is_returned_in_its_dtype():
    """As the eager path: the float32 map of the matrix cast to float32, cast back; the gradient too."""
    orthogonal, X = _parts(_rotation())
    graphs = _staged_graphs_on_cpu(orthogonal, X)
    half = X.detach().bfloat16().requires_grad_()
    got = rotation_graphs._StagedReplay.apply(half, graphs)
    assert got.dtype == torch.bfloat16
    grad_Q = torch.randn(X.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    got.backward(grad_Q)
    expected_half = half.detach().clone().requires_grad_()
    expected = orthogonal(expected_half.float()).to(torch.bfloat16)
    expected.backward(grad_Q)
    assert torch.equal(got, expected)
    assert half.grad.dtype == torch.bfloat16
    assert _relative_error(half.grad.float(), expected_half.grad.float()) < 1e-2  # bf16 rounding of the same


@pytest.mark.gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_in_new_storage_at_every_step_is_replayed(patched, monkeypatch, dtype):
    """What DeepSpeed ZeRO-3's hooks hand the rotation (its matrix gathered into new storage at every
    step), and what its bf16 engine gives (the matrix in bf16): one capture, read through a copy of the
    matrix; every step's rotation equals the eager path's bit for bit, its gradient to rounding."""
    rotate = _rotation("cuda", hidden=2048)
    orthogonal, X = _parts(rotate)
    X.data = X.data.to(dtype)
    captures = []
    capture = rotation_graphs._Graphs.capture
    monkeypatch.setattr(rotation_graphs._Graphs, "capture", lambda graphs, *args: captures.append(capture(graphs, *args)))
    grad_bound = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the same float32 gradient, rounded
    for step in range(6):
        X.data = X.data.clone()  # a new storage, as each gather gives
        with torch.no_grad():
            X.data[step + 1, 0] += 0.01
        weight = rotate.weight
        _loss(weight.float()).backward()
        assert weight.dtype == dtype
        X_eager = X.detach().clone().requires_grad_()
        expected = graphed._eager(orthogonal, X_eager.float()).to(dtype)  # the eager path (torch's for float32)
        _loss(expected.float()).backward()
        assert torch.equal(weight, expected), f"step {step}: forward differs"
        error = _relative_error(X.grad.float(), X_eager.grad.float())
        assert X.grad.dtype == dtype and error < grad_bound, f"step {step}: gradient relative error {error:.2e}"
        X.grad = None
    graphs = graphed.graphs_of(orthogonal)
    assert graphs.staged and graphs.forward_graph is not None, "not replayed through a copy"
    assert len(captures) == 1


def test_a_loaded_reft_keeps_the_fixs_rotation(patched, tmp_path):
    """pyreft's ReftModel.load hands the interventions pyvene's load built to a new ReftModel and drops the model
    that adopted them, whose state gave them this fix's class back when collected: the fix adopts them again once
    the load returns (its entry around IntervenableModel.load), so they keep ReftOrthogonal (torch's has no
    half-precision kernel on the CPU)."""
    import gc

    import pyreft

    from pyvene_dist.testing import models

    models.reft_model(models.tiny_llama(), layers=(0,)).save(str(tmp_path))
    loaded = pyreft.ReftModel.load(str(tmp_path), models.tiny_llama())
    gc.collect()  # the model the load built, and its state
    rotation = next(iter(loaded.interventions.values())).rotate_layer.parametrizations.weight[0]
    assert type(rotation) is graphed.ReftOrthogonal
