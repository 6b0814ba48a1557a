"""The guard by what changed (``pyvene_dist.versions``: ``guard``, ``forms``): a release whose functions are as recorded
is patched whatever its number, a changed function refuses its fix (and ``patch()``) before anything is applied,
naming the function and the fix, pyreft's check comes at ``patch()`` rather than at ``import pyreft``, and the forms
read from the files are those ``inspect`` gives for the imported functions.

What needs a fresh interpreter (pyreft not imported yet, or imported from another folder) runs in a subprocess.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYREFT_MAIN = ROOT.parent / "shared" / "upstream" / "pyreft-main-dafd099" / "pyreft"
#: pyreft 0.1.0's and its git main's ReftTrainer.save_model, as the issue's FixError named them.
SAVE_MODEL = "pyreft.reft_trainer:ReftTrainer.save_model"
SAVE_MODEL_FORMS = "d474bae7d6bf39cc (0.1.0), 983e15605f290488 (0.1.0+git.dafd099)"


def run(code: str, first_on_path: Path) -> str:
    """``code`` in a fresh interpreter with ``first_on_path`` first on ``PYTHONPATH`` and the override unset."""
    environ = {name: value for name, value in os.environ.items() if name != "PYVENE_DIST_ALLOW_UNSUPPORTED"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(first_on_path), environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                            env=environ)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_newer_release_with_the_same_functions_is_patched_with_one_note(monkeypatch, caplog):
    import pyvene_dist
    from pyvene_dist.versions import guard, installed

    real_version = installed.version
    newer = {"transformers": "5.99.0", "torch": "2.99.1", "pyvene": "0.1.9"}
    monkeypatch.setattr(installed, "version", lambda name: newer.get(name) or real_version(name))
    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="pyvene_dist"), pyvene_dist.patched():
        assert pyvene_dist.is_patched()
    notes = [record for record in caplog.records if record.name == "pyvene_dist"]
    assert [note.getMessage() for note in notes] == [
        "pyvene_dist: pyvene 0.1.9, torch 2.99.1, transformers 5.99.0 not among the releases the fixes were checked "
        "on; the functions the fixes depend on there are unchanged, so they are applied"]


def test_the_releases_recorded_patch_without_a_note(caplog):
    import pyvene_dist

    with caplog.at_level(logging.INFO, logger="pyvene_dist"), pyvene_dist.patched():
        assert pyvene_dist.is_patched()
    assert not [record for record in caplog.records if record.name == "pyvene_dist"]


def test_a_changed_function_refuses_every_fix_before_anything_is_applied_naming_it(monkeypatch):
    """A changed function of ``devices`` (which ``locations`` and two of ``pyreft_trainer``'s fixes require) and one ``fast_path``
    relies on without wrapping it: the message names both, and ``exclude=`` the fixes it names patches the rest."""
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel
    from pyvene_dist.versions import guard, table

    for target in ("pyvene.models.modeling_utils:gather_neurons", "torch.nn.functional:dropout"):
        monkeypatch.setitem(table.KNOWN, target, {"0123456789abcdef": ("0.0.1",)})
    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    original = vars(BaseModel)["named_parameters"]
    with pytest.raises(guard.UnsupportedVersionError) as error:
        pyvene_dist.patch()
    message = str(error.value)
    assert ("the fix 'devices' depends on pyvene.models.modeling_utils:gather_neurons, whose source here has the "
            "fingerprint 5bb3f955897f8a14, and knows 0123456789abcdef (0.0.1)") in message
    assert "the fix 'fast_path' depends on torch.nn.functional:dropout" in message
    excluded = ["devices", "fast_path", "locations", "reft_classifier_evaluate", "reft_compute_loss"]
    assert f"Nothing was patched. Leave those fixes out with pyvene_dist.patch(exclude={excluded})" in message
    assert not pyvene_dist.is_patched() and vars(BaseModel)["named_parameters"] is original
    with pyvene_dist.patched(exclude=excluded):
        assert pyvene_dist.is_patched() and vars(BaseModel)["named_parameters"] is not original
    with pytest.warns(RuntimeWarning, match="patching anyway: the fix 'devices' depends on"):
        with pyvene_dist.patched(allow_unsupported=True):
            assert pyvene_dist.is_patched()


def test_a_changed_pyreft_is_refused_at_patch_without_importing_it(tmp_path):
    """pyreft (a copy on PYTHONPATH whose ``save_model`` has another body) is read, not imported, by ``patch()``,
    which refuses naming the function, the fix and the forms it knows; ``exclude=`` and ``allow_unsupported``
    then patch, and the import applies the rest."""
    import pyreft

    copy = tmp_path / "pyreft"
    shutil.copytree(Path(pyreft.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    trainer = copy / "reft_trainer.py"
    source = trainer.read_text()
    # the first of two is ReftTrainer's
    assert source.count("    def save_model(self, output_dir, _internal_call=False):\n") == 2
    trainer.write_text(source.replace("    def save_model(self, output_dir, _internal_call=False):\n",
                                      "    def save_model(self, output_dir, _internal_call=False):\n        pass\n", 1))
    out = run(f"""
        import sys, warnings
        import pyvene_dist
        from pyvene_dist.versions.guard import UnsupportedVersionError
        try:
            pyvene_dist.patch()
        except UnsupportedVersionError as error:
            message = str(error)
        else:
            raise SystemExit("patch() accepted a changed save_model")
        assert "pyreft" not in sys.modules, "patch() imported pyreft"
        assert "the fix 'trainer_saves' depends on {SAVE_MODEL}, whose source here has the fingerprint " in message
        assert "and knows {SAVE_MODEL_FORMS}" in message, message
        assert "exclude=['trainer_saves']" in message and not pyvene_dist.is_patched()
        with pyvene_dist.patched(exclude=["checkpoints"]):  # the group: trainer_saves with the others
            import pyreft.reft_trainer
            assert pyreft.__file__.startswith({str(tmp_path)!r}) and pyvene_dist.is_patched()
            assert not hasattr(vars(pyreft.reft_trainer.ReftTrainer)["save_model"], "__wrapped__")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pyvene_dist.patch(allow_unsupported=True)
        assert any("patching anyway: the fix 'trainer_saves'" in str(w.message) for w in caught)
        assert hasattr(vars(pyreft.reft_trainer.ReftTrainer)["save_model"], "__wrapped__")
        print("ok")
    """, tmp_path)
    assert out.strip().endswith("ok")


@pytest.mark.skipif(not PYREFT_MAIN.is_dir(), reason=f"pyreft's git main is not here ({PYREFT_MAIN})")
def test_pyreft_git_main_passes_the_guard_at_patch_and_on_import(tmp_path):
    """pyreft's main (same version number as 0.1.0, another ``reft_trainer.py``) is known: no refusal at
    ``patch()``, no FixError at its import, and its changed ``save_model`` is replaced as 0.1.0's is."""
    shutil.copytree(PYREFT_MAIN, tmp_path / "pyreft", ignore=shutil.ignore_patterns("__pycache__"))
    out = run(f"""
        import warnings
        warnings.simplefilter("error", RuntimeWarning)
        import pyvene_dist
        pyvene_dist.patch()
        import pyreft
        from pyreft.reft_trainer import ReftTrainer
        assert pyreft.__file__.startswith({str(tmp_path)!r}) and pyvene_dist.is_patched()
        assert "**kwargs" in __import__("inspect").getsource(vars(ReftTrainer)["save_model"].__wrapped__)
        print("ok")
    """, tmp_path)
    assert out.strip().endswith("ok")


def _imported(target):
    """What ``target`` names in its imported module: the object a site wraps."""
    import importlib

    module, qualified = target.path.split(":")
    owner = importlib.import_module(module)
    for name in qualified.split(".")[:-1]:
        owner = vars(owner)[name]
    return vars(owner)[qualified.rsplit(".", 1)[-1]]


@pytest.mark.parametrize("from_bytecode", [True, False], ids=["bytecode", "ast"])
def test_forms_read_from_the_files_are_those_of_the_imported_functions(from_bytecode):
    import pyreft  # noqa: F401 (its modules are read as the others)

    from pyvene_dist.versions import fingerprint, forms
    from pyvene_dist.fixes import fixes

    targets = {target for fix in fixes() for target in forms.targets(fix)}
    assert len(targets) > 60
    found = {target.path: (forms.static_fingerprint(target, from_bytecode=from_bytecode),
                           fingerprint(_imported(target))) for target in targets}
    differ = [f"{path}: file {read}, imported {imported}" for path, (read, imported) in sorted(found.items())
              if read != imported]
    assert not differ, differ
    index = forms.known_files()  # a file as recorded answers from the table: the same forms
    assert all(forms.static_fingerprint(target, index=index) == fingerprint(_imported(target))
               for target in targets)


def test_a_target_is_found_as_the_import_system_would_without_importing_it(tmp_path, monkeypatch):
    from pyvene_dist.versions import forms

    package = tmp_path / "guarded_package_for_pyvene_dist"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "sub" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "sub" / "mod.py").write_text("class A:\n    @staticmethod\n    @property\n    def f(x):\n"
                                            "        return x  # one\n\n    # after\n\ndef g():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = forms.Target(f"{package.name}.sub.mod:A.f")
    assert forms.module_file(target.module) == str(package / "sub" / "mod.py")
    expected = hashlib.sha256(b"@staticmethod\n@property\ndef f(x):\n    return x  # one\n").hexdigest()[:16]
    assert forms.static_fingerprint(target, from_bytecode=False) == expected
    assert forms.static_fingerprint(forms.Target(f"{package.name}.sub.mod:A.h")) == forms.ABSENT
    assert forms.static_fingerprint(forms.Target(f"{package.name}.nothing:f")) is None
    assert package.name not in sys.modules


def test_the_table_is_one_generated_module_per_distribution_read_back_whole(tmp_path):
    """``write`` puts each distribution's forms in a module of its own (``table/forms_<name>.py``, none
    near 400 lines), and the files here are what it writes of the table they hold: generated, not edited."""
    from pyvene_dist.versions import forms, table

    forms.write((forms.known(), forms.known_files()), tmp_path)
    written = sorted(path.name for path in tmp_path.glob("*.py"))
    assert written == ["forms_accelerate.py", "forms_deepspeed.py", "forms_pyreft.py", "forms_pyvene.py", "forms_torch.py",
                       "forms_transformers.py"]
    for name in written:
        assert (tmp_path / name).read_text() == (forms.TABLE / name).read_text(), name
    assert forms.known() is table.KNOWN  # what tests monkeypatch is what patch() reads
