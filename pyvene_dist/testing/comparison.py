"""The comparison of two runs: the trained parameters' gradients and weights read whole (also when sharded),
the largest differences between two records, and ``assert_parity``, which names the tensor, step and size
of the first disagreement."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
from torch import nn

from .._optional import DEEPSPEED_INSTALL, OnFirstUse
from .case import Record, Tensors, Tolerance

zero_utils = OnFirstUse("deepspeed.utils", DEEPSPEED_INSTALL)  # optional (the deepspeed extra): where it runs


def trained_parameters(model: nn.Module):
    """The interventions' parameters, and the base model's trainable ones (``model.<name>``)."""
    yield from model.interventions.named_parameters()
    yield from ((f"model.{name}", p) for name, p in model.model.named_parameters() if p.requires_grad)


def intervention_grads(model: nn.Module) -> Tensors:
    """CPU copies of the trained parameters' gradients (see ``trained_parameters``), whole also when DeepSpeed ZeRO,
    FSDP or tensor parallelism holds them split (reading those is a collective: every rank calls this
    at the same point)."""
    grads = {}
    for name, parameter in trained_parameters(model):
        if parameter.requires_grad:
            grad = parameter.grad
            if grad is None and "deepspeed" in sys.modules:
                grad = zero_utils.safe_get_full_grad(parameter)
            if grad is None:
                raise AssertionError(f"trained parameter {name} received no gradient")
            grads[name] = _whole(grad).detach().float().cpu().clone()
    return grads


def intervention_weights(model: nn.Module) -> Tensors:
    """CPU copies of the trained parameters, whole also under DeepSpeed ZeRO, FSDP or tensor parallelism
    (a collective, as above)."""
    weights = {}
    for name, parameter in trained_parameters(model):
        if hasattr(parameter, "ds_id") or hasattr(parameter, "_hp_mapping"):
            parameter = zero_utils.safe_get_full_fp32_param(parameter)
        weights[name] = _whole(parameter).detach().float().cpu().clone()
    return weights


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor: every shard


@dataclasses.dataclass(frozen=True)
class Differences:
    """The largest disagreement of each kind between two records (relative to the reference's scale)."""

    loss: float
    grad: float
    weight: float
    #: With ``adam_lr``: the largest final-weight difference once AdamW's response to the two runs' recorded
    #: gradients is taken out (``adam_response``); None without.
    weight_beyond_adam: float | None = None


def differences(reference: Record, candidate: Record, *, adam_lr: float = 0.0) -> Differences:
    _check_same_shape(reference, candidate)
    loss = max((abs(a - b) for a, b in zip(reference.losses, candidate.losses)), default=0.0)
    grad = max((_relative(r, c) for rs, cs in zip(reference.grads, candidate.grads) for r, c in _pairs(rs, cs)),
               default=0.0)
    weight = max((_relative(r, c) for r, c in _pairs(reference.weights, candidate.weights)), default=0.0)
    beyond = None
    if adam_lr and reference.grads and len(reference.grads) == len(candidate.grads):
        beyond = max((_relative(reference.weights[name], candidate.weights[name]
                                - adam_response(reference, candidate, name, lr=adam_lr))
                      for name in sorted(reference.weights) if name in reference.grads[0]), default=0.0)
    return Differences(loss, grad, weight, beyond)


def assert_parity(reference: Record, candidate: Record, tolerance: Tolerance, *, grads: bool = True) -> None:
    """Fail with the first tensor (step, name) outside ``tolerance``, where, and by how much.

    ``grads=False`` compares losses and weights only, for runs that cannot record gradients (HF Trainer
    with DeepSpeed); a record without gradients is otherwise an error, never a silent pass.
    """
    _check_same_shape(reference, candidate)
    if grads and len(candidate.grads) != len(candidate.losses):
        raise AssertionError(f"{candidate.strategy} recorded gradients for {len(candidate.grads)} of "
                             f"{len(candidate.losses)} steps; pass grads=False to compare losses and weights only")
    label = f"{candidate.strategy} (world size {candidate.world_size}) vs {reference.strategy}"
    _assert_close(
        torch.tensor(candidate.losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        tolerance,
        f"{label}: per-step loss {candidate.losses} vs {reference.losses}",
    )
    for step, (expected, actual) in enumerate(zip(reference.grads, candidate.grads) if grads else ()):
        for name, (e, a) in _named_pairs(expected, actual):
            _assert_close(a, e, tolerance, f"{label}: step {step}, gradient of {name}")
    for name, (e, a) in _named_pairs(reference.weights, candidate.weights):
        if tolerance.adam_lr:
            allowed = _sign_noise_allowance(reference, name, tolerance) + tolerance.rtol * (e.abs().max() + e.abs())
            a = torch.where((a - e).abs() <= allowed, e, a)
        if tolerance.adam_response_lr:
            a = a - adam_response(reference, candidate, name, lr=tolerance.adam_response_lr)
        _assert_close(a, e, tolerance, f"{label}: final weight {name}")


#: torch's AdamW defaults, which the harness and HF Trainer's adamw_torch use.
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def adam_response(reference: Record, candidate: Record, name: str, *, lr: float, betas=ADAM_BETAS,
                  eps: float = ADAM_EPS) -> torch.Tensor:
    """What AdamW's steps, fed each run's own recorded gradients of ``name``, move the candidate's weight by beyond
    the reference's: ``sum_t lr * (m_c / (sqrt(v_c) + eps) - m_r / (sqrt(v_r) + eps))`` with the bias-corrected
    moments of each side, in float64. Weight decay's term is left out: ``lr * decay * (w_c - w_r)`` is second order.

    The step divides each element's first moment by the root of its second: a gradient element of 1e-12 against a
    reference of 0 (rounding) moves that weight by ``lr * 1e-12 / (1e-12 + eps)``, 1e-4 x lr, which a relative bound
    on the weights reads as a fault, while the gradients themselves agree within it."""
    (beta1, beta2), moved = betas, None
    moments = {"c": [0.0, 0.0], "r": [0.0, 0.0]}
    for step, (expected, actual) in enumerate(zip(reference.grads, candidate.grads), start=1):
        steps = {}
        for side, grad in (("r", expected[name].double()), ("c", actual[name].double())):
            first, second = moments[side]
            first, second = beta1 * first + (1 - beta1) * grad, beta2 * second + (1 - beta2) * grad * grad
            moments[side] = [first, second]
            steps[side] = lr * (first / (1 - beta1 ** step)) / ((second / (1 - beta2 ** step)).sqrt() + eps)
        difference = steps["r"] - steps["c"]  # the weight moves against the step
        moved = difference if moved is None else moved + difference
    if moved is None:
        raise AssertionError(f"{reference.strategy} recorded no gradients: Tolerance.adam_response_lr needs both runs'")
    return moved.float()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tolerance.rtol,
        atol=tolerance.rtol * scale,
        msg=lambda detail: f"{what} differs ({tolerance.why}):\n{detail}",
    )


def _sign_noise_allowance(reference: Record, name: str, tolerance: Tolerance) -> torch.Tensor:
    """2 x lr for each step in which the reference's gradient of an element was within the bound's noise
    (``rtol`` of the tensor's largest): Adam's step is lr x sign(gradient) at first, about lr later, so the
    other side's rounding may have stepped such an element the other way."""
    if not reference.grads:
        raise AssertionError(f"{reference.strategy} recorded no gradients: Tolerance.adam_lr needs the reference's")
    noise = [(grads[name].abs() <= tolerance.rtol * grads[name].abs().max()).float() for grads in reference.grads]
    return 2 * tolerance.adam_lr * torch.stack(noise).sum(0)


def _relative(expected: torch.Tensor, actual: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    difference = (actual - expected).abs().max().item()
    return difference / scale if scale else difference


def _check_same_shape(reference: Record, candidate: Record) -> None:
    if len(reference.losses) != len(candidate.losses):
        raise AssertionError(f"{len(candidate.losses)} steps recorded, expected {len(reference.losses)}")
    if set(reference.weights) != set(candidate.weights):
        raise AssertionError(
            f"intervention parameters differ: {sorted(set(reference.weights) ^ set(candidate.weights))}"
        )
    if any(math.isnan(loss) for loss in candidate.losses):
        raise AssertionError(f"{candidate.strategy}: NaN loss {candidate.losses}")


def _named_pairs(expected: Tensors, actual: Tensors):
    if set(expected) != set(actual):
        raise AssertionError(f"parameters differ: {sorted(set(expected) ^ set(actual))}")
    return ((name, (expected[name], actual[name])) for name in sorted(expected))


def _pairs(expected: Tensors, actual: Tensors) -> list[tuple[Any, Any]]:
    return [pair for _, pair in _named_pairs(expected, actual)]
