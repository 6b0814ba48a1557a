"""pyreft's LoReFT and DiReFT as the torch operations their forwards run (``fixes.fast_path``'s hook calls them in
place of the intervention module where nothing else could run: ``operations``)."""

from __future__ import annotations

import sys
import types
from types import MappingProxyType

import torch
from torch.nn.modules import module as torch_module
from transformers.activations import LinearActivation

from ..versions import fingerprint

#: The sources (``versions.fingerprint``) of pyreft 0.1.0's forwards that ``operations`` runs the operations of.
WRITTEN_FROM = MappingProxyType({
    "LoreftIntervention.forward": "e9e62508e54a2da7",
    "LowRankRotateLayer.forward": "de17864e332a5964",
    "DireftIntervention.forward": "7b42ef83fe824f81",
})


def operations(intervention, known: dict | None = None):
    """The forward of LoReFT (pyreft's default intervention) or DiReFT as the torch operations it runs, in
    its order, on its own parameters: the same outputs and gradients, bit for bit, without the module calls
    it makes (five for LoReFT) and LoReFT's second read of its parametrized rotation. That is about 45 of
    the 66 Python calls a LoReFT application costs, and in every-token generation 4 applications make most
    of what a token costs over the bare model's (``benchmarks/calls.py``).

    None, and the module is called, wherever the call could do something else: another type or a subclass
    (FSDP2's ``fully_shard`` makes one), a forward that is not pyreft 0.1.0's, one set on an instance, a
    hook on any of its modules (DeepSpeed ZeRO-3 gathers parameters in one) or a global one, an in-place
    dropout, a jit trace (module calls record scopes: ``Module._call_impl`` calls ``_slow_forward`` where
    ``torch._C._is_tracing()``, the test asked here; torch 2.15 asks it, 2.11-2.14 asked ``_get_tracing_state()``,
    which agrees with it there) or a compiled graph (where module calls cost nothing at run time).

    ``known`` (the plan's, kept per model): function -> whether it is pyreft's own, so each source is read once."""
    reft = sys.modules.get("pyreft.interventions")
    kind = type(intervention)
    form = _FORMS.get(kind.__name__)
    if reft is None or form is None or kind is not getattr(reft, kind.__name__) or torch.compiler.is_compiling() \
            or torch._C._is_tracing() or _global_hooks() \
            or not _written_from(kind.forward, f"{kind.__name__}.forward", known):
        return None
    rotate, source, act, dropout = (intervention.rotate_layer, intervention.learned_source, intervention.act_fn,
                                    intervention.dropout)
    if type(source) is not torch.nn.Linear or type(dropout) is not torch.nn.Dropout or dropout.inplace \
            or not all(_plain(module) for module in (intervention, rotate, source, dropout)) \
            or isinstance(act, torch.nn.Module) and not _plain(act):  # a function (torch.relu) is called as is
        return None
    activation = None if type(act) is LinearActivation else act  # pyreft's default act_fn returns its input
    return form(reft, rotate, source, activation, dropout, known)


def _loreft(reft, rotate, source, act, dropout, known):
    """LoreftIntervention.forward, LowRankRotateLayer.forward, Linear.forward, Dropout.forward."""
    if type(rotate).forward is not reft.LowRankRotateLayer.forward \
            or not _written_from(reft.LowRankRotateLayer.forward, "LowRankRotateLayer.forward", known):
        return None

    def loreft(base):
        weight = rotate.weight  # one read: the fast path's parametrize.cached() returns the same tensor twice
        rotated_base = torch.matmul(base.to(weight.dtype), weight)
        learned = torch.nn.functional.linear(base, source.weight, source.bias)
        output = base + torch.matmul((learned if act is None else act(learned)) - rotated_base, weight.T)
        return torch.dropout(output.to(base.dtype), dropout.p, dropout.training)  # F.dropout's operation

    return loreft


def _direft(reft, rotate, source, act, dropout, known):
    """DireftIntervention.forward (its rotation's weight is read, its module not called), Linear.forward,
    Dropout.forward."""
    def direft(base):
        cast_base = base.to(source.weight.dtype)
        learned = torch.nn.functional.linear(cast_base, source.weight, source.bias)
        weight = rotate.weight
        output = base + torch.matmul((learned if act is None else act(learned)).to(weight.dtype), weight.T)
        return torch.dropout(output.to(base.dtype), dropout.p, dropout.training)

    return direft


_FORMS = MappingProxyType({"LoreftIntervention": _loreft, "DireftIntervention": _direft})


def _written_from(function, name: str, known: dict | None) -> bool:
    """Whether ``function`` is still pyreft's own: a plain function (not wrapped, as a tracer or a user's
    patch may) whose source is the one ``operations`` was written from."""
    if type(function) is not types.FunctionType:  # first: a wrapt proxy hashes and compares as what it wraps
        return False
    same = None if known is None else known.get(function)
    if same is None:
        try:
            same = fingerprint(function) == WRITTEN_FROM[name]
        except (TypeError, OSError):  # no source to read
            same = False
        if known is not None:
            known[function] = same
    return same


def _plain(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs its class's ``forward`` and nothing else (``Module._call_impl``'s own
    test, with a ``forward`` set on the instance)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)
