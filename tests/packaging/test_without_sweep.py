"""scripts/without_sweep.py: every fix has test modules it finds, a report is read as pytest writes it, and one fix's
sweep really runs its tests without it (``PYVENE_DIST_TEST_WITHOUT``) and sees them fail."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("without_sweep", ROOT / "scripts" / "without_sweep.py")
sweep = importlib.util.module_from_spec(spec)
sys.modules["without_sweep"] = sweep
spec.loader.exec_module(sweep)


def test_every_fix_has_test_modules_of_its_own():
    from pyvene_dist.fixes import fixes

    found = {fix.name: [path.name for path in sweep.modules_of(fix.name)] for fix in fixes()}
    assert all(found.values()), sorted(name for name, modules in found.items() if not modules)
    assert found["saved_dtypes"] == ["test_saved_dtypes.py", "test_saved_dtypes_half.py"]
    assert found["devices"] == ["test_devices.py"]  # not test_device_map.py, another fix's


def test_a_report_is_counted_and_names_its_first_failure(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test_a" name="test_one"/>'
        '<testcase classname="test_a" name="test_two"><skipped message="no GPU"/></testcase>'
        '<testcase classname="test_a" name="test_three"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="test_b" name="test_four"><error message="fixture"/></testcase>'
        "</testsuite></testsuites>")
    assert sweep.outcome(report) == {"failed": 2, "passed": 1, "skipped": 1, "first_failure": "test_a::test_three"}


def test_an_unknown_fix_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as stopped:
        sweep.main(["--fixes", "weight_decay,weight_decays"])
    assert stopped.value.code == 2
    assert "--fixes names ['weight_decays'], which are no fixes; known: [" in capsys.readouterr().err


def test_a_fixs_tests_fail_without_it():
    row = sweep.sweep_one("weight_decay", timeout=300)
    assert row["fails_without"] and row["failed"] >= 1, row
    assert row["modules"] == ["tests/fixes/test_weight_decay.py"]
