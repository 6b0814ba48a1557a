# Source on a GPU machine of the device tool: installs the carried wheels (.whl/, made by
# ../shared/device/make-wheels.sh) and sets the environment the GPU scripts and benchmarks use.
#   source scripts/gpu_env.sh && python3 benchmarks/overhead.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# DeepSpeed's NVMe offload builds against libaio: carry .libaio (scripts/fetch_libaio.sh) to use it.
if [ -d .libaio ]; then
  lib=$(dirname "$(ls "$PWD"/.libaio/usr/lib/*/libaio.so.1)")
  export CPATH=$PWD/.libaio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# DeepSpeed 0.19.8 reads the image's TORCH_CUDA_ARCH_LIST ("9.0a") as integers when it builds an op.
export TORCH_CUDA_ARCH_LIST=9.0
export OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
