"""Whether the installed releases are ones the fixes work with: judged by what changed, not by a number.

The fixes reach into pyvene's, pyreft's, torch's and transformers' internals; against a release that changed
them they could wrap the wrong thing and give a silently wrong result. ``patch()`` (``check``) therefore looks,
before it applies anything, at the form of every function each selected fix depends on (``forms``: the
places of its sites but those it adds, and its ``relies_on``), read from the files, pyreft and
``transformers.trainer`` included though they are patched only when imported:

- every form is one recorded in ``table.KNOWN`` and the installed releases are among those recorded
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

import logging
import types
import warnings
from typing import Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .._options import ALLOW_UNSUPPORTED, Options
from . import forms, installed

#: Distribution -> the oldest releases pyvene_dist supports, whichever fixes it applies: those tested. torch 2.11
#: on the H200s (and ``fixes.fsdp`` needs 2.6+ for ``torch.distributed.fsdp._fully_shard``); transformers 5.17 on
#: the H200s (4.x's checkpointing is simulated in tests, never run). Newer releases are judged by their forms.
REQUIRED = types.MappingProxyType({"transformers": ">=5.17", "torch": ">=2.11"})
#: Distributions that may be missing (their fixes then have nothing to fix, and ``fixes.upstreamed`` counts a
#: missing one as carrying its fixes).
OPTIONAL = frozenset({"pyreft", "accelerate", "deepspeed"})
ALLOW_ENV = ALLOW_UNSUPPORTED.variable  # PYVENE_DIST_ALLOW_UNSUPPORTED
RECORD_COMMAND = "python -m pyvene_dist.fix_list --record"
log = logging.getLogger("pyvene_dist")


class UnsupportedVersionError(RuntimeError):
    pass


def admits(specifier: str, version: str) -> bool:
    """Whether ``version`` is within ``specifier`` (">=5.18", ">=5.24,<5.25"), a pre-release counted as its release."""
    return SpecifierSet(specifier).contains(Version(version), prereleases=True)


def below_floor() -> list[str]:
    """One line per ``REQUIRED`` distribution below its floor or not installed."""
    problems = []
    for distribution, specifier in REQUIRED.items():
        version = installed.version(distribution)
        if version is None:
            problems.append(f"{distribution} is not installed; pyvene_dist needs {distribution}{specifier}")
        elif not admits(specifier, version):
            problems.append(f"{distribution} {version} is installed; pyvene_dist supports {distribution}{specifier}")
    return problems


def mismatches(fixes: Iterable) -> list[str]:
    """One line per reason ``patch()`` would refuse ``fixes`` (those it would apply: ``fixes.select()``)."""
    return below_floor() + [str(change) for change in forms.survey(fixes).changed]


def check(fixes: Iterable, allow_unsupported: bool) -> None:
    """``patch()``'s guard, before anything is applied (see the module's docstring). What it needs of the installed
    packages is read in one pass below (``forms.survey``); the judging here works on what that returns."""
    fixes = list(fixes)
    dependents = _dependents(fixes)
    floors, found = below_floor(), forms.survey(fixes)
    if not floors and not found.changed:
        if found.unlisted:
            log.info("pyvene_dist: %s not among the releases the fixes were checked on; the functions the fixes "
                     "depend on there are unchanged, so they are applied",
                     ", ".join(f"{name} {version}" for name, version in sorted(found.unlisted.items())))
        return
    message = "; ".join(floors + [str(change) for change in found.changed])
    if allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=3)
        return
    ways = f"call pyvene_dist.patch(allow_unsupported=True) or set {ALLOW_ENV}=1"
    if found.changed:
        refused = sorted({name for change in found.changed for name in dependents[change.fix]})
        ways = (f"Nothing was patched. Leave those fixes out with pyvene_dist.patch(exclude={refused}) (what they "
                f"fix stays broken), or, to patch anyway, {ways}; once a run on this release passes, "
                f"`{RECORD_COMMAND}` records its forms")
    else:
        ways = f"To patch anyway, {ways}"
    raise UnsupportedVersionError(f"{message}. {ways}.")


def _dependents(fixes: list) -> dict[str, set[str]]:
    """Fix name -> it and the fixes among ``fixes`` that require it, directly or through others (``exclude=`` must
    name those too)."""
    requires = {fix.name: set(fix.requires) for fix in fixes}
    found = {name: {name} for name in requires}
    grown = True
    while grown:
        grown = False
        for name, names in found.items():
            more = {other for other, needs in requires.items() if needs & names} - names
            if more:
                found[name], grown = names | more, True
    return found


def check_replaced(fix: str, path: str, original, options: Options) -> None:
    """The object a ``replace`` site (``path``) of the fix ``fix`` replaces must have a known form: ``check`` read its
    file at ``patch()``, and this is what was imported (a module imported after ``patch()`` from elsewhere, an
    original someone replaced). Called by ``_records`` as it applies the site."""
    try:
        found = forms.fingerprint(original)
    except (TypeError, OSError):  # no source to read: no fingerprint either
        found = forms.NO_SOURCE
    known = forms.known().get(path, {})
    if found in known:
        return
    message = (
        f"pyvene_dist's fix {fix!r} replaces {path}, written for the sources {forms.known_forms(known)}; "
        f"the one imported has {found}, so the replacement may drop what changed"
    )
    if options.allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=4)
        return
    raise UnsupportedVersionError(
        f"{message}. To patch anyway, call pyvene_dist.patch(allow_unsupported=True) or set "
        f"{ALLOW_ENV}=1."
    )
