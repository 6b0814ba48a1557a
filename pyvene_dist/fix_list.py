"""``pyvene-dist fixes``: every fix, what it fixes, whether ``patch()`` applies it here, the releases it was checked
on, and whether the functions it depends on are unchanged here; ``python -m pyvene_dist.fix_list --record`` records
this environment's forms of those functions as known to work.

Everything comes from the records (``pyvene_dist.fixes``) and the table of known forms (``versions.forms``): the
summary is the first paragraph of the fix module's docstring, "applied" is what ``patch()`` with its defaults would
do in this environment, "checked on" the releases recorded with the forms of every function the fix depends on
(``versions.forms.checked_on``), and "fingerprint unchanged" says that each of those functions has a known form here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json

from .versions import forms, guard, installed


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    fixes: str
    applied: bool
    #: Why not, when not applied: upstream carries it, or a function it depends on changed (or a release below
    #: the floors).
    reason: str
    #: Distribution -> the releases the forms of its functions were recorded with.
    checked: dict[str, list[str]]
    #: "unchanged", or "changed" where a function it depends on has a form it does not know here.
    fingerprint: str
    #: The functions with a form it does not know here.
    changed: list[str]
    installed: dict[str, str | None]
    #: The group it belongs to (``fixes/<group>/``), whose name ``patch(exclude=...)`` takes for all of its fixes.
    group: str | None = None


def summary(module: str) -> str:
    """The first paragraph of ``module``'s docstring on one line, without reST's double backquotes."""
    doc = importlib.import_module(module).__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "`")


def rows() -> list[Row]:
    # The fixes import pyvene, which prints on import: imported when the command runs, inside __main__'s redirect
    # of standard output (tests/cli/test_cli.py), never when the command line is.
    from .fixes import fixes, groups, upstreamed

    records = fixes()
    group_of = {name: group for group, names in groups().items() for name in names}
    carried = upstreamed(records)
    floors = guard.below_floor()
    survey = forms.survey(records)  # one pass over every fix's functions
    changes = {fix.name: [change for change in survey.changed if change.fix == fix.name] for fix in records}
    # patch() applies none while a fix it would apply has a changed function (``versions.guard``' rule)
    refusing = sorted(name for name, found in changes.items() if found and name not in carried)
    found = []
    for fix in records:
        problems = floors + [str(change) for change in changes[fix.name]]
        if not problems and refusing:
            problems = [f"functions of {', '.join(map(repr, refusing))} changed (see those fixes)"]
        reason = ("upstream carries it (its packages list it in FIXES)" if fix.name in carried
                  else "patch() refuses: " + "; ".join(problems) if problems else "")
        checked = forms.checked_on(fix)
        found.append(Row(fix.name, summary(fix.module), not reason, reason, checked,
                         "changed" if changes[fix.name] else "unchanged", [c.target for c in changes[fix.name]],
                         {name: installed.version(name) for name in checked}, group_of.get(fix.name)))
    return found


def table(found: list[Row]) -> str:
    lines = []
    for row in found:
        checked = "; ".join(f"{name} {', '.join(releases) or 'none recorded'}"
                            for name, releases in row.checked.items())
        state = "fingerprint unchanged" if not row.changed else f"fingerprint changed: {', '.join(row.changed)}"
        lines += [f"{row.name}{f' ({row.group})' if row.group else ''}: {'applied' if row.applied else 'not applied'}; checked on "
                  f"{checked or 'any release (it depends on no function it could check)'}; {state}",
                  f"    {row.fixes}"]
        if row.reason:
            lines.append(f"    not applied: {row.reason}")
    applied = sum(row.applied for row in found)
    lines.append(f"{applied} of {len(found)} fixes applied here by pyvene_dist.patch()")
    return "\n".join(lines)


def to_json(found: list[Row]) -> str:
    return json.dumps([dataclasses.asdict(row) for row in found], indent=1)


def main(argv: list[str] | None = None) -> int:
    """``python -m pyvene_dist.fix_list [--json] [--record [--source DIR --release NAME=RELEASE ...]]``."""
    parser = argparse.ArgumentParser(prog="python -m pyvene_dist.fix_list", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the fixes as JSON instead of text")
    parser.add_argument("--record", action="store_true",
                        help="add the forms of the functions the fixes depend on, as installed here, to the table of "
                             f"known forms ({forms.TABLE.parent.name}/{forms.TABLE.name}); run it after the suite passed here. A "
                             "release is recorded by its version number (+git.<commit> where pip installed it from "
                             "git): a checkout installed from a folder carries its release's number, so record it "
                             "with --source and --release instead")
    parser.add_argument("--source", metavar="DIR",
                        help="with --record: read the forms from this folder (a source tree such as a git checkout "
                             "of pyreft, holding the package folder) instead of the installed packages")
    parser.add_argument("--release", metavar="NAME=RELEASE", action="append", default=[],
                        help="with --source: the release to record for that distribution's forms, e.g. "
                             "pyreft=0.1.0+git.dafd099 (only the distributions named are recorded)")
    arguments = parser.parse_args(argv)
    releases = dict(_release(value, parser) for value in arguments.release)
    if (arguments.source is None) != (not releases):
        parser.error("--source and --release go together")
    if arguments.record:
        from .fixes import fixes  # as in rows()

        forms.write(forms.record(fixes(), arguments.source, releases or None))
        print(f"recorded in {forms.TABLE}")
        return 0
    found = rows()
    print(to_json(found) if arguments.json else table(found))
    return 0


def _release(value: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    name, _, release = value.partition("=")
    if not name or not release:
        parser.error(f"--release {value!r}: expected NAME=RELEASE, such as pyreft=0.1.0+git.dafd099")
    return name, release


if __name__ == "__main__":
    raise SystemExit(main())
