"""What the parity harness trains and how close two runs must agree: ``ParityCase`` (model, interventions,
data, steps), ``Record`` (what one run produced) and ``Tolerance`` (the bound, per dtype and strategy)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch
from torch import nn

from . import models

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|`` with ``atol = rtol * max|expected|``.

    Scaling ``atol`` with the tensor's largest element keeps "relative 1e-5" meaningful for the
    elements of a gradient that are near zero, where a pure relative test compares rounding noise.
    """

    rtol: float
    why: str = ""
    #: Adam's learning rate, for runs whose two sides round differently (DeepSpeed's bf16 against plain bf16):
    #: a final weight may then also be off by 2 x lr for each step in which the reference's gradient of
    #: that element was within ``rtol`` of its tensor's largest (see ``comparison._sign_noise_allowance``).
    adam_lr: float = 0.0
    #: AdamW's learning rate, where a final weight may differ by what AdamW makes of the two runs' own gradients
    #: (each pair within ``rtol``): AdamW divides each element's step by its gradient's root mean square, so the
    #: step of an element whose gradient is near zero follows that gradient's rounding, not its size
    #: (``comparison.adam_response``). ``pyvene-dist check`` judges a user's model so.
    adam_response_lr: float = 0.0


TOLERANCES = MappingProxyType({
    torch.float32: Tolerance(1e-5, "fp32: the guide's bound; measured differences are ~1e-7"),
    # bf16 keeps 8 significant bits: one rounding step is 2**-8 = 3.9e-3 relative. A different
    # reduction order (two shards summed, then averaged) can move a value by a couple of steps.
    torch.bfloat16: Tolerance(
        4 * 2**-8, "bf16: 4 ulps of an 8-bit significand (3 roundings of half an ulp, plus cancellation); measured 1.4"
    ),
})
#: DeepSpeed's bf16 mode is not plain bf16: the engine casts LoReFT's rotation (pyreft keeps it in float32) to
#: bf16, accumulates the micro-batches' gradients in bf16 (``grad_accum_dtype`` defaults to the model's) and
#: steps float32 master copies of the trainable weights, the head's too. Each side rounds differently, within
#: the bf16 bound of 4 ulps of the same arithmetic, so they agree within 8. Measured on CPU, 2 ranks, the
#: default case in bf16 at lr 1e-3 (lengths 8 to 16, 2 micro-batches a step, lm_head trained; one run each)
#: against one plain bf16 device, ZeRO-2 / ZeRO-3 (offload gives ZeRO-3's floats): loss 1.1e-4 / 1.0e-4 to
#: 1.2e-4, gradients 1.3e-2 / 1.7e-2 to 1.8e-2 (step 0: 9.6e-3 / 8.3e-3), weights 2.6e-2 at one lm_head element
#: Adam stepped the other way (below), 6.5e-3 elsewhere. Against one device with DeepSpeed's own arithmetic
#: (bf16 weights, float32 master copies) ZeRO-2's first loss is the same float and its first gradients are
#: within 7e-3.
#: The lr: Adam steps every element by about lr whatever its gradient's size, so an element whose gradient is
#: within rounding of zero is stepped either way, and the next steps' gradients then differ by what that
#: move makes, not by rounding. At the default lr 1e-2 ZeRO-2's step-1 gradients differ by 4.4e-2 (3 of the
#: rotation's 128 elements stepped the other way at step 0), against the one device with DeepSpeed's
#: arithmetic too, and plain bf16 is itself 5.4e-2 (gradients) and 0.21 (weights) from float32 there; at
#: lr 1e-3 the same step's difference is 5e-3. bf16 comparisons therefore train at lr 1e-3, as DDP's and
#: FSDP's do, and a final weight may be ``adam_lr`` x 2 off per step in which its reference gradient was
#: within the noise (``comparison._sign_noise_allowance``): the lm_head element above had a first gradient of 3.3e-5 of
#: its tensor's largest, minus in one process, plus under ZeRO, and ends 2.0e-3 = 2 x lr off.
#: What the bound cannot tell apart: with this data a mean of per-rank means moves the gradients by 0.5e-2 to
#: 1.2e-2, within bf16's own rounding; the float32 comparisons at the same stages (1e-5) are what check the
#: normalisation. A missed micro-batch (0.44 to 0.89), a loss divided by the accumulation twice (0.5) or a
#: mean of micro-batch means (5.4e-2 on lm_head) fails here at step 0.
DEEPSPEED_BF16 = Tolerance(
    8 * 2**-8, "DeepSpeed bf16 (bf16 rotation, bf16 gradient accumulation, fp32 master weights) against plain "
    "bf16: 8 ulps, each side rounding within bf16's 4; measured 4.5 (gradients, CPU, lr 1e-3)"
)


def tolerance(case: "ParityCase", strategy: str) -> Tolerance:
    """The bound for ``strategy`` against one plain device: the dtype's, or DeepSpeed's bf16 one."""
    return dtype_tolerance(case.torch_dtype, strategy)


def dtype_tolerance(dtype: torch.dtype, strategy: str) -> Tolerance:
    """The bound for ``strategy`` against one plain device in ``dtype`` (runs that are not a ``ParityCase``)."""
    if dtype == torch.bfloat16 and strategy.startswith("zero"):
        return DEEPSPEED_BF16
    return TOLERANCES[dtype]


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """What to train. Every field takes part in the result; the defaults run in seconds on a CPU."""

    model: str = "llama"
    attention: str = "eager"  # transformers' attn_implementation (models.ATTENTIONS)
    hidden_size: int | None = None  # None: the model builder's own (32 and 2 for the tiny models)
    num_layers: int | None = None
    intervention: str = "LoreftIntervention"
    layers: tuple[int, ...] = (0, 1)
    component: str = "block_output"
    rank: int = 4
    positions: int = 2
    steps: int = 3
    batch_size: int = 8
    seq_len: int = 16  # the padded length; each example has between half of it and all of it
    padding: str = "right"  # the side examples are padded on
    accumulation: int = 2  # micro-batches per optimizer step (of batch_size examples each)
    trainable_head: bool = True  # lm_head (a classifier's score) trains beside the interventions, unless tied
    dtype: str = "float32"
    lr: float = 1e-2
    weight_decay: float = 0.01
    seed: int = 0
    checkpointing: str | None = None  # None, "reentrant" or "non-reentrant" activation checkpointing

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[self.torch_dtype]

    def build(self):
        return self.reft_model(self.base_model())

    def base_model(self) -> nn.Module:
        """The base model alone, its weights drawn from ``seed``."""
        if self.model not in models.BASE_MODELS:
            raise ValueError(f"model {self.model!r} is not one of {sorted(models.BASE_MODELS)}")
        shape = {"layers": self.num_layers, "hidden": self.hidden_size}
        return models.BASE_MODELS[self.model](
            seed=self.seed, dtype=self.torch_dtype, attention=self.attention,
            **{k: v for k, v in shape.items() if v is not None}
        )

    def reft_model(self, base: nn.Module) -> nn.Module:
        """``base`` with the case's interventions, checkpointed when the case says so."""
        model = models.reft_model(
            base,
            layers=self.layers,
            component=self.component,
            rank=self.rank,
            intervention=self.intervention,
            dtype=self.torch_dtype,
            seed=self.seed + 1,
        )
        if self.checkpointing is not None:
            if self.checkpointing not in ("reentrant", "non-reentrant"):
                raise ValueError(f"checkpointing {self.checkpointing!r} is not None, 'reentrant' or 'non-reentrant'")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": self.checkpointing == "reentrant"}
            )
        if self.trainable_head:  # here, so that every strategy's build (device_map's too) trains it
            head = getattr(model.model, "score", None) if self.model in models.CLASSIFIERS \
                else model.model.get_output_embeddings()
            # GPT-2's lm_head is its input embedding: training it is training the embedding, not a head
            if head.weight is not model.model.get_input_embeddings().weight:
                head.requires_grad_(True)
        return model

    def batches(self, steps: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Global micro-batches, ``accumulation`` per step: token ids, attention mask, labels, and
        pyreft-layout locations ``[interventions, batch, positions]`` within each example's tokens.

        Example lengths are drawn between ``seq_len // 2`` and ``seq_len``, padded with token 0 on ``padding``'s
        side. A language model's labels are the tokens of each example's second half (-100 elsewhere: the
        prompt and the padding); a classifier's are class ids.
        """
        steps = self.steps if steps is None else steps
        if self.padding not in ("left", "right"):
            raise ValueError(f"padding must be 'left' or 'right', got {self.padding!r}")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be 1 or more, got {self.accumulation}")
        generator = torch.Generator().manual_seed(self.seed + 2)
        count = steps * self.accumulation
        shape = (count, self.batch_size, self.seq_len)
        input_ids = torch.randint(1, models.VOCAB_SIZE, shape, generator=generator)
        lengths = torch.randint(max(1, self.seq_len // 2), self.seq_len + 1, shape[:2], generator=generator)
        locations = (torch.rand((count, len(self.layers), self.batch_size, self.positions), generator=generator)
                     * lengths[:, None, :, None]).long()  # a position within each example's own tokens
        column = torch.arange(self.seq_len)
        if self.padding == "left":
            offset = self.seq_len - lengths
            attention_mask = (column >= offset[..., None]).long()
            locations = locations + offset[:, None, :, None]
        else:
            offset = torch.zeros_like(lengths)
            attention_mask = (column < lengths[..., None]).long()
        input_ids = input_ids * attention_mask  # padding is token 0
        if self.model in models.CLASSIFIERS:
            labels = torch.randint(models.NUM_LABELS, (count, self.batch_size), generator=generator)
        else:
            answer = column >= (offset + lengths - lengths // 2)[..., None]
            labels = torch.where(answer & attention_mask.bool(), input_ids, -100)
        batches = [
            {"input_ids": input_ids[i], "attention_mask": attention_mask[i], "labels": labels[i],
             "locations": locations[i]}
            for i in range(count)
        ]
        if self.component.startswith("head_"):  # unit "h.pos": which head, then which positions
            heads = torch.randint(models.TINY_KV_HEADS, (count, len(self.layers), self.batch_size, 1),
                                  generator=generator)
            for i, batch in enumerate(batches):
                batch["heads"] = heads[i]
        return batches

    def steps_of(self, batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
        """``batches`` grouped into optimizer steps of ``accumulation`` micro-batches."""
        return [batches[i : i + self.accumulation] for i in range(0, len(batches), self.accumulation)]

    def labels_in(self, micro_batches: list[dict[str, torch.Tensor]]) -> int:
        """How many labels the loss of ``micro_batches`` averages over (HF's ``num_items_in_batch``)."""
        if self.model in models.CLASSIFIERS:
            return sum(batch["labels"].numel() for batch in micro_batches)
        return sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in micro_batches)


@dataclasses.dataclass
class Record:
    """What one run produced: the global loss and the gradients of every step, final weights (of the
    interventions and of every trainable base-model parameter, such as a trainable head)."""

    strategy: str
    world_size: int
    losses: list[float]
    grads: list[Tensors]
    weights: Tensors
    peak_memory_bytes: int = 0
    parameter_bytes: int = 0  # what rank 0 holds of the model's parameters after wrapping (its shards)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
