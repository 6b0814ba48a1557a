"""Which releases pyvene_dist's patches were written and tested against.

The patches reach into pyvene's and pyreft's internals; against another release they could wrap the
wrong thing and give a silently wrong result. ``patch()`` therefore refuses an unsupported release
unless told otherwise, with ``patch(allow_unsupported=True)`` or ``PYVENE_DIST_ALLOW_UNSUPPORTED=1``.
"""

from __future__ import annotations

import os
import warnings
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: Distribution name -> the releases the patches are tested against. pyreft is optional. torch: 2.11 on the
#: H200s, 2.13 on CPU (and ``patches.fsdp`` needs 2.6+ for ``torch.distributed.fsdp._fully_shard``);
#: transformers: 5.17 on the H200s, 5.24 on CPU (4.x's checkpointing is simulated in tests, never run).
SUPPORTED: dict[str, str] = {
    "pyvene": "==0.1.8",
    "pyreft": "==0.1.0",
    "transformers": ">=5.17,<5.25",
    "torch": ">=2.11,<2.14",
}
OPTIONAL = frozenset({"pyreft"})
ALLOW_ENV = "PYVENE_DIST_ALLOW_UNSUPPORTED"


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
        allow_unsupported = os.environ.get(ALLOW_ENV, "") not in ("", "0")
    message = "; ".join(problems)
    if allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=3)
        return
    raise UnsupportedVersionError(
        f"{message}. To patch anyway, call pyvene_dist.patch(allow_unsupported=True) or set {ALLOW_ENV}=1."
    )
