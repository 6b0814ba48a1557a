"""One decoder layer of TinyLlama-1.1B's shape on a GPU, eager attention, bf16, batch 2 x 2048: what its
forward saves, what its backward allocates beyond that, and the blocks over 128 MiB live at the backward's
peak. It backs plan's count of eager attention's backward on CUDA (docs/plan.md).

    source scripts/gpu_env.sh && python3 benchmarks/attention_backward.py     # writes $OUT/probe.json
"""

import json
import os

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

BATCH, SEQ, GIB, LARGE = 2, 2048, 2**30, 2**27


def live_at_peak(snapshot) -> list[float]:
    """Sizes (GiB) of the large blocks allocated when their total was highest."""
    live, peak, at_peak = {}, 0, []
    for event in (e for trace in snapshot["device_traces"] for e in trace if e["size"] > LARGE):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
        if sum(live.values()) > peak:
            peak, at_peak = sum(live.values()), [size / GIB for size in live.values()]
    return at_peak


def main() -> None:
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                         num_hidden_layers=1, attn_implementation="eager")
    layer = LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16).requires_grad_(False)
    x = torch.randn(BATCH, SEQ, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = LlamaRotaryEmbedding(config).to("cuda")(x, torch.arange(SEQ, device="cuda")[None].expand(BATCH, SEQ))
    mask = torch.full((SEQ, SEQ), float("-inf"), device="cuda").triu(1).to(torch.bfloat16).expand(BATCH, 1, SEQ, SEQ)
    for measured in (False, True):  # the first pass warms the allocator and cuBLAS
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        y = layer(x, attention_mask=mask, position_embeddings=positions)
        y = y[0] if isinstance(y, tuple) else y
        saved = torch.cuda.memory_allocated() - start
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if measured:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        y.backward(torch.ones_like(y))
        extra = torch.cuda.max_memory_allocated() - before
        x.grad, y = None, None
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    result = {"saved_GiB": saved / GIB, "backward_peak_extra_GiB": extra / GIB,
              "BHSS_fp32_GiB": BATCH * config.num_attention_heads * SEQ * SEQ * 4 / GIB,
              "big_live_at_peak_GiB": live_at_peak(snapshot)}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
