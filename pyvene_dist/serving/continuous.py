"""ReFTs inside transformers' continuous batching: each request names its ReFT (or none), and its interventions act
at that request's own positions inside the flattened batch that ``ContinuousBatchingManager`` runs.

    many = MultiReftModel(model)                     # the base, attn_implementation="sdpa" (or paged|...)
    many.load("poet", "out/poet/reft")
    manager = many.init_continuous_batching(generation_config=config)
    manager.start()
    manager.add_request(prompt_ids, request_id="a", reft="poet", max_new_tokens=32)
    manager.add_request(other_ids, request_id="b", max_new_tokens=32)   # the bare model
    manager.get_result(request_id="a", timeout=60)

How one step runs: transformers' scheduler picks the requests and flattens their tokens (a prefill may be split
across steps, a decoding request brings its one new token) and ``prepare_batch_tensors`` writes the step's
inputs. ``ReftBatchingManager._generation_step`` then writes three numbers per request of the step into a small
table (its ReFT's slot, its prompt's length, its mode) and copies it to the device, beside transformers' own
inputs (per IO pair when batching is asynchronous). In the forward, a pre-hook on the model maps each token to its
request (``cu_seq_lens_q``) and its position (``position_ids``), and each hooked module's hook applies, stage by
stage, every token's intervention (``slots.Stage.apply``, entry 0 for a token none acts on):

- prompt mode (pyreft's, ``intervene_on_prompt=True``): the first and last positions of the request's prompt, as
  ``pyreft.get_intervention_locations`` places them, whichever step of a split prefill holds them;
- every-token mode: each position past the prompt, i.e. each generated token as it is fed back.

The forward is given everything that changes from step to step as keywords (``reft_rows``, ``reft_tables``), and
no loop over requests runs in it. A step runs eagerly: ``batching`` refuses compiling and CUDA graphs (a step
dynamo compiled for one manager ran a later manager's mixed batch without some interventions: dynamo guards no
module hook). A step in which no token of the batch is intervened on (prompt mode's decoding steps) is given no
keywords, and the hooks do nothing.

Block sharing (prefix caching) is turned off: a shared block holds keys and values computed under one request's
ReFT. A request is refused before it enters the queue, naming the request and the numbers: an unknown ReFT, a
prompt too short for its ReFT's positions (pyreft would intervene past its end), an every-token request of fewer
than 2 new tokens (the first comes from the prompt's forward: it would intervene nowhere), or a prompt and
``max_new_tokens`` beyond the model's positions.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

from ..positions import parse_positions
from .slots import BOTH, FIRST, LAST, PARTS, SPARE_SLOTS, Stage, apply_stage, linear_form, rank_of, width_of

#: The forward's keywords for the ReFTs (``ContinuousRefts.step_inputs``), taken off before the model sees them.
ROWS, TABLES = "reft_rows", "reft_tables"
#: transformers names a forked sequence (``num_return_sequences``) after its parent: ``<parent>__child#<i>``.
CHILD = "__child#"


class ReftRequestError(ValueError):
    """A request the manager refuses before queueing it; ``param`` names the field at fault (for HTTP answers)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class ContinuousRefts:
    """The slots, tables and hooks of a ``MultiReftModel``'s ReFTs for one continuous batching manager, and the
    ReFT of each request in flight (see the module's docstring)."""

    def __init__(self, many):
        self.many = many
        self.model = many.model
        self.lock = threading.Lock()
        self.slots: dict[str, int] = {}
        self.positions: dict[int, tuple[int, int]] = {}    # slot -> pyreft's (first, last) counts
        self.capacity = max(len(many.refts), 1)
        self.stages: dict[tuple, list[Stage]] = {}           # (module, pre) -> its stages
        self.requests: dict[str, list] = {}                  # request id -> [slot, prompt length, every token, left]
        self.expected: dict[str, tuple] = {}                 # request id -> (reft, on prompt), for add_request
        self.manager = None
        self.step = None
        self.rows: dict[int, tuple] = {}                     # IO pair -> (host, device)
        self.names = {(module, pre): f"{name}:{'in' if pre else 'out'}" for name, module in self.model.named_modules()
                      for pre in (False, True)}
        parameter = next(self.model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        for name in many.names:  # refused before any hook is on the model
            self._check(name)
        self.first = torch.zeros(self.capacity + 1, dtype=torch.int64, device=self.device)
        self.last = torch.zeros_like(self.first)
        self.model_handle = self.model.register_forward_pre_hook(self._before_model, with_kwargs=True)
        self.hooked: dict[tuple, object] = {}                # (module, pre) -> its hook's handle
        for name in many.names:
            self.add(name)

    # --- ReFTs ---------------------------------------------------------------------------------------------

    def _check(self, name: str) -> None:
        """A ValueError naming what the tables cannot hold (``slots.linear_form``), before anything is written."""
        for item in self.many.refts[name].interventions:
            try:
                linear_form(item.intervention)
            except ValueError as error:
                raise ValueError(f"ReFT {name!r}: {error}") from None

    def add(self, name: str) -> None:
        """Give the loaded ReFT ``name`` a slot and write its interventions into the stages' tables."""
        self._check(name)
        reft = self.many.refts[name]
        free = sorted(set(range(1, self.capacity + 1)) - set(self.slots.values()))
        if not free:
            self._grow(self.capacity + SPARE_SLOTS)
            free = [self.capacity - SPARE_SLOTS + 1]
        slot = free[0]
        for stages in self.stages.values():  # nothing left of an earlier ReFT in this slot
            for stage in stages:
                stage.clear(slot)
        first, last = parse_positions(reft.positions)
        per_module: dict[tuple, list] = {}
        for item in reft.interventions:
            per_module.setdefault((item.module, item.pre), []).append(item)
        for key, items in per_module.items():
            stages = self.stages.setdefault(key, [])
            if key not in self.hooked:
                self._hook(key)
            for index, item in enumerate(items):
                if index == len(stages):
                    stages.append(Stage(width_of(item.intervention), rank_of(item.intervention), self.capacity,
                                        self.device, self.dtype))
                stage = stages[index]
                if rank_of(item.intervention) > stage.rank:
                    stages[index] = stage = stage.resized(self.capacity, rank_of(item.intervention))
                stage.write(slot, item.intervention, self._where(reft, item.index, first, last))
        self.slots[name] = slot
        self.positions[slot] = (first, last)
        self.first[slot], self.last[slot] = first, last

    def remove(self, name: str) -> None:
        slot = self.slots[name]
        busy = [rid for rid, entry in self.requests.items() if entry[0] == slot]
        if busy:
            raise ReftRequestError(f"ReFT {name!r} serves {len(busy)} request(s) in flight ({busy[:3]}); unload it "
                                   "once they are done", "model", 409)
        for stages in self.stages.values():
            for stage in stages:
                stage.clear(slot)
        del self.slots[name]
        self.positions.pop(slot)

    @staticmethod
    def _where(reft, index: int, first: int, last: int) -> int:
        """pyreft's ``get_intervention_locations``: shared weights, or one kind of position, give every
        intervention the first and last positions; otherwise the first half of the interventions (in
        ``sorted_keys``) takes the first positions and the second half the last."""
        if reft.share_weights or not first or not last:
            return BOTH
        return FIRST if index < len(reft.interventions) // 2 else LAST

    def _grow(self, capacity: int) -> None:
        """Tables of ``capacity`` slots (between two steps: the next is given the new tensors)."""
        self.capacity = capacity
        for key, stages in self.stages.items():
            self.stages[key] = [stage.resized(capacity, stage.rank) for stage in stages]
        for name in ("first", "last"):
            grown = torch.zeros(capacity + 1, dtype=torch.int64, device=self.device)
            grown[:getattr(self, name).shape[0]] = getattr(self, name)
            setattr(self, name, grown)

    def _hook(self, key: tuple) -> None:
        module, pre = key
        hook = self._before_module if pre else self._after_module
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self.hooked[key] = register(lambda module, args, kwargs, *output: hook(key, args, kwargs, *output),
                                    with_kwargs=True)

    def close(self) -> None:
        """Remove the hooks: the model is the bare model again."""
        for handle in [self.model_handle, *self.hooked.values()]:
            handle.remove()
        self.hooked = {}

    # --- requests ------------------------------------------------------------------------------------------

    def expect(self, request_id: str, reft: str | None, intervene_on_prompt: bool = True) -> None:
        """Name the ReFT of the request ``request_id`` that a caller (the server) will add without naming it."""
        self._check_reft(reft)
        self.expected[request_id] = (reft, intervene_on_prompt)

    def admit(self, request_id: str, reft: str | None, prompt_length: int, intervene_on_prompt: bool,
              max_new_tokens: int | None, sequences: int) -> None:
        """Check the request and record its ReFT (see the module's docstring for what is refused)."""
        self._check_reft(reft)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if prompt_length < 1:
            raise ReftRequestError(f"request {request_id}: the prompt is empty", "prompt")
        if positions is not None and prompt_length + (max_new_tokens or 0) > positions:
            raise ReftRequestError(f"request {request_id}: a prompt of {prompt_length} tokens and max_new_tokens="
                                   f"{max_new_tokens} need {prompt_length + (max_new_tokens or 0)} positions; the model "
                                   f"has {positions}", "max_tokens" if prompt_length < positions else "prompt")
        if request_id in self.requests:
            raise ReftRequestError(f"request {request_id}: a request of that id is in flight already", "request_id")
        if reft is None:
            return
        slot = self.slots[reft]
        first, last = self.positions[slot]
        if intervene_on_prompt and 2 * max(first, last) > prompt_length:
            position = prompt_length
            raise ReftRequestError(
                f"request {request_id}: ReFT {reft!r}'s positions {self.many.refts[reft].positions!r} take the first "
                f"{first} and last {last} tokens, each at most half the prompt: a prompt of {prompt_length} tokens is "
                f"too short (pyreft would intervene at position {position}, past the prompt's last position "
                f"{prompt_length - 1}); it needs at least {2 * max(first, last)} tokens", "prompt")
        if not intervene_on_prompt and max_new_tokens is not None and max_new_tokens < 2:
            raise ReftRequestError(
                f"request {request_id}: every-token mode intervenes on each generated token fed back, from the second "
                f"new token on; max_new_tokens={max_new_tokens} would intervene nowhere (at least 2)", "max_tokens")
        with self.lock:
            self.requests[request_id] = [slot, prompt_length, int(not intervene_on_prompt), sequences]

    def _check_reft(self, reft) -> None:
        if reft is not None and reft not in self.slots:
            raise ReftRequestError(f"ReFT {reft!r} is not loaded; loaded: {sorted(self.slots)}", "model", 404)

    def finished(self, request_id: str) -> None:
        """One sequence of the request (or of a child forked from it) is over."""
        parent = request_id.split(CHILD)[0]
        with self.lock:
            entry = self.requests.get(parent)
            if entry is not None:
                entry[3] -= 1
                if entry[3] <= 0:
                    del self.requests[parent]

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.requests.pop(request_id.split(CHILD)[0], None)
            self.expected.pop(request_id, None)

    # --- steps ---------------------------------------------------------------------------------------------

    def tables(self) -> dict[str, torch.Tensor]:
        """Every table, by a name that says which module and stage it is for: the forward's ``reft_tables``."""
        found = {"first": self.first, "last": self.last}
        for key, stages in self.stages.items():
            for index, stage in enumerate(stages):
                found.update({f"{self.names[key]}:{index}:{part}": table for part, table in stage.tables.items()})
                found[f"{self.names[key]}:{index}:where"] = stage.where
        return found

    def _rows(self, processor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) tables of the requests of a step: slot, prompt length, every-token; a column per request
        and one of zeros past them (where a padded step's padding would map)."""
        columns = processor.cb_config.max_requests_per_batch + 1
        if key not in self.rows or self.rows[key][0].shape[1] != columns:  # no reference to the processor kept:
            host = torch.zeros(3, columns, dtype=torch.int64, pin_memory=self.device.type == "cuda")  # its __del__
            self.rows[key] = (host, host if self.device.type == "cpu" else host.to(self.device))  # runs gc (0.7 s)
        return self.rows[key]

    def step_inputs(self, processor) -> dict:
        """The forward's keywords for the ReFTs of the step about to run: each request's ReFT, prompt length and
        mode (copied to the device on the compute stream, per IO pair when batching is asynchronous), and the
        tables; none for an eager step in which no token is intervened on (the hooks then do nothing)."""
        io = processor.inputs_and_outputs
        key, io = (io.current_pair, io.io_pairs[io.current_pair].host_io) if isinstance(
            io, ContinuousBatchingAsyncIOs) else (0, io)
        slots, lengths, every, active = [], [], [], False
        with self.lock:
            for future in io.requests_in_batch:
                entry = self.requests.get(future.state.request_id.split(CHILD)[0])
                if entry is None:
                    slots.append(0), lengths.append(0), every.append(0)
                    continue
                slot, length, every_token, _ = entry
                slots.append(slot), lengths.append(length), every.append(every_token)
                end = future.state.position_offset
                start = end - future.query_length
                first, last = self.positions.get(slot, (0, 0))
                last_start = length - last  # the last positions are [length - last, length)
                active = active or (end > length if every_token else
                                    start < first or (start < length and end > last_start))
        if not active:
            return {}
        host, device = self._rows(processor, key)
        count = len(slots)
        host[:, :count] = torch.tensor([slots, lengths, every], dtype=torch.int64)
        host[:, count:] = 0
        if device is not host:
            stream = processor.inputs_and_outputs.compute_stream  # transformers' stream_context (5.24), inlined:
            with contextlib.nullcontext() if stream is None else torch.get_device_module().stream(stream):  # 5.17 lacks it
                device.copy_(host, non_blocking=True)
        return {ROWS: device, TABLES: self.tables()}

    def _before_model(self, module, args, kwargs):
        """Each token's request, slot, prompt length, mode and position, for the module hooks of this forward. Reads
        only what the forward is given (``reft_rows``, ``reft_tables``)."""
        self.step = None
        if ROWS not in kwargs:
            return None
        kwargs = dict(kwargs)
        rows, tables = kwargs.pop(ROWS), kwargs.pop(TABLES)
        positions = kwargs["position_ids"][0].to(torch.int64)
        ends = kwargs["cu_seq_lens_q"][1:].to(torch.int64)
        tokens = torch.arange(positions.shape[0], device=positions.device)
        request = torch.searchsorted(ends, tokens, right=True).clamp_(max=rows.shape[1] - 1)
        slot, length, every = rows[0][request], rows[1][request], rows[2][request].bool()
        in_prompt = positions < length
        self.step = (tables, slot, every, positions >= length, positions < tables["first"][slot],
                     (positions >= length - tables["last"][slot]) & in_prompt)
        return args, kwargs

    def _apply(self, key: tuple, hidden: torch.Tensor) -> None:
        tables, slot, every, generated, in_first, in_last = self.step
        flat = hidden.reshape(-1, hidden.shape[-1])
        for index in range(len(self.stages[key])):
            name = f"{self.names[key]}:{index}"
            where = tables[f"{name}:where"][slot]
            prompt = ((where & FIRST).bool() & in_first) | ((where & LAST).bool() & in_last)
            entry = torch.where(torch.where(every, (where > 0) & generated, prompt), slot, torch.zeros_like(slot))
            apply_stage({part: tables[f"{name}:{part}"] for part in PARTS}, flat, entry)

    def _after_module(self, key, args, kwargs, output):
        if self.step is not None:
            self._apply(key, output[0] if isinstance(output, tuple) else output)
        return None

    def _before_module(self, key, args, kwargs):
        if self.step is not None:
            self._apply(key, args[0] if args else next(iter(kwargs.values())))
        return None
