"""A package of fixes is a group (``fixes/checkpoints/``): its fixes are found, and its name stands for all of them
wherever a fix name is taken, without the warning an old name gives."""

import dataclasses
import sys
import types
import warnings
from pathlib import Path

import pytest

from pyvene_dist import fixes

CHECKPOINTS = ("fsdp_base_unsaved", "hf_resume", "intervention_files", "loreft_load", "loreft_state_dict",
               "saved_dtypes", "trainer_saves", "zero3_base_unsaved")


def test_a_packages_modules_are_fixes_and_the_package_a_group():
    assert fixes.groups()["checkpoints"] == CHECKPOINTS
    found = fixes.by_name()
    assert set(CHECKPOINTS) <= set(found) and "checkpoints" not in found
    assert found["saved_dtypes"].module == "pyvene_dist.fixes.checkpoints.saved_dtypes"


def test_a_group_name_selects_and_excludes_all_its_fixes_without_a_warning(monkeypatch):
    monkeypatch.setattr(fixes, "upstreamed", lambda records=None: frozenset())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        excluded = {record.name for record in fixes.select(exclude=["checkpoints"])}
        only = {record.name for record in fixes.select(only=["checkpoints"])}
    assert not excluded & set(CHECKPOINTS) and excluded | set(CHECKPOINTS) == set(fixes.by_name())
    assert set(CHECKPOINTS) <= only


def test_a_packages_fixes_may_name_the_group(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyreft", types.SimpleNamespace(FIXES=frozenset({"checkpoints", "deepspeed"})))
    assert fixes.carried_fixes("pyreft") == {*CHECKPOINTS, "deepspeed"}


def test_a_record_after_a_group_comes_after_each_of_its_fixes():
    known = fixes.by_name()
    later = dataclasses.replace(known["zero_grad"], module="pyvene_dist.fixes.aaa_first_by_name", after=("checkpoints",))
    order = [record.name for record in fixes._ordered({**known, "aaa_first_by_name": later})]
    assert all(order.index(name) < order.index("aaa_first_by_name") for name in CHECKPOINTS)


def test_an_unknown_name_lists_the_groups_too():
    with pytest.raises(ValueError, match=r"unknown fix 'checkpoint'; known fixes: .*; groups: checkpoints"):
        fixes.select(exclude=["checkpoint"])


def test_the_fix_list_names_each_fixs_group(capsys):
    from pyvene_dist import fix_list

    rows = {row.name: row for row in fix_list.rows()}
    assert {name: row.group for name, row in rows.items() if name in CHECKPOINTS} == dict.fromkeys(CHECKPOINTS, "checkpoints")
    assert rows["hooks"].group is None
    lines = fix_list.table(list(rows.values())).splitlines()
    assert any(line.startswith("saved_dtypes (checkpoints): ") for line in lines)
    assert any(line.startswith("hooks: ") for line in lines)


def in_folder(folder: Path) -> dict[str, list[str]]:
    """What the folder ``fixes/`` holds: its fix modules (``ALL``: each ``.py`` not named ``_*``), its groups
    (``GROUPS``: each package not named ``_*``) and each group's fix modules (``<group>.ALL``)."""
    found = {"ALL": sorted(path.stem for path in folder.glob("*.py") if not path.stem.startswith("_")),
             "GROUPS": sorted(path.parent.name for path in folder.glob("*/__init__.py")
                              if not path.parent.name.startswith("_"))}
    for group in found["GROUPS"]:
        found[f"{group}.ALL"] = sorted(path.stem for path in (folder / group).glob("*.py")
                                       if not path.stem.startswith("_"))
    return found


def listed(package: types.ModuleType) -> dict[str, list[str]]:
    """What ``fixes``' lists name, in ``in_folder``'s form."""
    short = lambda module: module.__name__.rsplit(".", 1)[-1]  # noqa: E731
    found = {"ALL": sorted(map(short, package.ALL)), "GROUPS": sorted(map(short, package.GROUPS))}
    found.update({f"{short(group)}.ALL": sorted(map(short, group.ALL)) for group in package.GROUPS})
    return found


def listing_problems(folder: Path, lists: dict[str, list[str]]) -> list[str]:
    """Each module or group in ``folder`` that its list does not name, and each name a list holds that the folder
    does not: a fix module added to the folder and not to ``ALL`` would never be applied, without a word."""
    found = in_folder(folder)
    problems = []
    for name in sorted(found.keys() | lists.keys()):
        place = f"{folder.name}/{name.removesuffix('ALL').replace('.', '/')}" if name != "GROUPS" else f"{folder.name}/"
        suffix = "/" if name == "GROUPS" else ".py"
        problems += [f"{place}{module}{suffix} is not in fixes.{name}"
                     for module in sorted(set(found.get(name, ())) - set(lists.get(name, ())))]
        problems += [f"fixes.{name} names {module}, which is not in {place}"
                     for module in sorted(set(lists.get(name, ())) - set(found.get(name, ())))]
    return problems


def test_the_lists_of_fixes_are_the_folder():
    problems = listing_problems(Path(fixes.__file__).parent, listed(fixes))
    assert not problems, "\n".join(problems)


def test_a_fix_missing_from_its_list_or_a_listed_fix_missing_from_the_folder_is_named(tmp_path):
    folder = tmp_path / "fixes"
    (folder / "group").mkdir(parents=True)
    for path in ("__init__.py", "hooks.py", "unlisted.py", "_private_part.py", "group/__init__.py", "group/a.py",
                 "group/b.py"):
        (folder / path).touch()
    lists = {"ALL": ["gone", "hooks"], "GROUPS": ["group", "other"], "group.ALL": ["a"]}
    assert listing_problems(folder, lists) == [
        "fixes/unlisted.py is not in fixes.ALL",
        "fixes.ALL names gone, which is not in fixes/",
        "fixes.GROUPS names other, which is not in fixes/",
        "fixes/group/b.py is not in fixes.group.ALL",
    ]
    assert listing_problems(folder, {**lists, "GROUPS": []})[2:4] == [
        "fixes/group/ is not in fixes.GROUPS", "fixes/group/b.py is not in fixes.group.ALL"]
