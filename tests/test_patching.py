"""The patch layer: reversible, idempotent, lazy about pyreft, and guarded by versions.

Every order runs in a fresh interpreter (dd-trace-py's matrix): import state leaks between tests
otherwise, and "patch then import" cannot be tested in a process that has imported pyvene already.
"""

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).parent / "scripts" / "patch_probe.py"


def probe(*steps, env=None):
    result = subprocess.run(
        [sys.executable, str(PROBE), *steps], capture_output=True, text=True, timeout=300, env=env
    )
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
def test_patch_order(steps):
    assert probe(*steps).strip().endswith("ok")


def test_every_concern_wraps_its_sites():
    out = probe("import", "capture", "patch", "check-wrapped")
    from pyvene_dist.patches import concerns

    declared = sum(len(concern.SITES) for concern in concerns())
    assert f"wrapped {declared}" in out


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


def test_version_guard_names_installed_and_supported(monkeypatch):
    import pyvene_dist
    from pyvene_dist import _versions

    monkeypatch.setitem(_versions.SUPPORTED, "pyvene", "==9.9.9")
    monkeypatch.delenv(_versions.ALLOW_ENV, raising=False)
    with pytest.raises(_versions.UnsupportedVersionError) as error:
        pyvene_dist.patch()
    message = str(error.value)
    assert "pyvene 0.1.8 is installed" in message and "pyvene==9.9.9" in message
    assert _versions.ALLOW_ENV in message and "allow_unsupported=True" in message
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_version_guard_override(monkeypatch, how):
    import pyvene_dist
    from pyvene_dist import _versions

    monkeypatch.setitem(_versions.SUPPORTED, "transformers", "<1")
    kwargs = {}
    if how == "argument":
        kwargs["allow_unsupported"] = True
    else:
        monkeypatch.setenv(_versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="transformers .* is installed; pyvene_dist supports transformers<1"):
        with pyvene_dist.patched(**kwargs):
            assert pyvene_dist.is_patched()
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("value", ["false", "0", "no", "FALSE", ""])
def test_version_guard_override_off(monkeypatch, value):
    import pyvene_dist
    from pyvene_dist import _versions

    monkeypatch.setitem(_versions.SUPPORTED, "transformers", "<1")
    monkeypatch.setenv(_versions.ALLOW_ENV, value)
    with pytest.raises(_versions.UnsupportedVersionError):
        pyvene_dist.patch()
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("value", ["true", "Yes"])
def test_version_guard_override_words(monkeypatch, value):
    import pyvene_dist
    from pyvene_dist import _versions

    monkeypatch.setitem(_versions.SUPPORTED, "transformers", "<1")
    monkeypatch.setenv(_versions.ALLOW_ENV, value)
    with pytest.warns(RuntimeWarning, match="patching anyway"):
        with pyvene_dist.patched():
            assert pyvene_dist.is_patched()


def test_version_guard_refuses_other_override_values(monkeypatch):
    import pyvene_dist
    from pyvene_dist import _versions

    monkeypatch.setitem(_versions.SUPPORTED, "transformers", "<1")
    monkeypatch.setenv(_versions.ALLOW_ENV, "maybe")
    with pytest.raises(ValueError) as error:
        pyvene_dist.patch()
    assert str(error.value).startswith("PYVENE_DIST_ALLOW_UNSUPPORTED='maybe' is not a switch value")
    assert "'1', 'true', 'yes', '0', 'false', 'no'" in str(error.value)
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


def test_failed_patch_leaves_nothing_behind(monkeypatch):
    import pyvene_dist
    from pyvene.models.intervenable_base import BaseModel
    from pyvene_dist.patches import hooks

    original = vars(BaseModel)["named_parameters"]

    def broken(registry):
        raise RuntimeError("boom")

    monkeypatch.setattr(hooks, "patch", broken)
    with pytest.raises(RuntimeError, match="boom"):
        pyvene_dist.patch()
    assert vars(BaseModel)["named_parameters"] is original
    assert not pyvene_dist.is_patched()
