"""lm-eval-harness's model for a ReFT: ``--model reft``, lm-eval's ``HFLM`` with the interventions of a ReFT folder.

    pyvene-dist eval --model reft --model_args reft=out/run/reft --tasks TASK [every other lm_eval flag]
    accelerate launch -m pyvene_dist eval --model reft --model_args reft=out/run/reft,batch_size=8 --tasks TASK

    import lm_eval, pyvene_dist.evaluation
    pyvene_dist.evaluation.register()
    results = lm_eval.simple_evaluate(model="reft", model_args="reft=out/run/reft", tasks=["TASK"])

``HFLM`` loads the base model and the tokenizer, batches and sorts the requests, splits them over the ranks and
gathers them; this class adds the interventions to its two model calls:

- scoring (``loglikelihood``, ``loglikelihood_rolling``, multiple choice): the interventions sit at pyreft's
  training positions of the context, the continuation un-intervened and scored, which is pyreft's training
  forward on (prompt = context, answer = continuation) (``_scoring_locations``); the rows of a batch are padded on
  the right, each row at its own positions. HFLM shares one forward among requests with the same tokens (a
  multiple-choice question's one-token answers); here only among those with the same context too, since the
  context decides where the interventions sit.
- ``generate_until``: the prompts padded on the left, each row at its prompt's positions as pyreft gives them
  for that prompt alone (``pyvene_dist.positions_from_attention_mask``), through pyvene's
  ``generate(intervene_on_prompt=True)``.

Under ``accelerate launch`` or ``torchrun`` every rank scores its share of the requests (lm-eval splits them and
gathers the results on rank 0), on CPUs too, where ``HFLM`` alone would have every rank score everything. A base
already sharded over the ranks (FSDP2's ``fully_shard``, DeepSpeed ZeRO-3) is given as a model:
``ReftLM(reft=reft_model, tokenizer=tokenizer, positions="f1+l1")``; every rank then runs the same number of
forwards (a collective each), and generation keeps stepping until every rank is done (``synced_gpus``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

# lm-eval is optional (the ``eval`` extra): this module is the only one that imports it.
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from lm_eval.models.utils_hf import stop_sequences_criteria

from .. import is_patched, patch
from ..gather import partitioned
from ..mechanisms.dtensors import has_dtensor_parameters
from ..mechanisms.parametrization_cache import cached_parametrizations
from ..positions import positions_from_attention_mask
from ._loading import ReftSettings, check_locations, load_reft, reft_settings, settings_of
from ._scoring_locations import scoring_locations

#: Beside a context's tokens in the key that groups requests into one forward: no token id is negative, so
#: requests whose tokens agree but whose contexts end elsewhere (intervened elsewhere) are not grouped.
_CONTEXT_END = -1


@register_model("reft")
class ReftLM(HFLM):
    """``HFLM`` with a ReFT (see the module's docstring).

    ``reft``: the folder ``ReftModel.save`` wrote (docs/examples/train_reft.py's ``OUTPUT_DIR/reft``), whose
    ``train_settings.json`` gives ``pretrained`` (the base model's folder), ``positions``, ``share_weights`` and
    ``dtype`` unless given here; or a pyvene ``IntervenableModel`` already built on its base (a sharded one),
    with ``tokenizer`` and ``positions`` given; or None, for the base model alone. Every other argument is
    ``HFLM``'s (``batch_size``, ``device``, ``max_length``, ...). Calls ``pyvene_dist.patch()`` if it was not.
    """

    def __init__(self, pretrained=None, reft=None, positions=None, share_weights=None, dtype=None, **kwargs):
        if not is_patched():
            patch()
        built = isinstance(reft, nn.Module)
        if built:
            if pretrained is not None:
                raise ValueError("pretrained: reft is a model, which holds its base; leave pretrained out")
            if positions is None:
                raise ValueError("positions: reft is a model, which records no training positions; pass them "
                                 "as in training, e.g. positions='f1+l1'")
            if kwargs.get("tokenizer") is None:
                raise ValueError("tokenizer: reft is a model, which holds no tokenizer; pass the base model's")
            settings = settings_of(None, positions, False if share_weights is None else share_weights, None)
            pretrained = reft.model
        elif reft is not None:
            settings = reft_settings(reft, pretrained=pretrained, positions=positions, share_weights=share_weights,
                                     dtype=dtype)
            pretrained = settings.pretrained
        else:
            if pretrained is None:
                raise ValueError("pretrained: expected the base model's folder (or reft=, a ReFT folder naming it)")
            settings = None
        if not built:
            given = dtype if dtype is not None else settings.dtype if settings is not None else None
            kwargs["dtype"] = given or "auto"
        super().__init__(pretrained=pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"pretrained: {type(self._model).__name__} is a sequence-to-sequence model; ReFTs are "
                             "evaluated on causal language models")
        self.settings: ReftSettings | None = settings
        self._join_the_process_group(kwargs)
        if built:
            check_locations(reft, settings, type(reft).__name__)
            reft.eval()
        elif reft is not None:
            reft = load_reft(reft, self._model, settings)
        self.reft_model = reft
        # A sharded base runs a collective in every forward: every rank runs as many as the others.
        self.synced = self.world_size > 1 and (has_dtensor_parameters(self._model) or
                                               bool(partitioned(self._model.parameters())))
        if reft is not None and not self.synced:
            for intervention in reft.interventions.values():
                intervention.to(self.device)

    @classmethod
    def from_model(cls, reft_model, tokenizer, *, positions: str, share_weights: bool = False, **kwargs):
        """A ReFT already built on its base, sharded or not (the entry a sharded loader hands its model to)."""
        return cls(reft=reft_model, tokenizer=tokenizer, positions=positions, share_weights=share_weights, **kwargs)

    # --- ranks -------------------------------------------------------------------------------------------------

    def _join_the_process_group(self, kwargs) -> None:
        """Every rank its share: ``HFLM`` splits the requests only over several GPUs, and not at all for a
        model it is given; here over the initialised process group, whatever the devices (not under
        ``tp_plan``, where every rank runs every request)."""
        if kwargs.get("tp_plan") is None and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """accelerate's ``gather`` (one tensor: the ranks' concatenated, a 0-d one stacked) over the process group,
        which a model given to ``HFLM`` has no accelerator for."""
        if self.world_size <= 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- the request methods -----------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self._weights_fixed():
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        with self._weights_fixed():
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        with self._weights_fixed():
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _weights_fixed(self):
        """Each LoReFT rotation (and any other parametrized weight) built once for all the requests of a call, not
        once per batch: the weights do not change while lm-eval evaluates (``parametrize.cached()``, entered under
        ``mechanisms.parametrization_cache``'s lock). A tiny model's generation spent about 4% of its time
        building them per batch."""
        return contextlib.nullcontext() if self.reft_model is None else cached_parametrizations()

    # --- scoring -----------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """``HFLM._loglikelihood_tokens`` for causal models with the interventions at each context's training
        positions (the forward grouping keyed by the context's end too)."""
        reft = self.reft_model is not None

        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        def same_forward(request):
            return request[1] + [_CONTEXT_END] * reft + request[2][:-1]

        ordered = Collator(requests, sort_fn=longest_first, group_by="contexts" if self.logits_cache else None,
                           group_fn=same_forward)
        batch_size = self.batch_size if self.batch_size != "auto" else override_bs or 0
        scheduled = self.batch_size == "auto" and len(ordered) > 0 and not override_bs
        if scheduled:
            self.batch_sizes = {}
        results, forwards = [], 0
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        for chunk in ordered.get_batched(n=batch_size, batch_fn=self._batch_scheduler if scheduled else None):
            rows = [self._scored_row(context, continuation) for _, context, continuation in chunk]
            log_probs = F.log_softmax(self._score(rows), dim=-1, dtype=self.softmax_dtype)
            forwards += 1
            for (request, context, _), (inputs, _, continuation), row in zip(chunk, rows, log_probs, strict=True):
                logits = row[len(inputs) - len(continuation):len(inputs)].unsqueeze(0)
                greedy = logits.argmax(dim=-1)
                key = context + [_CONTEXT_END] * reft
                for request_text, tokens, logits in ordered.get_cache(req_str=request, cxt_toks=key,
                                                                      cont_toks=continuation, logits=logits):
                    tokens = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(0)
                    exact = bool((greedy[:, -tokens.shape[1]:] == tokens).all())
                    answer = (float(torch.gather(logits, 2, tokens.unsqueeze(-1)).sum()), exact)
                    results.append(answer)
                    if request_text is not None:
                        self.cache_hook.add_partial("loglikelihood", request_text, answer)
                    progress.update(1)
        progress.close()
        self._match_forwards(forwards)
        return ordered.get_original(results)

    def _scored_row(self, context: list[int], continuation: list[int]):
        """HFLM's row: context and continuation less the last token, cut on the left to ``max_length``; and where
        the context ends in it."""
        if not context or not continuation or len(continuation) > self.max_length:
            raise ValueError(f"a loglikelihood request has {len(context)} context and {len(continuation)} "
                             f"continuation tokens; expected at least one of each, at most max_length "
                             f"({self.max_length}) continuation tokens")
        whole = context + continuation
        inputs = whole[-(self.max_length + 1):][:-1]
        context_length = len(context) - (len(whole) - 1 - len(inputs))
        if self.reft_model is not None and context_length < 1:
            raise ValueError(f"a loglikelihood request's {len(continuation)} continuation tokens leave no room for its "
                             f"context within max_length ({self.max_length}): the ReFT intervenes on the context")
        return inputs, context_length, continuation

    def _score(self, rows) -> torch.Tensor:
        """The logits of ``rows`` padded on the right (with 0, as ``HFLM``), intervened at each row's context;
        one more column where a context's pyreft position past its end (the continuation's first token) is
        beyond every row, so that it indexes a padding token no scored logit sees."""
        locations = None
        width = max(len(inputs) for inputs, _, _ in rows)
        if self.reft_model is not None:
            locations = scoring_locations([length for _, length, _ in rows], self.settings.positions,
                                          num_interventions=len(self.reft_model.interventions),
                                          share_weights=self.settings.share_weights)
            width = max(width, int(locations.max()) + 1)
        batch = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for index, (inputs, _, _) in enumerate(rows):
            batch[index, :len(inputs)] = torch.tensor(inputs, dtype=torch.long)
        return self._forward(batch, locations)

    def _forward(self, batch: torch.Tensor, locations) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            if locations is None:
                return self.model(batch).logits
            _, output = self.reft_model({"input_ids": batch},
                                        unit_locations={"sources->base": (None, locations.tolist())})
            return output.logits

    def _match_forwards(self, forwards: int) -> None:
        """Over a sharded base, run one-token forwards until this rank has run as many as the rank that ran most
        (lm-eval gives every rank as many requests, but grouping makes their forwards differ)."""
        if not self.synced:
            return
        most = torch.tensor(forwards, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        # A one-token context, its pyreft positions at 0 and 1 (the continuation's first token): two tokens.
        filler = torch.full((1, 2), self.prefix_token_id, dtype=torch.long, device=self.device)
        locations = None if self.reft_model is None else scoring_locations(
            [1], self.settings.positions, num_interventions=len(self.reft_model.interventions),
            share_weights=self.settings.share_weights)
        for _ in range(int(most) - forwards):
            self._forward(filler, locations)

    # --- generation --------------------------------------------------------------------------------------------

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """``HFLM._model_generate`` through pyvene's ``generate(intervene_on_prompt=True)``, each left-padded row
        at its prompt's positions; over a sharded base every rank steps until all are done (``synced_gpus``)."""
        if self.synced:
            generation_kwargs["synced_gpus"] = True
        if self.reft_model is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        generation_kwargs["temperature"] = temperature = generation_kwargs.get("temperature", 0.0)
        if temperature == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if generation_kwargs.get("do_sample") is False and temperature == 0.0:
            generation_kwargs.pop("temperature")
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        try:
            locations = positions_from_attention_mask(mask, self.settings.positions,
                                                      num_interventions=len(self.reft_model.interventions),
                                                      share_weights=self.settings.share_weights)
        except ValueError as error:
            raise ValueError(f"generate_until: a prompt is too short for the ReFT's positions "
                             f"{self.settings.positions!r}: {error}") from None
        stopping = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            _, generated = self.reft_model.generate(
                {"input_ids": context, "attention_mask": mask},
                unit_locations={"sources->base": (None, locations.tolist())}, intervene_on_prompt=True,
                max_length=max_length, stopping_criteria=stopping, pad_token_id=self.tokenizer.pad_token_id,
                use_cache=True, **generation_kwargs)
        return generated
