"""A package of fixes is a group (``fixes/checkpoints/``): its fixes are found, and its name stands for all of them
wherever a fix name is taken, without the warning an old name gives."""

import dataclasses
import sys
import types
import warnings

import pytest

from pyvene_dist import fixes

CHECKPOINTS = ("hf_resume", "intervention_files", "loreft_load", "loreft_state_dict", "saved_dtypes", "trainer_saves")


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
