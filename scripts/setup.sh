#!/usr/bin/env bash
# Create .venv with pyvene_dist, its test and launcher extras, pyreft and DeepSpeed (CPU machine).
# torch goes first, pinned: this machine keeps the CPU build of torch 2.13.0 on disk, and a package
# that asks for plain "torch" would otherwise pull a 5 GB CUDA build. Set PYVENE_DIST_TORCH to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# Every install below takes the versions the suite is checked on (scripts/constraints.txt): setup.cfg has
# lower bounds only, and a newer transformers on PyPI would otherwise change what CI tests.
constraints=(-c scripts/constraints.txt)
pip install --upgrade pip
pip install "${PYVENE_DIST_TORCH:-torch==2.13.0}"
# DeepSpeed builds against the torch above (its CPU ops compile on first use, about a minute); before the
# test extra, which names it, so that pip does not build it in an isolated environment without torch.
pip install "${constraints[@]}" setuptools wheel
pip install "${constraints[@]}" --no-build-isolation "deepspeed==0.19.8"
pip install "${constraints[@]}" -e ".[test,accelerate,quantize]"
# pyreft's own requirements pull in jupyter and wandb; what it imports is already here (the test extra).
pip install --no-deps pyreft==0.1.0
# Build DeepSpeed's shared-memory communication op now: every DeepSpeed process on CPU loads it when it joins
# the process group, and the first ones would otherwise build it there (minutes on a loaded machine), each
# waiting on the others' lock, inside the tests' time limits.
# A build killed midway leaves its lock behind, and torch's next build of the op would wait on it forever:
# a lock older than the longest build goes, and the build is given at most 15 minutes.
if .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -path '*deepspeed_shm_comm/lock' -mmin +15 \
        -print -delete 2>/dev/null || true
    DS_ACCELERATOR=cpu timeout 900 .venv/bin/python -c "from deepspeed.accelerator import get_accelerator; \
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
        || echo "setup: DeepSpeed's shm comm op did not build; DeepSpeed on CPU will build it at first use" >&2
else
    echo "setup: deepspeed is not installed; its shm comm op is not built" >&2
fi
# libaio for DeepSpeed's NVMe offload, unpacked into .libaio/ (no root needed); without it those tests skip.
bash scripts/fetch_libaio.sh || echo "setup: libaio not fetched; the NVMe offload tests will skip" >&2
# Build DeepSpeed's async_io op (NVMe offload) now too, against that libaio: the first NVMe test would
# otherwise spend about five minutes of the suite compiling it. Bounded, and a stale lock goes, as above.
if [ -d .libaio ] && .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -path '*async_io/lock' -mmin +15 \
        -print -delete 2>/dev/null || true
    DS_ACCELERATOR=cpu timeout 900 .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import helpers; \
helpers.use_libaio(); from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load()" \
        || echo "setup: DeepSpeed's async_io op did not build; the first NVMe test will build it" >&2
fi
.venv/bin/python -c "import torch, pyvene, pyreft, deepspeed, pyvene_dist; print('setup ok: torch', torch.__version__)"
