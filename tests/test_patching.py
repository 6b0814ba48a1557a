"""The patch layer: reversible, idempotent, lazy about pyreft, and guarded by versions.

Every order runs in a process of its own (dd-trace-py's matrix): import state leaks between tests otherwise, and
"patch then import" cannot be tested in a process that has imported pyreft or HF's trainer already. The process is
forked from the ranks' preloaded server (pyvene_dist.testing._preloaded), which imported torch, transformers and
pyvene but neither pyreft nor transformers.trainer, and patched nothing (tests/test_preloaded.py): what every order
imports first anyway, saving the 5 of the 7 seconds a fresh interpreter takes to import pyvene here.
"""

import ast
import contextlib
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from pyvene_dist.testing import _preloaded

PROBE = Path(__file__).parent / "scripts" / "patch_probe.py"


def _in_fork(steps, code, out: str) -> None:
    """In the forked process: the probe script's ``steps``, or ``code``, its output and errors written to ``out``."""
    with open(out, "w") as stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        try:
            if code is None:
                sys.argv = [str(PROBE), *steps]
                runpy.run_path(str(PROBE), run_name="__main__")
            else:
                exec(compile(code, "<test code>", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1)


def forked(tmp_path, steps=(), code=None) -> str:
    """What the probe's ``steps`` (or ``code``) printed in a process forked from the preloaded server; fails the test
    with that output and the traceback where it failed."""
    out = tmp_path / "forked.out"
    process = _preloaded.context().Process(target=_in_fork, args=(steps, code, str(out)), daemon=True)
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
        pytest.fail(f"{code or steps} still running after 300 s:\n{out.read_text() if out.exists() else ''}")
    text = out.read_text()
    assert process.exitcode == 0, f"{code or steps} failed (exit {process.exitcode}):\n{text}"
    return text


def probe(*steps, env=None, tmp_path=None):
    """The probe's output for ``steps``: in a forked process, or in a fresh interpreter where ``env`` is given."""
    if env is None:
        return forked(tmp_path, steps)
    result = subprocess.run([sys.executable, str(PROBE), *steps], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"steps {steps} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


ORDERS = {
    "import-then-patch": (
        "import", "capture", "check-behaviour-original", "patch", "check-wrapped", "check-behaviour-patched",
        "unpatch", "check-restored", "check-behaviour-original",
    ),
    "patch-then-import": (
        "patch", "check-lazy", "import-pyreft", "check-wrapped", "check-behaviour-patched",
        "unpatch", "check-restored", "check-behaviour-original",
    ),
    "patch-twice": ("import", "capture", "patch", "patch", "check-wrapped", "unpatch", "check-restored"),
    "unpatch-twice": ("import", "capture", "patch", "unpatch", "unpatch", "check-restored", "check-behaviour-original"),
    "unpatch-without-patch": ("import", "capture", "unpatch", "check-restored"),
    "patch-unpatch-patch": (
        "import", "capture", "patch", "unpatch", "patch", "check-wrapped", "check-behaviour-patched",
        "unpatch", "check-restored",
    ),
    "unpatch-before-deferred-import": ("patch", "unpatch", "import-pyreft", "check-restored", "check-behaviour-original"),
}


@pytest.mark.parametrize("steps", ORDERS.values(), ids=ORDERS.keys())
def test_patch_order(steps, tmp_path):
    assert probe(*steps, tmp_path=tmp_path).strip().endswith("ok")


def test_every_site_of_every_fix_is_wrapped_then_restored(tmp_path):
    out = probe("import", "capture", "patch", "check-wrapped", "unpatch", "check-restored",
                tmp_path=tmp_path).splitlines()
    from pyvene_dist.fixes import select

    declared = sorted(site.path for fix in select() for site in fix.places)
    assert sorted(line.split(" ", 1)[1] for line in out if line.startswith("wrapped ")) == declared
    assert sorted(line.split(" ", 1)[1] for line in out if line.startswith("restored ")) == declared


def test_import_has_no_side_effects():
    code = (
        "import sys; before = set(sys.modules); import pyvene_dist;"
        "heavy = {'torch', 'pyvene', 'pyreft', 'transformers', 'wrapt'} & set(sys.modules);"
        "assert not heavy, heavy; assert not pyvene_dist.is_patched()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plugin_imports_only_pytest():
    code = (
        "import sys; import pyvene_dist.pytest_plugin;"
        "heavy = {'torch', 'pyvene', 'pyreft', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_release_below_the_floor_is_refused_naming_installed_and_floor(monkeypatch):
    """The floors stay hard whatever the forms (transformers 5.16 is older than any release tested)."""
    import pyvene_dist
    from pyvene_dist.versions import guard, installed

    real_version = installed.version
    monkeypatch.setattr(installed, "version", lambda d: "5.16.0" if d == "transformers" else real_version(d))
    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    with pytest.raises(guard.UnsupportedVersionError) as error:
        pyvene_dist.patch()
    message = str(error.value)
    assert "transformers 5.16.0 is installed; pyvene_dist supports transformers>=5.17" in message
    assert guard.ALLOW_ENV in message and "allow_unsupported=True" in message
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_version_guard_override(monkeypatch, how):
    import pyvene_dist
    from pyvene_dist.versions import guard

    monkeypatch.setattr(guard, "REQUIRED", {**guard.REQUIRED, "transformers": "<1"})
    kwargs = {}
    if how == "argument":
        kwargs["allow_unsupported"] = True
    else:
        monkeypatch.setenv(guard.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="transformers .* is installed; pyvene_dist supports transformers<1"):
        with pyvene_dist.patched(**kwargs):
            assert pyvene_dist.is_patched()
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("value", ["false", "0", "no", "FALSE", ""])
def test_version_guard_override_off(monkeypatch, value):
    import pyvene_dist
    from pyvene_dist.versions import guard

    monkeypatch.setattr(guard, "REQUIRED", {**guard.REQUIRED, "transformers": "<1"})
    monkeypatch.setenv(guard.ALLOW_ENV, value)
    with pytest.raises(guard.UnsupportedVersionError):
        pyvene_dist.patch()
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("value", ["true", "Yes"])
def test_version_guard_override_words(monkeypatch, value):
    import pyvene_dist
    from pyvene_dist.versions import guard

    monkeypatch.setattr(guard, "REQUIRED", {**guard.REQUIRED, "transformers": "<1"})
    monkeypatch.setenv(guard.ALLOW_ENV, value)
    with pytest.warns(RuntimeWarning, match="patching anyway"):
        with pyvene_dist.patched():
            assert pyvene_dist.is_patched()


def test_version_guard_refuses_other_override_values(monkeypatch):
    import pyvene_dist
    from pyvene_dist.versions import guard

    monkeypatch.setattr(guard, "REQUIRED", {**guard.REQUIRED, "transformers": "<1"})
    monkeypatch.setenv(guard.ALLOW_ENV, "maybe")
    with pytest.raises(ValueError) as error:
        pyvene_dist.patch()
    assert str(error.value).startswith("PYVENE_DIST_ALLOW_UNSUPPORTED='maybe': expected one of 1, true, yes, on")
    assert not pyvene_dist.is_patched()


def test_unpatch_refuses_when_someone_replaced_a_site():
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel

    with pytest.raises(RuntimeError, match="BaseModel.named_parameters: replaced by someone else"):
        with pyvene_dist.patched():
            ours = vars(BaseModel)["named_parameters"]
            BaseModel.named_parameters = lambda self, *a, **k: iter(())
            try:
                pyvene_dist.unpatch()
            finally:
                BaseModel.named_parameters = ours
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("where", ["wrapper", "state", "on_patch"])
def test_a_record_that_names_its_code_by_a_string_is_refused_saying_where_it_goes(where):
    """Records hold their wrappers, states and on_patch themselves: a name given as a string (resolved by importlib
    at patch() before, so a reader lost the trail at the record) is refused when the record is made."""
    from pyvene_dist._records import Fix, Site

    wrapper, extra = ("_wrap", {}) if where == "wrapper" else (print, {where: "_named"})
    with pytest.raises(TypeError, match=rf"Fix 'fixes.example': .*{where}.*expected the object itself, not its name"):
        Fix("fixes.example", sites=(Site("pyvene.models.intervenable_base:IntervenableModel.save", wrapper),), **extra)


def test_failed_patch_leaves_nothing_behind(monkeypatch):
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel
    from pyvene_dist._records import Fix
    from pyvene_dist.fixes import fixes

    original = vars(BaseModel)["named_parameters"]
    last, fix_patch = fixes()[-1].name, Fix.patch

    def broken(fix, undo_log, import_hooks, options):
        if fix.name == last:  # every other fix is applied by then
            raise RuntimeError("boom")
        fix_patch(fix, undo_log, import_hooks, options)

    monkeypatch.setattr(Fix, "patch", broken)
    with pytest.raises(RuntimeError, match="boom"):
        pyvene_dist.patch()
    assert vars(BaseModel)["named_parameters"] is original
    assert not pyvene_dist.is_patched()
    from pyvene_dist import _registry

    assert not _registry.UNDO_LOG.sites and not _registry.APPLIED.names and _registry.OPTIONS.current is None


def _wrapped(owner, attribute):
    import wrapt

    return isinstance(vars(owner)[attribute], wrapt.FunctionWrapper)


def test_only_pulls_in_the_fixes_it_requires():
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel, IntervenableModel

    with pyvene_dist.patched(only=["gradient_checkpointing"]):
        assert _wrapped(IntervenableModel, "forward")  # checkpointing
        assert _wrapped(IntervenableModel, "_remove_forward_hooks")  # hooks, which it requires
        assert not _wrapped(BaseModel, "named_parameters")
    assert not _wrapped(IntervenableModel, "forward")


def test_exclude_leaves_a_fix_out():
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel, IntervenableModel

    with pyvene_dist.patched(exclude=["locations", "gradient_checkpointing"]):
        assert not _wrapped(BaseModel, "_broadcast_unit_locations") and not _wrapped(IntervenableModel, "forward")
        assert _wrapped(IntervenableModel, "_remove_forward_hooks") and _wrapped(BaseModel, "named_parameters")


#: (id, a second patch()'s arguments after patch(exclude=["fast_path"], cuda_graphs=False), the words of its
#: error; None where they ask for what is in force). It returned quietly, leaving what it asked for unapplied.
SECOND_PATCHES = [
    ("bare", {}, None),
    ("the-same", {"exclude": ["fast_path"], "cuda_graphs": False}, None),
    ("the-same-fixes", {"exclude": ("fast_path",)}, None),  # cuda_graphs not asked for
    ("allow-unsupported", {"allow_unsupported": True}, None),  # decides only whether the first call patched
    ("exclude-another", {"exclude": ["householder", "fast_path"]}, "this call asks for no householder (applied). "),
    ("include-it", {"only": ["fast_path"]}, "; the fixes fast_path (not applied). "),
    ("excluding-nothing", {"exclude": []}, None),  # the default: asks for no fix in particular
    ("only", {"only": ["locations"]}, "this call asks for no consistency, data_parallel,"),
    ("an-option", {"exclude": ["fast_path"], "cuda_graphs": True}, "this call asks for cuda_graphs=True (False in "
                                                                   "force). Call pyvene_dist.unpatch() first"),
    ("only-unknown", {"only": ["tensor_paralel"]}, "only: unknown fix 'tensor_paralel'"),
    ("exclude-unknown", {"exclude": ["tensor_paralel"]}, "exclude: unknown fix 'tensor_paralel'"),
    ("misspelt-option", {"cuda_graph": False}, "pyvene_dist.patch() has no option 'cuda_graph'"),
]


def test_a_second_patch_asking_for_other_fixes_or_options_is_refused_naming_them():
    """Table-driven in one test: one patch() in force for every case."""
    import pyvene_dist
    from pyvene_dist import _registry

    pyvene_dist.patch(exclude=["fast_path"], cuda_graphs=False)
    try:
        applied, options = set(_registry.APPLIED.names), _registry.OPTIONS.current
        for case, arguments, words in SECOND_PATCHES:
            if words is None:
                pyvene_dist.patch(**arguments)
            else:
                with pytest.raises((ValueError, TypeError)) as error:
                    pyvene_dist.patch(**arguments)
                assert words in str(error.value), f"{case}: {error.value}"
            assert _registry.APPLIED.names == applied and _registry.OPTIONS.current is options, case  # as it was
    finally:
        pyvene_dist.unpatch()


def test_excluding_a_fix_another_requires_names_both():
    import pyvene_dist

    with pytest.raises(ValueError, match=r"exclude=\['hooks'\] leaves out \['hooks'\], "
                                         r"which the fix 'gradient_checkpointing'"):
        pyvene_dist.patch(exclude=["hooks"])
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("argument", ["only", "exclude"])
def test_an_unknown_fix_is_refused_naming_it_and_the_known_ones(argument):
    import pyvene_dist

    with pytest.raises(ValueError, match=rf"{argument}: unknown fix 'tensor_paralel'; known fixes: .*hooks.*weight_decay"):
        pyvene_dist.patch(**{argument: ["tensor_paralel"]})
    with pytest.raises(TypeError, match=rf"{argument}='hooks': expected a collection of fix names"):
        pyvene_dist.patch(**{argument: "hooks"})
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("old, new", [("trainer", {"pyreft_trainer", "hf_trainer"}),  # split in issue 29
                                      ("checkpointing", {"gradient_checkpointing"})])  # renamed in issue 19
def test_an_old_fix_name_stands_for_the_fixes_it_became(old, new):
    from pyvene_dist import fixes

    every = {fix.name for fix in fixes.fixes()}
    new = {fix for name in new for fix in fixes.groups().get(name, (name,))}  # pyreft_trainer is a group now
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is now "):
        assert {fix.name for fix in fixes.select(exclude=[old])} == every - new - fixes.upstreamed()
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is now "):
        assert {fix.name for fix in fixes.select(only=[old])} >= new


def test_excluding_trainer_leaves_hf_trainer_and_pyreft_trainer_unwrapped():
    import pyreft.reft_trainer  # noqa: F401 (patched on import otherwise: here it is imported already)
    from pyreft.reft_trainer import ReftTrainer
    from transformers.trainer import Trainer

    import pyvene_dist

    with pytest.warns(DeprecationWarning), pyvene_dist.patched(exclude=["trainer"]):
        assert not _wrapped(Trainer, "_set_signature_columns_if_needed") and not _wrapped(ReftTrainer, "compute_loss")
        assert "train" not in vars(ReftTrainer)
    with pyvene_dist.patched():
        assert _wrapped(Trainer, "_set_signature_columns_if_needed") and _wrapped(ReftTrainer, "compute_loss")


def test_a_package_carrying_the_old_trainer_name_carries_both_halves(tmp_path, monkeypatch):
    from pyvene_dist import fixes

    package = tmp_path / "carries_trainer_for_pyvene_dist"
    package.mkdir()
    (package / "__init__.py").write_text('FIXES = frozenset({"trainer", "deepspeed"})\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fixes.carried_fixes(package.name) == {*fixes.groups()["pyreft_trainer"], "hf_trainer", "deepspeed"}


def test_a_release_carrying_fixes_is_checked_only_against_the_fixes_it_does_not_carry(monkeypatch):
    """pyvene 0.2 (pretend) reports carrying every fix with a pyvene diff but ``parameters``, and its
    ``named_parameters`` is no form that fix knows: only ``parameters`` refuses it; carrying that too, it is
    accepted (the changed function then belongs to no fix applied)."""
    import pyreft
    import pyvene

    import pyvene_dist
    from pyvene_dist.versions import guard, table
    from pyvene_dist.fixes import fixes

    monkeypatch.setitem(table.KNOWN, "pyvene.models.intervenable_base:BaseModel.named_parameters",
                        {"0123456789abcdef": ("0.2.0",)})
    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    monkeypatch.setattr(pyreft, "FIXES", frozenset(f.name for f in fixes() if "pyreft" in f.upstream), raising=False)
    carried = {fix.name for fix in fixes() if "pyvene" in fix.upstream}
    monkeypatch.setattr(pyvene, "FIXES", frozenset(carried - {"parameters"}), raising=False)
    with pytest.raises(guard.UnsupportedVersionError,
                       match=r"^the fix 'parameters' depends on pyvene\.models\.intervenable_base:BaseModel\."
                             r"named_parameters, whose source here has the fingerprint e52cb39a23126512, and knows "
                             r"0123456789abcdef \(0\.2\.0\)\. Nothing was patched\. .*exclude=\['parameters'\]"):
        pyvene_dist.patch()
    monkeypatch.setattr(pyvene, "FIXES", frozenset(carried), raising=False)
    with pyvene_dist.patched():
        assert pyvene_dist.is_patched()


def test_a_replaced_original_that_changed_is_refused_naming_the_fix(monkeypatch):
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel, IntervenableModel
    from pyvene_dist.versions import guard

    def named_parameters(self, prefix="", recurse=True):  # what a new pyvene release might define
        return iter(())

    monkeypatch.setattr(BaseModel, "named_parameters", named_parameters)
    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    with pytest.raises(guard.UnsupportedVersionError, match=r"fix 'parameters' replaces pyvene\.models\."
                                                                r"intervenable_base:BaseModel\.named_parameters"):
        pyvene_dist.patch()
    assert not pyvene_dist.is_patched() and not _wrapped(IntervenableModel, "_remove_forward_hooks")
    with pytest.warns(RuntimeWarning, match="fix 'parameters' replaces"):
        with pyvene_dist.patched(allow_unsupported=True):
            assert _wrapped(BaseModel, "named_parameters")


def test_a_deferred_fix_that_fails_undoes_every_fix_and_names_itself(tmp_path):
    """A fix of a module imported later (pyreft) whose site cannot be wrapped there: its place is pointed at a
    method the class lacks before ``patch()`` (records point at their wrappers, so none can go missing by name)."""
    code = (
        "import dataclasses, sys, pyvene, wrapt, pyvene_dist\n"
        "from pyvene.models.intervenable_base import BaseModel\n"
        "from pyvene_dist._registry import APPLIED, OPTIONS, UNDO_LOG, FixError\n"
        "from pyvene_dist.fixes.pyreft_trainer import reft_classifier_evaluate\n"
        "original = vars(BaseModel)['named_parameters']\n"
        "record = reft_classifier_evaluate.FIX\n"
        "record.__dict__['places'] = tuple(dataclasses.replace(site, path=site.path.replace('.evaluate', '.gone'))\n"
        "                                  for site in record.places)\n"
        "pyvene_dist.patch(allow_unsupported=True)\n"
        "try:\n"
        "    import pyreft\n"
        "except FixError as error:\n"
        "    message = str(error)\n"
        "else:\n"
        "    raise SystemExit('import pyreft did not fail')\n"
        "assert \"fix 'reft_classifier_evaluate' failed when pyreft.reft_trainer was imported\" in message, message\n"
        "assert \"does not define 'gone'\" in message and 'every fix was undone' in message, message\n"
        "assert not pyvene_dist.is_patched() and not UNDO_LOG.sites and not APPLIED.names and OPTIONS.current is None\n"
        "assert not [finder for finder in sys.meta_path if type(finder).__name__ == 'ImportHook'], sys.meta_path\n"
        "assert vars(BaseModel)['named_parameters'] is original\n"
    )
    forked(tmp_path, code=code)


def test_no_fix_rebinds_a_module_global():
    """Runtime state lives in the model's state object and switches in ``_registry.OPTIONS``/``APPLIED``
    (docs/architecture.md): a ``global`` statement in a fix is state that outlives ``unpatch()``."""
    folder = Path(__file__).resolve().parents[1] / "pyvene_dist" / "fixes"
    found = [f"{path.name}:{node.lineno} global {', '.join(node.names)}"
             for path in sorted(folder.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Global, ast.Nonlocal))]
    assert not found, f"fixes rebinding module globals: {found}"


def _named(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def applied_checks(source: str, names: set[str]) -> set[str]:
    """The fix names of ``names`` that ``source`` asks about: ``applied("hooks", by=FIX)`` (``_registry.applied``,
    also as ``_registry.applied(...)``), and the membership tests it replaced (``"hooks" in APPLIED``, ``not in``),
    should one come back: the code that acts only where another fix is applied. No fix imports another
    (tests/test_layout.py), so this is how one fix's code depends on another's being there."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _named(node.func) == "applied" and node.args:
            target = node.args[0]
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _named(node.comparators[0]) in ("APPLIED", "applied"):
            target = node.left
        else:
            continue
        if isinstance(target, ast.Constant) and target.value in names:
            found.add(target.value)
    return found


def shared_sites(fix, records) -> set[str]:
    """The fixes whose wrap an ``entry`` site of ``fix`` stacks on (the same attribute): applied before it."""
    entries = {site.path for site in fix.places if site.kind == "entry"}
    return {other.name for other in records.values()
            if other is not fix and any(site.path in entries and site.kind != "entry" for site in other.places)}


def fixes_used(fix, records) -> set[str]:
    """What ``fix``'s code uses of other fixes: those it asks ``APPLIED`` about (in its module and its private
    parts, ``_<fix>_*.py``) and those whose wraps its entries stack on."""
    path = Path(sys.modules[fix.module].__file__)
    sources = [path, *path.parent.glob(f"_{fix.name}_*.py")]
    names = set(records) - {fix.name}
    return set().union(*(applied_checks(source.read_text(), names) for source in sources)) | shared_sites(fix, records)


def test_each_fix_records_the_fixes_its_code_uses():
    """``requires`` (applied with it) or ``after`` (used where applied, applied before it) names every fix whose
    application a fix's code asks about or whose wrap its entry stacks on, so ``exclude=`` means what it says
    (``fsdp`` ran ``consistency``'s check with ``consistency`` excluded); and each name in ``after`` is such a
    use, so the record says why it is there (``orthogonal`` named ``householder`` nowhere while it branched on
    it, and ``householder`` required ``orthogonal``)."""
    from pyvene_dist import fixes

    records = fixes.by_name()
    used = {name: fixes_used(fix, records) for name, fix in records.items()}
    unrecorded = sorted(f"{name} uses {other}" for name, fix in records.items() for other in used[name]
                        if other not in fix.requires + fix.after)
    assert not unrecorded, f"fixes using others their record does not name: {unrecorded}"
    unused = sorted(f"{name} is after {other}" for name, fix in records.items() for other in fix.after
                    if other not in used[name])
    assert not unused, f"records naming in `after` a fix their code does not use: {unused}"


def test_a_use_of_another_fix_is_found():
    source = ('if applied("hooks", by=FIX) and not _registry.applied("devices", by=FIX):\n    pass\n'
              'x = "locations" in names\ny = applied("zero_grad", by=FIX)\nz = "orthogonal" in APPLIED\n'
              'w = applied(FIX.name, by=FIX)\n')
    assert applied_checks(source, {"hooks", "devices", "locations", "orthogonal"}) == {"hooks", "devices", "orthogonal"}


def test_no_fix_asks_about_another_by_membership():
    """A fix asks ``_registry.applied(name, by=FIX)``, which refuses a name its record does not declare, never
    ``name in APPLIED``, which answers for any (``data_parallel``, ``fsdp`` and ``orthogonal`` asked so)."""
    folder = Path(__file__).resolve().parents[1] / "pyvene_dist" / "fixes"
    found = [f"{path.relative_to(folder)}:{node.lineno}" for path in sorted(folder.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Compare) and any(_named(c) == "APPLIED" for c in node.comparators)]
    assert not found, f"fixes asking `in APPLIED` rather than _registry.applied(name, by=FIX): {found}"


def test_asking_about_a_fix_the_record_does_not_declare_is_refused(monkeypatch):
    from pyvene_dist import _registry
    from pyvene_dist._records import Fix

    record = Fix("pyvene_dist.fixes.asker", sites=(), requires=("hooks",), after=("consistency",))
    monkeypatch.setattr(_registry.APPLIED, "names", {"hooks", "asker"})
    assert _registry.applied("hooks", by=record) and _registry.applied("asker", by=record)
    assert not _registry.applied("consistency", by=record)
    with pytest.raises(_registry.FixError, match=r"the fix 'asker' asks whether 'devices' is applied, which its "
                                                 r"record does not declare: requires=\('hooks',\), after="):
        _registry.applied("devices", by=record)


def test_a_site_is_its_owner_where_the_fix_can_import_it_and_a_name_only_where_it_is_imported_later():
    """Sites of torch, transformers and pyvene are given as ``(owner, "attribute")`` (re-exports and ``relies_on``
    as objects), so that ``patch()`` resolves none by name and a reader follows each to the code; only the modules
    patched when they are imported (``_records.IMPORTED_LATER``: pyreft, ``transformers.trainer``, accelerate,
    deepspeed) are named. At 2ba72c5 every site was a ``"module:attr"`` string that ``_records`` imported."""
    from pyvene_dist import fixes

    named = sorted(f"{fix.name}: {place.path}" for fix in fixes.fixes() for place in fix.places
                   if (place.holder is None) != place.imported_later)
    assert not named, f"sites named that the fix could import, or held that are imported later: {named}"


def test_a_sites_path_is_derived_from_its_owner():
    from pyvene.models import modeling_utils
    from pyvene.models.intervenable_base import BaseModel

    from pyvene_dist._records import Fix, Site

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    assert Site((BaseModel, "zero_grad"), wrapper).path == "pyvene.models.intervenable_base:BaseModel.zero_grad"
    assert Site((modeling_utils, "do_intervention"), wrapper).path == "pyvene.models.modeling_utils:do_intervention"
    assert Fix("fixes.example", sites=(), relies_on=(BaseModel.zero_grad,)).relies_on == (
        "pyvene.models.intervenable_base:BaseModel.zero_grad",)
    with pytest.raises(TypeError, match=r"Site owner <function .*>: expected a module or a class"):
        Site((wrapper, "x"), wrapper)


def test_no_fix_copies_a_reexport_site_by_hand():
    """A name star-imported into other modules is one ``Site`` with ``reexported_in`` (fsdp's ``fully_shard``
    was three sites): the same target under other module paths is a re-export, or a definition of its own."""
    import importlib

    from pyvene_dist import fixes

    copied = []
    for fix in fixes.fixes():
        for site in fix.sites:
            for other in fix.sites:
                if other is site or other.path.split(":")[1] != site.path.split(":")[1] or other.kind != site.kind:
                    continue
                modules = [importlib.import_module(s.module) for s in (site, other)]
                if site.owner(modules[0]).__dict__.get(site.attribute) is other.owner(modules[1]).__dict__.get(other.attribute):
                    copied.append(f"{fix.name}: {other.path} re-exports {site.path}")
    assert not copied, copied


def test_a_reexport_that_became_a_definition_of_its_own_is_refused(monkeypatch):
    import types

    from pyvene_dist._records import Fix, Site
    from pyvene_dist._registry import FixError, ImportHooks, UndoLog

    def original():
        return "original"

    defining, reexporting = types.ModuleType("pyvene_dist_defines"), types.ModuleType("pyvene_dist_reexports")
    defining.f = reexporting.f = original
    monkeypatch.setitem(sys.modules, defining.__name__, defining)
    monkeypatch.setitem(sys.modules, reexporting.__name__, reexporting)
    fix = Fix("tests.reexport", sites=(Site(f"{defining.__name__}:f", lambda wrapped, instance, args, kwargs: "fixed",
                                            reexported_in=(reexporting.__name__,)),))
    undo_log = UndoLog()
    fix.patch(undo_log, ImportHooks(undo=undo_log.restore))
    assert defining.f() == reexporting.f() == "fixed"
    undo_log.restore()
    assert defining.f is original and reexporting.f is original

    def its_own():
        return "its own"

    reexporting.f = its_own
    with pytest.raises(FixError, match=r"pyvene_dist_reexports:f is not pyvene_dist_defines's f re-exported"):
        fix.patch(undo_log, ImportHooks(undo=undo_log.restore))
    undo_log.restore()
    assert defining.f is original and reexporting.f is its_own
    with pytest.raises(TypeError, match=r"reexported_in='pyvene_dist_reexports', expected a tuple of modules"):
        Site(f"{defining.__name__}:f", original, reexported_in=reexporting.__name__)
    with pytest.raises(TypeError, match=r"reexported_in=<module 'pyvene_dist_reexports'>, expected a tuple of modules"):
        Site((defining, "f"), original, reexported_in=reexporting)


def test_a_reexport_given_as_objects_is_patched_and_restored_in_each_module(monkeypatch):
    """The same site as ``(owner, "attribute")`` with the re-exporting module itself: nothing is looked up by name,
    and a re-export that became a definition of its own is still refused."""
    import types

    from pyvene_dist._records import Fix, Site
    from pyvene_dist._registry import FixError, ImportHooks, UndoLog

    def original():
        return "original"

    defining, reexporting = types.ModuleType("pyvene_dist_defines"), types.ModuleType("pyvene_dist_reexports")
    defining.f = reexporting.f = original  # neither in sys.modules: found through the objects only
    fix = Fix("tests.reexport", sites=(Site((defining, "f"), lambda wrapped, instance, args, kwargs: "fixed",
                                            reexported_in=(reexporting,)),))
    assert [(place.path, place.holder, place.source) for place in fix.places] == [
        ("pyvene_dist_defines:f", defining, None), ("pyvene_dist_reexports:f", reexporting, defining)]
    undo_log = UndoLog()
    fix.patch(undo_log, ImportHooks(undo=undo_log.restore))
    assert defining.f() == reexporting.f() == "fixed"
    undo_log.restore()
    assert defining.f is original and reexporting.f is original
    reexporting.f = lambda: "its own"
    with pytest.raises(FixError, match=r"pyvene_dist_reexports:f is not pyvene_dist_defines's f re-exported"):
        fix.patch(undo_log, ImportHooks(undo=undo_log.restore))
    undo_log.restore()


def test_unpatch_takes_off_every_import_hook_patch_installed(tmp_path):
    """Before pyreft's import, patch() waits for it with a finder on sys.meta_path; unpatch() leaves sys.meta_path
    and wrapt's post-import hooks as patch() found them (wrapt's hooks could not be unregistered), and pyreft
    imported then is pyreft's own."""
    code = (
        "import sys, wrapt.importer as importer, pyvene_dist, pyvene, transformers  # their finders come with them\n"
        # the optional extras' sites (_records.IMPORTED_LATER) imported first: patch() waits for pyreft alone
        "import accelerate.utils.fsdp_utils, deepspeed.runtime.engine\n"
        "meta_path, hooks = list(sys.meta_path), {k: list(v) for k, v in importer._post_import_hooks.items()}\n"
        "pyvene_dist.patch()\n"
        "added = [finder for finder in sys.meta_path if finder not in meta_path]\n"
        "assert 'pyreft' not in sys.modules and [type(f).__name__ for f in added] == ['ImportHook'], sys.meta_path\n"
        "pyvene_dist.unpatch()\n"
        "assert sys.meta_path == meta_path, (sys.meta_path, meta_path)\n"
        "assert {k: list(v) for k, v in importer._post_import_hooks.items()} == hooks, importer._post_import_hooks\n"
        "import pyreft.reft_trainer as reft_trainer, wrapt\n"
        "assert not isinstance(vars(reft_trainer.ReftTrainer)['compute_loss'], wrapt.FunctionWrapper)\n"
        "assert reft_trainer.__loader__ is reft_trainer.__spec__.loader and type(reft_trainer.__loader__).__module__ "
        "!= 'pyvene_dist._imports'\n"
        "pyvene_dist.patch()\n"
        "assert isinstance(vars(reft_trainer.ReftTrainer)['compute_loss'], wrapt.FunctionWrapper)\n"
        "assert sys.meta_path == meta_path  # waits for nothing: transformers.trainer came with pyreft\n"
        "pyvene_dist.unpatch()\n"
        "assert sys.meta_path == meta_path\n"
        "print('ok')\n"
    )
    assert forked(tmp_path, code=code).strip().endswith("ok")


def test_a_fix_applied_apart_from_patch_changes_only_the_undo_log_it_is_handed():
    """``Fix.patch`` records its wraps in the undo log it is given: patch()'s own objects (``_registry``'s) stay as
    they were, and that log alone puts back the very originals."""
    from pyvene.models.intervenable_base import IntervenableModel

    import pyvene_dist
    from pyvene_dist import _registry
    from pyvene_dist._registry import ImportHooks, UndoLog
    from pyvene_dist.fixes import train_mode

    before = dict(vars(IntervenableModel))
    undo_log = UndoLog()
    train_mode.FIX.patch(undo_log, ImportHooks(undo=undo_log.restore))
    assert sorted(site.name for site in undo_log.sites) == [
        "pyvene.models.intervenable_base.IntervenableModel.eval", "pyvene.models.intervenable_base.IntervenableModel.train"]
    assert vars(IntervenableModel)["train"] is not before["train"]
    assert not _registry.UNDO_LOG.sites and not _registry.APPLIED.names and not pyvene_dist.is_patched()
    undo_log.restore()
    after = dict(vars(IntervenableModel))
    assert after.keys() == before.keys() and all(after[name] is before[name] for name in before)


def test_unpatch_empties_every_job_of_the_registry():
    """What patch() set up, each in its own object (the undo log, the import hooks' finder, the applied fixes, the
    options in force, the models' states), is gone after unpatch(), and a second patch() starts afresh."""
    code = (
        "import sys, torch, pyvene_dist\n"
        "from pyvene_dist import _registry\n"
        "from pyvene_dist.fixes.hooks import HookState\n"
        "def awaiting():\n"
        "    return [finder for finder in sys.meta_path if type(finder).__name__ == 'ImportHook']\n"
        "pyvene_dist.patch(cuda_graphs=False)\n"
        "model = torch.nn.Linear(2, 2)\n"
        "_registry.MODELS.of(model, HookState)\n"
        "assert _registry.UNDO_LOG.sites and 'orthogonal' in _registry.APPLIED and len(_registry.MODELS) == 1\n"
        "assert _registry.OPTIONS.current.cuda_graphs is False and awaiting()  # pyreft is not imported yet\n"
        "pyvene_dist.unpatch()\n"
        "assert not _registry.UNDO_LOG.sites and not _registry.APPLIED.names and not _registry.APPLIED.active\n"
        "assert _registry.OPTIONS.current is None and len(_registry.MODELS) == 0 and not awaiting()\n"
        "pyvene_dist.patch()\n"
        "assert _registry.OPTIONS.current.cuda_graphs is True and 'orthogonal' in _registry.APPLIED\n"
        "assert _registry.MODELS.get(model, HookState) is None  # the state unpatch() closed is not back\n"
        "pyvene_dist.unpatch()\n"
        "print('ok')\n"
    )
    environment = {name: value for name, value in os.environ.items() if name != "PYVENE_DIST_CUDA_GRAPHS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment)
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_no_fix_docstring_types_the_releases_it_was_checked_on():
    """The releases a fix was checked on are the fingerprints table's (``pyvene-dist fixes`` shows them); a
    docstring that types them as well goes out of step with it (hooks said torch 2.11 and 2.13 where the table
    recorded pyvene 0.1.8 alone)."""
    import re

    from pyvene_dist import fixes

    typed = [fix.module for fix in fixes.fixes()
             if re.search(r"\b[Cc]hecked (?:on|with)\b[^.]*?\d+\.\d+", sys.modules[fix.module].__doc__ or "")]
    assert not typed, f"fix docstrings typing releases: {typed}"


def test_two_fixes_entries_on_one_attribute_stack_and_unpatch_restores_the_original(monkeypatch):
    """Entries of two fixes on one attribute stack, the later outside (orthogonal and deepspeed each act after
    IntervenableModel.load, around the wrap of another fix); applying the same entry again adds nothing, and
    restoring gives back the original itself."""
    import types

    from pyvene_dist._registry import UndoLog

    owner = types.SimpleNamespace()

    def original(value):
        return [value]

    owner.f = original

    def first(current):
        def first_entry(value):
            return current(value) + ["first"]
        return first_entry

    def second(current):
        def second_entry(value):
            return current(value) + ["second"]
        return second_entry

    log = UndoLog()
    for make_entry in (first, second, first, second):
        log.enter(owner, "f", make_entry)
    assert owner.f(0) == [0, "first", "second"]
    log.restore()
    assert owner.f is original
