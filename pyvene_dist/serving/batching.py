"""transformers' ``ContinuousBatchingManager`` whose requests name their ReFT, and ``MultiReftModel``'s
``init_continuous_batching`` and ``generate_batch`` on it; ``continuous`` says how a step applies the ReFTs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time

from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.continuous_api import OutputRouter

from ..versions import UnsupportedVersionError, admits, installed
from .continuous import CHILD, ContinuousRefts, ReftRequestError

#: The oldest transformers whose continuous batching the ReFT manager runs on: 5.18 added the manager's ``pause``
#: (a ReFT loaded or unloaded while the manager runs waits in it), named the cache's ``block_size`` ``page_size`` and
#: reworked the cache's allocation beneath. The padded ``MultiReftModel.generate`` needs none of it.
CONTINUOUS_BATCHING = ">=5.18"
#: The transformers whose ``transformers serve`` internals ``openai_api`` builds on: 5.18-5.22's ``ModelManager``
#: takes no ``continuous_batching``, 5.23's server answered the concurrent completions of tests/test_openai_server.py
#: with a 500, and 5.25 rewrote ``transformers.cli.serving`` (no ``TimedModel``, no ``CBGenerateManager``).
SERVER = ">=5.24,<5.25"


def require_transformers(specifier: str = CONTINUOUS_BATCHING, needed_by: str = "ReFT continuous batching") -> None:
    """``UnsupportedVersionError`` naming the transformers found, the one needed and what works on it, where it is
    not ``specifier``: before any manager starts, rather than a stranger error from inside transformers."""
    found = installed.version("transformers")
    if found is None or admits(specifier, found):
        return
    usable = ["MultiReftModel.generate (padded batches)"]
    if admits(CONTINUOUS_BATCHING, found):
        usable.append("continuous batching (init_continuous_batching, generate_batch)")
    raise UnsupportedVersionError(f"{needed_by} needs transformers {specifier} (found {found}): pip install "
                                  f"'transformers{specifier}'; {' and '.join(usable)} work"
                                  f"{'s' * (len(usable) == 1)} on {found}")


class _Router(OutputRouter):
    """transformers' router, telling the ReFTs which requests are over."""

    def __init__(self, engine: ContinuousRefts):
        super().__init__()
        self.engine = engine

    def deliver(self, output) -> None:
        super().deliver(output)
        if output.is_finished():
            self.engine.finished(output.request_id)

    def deliver_batch(self, outputs) -> None:
        super().deliver_batch(outputs)
        for output in outputs:
            if output.is_finished():
                self.engine.finished(output.request_id)


class ReftBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` whose requests name their ReFT: ``add_request(..., reft=,
    intervene_on_prompt=)``; ``MultiReftModel.init_continuous_batching`` makes one."""

    def __init__(self, engine: ContinuousRefts, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.output_router = _Router(engine)
        self._request_counter_lock = threading.Lock()

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None, *,
                    reft: str | None = None, intervene_on_prompt: bool = True, **logit_processor_kwargs) -> str:
        """transformers' ``add_request``, the request with the ReFT ``reft`` (None: the bare model, unless
        ``expect`` named one for this ``request_id``). Raises ``ReftRequestError`` for a request it refuses, and
        RuntimeError where transformers would drop it (a manager stopping)."""
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        with self.engine.lock:
            reft, intervene_on_prompt = self.engine.expected.pop(request_id, (reft, intervene_on_prompt))
        new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.engine.admit(request_id, reft, len(input_ids), intervene_on_prompt, new_tokens,
                          self.num_return_sequences)
        try:
            added = super().add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                        streaming=streaming, record_timestamps=record_timestamps,
                                        eos_token_id=eos_token_id, **logit_processor_kwargs)
        except queue.Full:
            self.engine.forget(request_id)
            raise ReftRequestError(f"request {request_id}: {self.input_queue.maxsize} requests wait already "
                                   "(max_queue_size); retry later", None, 503) from None
        except BaseException:
            self.engine.forget(request_id)
            raise
        if added is None:
            self.engine.forget(request_id)
            raise RuntimeError(f"request {request_id}: {self.background_thread_status.can_accept_new_requests()} "
                               "(transformers would drop it)")
        return added

    def add_requests(self, inputs: list[list[int]], *, refts=None, intervene_on_prompt: bool = True,
                     max_new_tokens: int | None = None, **kwargs) -> list[str]:
        """One ``add_request`` per prompt, ``refts[i]`` for prompt ``i`` (None, or absent: the bare model)."""
        refts = [None] * len(inputs) if refts is None else list(refts)
        if len(refts) != len(inputs):
            raise ValueError(f"refts: expected one name (or None) per prompt, {len(inputs)} in all, found {len(refts)}")
        for index, name in enumerate(refts):
            if name is not None:
                try:
                    self.engine._check_reft(name)
                except ReftRequestError as error:
                    raise KeyError(f"refts[{index}]: {error}") from None
        eos = self.generation_config.eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        return [self.add_request(ids, max_new_tokens=max_new_tokens, eos_token_id=-1 if eos is None else eos,
                                 reft=name, intervene_on_prompt=intervene_on_prompt, **kwargs)
                for ids, name in zip(inputs, refts)]

    def cancel_request(self, request_id: str) -> None:
        super().cancel_request(request_id)
        self.engine.forget(request_id)

    def warmup(self) -> None:
        """Nothing: transformers' warmup runs forwards (and captures CUDA graphs) without the ReFTs' inputs, and a
        graph captured so would replay without them. Each graph is captured at the first real step of its shape."""
        self.warmed_up = True

    def _generation_step(self) -> None:
        """transformers' step (``ContinuousBatchProcessor._generation_step``), the forward also given the ReFTs of
        the step's requests (``ContinuousRefts.step_inputs``)."""
        processor = self.batch_processor
        if processor is None:
            raise RuntimeError("Tried to perform a generation step before the batch processor was initialized.")
        batch_data = processor.inputs_and_outputs.get_model_kwargs(use_padding=processor.model_runner.pad_inputs)
        batch_data.update(self.engine.step_inputs(processor))
        processor.model_runner.compute_batch(self.model, batch_data)
        processor.inputs_and_outputs.retrieve_device_outputs()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        super().stop(block=block, timeout=timeout, keep_for_next_session=keep_for_next_session, hard_stop=hard_stop)
        if not keep_for_next_session and self.engine.manager is self:
            self.engine.manager = None


def init_manager(many, generation_config=None, continuous_batching_config: ContinuousBatchingConfig | None = None, *,
                 workload_hints=None) -> ReftBatchingManager:
    """A ``ReftBatchingManager`` over ``many``'s model and ReFTs, as ``model.init_continuous_batching`` makes
    transformers' own (block sharing off: see ``continuous``)."""
    require_transformers()
    engine = many._continuous
    if engine is not None and engine.manager is not None and engine.manager.is_running():
        raise RuntimeError("a continuous batching manager of this MultiReftModel is running; stop it first")
    config = copy.deepcopy(generation_config if generation_config is not None else many.model.generation_config)
    if config.eos_token_id is None:
        config.eos_token_id = -1
    batching = (dataclasses.replace(continuous_batching_config) if continuous_batching_config is not None
                else ContinuousBatchingConfig())
    batching.allow_block_sharing = False
    if batching.use_cuda_graph is None:  # transformers would decide by itself: the ReFTs' steps run without graphs
        batching.use_cuda_graph = False
    _refuse_compiled(batching, config)
    if engine is None:  # one per MultiReftModel, its hooks on the model from then on (inert outside its steps)
        engine = many._continuous = ContinuousRefts(many)
    engine.manager = ReftBatchingManager(engine, model=many.model, generation_config=config,
                                         continuous_batching_config=batching, workload_hints=workload_hints)
    return engine.manager


def _refuse_compiled(batching: ContinuousBatchingConfig, config) -> None:
    """A compiled step or a captured CUDA graph is refused: dynamo guards no module hook, and a step it compiled
    for one manager ran a later manager's mixed batch without some of its interventions (CPU, eager backend).
    Refused rather than run without them."""
    found = [(name, getattr(batching, name)) for name in ("varlen_compile_config", "decode_compile_config")
             if getattr(batching, name) is not None]
    found += [("default_compile_level", batching.default_compile_level)] if batching.default_compile_level else []
    found += [("use_cuda_graph", batching.use_cuda_graph)] if batching.use_cuda_graph not in (False, (False, False)) else []
    found += [("generation_config.compile_config", config.compile_config)] if getattr(
        config, "compile_config", None) is not None and getattr(config.compile_config, "_compile_all_devices", None) else []
    if found:
        name, value = found[0]
        raise ValueError(f"{name}={value!r}: a continuous batching step with ReFTs runs eagerly (no torch.compile, no "
                         "CUDA graph); leave it unset (use_cuda_graph=False, default_compile_level=0)")


def paused(engine: ContinuousRefts | None):
    """The manager's pause while its loop runs (to change the tables between two steps), else nothing."""
    manager = getattr(engine, "manager", None)
    return manager.pause() if manager is not None and manager.is_running() else contextlib.nullcontext()


def generate_batch(many, inputs: list[list[int]], *, refts, intervene_on_prompt: bool = True,
                   max_new_tokens: int | None = None, generation_config=None, continuous_batching_config=None,
                   timeout: float = 600.0) -> dict:
    """``model.generate_batch`` with a ReFT per prompt: request id -> transformers' ``GenerationOutput``, in the
    order of ``inputs`` (forked sequences after their parent). Raises for a refused prompt before any runs, for a
    request that failed, and after ``timeout`` seconds."""
    manager = init_manager(many, generation_config, continuous_batching_config)
    manager.start()
    try:
        ids = manager.add_requests(inputs, refts=refts, intervene_on_prompt=intervene_on_prompt,
                                   max_new_tokens=max_new_tokens)
        wanted = [f"{rid}{CHILD}{i}" for rid in ids for i in range(manager.num_return_sequences - 1)] + ids
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < len(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(f"generate_batch: {len(wanted) - len(results)} of {len(wanted)} sequences were not "
                                   f"done after {timeout} s")
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"generate_batch: the generation loop stopped: "
                                   f"{manager.background_thread_status.fatal_error}")
        failed = {rid: result.error for rid, result in results.items() if result.error is not None}
        if failed:
            raise RuntimeError(f"generate_batch: requests failed: {failed}")
        order = [rid for parent in ids for rid in (*[f"{parent}{CHILD}{i}" for i in
                                                    range(manager.num_return_sequences - 1)], parent)]
        return {rid: results[rid] for rid in order}
    except BaseException:
        manager.stop(block=True, timeout=60, hard_stop=True)
        raise
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=60)
