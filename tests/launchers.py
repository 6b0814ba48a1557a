"""Start a real launcher (torchrun, accelerate launch, deepspeed) on a script that saves a Record."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from pyvene_dist.testing import Record


def run_launcher(tmp_path, launcher_arguments, script_arguments=(), *, timeout=480, env=None):
    """``python <launcher_arguments> OUT <script_arguments>``; returns the Record the script saved at OUT."""
    out = tmp_path / f"record-{len(list(tmp_path.iterdir()))}.pt"
    command = [sys.executable, *launcher_arguments, str(out), *script_arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout}s:\n{output}")
    assert process.returncode == 0, f"{' '.join(command)} failed:\n{output}"
    return Record(**torch.load(out))
