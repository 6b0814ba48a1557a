"""``nn.Module``'s own method where a pyvene class overrides it: the ``replace`` wrapper of ``fixes.parameters``
(``BaseModel.named_parameters``) and of ``fixes.zero_grad`` (``BaseModel.zero_grad``), each the override dropped,
as if the class had never defined it."""

from __future__ import annotations

from typing import Callable

from torch import nn


def nn_module_method(name: str) -> Callable:
    """A ``replace`` wrapper, ``(wrapped, instance, args, kwargs)``, that calls ``nn.Module.<name>`` on the
    instance with the caller's arguments: the signature and behaviour of the method the override shadows."""
    method = vars(nn.Module).get(name) if isinstance(name, str) else None
    if not callable(method):
        raise ValueError(f"nn_module_method(name={name!r}): expected the name of a method nn.Module defines, "
                         f"such as 'zero_grad'; found {type(method).__name__ if method is not None else 'none'}")

    def wrapper(wrapped, instance, args, kwargs):
        return method(instance, *args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = f"_wrap_{name}"
    wrapper.__doc__ = f"``nn.Module.{name}`` on the instance, in place of its class's override."
    return wrapper
