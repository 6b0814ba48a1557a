"""Make pyvene and pyreft train and infer under DataParallel, DDP, FSDP, DeepSpeed and device_map.

    import pyvene_dist
    pyvene_dist.patch()        # before building models; stock pyvene/pyreft/HF Trainer code then works

Importing this package changes nothing: only ``patch()`` does, and ``unpatch()`` undoes it exactly (the old
names of moved modules are files of the package's own, ``_old_names/``: ``_moved_modules``).

Beside ``patch()``: ``gather.gathered`` (the interventions whole outside a forward, as for a save under
ZeRO-3), ``optim``, ``fully_shard``, ``testing`` (the parity harness) and the commands
``pyvene-dist check`` and ``plan``. ``fixes`` holds one module per fix; names with ``_`` are private.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

__version__ = "0.1.0"
__all__ = ("patch", "unpatch", "patched", "is_patched", "positions_from_attention_mask", "__version__")

from ._moved_modules import old_names_folder
from ._options import ALLOW_UNSUPPORTED, Options  # dataclasses and os only

# Importing the package imports nothing else: the functions below import what they use (the registry needs wrapt;
# the fixes, torch, pyvene and transformers; positions, torch) when they are called (tests/test_patching.py).

__path__.append(old_names_folder(__file__))  # last: a module of today's name is found first


def patch(
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    allow_unsupported: bool | None = None,
    **options: bool | None,
) -> None:
    """Apply the fixes (``pyvene_dist.fixes``). A second call changes nothing until ``unpatch()``: one without
    arguments returns at once, one whose arguments select the fixes and options in force too, and one asking for
    others raises ``ValueError`` naming what differs (it returned quietly, leaving them unapplied).

    ``only``: these fixes and those they require; ``exclude``: every fix but these (an error if a fix
    applied requires one). Fixes that pyvene's and pyreft's ``FIXES`` report carrying are left out.

    ``options`` are the fixes' own switches, each declared in its record (``Fix(options=...)``):
    ``cuda_graphs=False`` keeps LoReFT's rotation eager on CUDA (``fixes.orthogonal``; default: the
    ``PYVENE_DIST_CUDA_GRAPHS`` environment variable, else on); ``fast_path=False`` runs every forward
    and generate through pyvene's general path (``fixes.fast_path``; default: ``PYVENE_DIST_FAST_PATH``,
    else on; see docs/fast_path.md). An option no fix declares is refused naming it and the known ones.

    Before applying anything, compares the source of every function the selected fixes depend on (pyreft's and
    ``transformers.trainer``'s too, read from their files without importing them) with the forms known to work
    (``pyvene_dist.versions``). A newer release that left them unchanged is patched, with one logged note
    (logger ``pyvene_dist``); a changed one raises ``UnsupportedVersionError`` naming the function and the fix,
    and so does torch or transformers older than the tested floors, unless ``allow_unsupported=True`` or
    ``PYVENE_DIST_ALLOW_UNSUPPORTED=1`` (then a warning). Each environment variable takes 1/0, true/false,
    yes/no or on/off in any case (``pyvene_dist._options.switch``), and another value is refused by name.
    """
    from . import _registry, versions
    from .fixes import fixes, select

    only, exclude = (tuple(names) if names is not None and not isinstance(names, str) else names  # read twice
                     for names in (only, exclude))
    if _registry.APPLIED.active and only is None and not exclude and all(value is None for value in options.values()):
        return
    declared = [("pyvene_dist.patch()", ALLOW_UNSUPPORTED)]
    declared += [(f"the fix {fix.name!r}", option) for fix in fixes() for option in fix.options]
    resolved = Options.resolve(declared, {"allow_unsupported": allow_unsupported, **options})
    selected = select(only, exclude)
    if _registry.APPLIED.active:
        given = [name for name, value in options.items() if value is not None]
        asked = {fix.name for fix in selected} if only is not None or exclude else None
        _refuse_other_arguments(asked, resolved, given, _registry.APPLIED.names, _registry.OPTIONS.current)
        return
    versions.check(selected, resolved.allow_unsupported)
    _registry.OPTIONS.current = resolved
    try:
        for fix in selected:
            _registry.APPLIED.add(fix.name)
            fix.patch(_registry.UNDO_LOG, _registry.IMPORT_HOOKS, resolved)
    except BaseException:
        _registry.restore_all()
        raise
    _registry.APPLIED.active = True


def _refuse_other_arguments(selected: set[str] | None, resolved: Options, given: list[str], applied: set[str],
                            current: Options) -> None:
    """A second ``patch()`` asking for other fixes (``selected``, where ``only``/``exclude`` were given) or other
    values of the options ``given`` than those in force (the fixes ``applied`` and the options ``current``):
    refused, naming them. ``allow_unsupported`` decides only whether the first call patched at all."""
    differ = [f"{name}={getattr(resolved, name)} ({getattr(current, name)} in force)" for name in sorted(given)
              if getattr(current, name) != getattr(resolved, name)]
    if selected is not None and selected - applied:
        differ.insert(0, f"the fixes {', '.join(sorted(selected - applied))} (not applied)")
    if selected is not None and applied - selected:
        differ.insert(0, f"no {', '.join(sorted(applied - selected))} (applied)")
    if differ:
        raise ValueError(f"pyvene_dist.patch() is in force with other arguments; this call asks for "
                         f"{'; '.join(differ)}. Call pyvene_dist.unpatch() first to patch with these")


def unpatch() -> None:
    """Put back every object ``patch()`` replaced. Without a prior ``patch()`` it does nothing."""
    from ._registry import restore_all

    restore_all()


def is_patched() -> bool:
    from ._registry import APPLIED

    return APPLIED.active


def positions_from_attention_mask(attention_mask, positions: str = "l1", *, num_interventions: int = 1,
                                  share_weights: bool = False):
    """Each row's intervention positions from a batch's attention mask, as pyreft's ``get_intervention_locations``
    gives them for the row's prompt alone (``pyvene_dist.positions``; no ``patch()`` needed)."""
    from .positions import positions_from_attention_mask as positions_of

    return positions_of(attention_mask, positions, num_interventions=num_interventions, share_weights=share_weights)


@contextlib.contextmanager
def patched(**options) -> Iterator[None]:
    """``with pyvene_dist.patched(): ...`` -- patched inside (``patch(**options)``), as it was before outside. Inside
    an earlier ``patch()``, options other than it was given are refused (``patch``)."""
    already = is_patched()
    patch(**options)
    try:
        yield
    finally:
        if not already:
            unpatch()
