"""``pyvene-dist fixes``: every fix, what it fixes, whether ``patch()`` applies it here, and the releases checked.

Everything comes from the records (``pyvene_dist.fixes``): the summary is the first paragraph of the fix
module's docstring, "applied" is what ``patch()`` with its defaults would do in this environment, and the
ranges are the record's ``checked``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

from . import _versions
from .fixes import fixes, upstreamed


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    fixes: str
    applied: bool
    #: Why not, when not applied: upstream carries it, or a release outside what it was checked on.
    reason: str
    checked: dict[str, str]
    installed: dict[str, str | None]


def summary(module: str) -> str:
    """The first paragraph of ``module``'s docstring on one line, without reST's double backquotes."""
    doc = importlib.import_module(module).__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "`")


def rows() -> list[Row]:
    records = fixes()
    carried = upstreamed(records)
    found = []
    for fix in records:
        problems = _versions.mismatches([fix])
        reason = ("upstream carries it (its packages list it in FIXES)" if fix.name in carried
                  else "patch() refuses: " + "; ".join(problems) if problems else "")
        found.append(Row(fix.name, summary(fix.module), not reason, reason, dict(fix.checked),
                         {name: _versions.installed_version(name) for name in fix.checked}))
    return found


def table(found: list[Row]) -> str:
    lines = []
    for row in found:
        checked = ", ".join(f"{name}{spec}" for name, spec in row.checked.items()) or "any release"
        lines += [f"{row.name}: {'applied' if row.applied else 'not applied'}; checked on {checked}",
                  f"    {row.fixes}"]
        if row.reason:
            lines.append(f"    not applied: {row.reason}")
    applied = sum(row.applied for row in found)
    lines.append(f"{applied} of {len(found)} fixes applied here by pyvene_dist.patch()")
    return "\n".join(lines)


def to_json(found: list[Row]) -> str:
    return json.dumps([dataclasses.asdict(row) for row in found], indent=1)
