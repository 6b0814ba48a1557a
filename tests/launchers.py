"""Start real launchers (torchrun, accelerate launch, deepspeed) on scripts users run, and read what they wrote."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyvene_dist.testing import Record

#: The scripts users write, which the tests start under launchers (tests/scripts).
SCRIPTS = Path(__file__).parent / "scripts"


def run_launcher(tmp_path, launcher_arguments, script_arguments=(), *, timeout=480, env=None):
    """``python <launcher_arguments> OUT <script_arguments>``; returns the Record the script saved at OUT."""
    out = tmp_path / f"record-{len(list(tmp_path.iterdir()))}.pt"
    run_together([[*launcher_arguments, str(out), *script_arguments]], timeout=timeout, env=env)
    return Record(**torch.load(out))


def run_together(commands, *, timeout=480, env=None, cwd=None):
    """``python <command>`` for each command, all at once (the nodes of one job); fails the test, with every
    output, if one exits non-zero or runs past ``timeout`` seconds (then each is killed with its children)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    processes = [subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True, env=environment, cwd=cwd)
                 for command in commands]
    outputs, failed = [], []
    for command, process in zip(commands, processes):
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output, _ = process.communicate()
            failed.append(f"{' '.join(command)} ran past {timeout}s:\n{output}")
            continue
        outputs.append(output)
        if process.returncode != 0:
            failed.append(f"{' '.join(command)} exited {process.returncode}:\n{output}")
    if failed:
        pytest.fail("\n\n".join(failed))
    return outputs
