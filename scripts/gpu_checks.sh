#!/usr/bin/env bash
# On a GPU machine of the device tool: install the carried wheels (.whl/, made by
# ../shared/device/make-wheels.sh), then run the given pytest targets with the nccl backend.
# Logs and JUnit XML go to $OUT (or ./gpu-out).
#   bash scripts/gpu_checks.sh tests/test_data_parallel.py tests/test_ddp.py
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
  nvidia-smi -L
  python3 -c 'import torch, transformers, pyvene, pyreft; print("torch", torch.__version__, "transformers",
    transformers.__version__, "pyvene", pyvene.__version__ if hasattr(pyvene, "__version__") else "0.1.8")'
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -p pyvene_dist.pytest_plugin -p no:cacheprovider -q -rA -s --world-backend auto \
  --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/tests.log"
exit "${PIPESTATUS[0]}"
