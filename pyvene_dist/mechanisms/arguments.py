"""Binding a call to the signature of the function it calls: ``bound(function, args, kwargs)``.

A wrapper receives what its caller passed (``args``, ``kwargs``) in whatever mix of positions and keywords the
caller chose; binding them against the original function's signature, defaults applied, gives it every argument
by name, as the original sees it. A call the original would refuse is refused here with the same ``TypeError``,
naming the function, before the wrapper acts on half of it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable


def bound(function: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``args`` and ``kwargs`` bound to ``function``'s parameters, defaults applied.

    ``function`` is what a wrapt wrapper receives as ``wrapped``: a plain function, a static method, or a method
    bound to its instance or class (whose ``self``/``cls`` is not among ``args``). The result's ``arguments``
    name every parameter; ``wrapped(*result.args, **result.kwargs)`` makes the same call.
    """
    target = getattr(function, "__func__", function)
    signature = _signature(target, target is not function)  # a bound method: its __func__ less self/cls
    try:
        arguments = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{_name(target)}(): {error}; its signature is {signature}") from None
    arguments.apply_defaults()
    return arguments


@functools.lru_cache(maxsize=256)  # keyed by the function object, never by an instance its method is bound to
def _signature(function: Callable, bound_method: bool) -> inspect.Signature:
    """``function``'s signature, less its first parameter where it is called as a bound method."""
    signature = inspect.signature(function)
    if bound_method:
        signature = signature.replace(parameters=tuple(signature.parameters.values())[1:])
    return signature


def _name(function: Callable) -> str:
    module = getattr(function, "__module__", None)
    qualified = getattr(function, "__qualname__", None) or getattr(function, "__name__", repr(function))
    return f"{module}.{qualified}" if module else qualified
