"""Which releases pyvene_dist's patches were written and tested against.

The patches reach into pyvene's and pyreft's internals; against another release they could wrap the
wrong thing and give a silently wrong result. ``patch()`` therefore refuses an unsupported release
unless told otherwise, with ``patch(allow_unsupported=True)`` or ``PYVENE_DIST_ALLOW_UNSUPPORTED=1``.
The variable takes ``1``/``true``/``yes`` (on) and ``0``/``false``/``no`` or empty (off), in any case;
anything else is refused, so that ``=false`` cannot turn the override on.
"""

from __future__ import annotations

import os
import warnings
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: Distribution name -> the releases the patches are tested against. pyreft is optional.
SUPPORTED: dict[str, str] = {
    "pyvene": "==0.1.8",
    "pyreft": "==0.1.0",
    "transformers": ">=4.55,<6",
    "torch": ">=2.4",
}
OPTIONAL = frozenset({"pyreft"})
ALLOW_ENV = "PYVENE_DIST_ALLOW_UNSUPPORTED"
ALLOW_VALUES = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False, "": False}


class UnsupportedVersionError(RuntimeError):
    pass


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def mismatches() -> list[str]:
    """One line per installed (or missing required) distribution outside ``SUPPORTED``."""
    problems = []
    for distribution, specifier in SUPPORTED.items():
        version = installed_version(distribution)
        if version is None:
            if distribution not in OPTIONAL:
                problems.append(f"{distribution} is not installed; pyvene_dist needs {distribution}{specifier}")
        elif not SpecifierSet(specifier).contains(Version(version), prereleases=True):
            problems.append(f"{distribution} {version} is installed; pyvene_dist supports {distribution}{specifier}")
    return problems


def check(allow_unsupported: bool | None = None) -> None:
    problems = mismatches()
    if not problems:
        return
    if allow_unsupported is None:
        allow_unsupported = allowed_by_environment()
    message = "; ".join(problems)
    if allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=3)
        return
    raise UnsupportedVersionError(
        f"{message}. To patch anyway, call pyvene_dist.patch(allow_unsupported=True) or set {ALLOW_ENV}=1."
    )


def allowed_by_environment() -> bool:
    """``PYVENE_DIST_ALLOW_UNSUPPORTED`` read as a switch; a value that is none of ``ALLOW_VALUES`` is refused."""
    value = os.environ.get(ALLOW_ENV, "")
    try:
        return ALLOW_VALUES[value.strip().lower()]
    except KeyError:
        accepted = ", ".join(repr(v) for v in ALLOW_VALUES if v)
        raise ValueError(
            f"{ALLOW_ENV}={value!r} is not a switch value; use one of {accepted} (case does not matter), "
            "or leave it unset or empty"
        ) from None
