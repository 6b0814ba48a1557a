"""Which releases pyvene_dist's fixes were written and tested against.

The fixes reach into pyvene's and pyreft's internals; against another release they could wrap the
wrong thing and give a silently wrong result. Each fix's record says which releases it was checked on
(``Fix.checked``); ``patch()`` compares the installed releases with those of the fixes it applies (a fix
upstream carries is not applied, so its range does not count), and refuses a mismatch unless told
otherwise, with ``patch(allow_unsupported=True)`` or ``PYVENE_DIST_ALLOW_UNSUPPORTED=1``.
The variable is a switch like every one of ``patch()`` (``_options.switch``): ``1``/``true``/``yes``/``on``
or ``0``/``false``/``no``/``off`` in any case, empty for off; anything else is refused, so that a typo cannot
turn the override on.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ._options import VARIABLES

#: Distribution -> releases pyvene_dist as a whole needs, whichever fixes it applies: the ones tested. torch:
#: 2.11 on the H200s, 2.13 on CPU (and ``fixes.fsdp`` needs 2.6+ for ``torch.distributed.fsdp._fully_shard``);
#: transformers: 5.17 on the H200s, 5.24 on CPU (4.x's checkpointing is simulated in tests, never run).
REQUIRED: dict[str, str] = {"transformers": ">=5.17,<5.25", "torch": ">=2.11,<2.14"}
#: Distributions that may be missing (their fixes then have nothing to fix).
OPTIONAL = frozenset({"pyreft"})
ALLOW_ENV = VARIABLES["allow_unsupported"][0]  # PYVENE_DIST_ALLOW_UNSUPPORTED


class UnsupportedVersionError(RuntimeError):
    pass


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def supported(fixes: Iterable = ()) -> dict[tuple[str, str], list[str]]:
    """(distribution, specifier) -> who declares it: ``REQUIRED`` and each fix's ``checked``."""
    declared: dict[tuple[str, str], list[str]] = {key: [] for key in REQUIRED.items()}
    for fix in fixes:
        for key in fix.checked.items():
            declared.setdefault(key, []).append(fix.name)
    return declared


def mismatches(fixes: Iterable) -> list[str]:
    """One line per installed (or missing required) distribution outside what ``fixes`` (those ``patch()``
    would apply: ``pyvene_dist.fixes.select()``) and ``REQUIRED`` declare."""
    problems = []
    for (distribution, specifier), names in supported(fixes).items():
        who = f" (checked for the fixes {', '.join(names)})" if names else ""
        version = installed_version(distribution)
        if version is None:
            if distribution not in OPTIONAL:
                problems.append(f"{distribution} is not installed; pyvene_dist needs {distribution}{specifier}{who}")
        elif not SpecifierSet(specifier).contains(Version(version), prereleases=True):
            problems.append(f"{distribution} {version} is installed; pyvene_dist supports {distribution}{specifier}{who}")
    return problems


def check(fixes: Iterable, allow_unsupported: bool) -> None:
    problems = mismatches(list(fixes))
    if not problems:
        return
    message = "; ".join(problems)
    if allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=3)
        return
    raise UnsupportedVersionError(
        f"{message}. To patch anyway, call pyvene_dist.patch(allow_unsupported=True) or set {ALLOW_ENV}=1."
    )

