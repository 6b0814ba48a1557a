#!/usr/bin/env bash
# On a GPU machine of the device tool: install the carried wheels (.whl/, made by
# ../shared/device/make-wheels.sh), then run the given pytest targets with the nccl backend.
# Logs and JUnit XML go to $OUT (or ./gpu-out).
#   bash scripts/gpu_checks.sh tests/fixes/test_data_parallel.py tests/strategies/test_ddp.py
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" || exit 1
out=$OUT
{
  nvidia-smi -L
  python3 -c 'import torch, transformers, pyvene, pyreft; print("torch", torch.__version__, "transformers",
    transformers.__version__, "pyvene", pyvene.__version__ if hasattr(pyvene, "__version__") else "0.1.8")'
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -p pyvene_dist.pytest_plugin -p no:cacheprovider -q -rA -s --world-backend auto \
  --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/tests.log"
exit "${PIPESTATUS[0]}"
