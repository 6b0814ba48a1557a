"""Optional packages are named at the top of the modules that use them and imported at their first use
(pyvene_dist._optional.OnFirstUse, issue 51)."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest

from pyvene_dist._optional import OnFirstUse


def test_a_missing_package_is_named_with_how_to_install_it_when_first_read():
    missing = OnFirstUse("pyvene_dist_no_such_package.utils", 'pip install "pyvene_dist[nothing]"')
    with pytest.raises(ImportError) as raised:
        missing.safe_get_full_grad
    assert "pyvene_dist_no_such_package.utils is needed here and is not installed" in str(raised.value)
    assert 'pip install "pyvene_dist[nothing]"' in str(raised.value)


def test_the_module_is_imported_at_the_first_read_and_not_before(tmp_path, monkeypatch):
    (tmp_path / "pyvene_dist_probe.py").write_text("IMPORTED = True\nvalue = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pyvene_dist_probe", raising=False)
    probe = OnFirstUse("pyvene_dist_probe", "write it")
    assert "pyvene_dist_probe" not in sys.modules
    assert probe.value == 3
    assert sys.modules["pyvene_dist_probe"].IMPORTED
    with mock.patch("pyvene_dist_probe.value", 4):  # read afresh: a test's patch of the module is seen
        assert probe.value == 4


@pytest.mark.parametrize("modules, optional", [
    # before pyvene, whose own import brings in peft's bitsandbytes and accelerate
    (["pyvene_dist", "pyvene_dist.gather", "pyvene_dist.loading.four_bit", "pyvene_dist.testing.runners"],
     ["deepspeed", "bitsandbytes", "accelerate", "transformers.trainer"]),
    (["pyvene_dist.evaluation", "pyvene_dist.fixes.evaluate_before_train", "pyvene_dist.fixes.checkpoints.trainer_saves",
      "pyvene_dist.fixes.pyreft_trainer.reft_compute_loss", "pyvene_dist.mechanisms.trainer_steps"],
     ["deepspeed", "lm_eval", "pyreft", "transformers.trainer"]),
], ids=["before-pyvene", "with-pyvene"])
def test_importing_the_modules_that_name_optional_packages_imports_none_of_them(modules, optional):
    code = (f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
            f"print([name for name in {optional!r} if name in sys.modules])")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip().splitlines()[-1] == "[]", found.stdout
