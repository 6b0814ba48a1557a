"""What ``patch()`` was asked for (``Options``): each switch from its argument, else its environment variable,
read once at ``patch()`` by one parser (``switch``), else its default."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

#: The words a switch takes, in any case; an empty variable counts as unset.
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: argument of ``patch()`` -> (environment variable, default).
VARIABLES = {
    "allow_unsupported": ("PYVENE_DIST_ALLOW_UNSUPPORTED", False),
    "cuda_graphs": ("PYVENE_DIST_CUDA_GRAPHS", True),
    "fast_path": ("PYVENE_DIST_FAST_PATH", True),
}


def switch(variable: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The environment ``variable`` as a boolean: 1/0, true/false, yes/no, on/off in any case; ``default`` when
    unset or empty. Any other value raises ``ValueError`` naming the variable, what it takes and what it holds."""
    value = environ.get(variable, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in ON or word in OFF:
        return word in ON
    raise ValueError(f"{variable}={value!r}: expected one of {', '.join(ON)} (on) or {', '.join(OFF)} (off), in any "
                     f"case, or unset ({'on' if default else 'off'})")


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``patch()`` was asked for, handed to each fix's ``on_patch`` and kept while patched
    (``REGISTRY.options``), where the fixes read their switches at run time."""

    #: Patch releases outside those the fixes were checked on, with a warning (``_versions``).
    allow_unsupported: bool = False
    #: ``orthogonal``'s CUDA graphs.
    cuda_graphs: bool = True
    #: ``fast_path``'s plans.
    fast_path: bool = True

    @classmethod
    def resolve(cls, **arguments: bool | None) -> "Options":
        """Each argument, or its environment variable where it is None (``VARIABLES``)."""
        values = {}
        for name, value in arguments.items():
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name}={value!r}: expected True, False or None")
            values[name] = switch(*VARIABLES[name]) if value is None else value
        return cls(**values)
