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

__path__.append(old_names_folder(__file__))  # last: a module of today's name is found first


def patch(
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    allow_unsupported: bool | None = None,
    **options: bool | None,
) -> None:
    """Apply the fixes (``pyvene_dist.fixes``). A second call changes nothing until ``unpatch()``.

    ``only``: these fixes and those they require; ``exclude``: every fix but these (an error if a fix
    applied requires one). Fixes that pyvene's and pyreft's ``FIXES`` report carrying are left out.

    ``options`` are the fixes' own switches, each declared in its record (``Fix(options=...)``):
    ``cuda_graphs=False`` keeps LoReFT's rotation eager on CUDA (``fixes.orthogonal``; default: the
    ``PYVENE_DIST_CUDA_GRAPHS`` environment variable, else on); ``fast_path=False`` runs every forward
    and generate through pyvene's general path (``fixes.fast_path``; default: ``PYVENE_DIST_FAST_PATH``,
    else on; see docs/fast_path.md). An option no fix declares is refused naming it and the known ones.

    Before applying anything, compares the source of every function the selected fixes depend on (pyreft's and
    ``transformers.trainer``'s too, read from their files without importing them) with the forms known to work
    (``pyvene_dist._versions``). A newer release that left them unchanged is patched, with one logged note
    (logger ``pyvene_dist``); a changed one raises ``UnsupportedVersionError`` naming the function and the fix,
    and so does torch or transformers older than the tested floors, unless ``allow_unsupported=True`` or
    ``PYVENE_DIST_ALLOW_UNSUPPORTED=1`` (then a warning). Each environment variable takes 1/0, true/false,
    yes/no or on/off in any case (``pyvene_dist._options.switch``), and another value is refused by name.
    """
    from . import _registry, _versions  # torch, wrapt and the fixes: imported by patch(), not by the package
    from .fixes import fixes, select

    if _registry.APPLIED.active:
        return
    declared = [("pyvene_dist.patch()", ALLOW_UNSUPPORTED)]
    declared += [(f"the fix {fix.name!r}", option) for fix in fixes() for option in fix.options]
    resolved = Options.resolve(declared, {"allow_unsupported": allow_unsupported, **options})
    selected = select(only, exclude)
    _versions.check(selected, resolved.allow_unsupported)
    _registry.OPTIONS.current = resolved
    try:
        for fix in selected:
            _registry.APPLIED.add(fix.name)
            fix.patch(_registry.UNDO_LOG, _registry.IMPORT_HOOKS, resolved)
    except BaseException:
        _registry.restore_all()
        raise
    _registry.APPLIED.active = True


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
    """``with pyvene_dist.patched(): ...`` -- patched inside (``patch(**options)``), as it was before outside."""
    already = is_patched()
    patch(**options)
    try:
        yield
    finally:
        if not already:
            unpatch()
