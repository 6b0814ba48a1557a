#!/usr/bin/env bash
# The GPU runs behind the committed figures (benchmarks/results/*-2xH200.jsonl, docs/benchmarks.md),
# on the device tool's nvidia-h200-x2 with .whl and .libaio carried. Rows go to $OUT/<part>.jsonl, logs to
# $OUT/<part>.log.
#   bash benchmarks/run_h200.sh ddp-scaling zero-memory nvme overhead overhead-trace tests
# The one-GPU parts of speed round two (issue 22) run on nvidia-h200, in two commands of under 9 minutes:
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh sharded compiled
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh large-7b generation-stock generation
# (`all-new` runs the five in turn, for a machine held longer.) Issue 28's figures, in one command:
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh generation-both compiled sharded-9 overhead
# Issue 37's generation figures and check (one H200, each under 10 minutes):
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh generation-check
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh generation-check-stock
#   PYVENE_DIST_COMMIT=<sha> bash benchmarks/run_h200.sh generation-static
# Rows carry PYVENE_DIST_COMMIT: the device's copy of the tree has no .git.
set -uo pipefail
source "$(dirname "$0")/../scripts/gpu_env.sh" || exit 1
# One run id for every row this invocation writes, whichever part and script writes it (benchmarks/common.py)
export PYVENE_DIST_RUN_ID=${PYVENE_DIST_RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-$(hostname -s)}
parts=()
for part in "$@"; do
  if [ "$part" = all-new ]; then parts+=(sharded compiled large-7b generation-stock generation); else parts+=("$part"); fi
done
set -- "${parts[@]}"
knobs='"stage3_max_live_parameters": 3e7, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 5e6'
for part in "$@"; do
  echo "=== $part" >&2
  case $part in
    ddp-scaling)  # throughput at the same per-GPU batch; independent = two processes, no communication
      python3 benchmarks/scaling.py --strategies ddp,independent --world-sizes 1,2 --model llama-1b \
        --batch 8 --seq-len 512 --dtype bfloat16 --steps 20 --warmup 3 --out "$OUT/ddp-scaling.jsonl" ;;
    ddp-scaling-32)  # the same at 32 x 512 tokens per GPU, where the step is bound by the GPU, not the host
      python3 benchmarks/scaling.py --strategies ddp,independent --world-sizes 1,2 --model llama-1b \
        --batch 32 --seq-len 512 --dtype bfloat16 --steps 10 --warmup 3 --out "$OUT/ddp-scaling.jsonl" ;;
    zero-memory)  # peak memory per GPU, fp32, activation checkpointing, a 5.9B model (hidden 4096, 32 layers)
      python3 benchmarks/scaling.py --strategies ddp,zero3,zero3-offload --world-sizes 2 --model llama-1b \
        --hidden 4096 --layers 32 --batch 2 --seq-len 512 --steps 3 --warmup 1 --checkpointing non-reentrant \
        --zero "{$knobs, \"stage3_prefetch_bucket_size\": 3e7}" --out "$OUT/zero-memory.jsonl" ;;
    nvme)  # ZeRO-3 with parameters and optimizer swapped to files under /tmp (1.1B, fp32); fewer live
      # parameters than a layer, so the swap buffers are not all held when the backward needs one
      python3 benchmarks/scaling.py --strategies zero3-nvme --world-sizes 2 --model llama-1b --batch 2 \
        --seq-len 512 --steps 2 --warmup 1 --checkpointing non-reentrant --zero '{"stage3_max_live_parameters":
        3e6, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 5e6, "offload_param": {"buffer_count": 32,
        "buffer_size": 4e7}}' --out "$OUT/zero-memory.jsonl" ;;
    overhead)  # 40 timed steps per measurement, in 8 interleaved rounds
      python3 benchmarks/overhead.py --steps 40 --rounds 8 --out "$OUT/overhead.jsonl" ;;
    overhead-trace)  # host-device syncs, kernel launches and operator calls per step, and profiles
      python3 benchmarks/overhead.py --steps 8 --rounds 2 --trace "$OUT/overhead-trace.txt" \
        --out "$OUT/overhead-trace.jsonl" ;;
    compiled)  # torch.compile: ReFT whole and on a compiled base, against compiled LoRA; graph breaks by line
      TORCH_LOGS=graph_breaks python3 benchmarks/compiled.py --steps 10 --rounds 5 --warmup 3 \
        --out "$OUT/compiled.jsonl" --profile "$OUT/compiled-profile.txt" ;;
    sharded)  # FSDP2 and ZeRO-3 in a process group of one: the ReFT step against the LoRA step under each
      python3 benchmarks/sharded.py --steps 10 --rounds 5 --warmup 3 --out "$OUT/sharded.jsonl" \
        --profile "$OUT/sharded-profile.txt" ;;
    large-7b)  # Llama-2-7B shape, bf16, activation checkpointing, 8 x 512 and 1 x 4096 tokens; no stock pyvene
      for shape in "8 512" "1 4096"; do
        set -- $shape
        python3 benchmarks/overhead.py --model llama-2-7b --checkpointing --batch "$1" --seq-len "$2" --no-stock \
          --steps 10 --rounds 5 --warmup 2 --out "$OUT/large-7b.jsonl" --profile "$OUT/large-7b-profile.txt"
      done ;;
    generation-both)  # issue 28's setting: 256 new tokens, both providers and the bare model in each round
      python3 benchmarks/generation.py --providers pyvene,pyvene_dist --new-tokens 256 --rounds 15 \
        --out "$OUT/generation.jsonl" ;;
    generation-static)  # issue 37: every column in the same rounds (bare unpatched, eager and static-cache compiled;
      # stock pyvene; pyvene_dist eager and in its compiled step), 256 new tokens; each round recompiles the ReFT's
      # step after its patch() (untimed)
      python3 benchmarks/generation.py --providers pyvene,pyvene_dist --new-tokens 256 --rounds 7 \
        --out "$OUT/generation.jsonl" ;;
    generation-check)  # issue 37: both orders with the static cache and transformers' default compile, fresh
      # processes, patched (each case compiles twice: a few minutes for the four)
      python3 benchmarks/gpu_generation_check.py --out "$OUT/generation-check.json" --cases \
        bare-first,patched,every bare-first,patched,prompt reft-first,patched,every reft-first,patched,prompt ;;
    generation-check-stock)  # the same with stock pyvene (unpatched), what the patched cases were compared with
      python3 benchmarks/gpu_generation_check.py --out "$OUT/generation-check-stock.json" --cases \
        bare-first,stock,every bare-first,stock,prompt reft-first,stock,every reft-first,stock,prompt ;;
    sharded-9)  # issue 28's setting: FSDP2 and ZeRO-3 at world 1, the median of 9 rounds of 5 steps each
      python3 benchmarks/sharded.py --steps 45 --rounds 9 --warmup 3 --out "$OUT/sharded.jsonl" \
        --profile "$OUT/sharded-profile.txt" ;;
    generation-stock)  # every-token interventions, 1,024 new tokens, KV cache: stock pyvene beside the bare model
      python3 benchmarks/generation.py --providers pyvene --new-tokens 1024 --rounds 5 \
        --out "$OUT/generation.jsonl" ;;
    generation)  # the same with pyvene_dist beside the bare model
      python3 benchmarks/generation.py --providers pyvene_dist --new-tokens 1024 --rounds 5 \
        --out "$OUT/generation.jsonl" ;;
    gpu-debt-tests)  # issue 46's tests: quantized bases, the bf16 flows and reloads, the half-precision saves, and the
      # static-cache generation tests forced onto the GPU under transformers' default compile (CUDA graphs)
      PYVENE_DIST_TEST_DEVICE=cuda timeout "${PART_TIMEOUT:-540}" bash scripts/gpu_checks.sh \
        tests/strategies/test_quantized_gpu.py tests/strategies/test_gpu_bf16.py tests/fixes/test_fsdp_mixed_precision.py \
        tests/fixes/test_saved_dtypes_half.py tests/fixes/test_fast_path_generation.py tests/fixes/test_fast_path_compile.py \
        tests/fixes/test_sharded_loading.py ;;
    mixed-refts)  # issue 46: several ReFTs in one batch against one ReFT's batch, prompt then every-token mode
      for mode in "" --every-token; do
        timeout "${PART_TIMEOUT:-240}" python3 benchmarks/mixed_refts.py $mode --rounds 3 --new-tokens 128 \
          --out "$OUT/mixed-refts.jsonl"
      done ;;
    continuous-refts)  # issue 48: 64 requests over 8 ReFTs in continuous batching against the bare model's manager
      for mode in "" --every-token; do
        timeout "${PART_TIMEOUT:-240}" python3 benchmarks/continuous_refts.py $mode --out "$OUT/continuous-refts.jsonl"
      done ;;
    quantized)  # issue 46: the 4-bit 8B-shape step against PEFT QLoRA, and the planner's 70B weights
      timeout "${PART_TIMEOUT:-300}" python3 benchmarks/quantized.py --training --planner --rounds 2 \
        --out "$OUT/quantized.jsonl" ;;
    generation-static-short)  # generation-static in fewer rounds and tokens, for one call of under 10 minutes
      timeout "${PART_TIMEOUT:-240}" python3 benchmarks/generation.py --providers pyvene,pyvene_dist --new-tokens 128 \
        --rounds 3 --out "$OUT/generation.jsonl" ;;
    overhead-short)  # the training-step A/B against LoRA, 20 steps per measurement in 4 rounds
      timeout "${PART_TIMEOUT:-180}" python3 benchmarks/overhead.py --steps 20 --rounds 4 --out "$OUT/overhead.jsonl" ;;
    loading-gpu)  # issue 47: each way of loading an 8B-shaped folder of 8 layers in a fresh process, GPU and host peaks
      timeout "${PART_TIMEOUT:-240}" python3 benchmarks/loading_gpu.py --layers 8 --out "$OUT/loading-gpu.jsonl" ;;
    tests)  # the GPU tests of the latest changes
      bash scripts/gpu_checks.sh tests/fixes/test_householder.py tests/fixes/test_fast_path.py tests/fixes/test_devices.py \
        tests/fixes/test_gradient_checkpointing.py ;;
    graphs)  # capture by CUDA graphs, and the sync check
      bash scripts/gpu_checks.sh tests/fixes/test_fast_path.py -k "cuda_graphs or steady_state" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac 2>&1 | grep --line-buffered -v "Warning: \|return func" > "$OUT/$part.log"
  tail -5 "$OUT/$part.log"
done
