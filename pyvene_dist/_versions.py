"""Whether the installed releases are ones the fixes work with: judged by what changed, not by a number.

The fixes reach into pyvene's, pyreft's, torch's and transformers' internals; against a release that changed
them they could wrap the wrong thing and give a silently wrong result. ``patch()`` (``check``) therefore looks,
before it applies anything, at the form of every function each selected fix depends on (``_fingerprints``: the
places of its sites but those it adds, and its ``relies_on``), read from the files, pyreft and
``transformers.trainer`` included though they are patched only when imported:

- every form is one recorded in ``_fingerprints_table.KNOWN`` and the installed releases are among those recorded
  with them: the fixes are applied;
- every form is known but a release is not among those recorded (a newer transformers that left these functions
  as they were): the fixes are applied, and one line is logged (``logging``, logger ``pyvene_dist``, INFO) naming
  the releases and that the functions are unchanged;
- some function has a form no fix knows: ``UnsupportedVersionError`` before anything is applied, naming for each
  such fix the function, the form found and the forms known, and the two ways on: ``exclude=[...]`` those fixes
  (and those requiring them), or apply them anyway. The other fixes are not applied alone: a fix left out
  silently leaves its failure (a hang, or a silently wrong gradient) in place, so leaving it out is the user's
  call, made by naming it.

torch and transformers must also be at least the ``REQUIRED`` floors (the oldest releases tested), whatever
their forms. ``patch(allow_unsupported=True)`` or ``PYVENE_DIST_ALLOW_UNSUPPORTED=1`` applies the fixes anyway,
with a ``RuntimeWarning`` saying what is unsupported. The variable is a switch like every one of ``patch()``
(``_options.switch``): ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` in any case, empty for off;
anything else is refused, so that a typo cannot turn the override on. A fix that upstream carries is not applied,
so its functions do not count.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import warnings
from importlib import metadata
from typing import Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import _fingerprints
from ._options import ALLOW_UNSUPPORTED

#: Distribution -> the oldest releases pyvene_dist supports, whichever fixes it applies: those tested. torch 2.11
#: on the H200s (and ``fixes.fsdp`` needs 2.6+ for ``torch.distributed.fsdp._fully_shard``); transformers 5.17 on
#: the H200s (4.x's checkpointing is simulated in tests, never run). Newer releases are judged by their forms.
REQUIRED = types.MappingProxyType({"transformers": ">=5.17", "torch": ">=2.11"})
#: Distributions that may be missing (their fixes then have nothing to fix, and ``fixes.upstreamed`` counts a
#: missing one as carrying its fixes).
OPTIONAL = frozenset({"pyreft"})
ALLOW_ENV = ALLOW_UNSUPPORTED.variable  # PYVENE_DIST_ALLOW_UNSUPPORTED
RECORD_COMMAND = "python -m pyvene_dist.fix_list --record"
log = logging.getLogger("pyvene_dist")


class UnsupportedVersionError(RuntimeError):
    pass


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class Changed:
    """A function ``fix`` depends on whose installed form none of those known."""

    fix: str
    target: str
    found: str
    known: dict[str, tuple[str, ...]]

    def __str__(self) -> str:
        return (f"the fix {self.fix!r} depends on {self.target}, whose source here has the fingerprint {self.found}, "
                f"and knows {known_forms(self.known)}")


def known_forms(forms: dict[str, tuple[str, ...]]) -> str:
    """``d474bae7d6bf39cc (0.1.0), 983e15605f290488 (0.1.0+git.dafd099)``, or that there is none."""
    return ", ".join(f"{form} ({', '.join(releases)})" for form, releases in forms.items()) or "no form of it"


def changed(fixes: Iterable) -> list[Changed]:
    """Every function of ``fixes`` whose installed form is not known, where its distribution is installed."""
    table, index = _fingerprints.known(), _fingerprints.known_files()
    found = []
    for fix in fixes:
        for target in _fingerprints.targets(fix):
            if target.any_form:
                continue
            form = _fingerprints.static_fingerprint(target, index=index)
            if form is None and installed_version(target.distribution) is None:
                continue  # pyreft not installed: its sites have nothing to patch
            form, forms = form or _fingerprints.ABSENT, table.get(target.path, {})
            if form not in forms:
                found.append(Changed(fix.name, target.path, form, forms))
    return found


def below_floor() -> list[str]:
    """One line per ``REQUIRED`` distribution below its floor or not installed."""
    problems = []
    for distribution, specifier in REQUIRED.items():
        version = installed_version(distribution)
        if version is None:
            problems.append(f"{distribution} is not installed; pyvene_dist needs {distribution}{specifier}")
        elif not SpecifierSet(specifier).contains(Version(version), prereleases=True):
            problems.append(f"{distribution} {version} is installed; pyvene_dist supports {distribution}{specifier}")
    return problems


def mismatches(fixes: Iterable) -> list[str]:
    """One line per reason ``patch()`` would refuse ``fixes`` (those it would apply: ``fixes.select()``)."""
    return below_floor() + [str(change) for change in changed(fixes)]


def unlisted(fixes: Iterable) -> dict[str, str]:
    """Distribution -> installed release, for each release no form of the functions of ``fixes`` was recorded
    with (the fixes' "checked on", ``_fingerprints.checked_on``)."""
    installed: dict[str, str | None] = {}
    found = {}
    for fix in fixes:
        for distribution, releases in _fingerprints.checked_on(fix).items():
            if distribution not in installed:
                installed[distribution] = installed_version(distribution)
            version = installed[distribution]
            if version is not None and Version(version).public not in {Version(r).public for r in releases}:
                found[distribution] = version
    return found


def check(fixes: Iterable, allow_unsupported: bool) -> None:
    """``patch()``'s guard, before anything is applied (see the module's docstring)."""
    fixes = list(fixes)
    floors, changes = below_floor(), changed(fixes)
    if not floors and not changes:
        newer = unlisted(fixes)
        if newer:
            log.info("pyvene_dist: %s not among the releases the fixes were checked on; the functions the fixes "
                     "depend on there are unchanged, so they are applied",
                     ", ".join(f"{name} {version}" for name, version in sorted(newer.items())))
        return
    message = "; ".join(floors + [str(change) for change in changes])
    if allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=3)
        return
    ways = f"call pyvene_dist.patch(allow_unsupported=True) or set {ALLOW_ENV}=1"
    if changes:
        refused = _with_dependents({change.fix for change in changes}, fixes)
        ways = (f"Nothing was patched. Leave those fixes out with pyvene_dist.patch(exclude={refused}) (what they "
                f"fix stays broken), or, to patch anyway, {ways}; once a run on this release passes, "
                f"`{RECORD_COMMAND}` records its forms")
    else:
        ways = f"To patch anyway, {ways}"
    raise UnsupportedVersionError(f"{message}. {ways}.")


def _with_dependents(names: set[str], fixes: list) -> list[str]:
    """``names`` and the fixes among ``fixes`` that require one of them (``exclude=`` must name those too)."""
    names = set(names)
    grown = True
    while grown:
        more = {fix.name for fix in fixes if set(fix.requires) & names} - names
        names |= more
        grown = bool(more)
    return sorted(names)
