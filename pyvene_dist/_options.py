"""What ``patch()`` is asked for: each option declared once, by what it belongs to (``Option``): the core's
``allow_unsupported`` here (``ALLOW_UNSUPPORTED``), a fix's in its record (``Fix(options=...)``). ``patch(**options)``
resolves them all into one ``Options``: each from its argument, else its environment variable (read once, at
``patch()``, by one parser: ``switch``), else its default."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping

#: The words a switch takes, in any case; an empty variable counts as unset.
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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
class Option:
    """A switch of ``patch()``: its argument ``name``, the environment ``variable`` read where the argument is
    None or not given, and the ``default`` where that is unset too."""

    name: str
    variable: str
    default: bool

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.variable.startswith("PYVENE_DIST_"):
            raise ValueError(f"Option({self.name!r}, {self.variable!r}): expected an argument name and a "
                             "PYVENE_DIST_* environment variable")

    def resolve(self, value: Any, owner: str, environ: Mapping[str, str] = os.environ) -> bool:
        """``value``, or the variable's where it is None; anything but a boolean or None is refused naming the
        option and ``owner`` (what declares it: ``"the fix 'fast_path'"``)."""
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{self.name}={value!r}: expected True, False or None (an option of {owner})")
        return switch(self.variable, self.default, environ) if value is None else value


#: Patch releases outside those the fixes were checked on, with a warning (``versions``).
ALLOW_UNSUPPORTED = Option("allow_unsupported", "PYVENE_DIST_ALLOW_UNSUPPORTED", False)


class Options:
    """What ``patch()`` was asked for, one attribute per option (``options.fast_path``), read-only: handed to each
    fix's ``on_patch`` and kept while patched (``_registry.OPTIONS``), where the fixes read theirs at run time."""

    def __init__(self, **values: bool) -> None:
        vars(self).update(values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Options are read-only (setting {name!r}); make others with replace({name}=...)")

    def replace(self, **changes: bool) -> "Options":
        unknown = sorted(set(changes) - set(vars(self)))
        if unknown:
            raise TypeError(f"Options has no option {', '.join(map(repr, unknown))}; known: {', '.join(sorted(vars(self)))}")
        return Options(**{**vars(self), **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Options({', '.join(f'{name}={value!r}' for name, value in sorted(vars(self).items()))})"

    @classmethod
    def resolve(cls, declared: Iterable[tuple[str, Option]], given: Mapping[str, Any],
                environ: Mapping[str, str] = os.environ) -> "Options":
        """Every option ``declared`` (owner, option), from ``given`` (``patch()``'s keyword arguments) or the
        environment. A name in ``given`` that nothing declares is refused naming it and the known ones."""
        owners: dict[str, tuple[str, Option]] = {}
        for owner, option in declared:
            if option.name in owners:
                raise ValueError(f"the option {option.name!r} is declared by both {owners[option.name][0]} and {owner}")
            owners[option.name] = owner, option
        unknown = sorted(set(given) - set(owners))
        if unknown:
            raise TypeError(f"pyvene_dist.patch() has no option {', '.join(map(repr, unknown))}; its options: "
                            f"{', '.join(sorted(owners))}")
        return cls(**{name: option.resolve(given.get(name), owner, environ) for name, (owner, option) in owners.items()})
