"""The wheel installs with each extra and runs, in a fresh virtual environment, offline.

The environment sees this one's packages (torch is never downloaded): it is made with
``--system-site-packages`` and a ``.pth`` naming this interpreter's site-packages. pip then installs the
wheel with ``--no-index``: each extra's requirements must be met by what is installed here (CI's set-up
installs the test and accelerate extras), and a requirement no package here meets fails the install.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXTRAS = ("reft", "deepspeed", "accelerate", "quantize", "eval", "ray", "serve", "test", "bench")
#: Extras CI's set-up does not install (their size), installed here only where their package is.
NOT_IN_CI = {"ray": "ray"}


#: Without the caller's PYTHONPATH, which may name this checkout: the fresh environment imports its own copy.
ENV = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


def run(*command, **kwargs) -> str:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=300, env=ENV,
                            **kwargs)
    assert result.returncode == 0, (f"{command} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    return result.stdout


def test_setup_cfg_declares_the_extras_the_readme_names():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert tuple(config["options.extras_require"]) == EXTRAS
    assert "pip install --no-deps pyreft==0.1.0" in (ROOT / "README.md").read_text()


def _tracked_copy(folder: Path) -> Path:
    """The checkout's tracked files (and its untracked, unignored ones) copied to ``folder``: setuptools builds in
    the source tree's ``build/``, and a ``build/lib`` left from an earlier build put removed modules in the wheel
    (a stale ``fixes/trainer.py`` broke ``pyvene-dist fixes``), besides writing into the checkout."""
    listed = run("git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder


@pytest.mark.slow
def test_the_wheel_installs_with_each_extra_and_lists_the_fixes(tmp_path):
    source = _tracked_copy(tmp_path / "source")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "-w", tmp_path / "dist", source)
    (wheel,) = (tmp_path / "dist").glob("pyvene_dist-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python = venv / "bin" / "python"
    fresh_site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # This environment's packages (torch, pyvene, pyreft...), after the fresh one's own; pip runs from here.
    (fresh_site / "here.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    pip = (python, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-index")
    run(*pip, "--no-deps", wheel)
    for extra in EXTRAS:  # pip resolves each extra's requirements against what is installed, offline
        if extra in NOT_IN_CI and importlib.util.find_spec(NOT_IN_CI[extra]) is None:
            continue
        run(*pip, f"{wheel}[{extra}]")
    found = run(python, "-c", "import pyvene_dist; print(pyvene_dist.__file__)", cwd=tmp_path)
    assert found.startswith(str(fresh_site)), found  # the wheel's copy, not this checkout's
    listing = run(venv / "bin" / "pyvene-dist", "fixes", cwd=tmp_path)
    assert listing.splitlines()[-1].endswith("fixes applied here by pyvene_dist.patch()"), listing
