"""``pyvene-dist plan``: memory per GPU of ReFT training under each strategy, before a run.

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live`` and ``accelerate estimate-memory``,
from the model's shape alone (built on the meta device: nothing is downloaded or allocated), but for
ReFT: the base model is frozen, so it has no gradients and no optimizer state; what counts besides its
weights is what each strategy holds gathered or buffered, the interventions' own weights, gradients
and Adam state, and the activations autograd keeps to reach the interventions.

The activation terms are those of a Llama-family decoder layer (RMSNorm, grouped-query attention, gated
MLP) under transformers 5 with frozen weights, counted tensor by tensor from what autograd saves
(``torch.autograd.graph.saved_tensors_hooks``; ``tests/cli/test_plan.py`` checks them on CPU), and the peak
from where backward starts. Other architectures are estimated as if they had that layer. The results are
checked against the measured peaks in ``benchmarks/results`` (``tests/cli/test_plan.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import MappingProxyType

import torch
import transformers
from torch import nn

from .testing import models
from .testing.check_runs import model_config

GIB = 2**30
#: The strategies `pyvene-dist plan` estimates, as named in the harness's registry.
PLANNED = ("ddp", "fsdp2", "zero2", "zero3", "zero3-offload", "device_map")
DTYPE_BYTES = MappingProxyType({"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4})
#: The strategies planned for a quantized base (``--quantize``): FSDP2 also with its CPU offload
#: (``CPUOffloadPolicy``), what PEFT and fsdp_qlora use for a 70B on 2 x 24 GB.
QUANTIZED_PLANNED = ("ddp", "fsdp2", "fsdp2-offload", "zero2", "zero3", "zero3-offload", "device_map")
#: Bytes per element of a quantized linear weight, as transformers configures bitsandbytes by default: 4-bit packs
#: two elements a byte and keeps one float32 absmax per block of 64 (no double quantization); 8-bit (LLM.int8)
#: one byte an element, plus a float32 scale per output row (``rows``).
QUANTIZED_BYTES = MappingProxyType({"4bit": 0.5 + 4 / 64, "8bit": 1.0})
#: What FSDP cannot shard (``pyvene_dist.quantized``: refused before sharding).
QUANTIZED_REFUSED = MappingProxyType({"8bit": ("fsdp2", "fsdp2-offload")})
#: DeepSpeed's own defaults for the ZeRO-3 settings that decide what is held gathered or buffered.
ZERO_DEFAULTS = MappingProxyType({"stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e7, "reduce_bucket_size": 5e8})


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model, read from its config and its parameters on the meta device."""

    name: str
    parameters: int  # all of the base model's
    layer_parameters: int  # one decoder layer's
    largest_outer_module: int  # the largest module outside the decoder layers (embedding, LM head)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    llama_like: bool
    #: The decoder layers' linear weights, which bitsandbytes quantizes (elements; embeddings, norms and the LM
    #: head stay in the model's dtype): all layers', the largest layer's, the largest one's, and their output rows.
    quantizable: int = 0
    layer_quantizable: int = 0
    largest_linear: int = 0
    linear_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Run:
    """What is trained, and how: per-GPU batch (the whole batch for ``device_map``, one process)."""

    gpus: int = 1
    nodes: int = 1
    batch: int = 1
    seq_len: int = 512
    dtype: str = "bf16"
    rank: int = 4
    layers: tuple[int, ...] = (0,)  # the decoder layers that carry an intervention
    attention: str = "sdpa"
    zero: dict = dataclasses.field(default_factory=dict)  # ZeRO-3 settings merged over DeepSpeed's defaults
    device: str = "cuda"  # "cpu": the softmax's backward below allocates less there
    quantize: str | None = None  # "4bit" or "8bit": the base's linear layers quantized (bitsandbytes)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Estimate:
    strategy: str
    parameters: float  # bytes per GPU: the base model's weights held (a shard, or all)
    gathered: float  # weights held gathered for compute (FSDP2, ZeRO-3) or buffers (ZeRO-3's reduce bucket)
    interventions: float  # their weights, gradients and Adam state
    activations: float  # at the peak, without gradient checkpointing
    activations_checkpointed: float  # with (non-reentrant) gradient checkpointing
    #: Bytes on a process's device at the peak of loading the base (``load_bytes``), before the first step.
    load: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gathered + self.interventions + self.activations

    @property
    def total_checkpointed(self) -> float:
        return self.parameters + self.gathered + self.interventions + self.activations_checkpointed


def shape_of(model, name: str = "") -> Shape:
    """The shape of a (meta-device) causal LM: parameter counts, and the config's sizes."""
    config = model.config
    layers = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if layers is None or len(layers) == 0:
        raise ValueError(f"{name or type(model).__name__} has no list of decoder layers")
    inside = {id(p) for p in layers.parameters()}
    linears = [[m for m in layer.modules() if isinstance(m, nn.Linear)] for layer in layers]
    layer_linear = [sum(m.weight.numel() for m in found) for found in linears]
    outer = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
             if any(id(p) not in inside for p in m.parameters(recurse=False))]
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    return Shape(
        name=name or getattr(config, "_name_or_path", "") or type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        largest_outer_module=max(outer, default=0),
        layers=len(layers),
        hidden=hidden,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        vocab=config.vocab_size,
        llama_like=hasattr(config, "intermediate_size") and hasattr(config, "rms_norm_eps"),
        quantizable=sum(layer_linear),
        layer_quantizable=max(layer_linear),
        largest_linear=max((m.weight.numel() for found in linears for m in found), default=0),
        linear_rows=sum(m.out_features for found in linears for m in found),
    )


def _first(config, *names):
    for name in names:
        if getattr(config, name, None):
            return getattr(config, name)
    raise ValueError(f"{type(config).__name__} has none of {', '.join(names)}")


def meta_model(model: str, hidden: int | None = None, layers: int | None = None):
    """A causal LM on the meta device: a built-in name of ``pyvene_dist.testing.models``, a local folder
    with config.json, a config .json file, or a hub name already in the local cache (never downloaded)."""
    with torch.device("meta"):
        if model in models.BASE_MODELS:
            shape = {k: v for k, v in {"hidden": hidden, "layers": layers}.items() if v is not None}
            return models.BASE_MODELS[model](**shape)
        if Path(model).exists():
            config = model_config(model)
        else:
            try:
                config = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
            except (OSError, ValueError) as error:
                raise ValueError(f"{model}: neither a built-in name ({', '.join(sorted(models.BASE_MODELS))}), a "
                                 f"local path, nor a hub name in the local cache (plan never downloads): "
                                 f"{str(error).splitlines()[0]}") from None
        return transformers.AutoModelForCausalLM.from_config(config)  # its modules imported here, when used


# --- the terms -----------------------------------------------------------------------------------------------

def intervention_bytes(shape: Shape, run: Run) -> float:
    """LoReFT per layer: rotation (hidden x rank) and learned source (hidden x rank + rank); weights,
    gradients and AdamW's two moments, all in the training dtype (fp32 master copies under ZeRO: at most 2x
    more of a few megabytes)."""
    count = len(run.layers) * (2 * shape.hidden * run.rank + run.rank)
    return count * 4 * run.bytes


def _layer_saved(shape: Shape, run: Run, tokens: int) -> float:
    """Bytes autograd keeps for one decoder layer whose weights are frozen but whose input needs a gradient.

    Frozen linear layers keep only their weights (no copies); each RMSNorm keeps its input upcast to fp32
    and its inverse norm; the gated MLP keeps gate, SiLU(gate) and up; attention keeps q and k, v at the
    key-value heads' size, its output and the log-sum-exp (flash and memory-efficient sdpa), or under eager
    attention (and under sdpa in fp32 with grouped KV heads, which takes the math kernel) q, k, v at the
    query heads' size and the softmax, in fp32 and again in the model's dtype.
    """
    h, e, s = shape.hidden, run.bytes, run.seq_len
    norms = 2 * (4 * h + 4)
    mlp = 3 * e * shape.intermediate
    if _quadratic(shape, run):
        attention = 3 * e * h + 4 * shape.heads * s + (e * shape.heads * s if e != 4 else 0)
    else:
        attention = 2 * e * h + 2 * e * h * shape.kv_heads // shape.heads + 4 * shape.heads
    return tokens * (norms + mlp + attention)


def _quadratic(shape: Shape, run: Run) -> bool:
    """Whether attention materialises the [heads, seq, seq] scores (measured on H200, torch 2.11: fp32 sdpa
    with grouped KV heads runs as the math kernel, as memory-hungry as eager)."""
    return run.attention == "eager" or (run.bytes == 4 and shape.kv_heads != shape.heads)


def _layer_backward_extra(shape: Shape, run: Run, tokens: int) -> float:
    """What one layer's backward allocates on top of what it saved: with the scores materialised, the
    gradient of the softmax's input and output side by side (two [heads, seq, seq] tensors, in fp32 or in
    fp32 and the model's dtype); with fused attention, the MLP's three gradients of intermediate size and a
    few of hidden size."""
    if _quadratic(shape, run):
        e = run.bytes
        if e == 4:
            return tokens * shape.heads * run.seq_len * 2 * e
        # Half precision: the CPU holds the fp32 gradient of the softmax and its input's in the model's dtype;
        # CUDA (measured on an H200, torch 2.11, one 1B-shaped layer: 2.37 GiB at batch 2 x 2048, where
        # [batch, heads, seq, seq] in fp32 is 1 GiB) holds a second fp32 one beside them.
        return tokens * shape.heads * run.seq_len * ((4 + e) if run.device == "cpu" else (2 * 4 + e))
    return tokens * run.bytes * (3 * shape.intermediate + 4 * shape.hidden)


def _loss_peak(shape: Shape, run: Run, tokens: int) -> float:
    """transformers' causal-LM loss: the logits upcast to fp32, log-softmax kept for backward; backward
    starts with the dense gradient of the log-softmax and of its input beside it: three fp32
    [tokens, vocab] tensors, and the final norm's fp32 input."""
    return tokens * (12 * shape.vocab + 4 * shape.hidden)


def activation_bytes(shape: Shape, run: Run, layers_here: int | None = None, checkpointed: bool = False,
                     loss_here: bool = True) -> float:
    """Peak activation bytes on one GPU. Only the layers after the first intervened one keep anything:
    before it nothing needs a gradient. ``layers_here``: of those, how many this GPU runs (device_map)."""
    tokens = run.batch * run.seq_len
    downstream = shape.layers - 1 - min(run.layers)
    here = downstream if layers_here is None else min(layers_here, downstream)
    one_layer = _layer_saved(shape, run, tokens)
    backward = _layer_backward_extra(shape, run, tokens) if here else 0.0
    loss = _loss_peak(shape, run, tokens) if loss_here else 0.0
    if checkpointed:  # each layer keeps its input; backward recomputes one layer at a time
        kept = here * tokens * run.bytes * shape.hidden
        return kept + max(loss, (one_layer + backward) if here else 0.0)
    return here * one_layer + max(loss, backward)


def weight_bytes(shape: Shape, run: Run, elements: int | None = None, quantizable: int | None = None,
                 rows: float | None = None) -> float:
    """Bytes of ``elements`` base-model parameters (default: all) of which ``quantizable`` are linear weights with
    ``rows`` output rows: in the training dtype, or with those quantized by ``run.quantize``."""
    elements = shape.parameters if elements is None else elements
    if run.quantize is None:
        return elements * run.bytes
    quantizable = shape.quantizable if quantizable is None else quantizable
    rows = shape.linear_rows if rows is None else rows
    scales = 4 * rows if run.quantize == "8bit" else 0
    return (elements - quantizable) * run.bytes + quantizable * QUANTIZED_BYTES[run.quantize] + scales


def planned(run: Run) -> tuple[str, ...]:
    """The strategies planned for ``run``: ``QUANTIZED_PLANNED`` for a quantized base, less what cannot shard it."""
    if run.quantize is None:
        return PLANNED
    if run.quantize not in QUANTIZED_BYTES:
        raise ValueError(f"quantize {run.quantize!r} is not one of {', '.join(QUANTIZED_BYTES)}")
    refused = QUANTIZED_REFUSED.get(run.quantize, ())
    return tuple(strategy for strategy in QUANTIZED_PLANNED if strategy not in refused)


def estimate(shape: Shape, run: Run, strategy: str) -> Estimate:
    known = QUANTIZED_PLANNED if run.quantize else PLANNED
    if strategy not in known:
        raise ValueError(f"strategy {strategy!r} is not one of {', '.join(known)}")
    if strategy not in planned(run):
        raise ValueError(f"strategy {strategy!r} cannot shard {run.quantize} bases (pyvene_dist.quantized refuses "
                         f"it); planned for {run.quantize}: {', '.join(planned(run))}")
    if any(layer < 0 or layer >= shape.layers for layer in run.layers):
        raise ValueError(f"layers {list(run.layers)} are not all within the model's {shape.layers} decoder layers")
    e, n = run.bytes, run.world
    weights = weight_bytes(shape, run)
    # A quantized linear layer computes with its weight dequantized to the training dtype: the largest one at once.
    dequantized = shape.largest_linear * e if run.quantize else 0.0
    interventions = intervention_bytes(shape, run)
    activations = lambda **kw: (activation_bytes(shape, run, **kw),  # noqa: E731
                                activation_bytes(shape, run, checkpointed=True, **kw))
    parameters, gathered = weights, dequantized
    if strategy.startswith("fsdp2"):  # a shard each (on the host with offload); in backward one layer gathered while
        # the one before is prefetched, whose all-gather buffer lives until it is copied out: three layers; the LM head
        parameters = 0.0 if strategy == "fsdp2-offload" else weights / n
        layer = weight_bytes(shape, run, shape.layer_parameters, shape.layer_quantizable,
                             shape.linear_rows / shape.layers)
        gathered += 3 * layer + shape.largest_outer_module * e
    elif strategy.startswith("zero3"):
        zero = {**ZERO_DEFAULTS, **run.zero}
        parameters = 0.0 if strategy == "zero3-offload" else weights / n
        per_element = weights / shape.parameters if run.quantize else e  # the live elements' mean size
        gathered += _zero3_gathered(shape, zero) * per_element + _reduce_bucket(shape, run, zero) * e
    elif strategy == "device_map":  # one process; the layers split over the GPUs, the loss on the last
        parameters = weights / run.gpus
        per_gpu = math.ceil(shape.layers / run.gpus)
        plain, checkpointed = activations(layers_here=per_gpu)
        return Estimate(strategy, parameters, dequantized, interventions, plain, checkpointed,
                        load_bytes(shape, run, strategy))
    plain, checkpointed = activations()
    return Estimate(strategy, parameters, gathered, interventions, plain, checkpointed, load_bytes(shape, run, strategy))


def load_bytes(shape: Shape, run: Run, strategy: str) -> float:
    """Bytes on a process's device at the peak of loading the base, under ``pyvene_dist.patch()``
    (``pyvene_dist.loading``): under FSDP2 each rank holds its shard and reads one weight's rows at a time (a 4-bit
    base: read in the training dtype and quantized there); under ZeRO-3 each rank holds its partitions, and
    transformers' ``zero.Init`` builds each module whole before partitioning it, the largest at once; otherwise (DDP,
    ZeRO-1/2) every process loads the whole base, and ``device_map`` each GPU its layers. The host holds at most
    one weight's read part besides (safetensors read with ``pread``, not mapped)."""
    e, n = run.bytes, run.world
    weights = weight_bytes(shape, run)
    largest = max(shape.largest_linear, shape.largest_outer_module)
    if strategy.startswith("fsdp2"):
        return (0.0 if strategy == "fsdp2-offload" else weights / n) + largest / n * e
    if strategy.startswith("zero3"):
        return (0.0 if strategy == "zero3-offload" else weights / n) + largest * e
    if strategy == "device_map":
        return weights / run.gpus
    return weights


def _reduce_bucket(shape: Shape, run: Run, zero: dict) -> float:
    """Elements of ZeRO-3's gradient reduce bucket that take memory: the whole bucket on a GPU (allocated at once),
    on the CPU the part the interventions' gradients write (memory is committed where it is first written)."""
    if run.device != "cpu":
        return zero["reduce_bucket_size"]
    return min(zero["reduce_bucket_size"], len(run.layers) * (2 * shape.hidden * run.rank + run.rank))


def _zero3_gathered(shape: Shape, zero: dict) -> float:
    """Parameters ZeRO-3 holds gathered (elements). Up to ``stage3_max_live_parameters``, no more than the
    model; but DeepSpeed gathers whole modules, so with a small budget what is live at the peak is two decoder
    layers (the one computing, the one being fetched) or the largest module outside them, plus the prefetch
    bucket (measured on 2 x H200 with a budget of 3e7: about 2.6 layers at 1.1B to 5.9B parameters)."""
    budget = min(zero["stage3_max_live_parameters"], shape.parameters)
    floor = max(2 * shape.layer_parameters, shape.largest_outer_module) + zero["stage3_prefetch_bucket_size"]
    return max(budget, min(floor, shape.parameters))


def plan(shape: Shape, run: Run) -> list[Estimate]:
    return [estimate(shape, run, strategy) for strategy in planned(run)]


#: The share of a GPU's memory an estimate may fill and still "fit": the rest is for the CUDA context,
#: NCCL's buffers and the allocator's fragmentation, which the estimate does not count.
USABLE = 0.9


def fits(total: float, gpu_memory_gib: float) -> bool:
    return total / GIB <= USABLE * gpu_memory_gib


def detected_gpu_memory() -> float | None:
    """GiB of the first visible GPU, or None without one."""
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # noqa: BLE001 - a broken driver is the same as no GPU for a default
        pass
    return None


def table(shape: Shape, run: Run, estimates: list[Estimate], gpu_memory: float) -> str:
    base = run.dtype if run.quantize is None else f"base in {run.quantize} (bitsandbytes), computing in {run.dtype}"
    header = (f"{shape.name}: {shape.parameters / 1e9:.2f}B parameters, {shape.layers} layers, hidden "
              f"{shape.hidden}; {base}, batch {run.batch} x {run.seq_len} tokens per GPU, LoReFT rank "
              f"{run.rank} at layers {','.join(map(str, run.layers))}; {run.nodes} node(s) x {run.gpus} GPU(s); "
              f"fits = within {USABLE:.0%} of {gpu_memory:g} GiB")
    columns = ("strategy", "load", "weights", "gathered", "ReFT+Adam", "activations", "total", "fits",
               "ckpt activations", "ckpt total", "fits")
    rows = [columns]
    for found in estimates:
        fit = lambda total: "yes" if fits(total, gpu_memory) else "no"  # noqa: E731
        rows.append((found.strategy, _gib(found.load), _gib(found.parameters), _gib(found.gathered),
                     _gib(found.interventions),
                     _gib(found.activations), _gib(found.total), fit(found.total),
                     _gib(found.activations_checkpointed), _gib(found.total_checkpointed),
                     fit(found.total_checkpointed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    notes = ["GiB per GPU. load: the peak while the base loads, under pyvene_dist.patch() (FSDP2 with "
             "cpu_ram_efficient_loading and ZeRO-3 read each rank's share: docs/loading.md). The base model is "
             "frozen: no gradients or optimizer state for it. ZeRO settings: "
             + json.dumps({**ZERO_DEFAULTS, **run.zero}) + ". device_map: one process, the layers split over "
             "the GPUs of one node, --batch its whole batch."]
    if run.quantize is not None:
        notes.append(_quantized_note(shape, run))
    if not shape.llama_like:
        notes.append(f"{shape.name} is not a Llama-family decoder: its activations are estimated as if it were.")
    return "\n".join([header, *lines, *notes])


def _quantized_note(shape: Shape, run: Run) -> str:
    refused = QUANTIZED_REFUSED.get(run.quantize, ())
    held = f"{weight_bytes(shape, run) / run.world / GIB:.2f} GiB of host memory per process"
    scales = ", plus a float32 scale per row" if run.quantize == "8bit" else ""
    note = (f"{run.quantize}: the decoder layers' linear weights quantized ({shape.quantizable / 1e9:.2f}B elements, "
            f"{QUANTIZED_BYTES[run.quantize]:g} bytes each{scales}), the rest in {run.dtype}; gathered includes the "
            f"largest linear weight dequantized for compute. With offload the shards stay on the host: {held}.")
    if refused:
        note += f" Not planned: {', '.join(refused)} (FSDP cannot shard {run.quantize} bases; pyvene_dist refuses it)."
    return note


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"
