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


#: Separates the runs of one launch of train_with_trainer.py (``OUT.pt [options] --then OUT.pt [options] ...``).
THEN = "--then"


def launch_runs(folder, launcher_arguments, runs, *, timeout=480, env=None):
    """One launch, ``python <launcher_arguments> OUT1 <runs[0]> --then OUT2 <runs[1]> ...``, of a script that makes
    each run in turn in the same processes (tests/scripts/train_with_trainer.py), instead of a launch for each run:
    each launched process imports torch, transformers and pyvene once. Returns ``(record, output)``: ``record(i)`` is
    the Record of run ``i``, and fails the test that asks for it, with the launch's output, if the launch exited
    non-zero or ran past ``timeout`` seconds (as a launch of that run alone would have); ``output`` is the launch's."""
    outs = [folder / f"record-{len(list(folder.iterdir()))}-{number}.pt" for number in range(len(runs))]
    arguments = [argument for out, run in zip(outs, runs) for argument in (THEN, str(out), *run)][1:]
    outputs, failed = _run([[*launcher_arguments, *arguments]], timeout=timeout, env=env)

    def record(number):
        if failed:
            saved = [str(n) for n, out in enumerate(outs) if out.is_file()]
            pytest.fail(f"run {number} ({' '.join(runs[number])}) was made in a launch of {len(runs)} runs that failed "
                        f"(records saved: runs {', '.join(saved) or 'none'}):\n" + "\n\n".join(failed))
        return Record(**torch.load(outs[number]))
    return record, "\n\n".join(outputs)


def run_together(commands, *, timeout=480, env=None, cwd=None):
    """``python <command>`` for each command, all at once (the nodes of one job); fails the test, with every
    output, if one exits non-zero or runs past ``timeout`` seconds (then each is killed with its children)."""
    outputs, failed = _run(commands, timeout=timeout, env=env, cwd=cwd)
    if failed:
        pytest.fail("\n\n".join(failed))
    return outputs


def _run(commands, *, timeout=480, env=None, cwd=None):
    """``run_together``'s launch: the outputs of the commands that exited 0, and a report of each that did not."""
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
    return outputs, failed


def run_forked(script, arguments=(), *, timeout=480, cwd=None):
    """``python script arguments`` as a process of its own forked from the preloaded server
    (pyvene_dist.testing._preloaded: torch, transformers and pyvene imported, nothing patched, nothing of the
    test's; spawn's fresh interpreter where there is no server): the script runs as ``__main__`` with its folder
    first on ``sys.path`` and one intra-op thread (what ``run_together``'s ``OMP_NUM_THREADS=1`` gives a fresh
    interpreter), in ``cwd`` (None: this process's), without paying the 5 of 7 seconds a fresh interpreter takes to
    import those here. Fails the test, with the script's output (its stdout and stderr), if it fails or runs past
    ``timeout`` seconds; returns that output."""
    import tempfile

    from pyvene_dist.testing import _preloaded

    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        log = str(Path(folder) / "output.txt")
        process = _preloaded.context().Process(target=_run_script, args=(str(script), [*map(str, arguments)], log, cwd),
                                               daemon=True)
        process.start()
        process.join(timeout)
        timed_out = process.is_alive()
        if timed_out:
            process.kill()
            process.join()
        output = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    if timed_out or process.exitcode != 0:
        what = f"ran past {timeout}s" if timed_out else f"exited {process.exitcode}"
        pytest.fail(f"{script} {' '.join(map(str, arguments))} {what}:\n{output}")
    return output


def _run_script(script: str, arguments: list, log: str, cwd) -> None:
    """In the forked process: file descriptors 1 and 2 to ``log`` (what Python, the loggers the server's imports made
    and C code write), then the script as ``__main__``."""
    import runpy
    import traceback

    torch.set_num_threads(1)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdout.flush(), sys.stderr.flush()
    file = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(file, 1), os.dup2(file, 2)
    os.close(file)
    try:
        sys.argv = [script, *arguments]
        sys.path.insert(0, str(Path(script).parent))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exited:
        if exited.code not in (None, 0):
            traceback.print_exc()
            raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        sys.stdout.flush(), sys.stderr.flush()
