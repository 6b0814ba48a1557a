"""The version guard: whether the installed releases are ones the fixes work with, judged by what changed.

``check(fixes, allow_unsupported)`` is the one entry point ``patch()`` calls, before it applies anything; the rule
is ``guard``'s docstring. The rest is its parts, called one way, down:

- ``guard``: the rule (``check``, the ``REQUIRED`` floors, ``UnsupportedVersionError``), and ``check_replaced``,
  which ``_records`` calls as it applies a ``replace`` site, on the very object it replaces;
- ``forms``: the form (source fingerprint) of each function a fix depends on, read from its file without importing
  it, against the table; ``record`` and ``write`` make the table (``python -m pyvene_dist.fix_list --record``);
- ``table``: the forms known to work, one generated module per distribution;
- ``installed``: the installed releases, the one reader of the distributions' metadata (tests replace it there).

Its old names (``pyvene_dist._versions``, ``_fingerprints``, ``_installed``, ``_fingerprints_table``) still import,
with a ``DeprecationWarning`` naming the new one (``_moved_modules``).
"""

from __future__ import annotations

from .forms import fingerprint
from .guard import (ALLOW_ENV, OPTIONAL, RECORD_COMMAND, REQUIRED, UnsupportedVersionError, admits, below_floor,
                    check, check_replaced, mismatches)

__all__ = ("ALLOW_ENV", "OPTIONAL", "RECORD_COMMAND", "REQUIRED", "UnsupportedVersionError", "admits", "below_floor",
           "check", "check_replaced", "fingerprint", "mismatches")
