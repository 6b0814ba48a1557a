"""The parity harness's training loop: train the same ReFT model on the same data with the same seed on one
device and under a parallel strategy, then compare per-step losses, intervention gradients and final weights.

    case = ParityCase()                                   # tiny Llama, LoReFT at two layers, 3 steps
    candidate = train(case, "ddp")                        # inside an initialised process group
    reference = train(case, "single")                     # one device, the whole batch
    assert_parity(reference, candidate, case.tolerance)   # says which tensor differs, where, by how much

The default case trains on data like users': examples of different lengths padded on one side, labels
on each example's answer only (so examples, and ranks, hold different numbers of labels), ``accumulation``
micro-batches per optimizer step, and a trainable head beside the interventions (``lm_head``, or a
classifier's ``score``), cleared with ``model.zero_grad()`` after each step as HF Trainer clears it.

The comparison stays exact up to float rounding because the loop normalises as HF Trainer does with
``num_items_in_batch``: every micro-batch's loss is the *sum* of its tokens' cross-entropies divided by
the number of labels of the whole optimizer step (every rank's, every micro-batch's; each rank knows it,
as it holds the global batch), times the data-parallel world size that DDP, FSDP and ZeRO divide the
summed gradients by. The gradients summed over micro-batches and ranks are then those of the step's
token mean, on one device as on many; the recorded loss is that mean (summed over ranks).
Every rank gets an equal, contiguous share of each global micro-batch.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..optim import MixedParameterGroupsWarning, param_groups
from . import models
from .case import ParityCase, Record
from .comparison import intervention_grads, intervention_weights
from .strategies import STRATEGIES
from .runners import Strategy


def train(case: ParityCase, strategy: str | Strategy = "single") -> Record:
    """Train ``case`` under ``strategy`` and record every step. Deterministic for a given case."""
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {sorted(STRATEGIES)}")
        strategy = STRATEGIES[strategy]()
    model = strategy.place(strategy.build(case))
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)
    with warnings.catch_warnings():  # FSDP2's advice for a trainable head is taken: the groups are param_groups'
        warnings.simplefilter("ignore", MixedParameterGroupsWarning)
        wrapped, optimizer = strategy.prepare(model, optimizer, case)
    held = parameter_bytes(model)
    strategy.reset_peak_memory()
    losses, grads = [], []
    classifier = case.model in models.CLASSIFIERS
    for micro_batches in case.steps_of(case.batches()):
        labels = case.labels_in(micro_batches)
        step_loss = torch.zeros((), dtype=torch.float64, device=strategy.device)
        for index, batch in enumerate(micro_batches):
            loss = summed_loss(wrapped, strategy.shard(batch), strategy.device, classifier=classifier) / labels
            strategy.backward(loss * strategy.world_size)  # DDP, FSDP and ZeRO average over the ranks
            step_loss += loss.detach().double()
            if index < len(micro_batches) - 1:
                strategy.micro_step(optimizer)
        losses.append(strategy.mean(step_loss) * strategy.world_size)
        grads.append(intervention_grads(model))
        strategy.step(optimizer, wrapped)
    weights = intervention_weights(model)
    peak = strategy.peak_memory()
    return Record(strategy.name, strategy.devices, losses, grads, weights, peak, held)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this process holds: a sharded parameter counts its local shard only."""
    total = 0
    for parameter in model.parameters():
        if hasattr(parameter, "ds_tensor"):  # DeepSpeed ZeRO-3: this rank's partition
            local = parameter.ds_tensor
        else:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def summed_loss(model: nn.Module, shard: dict[str, torch.Tensor], device: torch.device, *,
          classifier: bool = False) -> torch.Tensor:
    """The sum of the cross-entropies of ``shard``'s labels (a language model's shifted by one position, as
    HF's loss shifts them), in float32."""
    locations = shard["locations"].tolist()
    if "heads" in shard:
        locations = [(heads, positions) for heads, positions in zip(shard["heads"].tolist(), locations)]
    base = {"input_ids": shard["input_ids"].to(device)}
    if "attention_mask" in shard:
        base["attention_mask"] = shard["attention_mask"].to(device)
    _, counterfactual = model(base, unit_locations={"sources->base": (None, locations)})
    logits, labels = counterfactual.logits.float(), shard["labels"].to(device)
    if not classifier:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       ignore_index=-100, reduction="sum")
