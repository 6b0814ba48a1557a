"""pyreft's evaluation loop on N processes: batched greedy generation over an eval set, every rank its share.

pyreft's examples/loreft (``compute_metrics``) generates each batch of the eval set with the interventions on the
prompt, decodes it and compares it with the answers, in one process. ``generate_over`` is that generation
under ``torchrun`` or ``accelerate launch``: the prompts are split into one contiguous share per rank, each rank
generates its share in left-padded batches (each row intervened at its own prompt's positions, as pyreft gives
them for that prompt alone), and the texts are gathered in the prompts' order on every rank::

    answers = generate_over(reft_model, tokenizer, [item["instruction"] for item in eval_items],
                            positions="f1+l1", batch_size=8, max_new_tokens=32)
    accuracy = sum(a.strip() == item["answer"] for a, item in zip(answers, eval_items)) / len(eval_items)

Over a base sharded across the ranks (FSDP2, ZeRO-3: every forward a collective), every rank runs as many
batches (a short share repeats its last prompt, and the repeats are dropped) and steps until all are done
(``synced_gpus``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..gather import partitioned
from ..mechanisms.dtensors import has_dtensor_parameters
from ..positions import positions_from_attention_mask


def generate_over(reft_model, tokenizer, prompts: Sequence[str], *, positions: str, share_weights: bool = False,
                  batch_size: int = 8, **generate_kwargs) -> list[str]:
    """The generated text (new tokens, special ones skipped) of each of ``prompts``, in order, on every rank.

    ``reft_model``: a pyreft ``ReftModel`` (any pyvene ``IntervenableModel``); ``positions`` and
    ``share_weights``: as in training (``"f1+l1"``); ``generate_kwargs`` go to ``generate`` (``max_new_tokens``,
    ``do_sample``; greedy unless told). Without an initialised process group, one process does it all.
    """
    if isinstance(prompts, str) or not all(isinstance(prompt, str) for prompt in prompts):
        raise ValueError(f"prompts: expected a list of strings, found {type(prompts).__name__}"
                         + ("" if isinstance(prompts, str) else " holding other things"))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, found {batch_size!r}")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: it has no pad token, and the batches are padded; set tokenizer.pad_token "
                         "(pyreft's examples use the unk or eos token)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    base = reft_model.model
    synced = world > 1 and (has_dtensor_parameters(base) or bool(partitioned(base.parameters())))
    share = _share(list(prompts), rank, world)
    count = len(share)
    if synced:  # as many batches on every rank
        longest = -(-len(prompts) // world)
        share += share[-1:] * (longest - count) if share else [prompts[0]] * longest
    generate_kwargs.setdefault("do_sample", False)
    if synced:
        generate_kwargs["synced_gpus"] = True
    device = next(base.parameters()).device
    texts = []
    for start in range(0, len(share), batch_size):
        texts += _generate(reft_model, tokenizer, share[start:start + batch_size], positions, share_weights, device,
                           generate_kwargs)
    texts = texts[:count]
    if world == 1:
        return texts
    every = [None] * world
    dist.all_gather_object(every, texts)
    return [text for part in every for text in part]


def _share(prompts: list, rank: int, world: int) -> list:
    """Rank ``rank``'s contiguous share, the first ``len % world`` shares one longer (accelerate's
    ``split_between_processes``)."""
    size, extra = divmod(len(prompts), world)
    start = rank * size + min(rank, extra)
    return prompts[start:start + size + (rank < extra)]


@torch.no_grad()
def _generate(reft_model, tokenizer, prompts: list[str], positions: str, share_weights: bool, device,
              generate_kwargs: dict) -> list[str]:
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    finally:
        tokenizer.padding_side = side
    locations = positions_from_attention_mask(inputs["attention_mask"], positions,
                                              num_interventions=len(reft_model.interventions),
                                              share_weights=share_weights)
    _, generated = reft_model.generate(
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
        unit_locations={"sources->base": (None, locations.tolist())}, intervene_on_prompt=True,
        pad_token_id=tokenizer.pad_token_id, **generate_kwargs)
    new = generated[:, inputs["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new, skip_special_tokens=True)
