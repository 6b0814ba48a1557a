"""An OpenAI-compatible server of a base model and its ReFTs: ``transformers serve``'s own handlers, FastAPI app and
continuous batching, with the ``model`` field naming the ReFT as vLLM names a LoRA adapter.

    pyvene-dist serve --reft poet=out/poet/reft --reft coder=out/coder/reft --port 8000

What this layer adds to transformers' (``transformers.cli.serving``): a ``ModelManager`` that holds the
``MultiReftModel``'s base instead of loading one, a ``GenerationState`` whose continuous batching manager is the
ReFTs' (``MultiReftModel.init_continuous_batching``), and in front of each handler a check of the request that
maps ``model`` to a ReFT (``--base_name``, ``base`` by default, or absent: the bare model) and refuses what the
server would otherwise ignore or misread, naming the field: an unknown model (404), fields it does not honour
(``n`` above 1, ``stop``, ``logprobs``, ``echo``, ``top_p`` below 1, ``suffix``, penalties, tools, ...), sampling
(it decodes greedily), a ``max_tokens`` that is no positive integer; the engine then refuses a prompt too short for
its ReFT's positions, or a prompt and ``max_tokens`` beyond the model's positions (``continuous``). A body not
read within ``--body_timeout`` seconds is answered 408; past ``--max_queue`` waiting requests, 503.
``"intervene_on_prompt": false`` (an extension, ``extra_body`` in the openai client) asks for every-token mode.
``POST /v1/load_reft`` (``{"reft_name", "reft_path"}``) and ``POST /v1/unload_reft`` load and unload ReFTs while
it runs, when started with ``--allow_runtime_loading`` (vLLM's ``/v1/load_lora_adapter``, likewise gated).
"""

from __future__ import annotations

import asyncio
import json
from typing import Final

import transformers
# The serve extra (fastapi; transformers' handlers subclass its types where it is installed): optional, so this
# module is imported by the server alone (``serving.build_app``, ``pyvene-dist serve``), never by the package.
from fastapi import Request
from fastapi.responses import JSONResponse
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, TimedModel
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import CBGenerateManager, GenerationState

from .batching import SERVER, ReftBatchingManager, require_transformers
from .continuous import ReftRequestError
from .multi_reft import MultiReftModel

#: Each endpoint's fields, and for those it honours only at OpenAI's default, the values that mean the default.
COMMON: Final = {"model": None, "max_tokens": None, "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0),
          "n": (None, 1), "stream": None, "stream_options": None, "user": None, "seed": None,
          "intervene_on_prompt": None, "stop": (None,), "logprobs": (None, False), "presence_penalty": (None, 0, 0.0),
          "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {})}
FIELDS: Final = {
    "completions": {**COMMON, "prompt": None, "echo": (None, False), "best_of": (None, 1), "suffix": (None,)},
    "chat": {**COMMON, "messages": None, "max_completion_tokens": None, "top_logprobs": (None,), "tools": (None, []),
             "tool_choice": (None, "none")},
}


class ApiError(ReftRequestError):
    """A request refused before generation: HTTP ``status``, the field at fault (OpenAI's error body)."""


def check_request(body: dict, kind: str, *, base_name: str, refts: list[str], default_max_tokens: int) -> tuple:
    """The ReFT (None: bare) and mode the request asks for; ``body`` is left as transformers' handler takes it
    (``model`` dropped, ``max_tokens`` set). Raises ``ApiError`` naming the field."""
    for field, value in body.items():
        if field not in FIELDS[kind]:
            raise ApiError(f"{field}: this server does not take it (it takes {sorted(FIELDS[kind])})", field)
        honoured = FIELDS[kind][field]
        if honoured is not None and not any(value == ok and type(value) is type(ok) for ok in honoured):
            defaults = " or ".join(json.dumps(ok) for ok in honoured)
            raise ApiError(f"{field}: this server answers with {field} {defaults} only (greedy decoding, one "
                           f"choice, no log-probabilities, stop sequences or penalties); found {json.dumps(value)}",
                           field)
    model = body.pop("model", None)
    if model is not None and not isinstance(model, str):
        raise ApiError(f"model: expected a string (a ReFT's name or {base_name!r}), found {json.dumps(model)}", "model")
    if model not in (None, base_name) and model not in refts:
        raise ApiError(f"model {model!r} is not served; expected one of {[base_name, *refts]}", "model", 404)
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ApiError(f"{field}: expected a positive integer, found {json.dumps(value)}", field)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = default_max_tokens
    on_prompt = body.pop("intervene_on_prompt", True)
    if not isinstance(on_prompt, bool):
        raise ApiError(f"intervene_on_prompt: expected true or false, found {json.dumps(on_prompt)}",
                       "intervene_on_prompt")
    for field in ("stream",):
        if body.get(field) is not None and not isinstance(body[field], bool):
            raise ApiError(f"{field}: expected true or false, found {json.dumps(body[field])}", field)
    if kind == "completions" and (not isinstance(body.get("prompt"), str) or not body["prompt"]):
        raise ApiError(f"prompt: expected a non-empty string, found {json.dumps(body.get('prompt'))}", "prompt")
    if kind == "chat":
        _check_messages(body.get("messages"))
    return (None if model in (None, base_name) else model), on_prompt


def _check_messages(messages) -> None:
    def text(content) -> bool:
        return isinstance(content, str) or (isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content))

    if not isinstance(messages, list) or not messages or not all(
            isinstance(message, dict) and isinstance(message.get("role"), str) and text(message.get("content"))
            for message in messages):
        raise ApiError("messages: expected a non-empty list of {\"role\": string, \"content\": string or text parts}, "
                       f"found {json.dumps(messages)[:200]}", "messages")


def _handlers(server):
    """transformers' completion and chat handlers, each request checked and its ReFT named first."""

    class Checked:
        kind = ""

        async def handle_request(self, body: dict, request_id: str):
            reft, on_prompt = check_request(body, self.kind, base_name=server.base_name, refts=server.many.names,
                                            default_max_tokens=server.default_max_tokens)
            body["model"] = reft or server.base_name  # answers name the model asked for (_resolve_model)
            server.engine().expect(request_id, reft, on_prompt)
            try:
                return await super().handle_request(body, request_id)
            except BaseException:
                server.engine().forget(request_id)
                raise

        def _resolve_model(self, body: dict):
            """The name asked for, and the served base and tokenizer (loaded once, by the server)."""
            return body["model"], server.many.model, server.tokenizer

    class Completions(Checked, CompletionHandler):
        kind = "completions"

    class Chat(Checked, ChatCompletionHandler):
        kind = "chat"

    return Completions, Chat


class ReftServer:
    """The parts of one server: the ``MultiReftModel``, its tokenizer, the continuous batching manager and the
    FastAPI ``app`` (``build_app`` makes one)."""

    def __init__(self, many: MultiReftModel, tokenizer, *, model_id: str, base_name: str = "base",
                 batching: transformers.ContinuousBatchingConfig | None = None, default_max_tokens: int = 16,
                 body_timeout: float = 30.0, allow_runtime_loading: bool = False):
        self.many, self.tokenizer, self.model_id, self.base_name = many, tokenizer, model_id, base_name
        self.default_max_tokens, self.body_timeout = default_max_tokens, body_timeout
        self.allow_runtime_loading = allow_runtime_loading
        require_transformers(SERVER, "pyvene_dist.serving.build_app")
        config = transformers.GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, max_new_tokens=default_max_tokens)
        self.manager: ReftBatchingManager = many.init_continuous_batching(config, batching)
        self.manager.start()
        try:
            self.app = self._build()
        except BaseException:  # the manager's thread would keep the process alive after the error: a hung server
            self.close()
            raise

    def engine(self):
        return self.many._continuous

    def close(self) -> None:
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=30)

    def _build(self):
        server = self

        class Models(ModelManager):
            """transformers' model manager holding the served base (loaded already) under ``model_id``."""

            def __init__(self):
                super().__init__(device=str(server.many.model.device), continuous_batching=True)
                self.force_model = server.model_id
                self.loaded_models[server.model_id] = TimedModel(server.many.model, -1, processor=server.tokenizer)

            def list_models(self, cache_dir=None) -> list[dict]:
                names = [server.base_name, *server.many.names]
                return [{"id": name, "object": "model", "created": 0, "owned_by": "pyvene_dist",
                         **({"parent": server.base_name} if name != server.base_name else {})} for name in names]

            def shutdown(self) -> None:
                server.close()

        class Batching(CBGenerateManager):
            def init_cb(self, model, gen_config) -> None:
                self._cb = server.manager

        class State(GenerationState):
            def __init__(self):
                super().__init__(continuous_batching=True)
                self._cb_manager, self._cb_model_id = Batching(), server.model_id

            def get_manager(self, model_id: str, use_cb: bool = False):
                return self._cb_manager

        models, state = Models(), State()
        completions, chat = _handlers(self)
        unused = dict(model_manager=models, generation_state=state)
        app = build_server(models, chat(**unused), completion_handler=completions(**unused), response_handler=None,
                           transcription_handler=None, systemone_handler=None, generation_state=state)

        @app.exception_handler(ReftRequestError)
        async def refused(request: Request, error: ReftRequestError):
            return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error",
                                           "param": error.param, "code": _code(error)}}, status_code=error.status)

        @app.post("/v1/load_reft")
        async def load_reft(body: dict):
            name, path = self._runtime_request(body, ("reft_name", "reft_path"))
            try:
                await asyncio.to_thread(self.many.load, name, path)
            except (ValueError, TypeError, KeyError) as error:
                raise ApiError(f"reft_path {path!r}: {error}", "reft_path") from None
            return JSONResponse({"status": "loaded", "model": name})

        @app.post("/v1/unload_reft")
        async def unload_reft(body: dict):
            (name,) = self._runtime_request(body, ("reft_name",))
            if name not in self.many.refts:
                raise ApiError(f"reft_name {name!r} is not loaded; loaded: {self.many.names}", "reft_name", 404)
            await asyncio.to_thread(self.many.unload, name)
            return JSONResponse({"status": "unloaded", "model": name})

        return _BodyTimeout(app, self.body_timeout)

    def _runtime_request(self, body: dict, fields: tuple[str, ...]) -> list[str]:
        if not self.allow_runtime_loading:
            raise ApiError("loading and unloading ReFTs at run time is off: start the server with "
                           "--allow_runtime_loading", None, 403)
        found = [body.get(field) for field in fields]
        for field, value in zip(fields, found):
            if not isinstance(value, str) or not value:
                raise ApiError(f"{field}: expected a non-empty string, found {json.dumps(value)}", field)
        extra = sorted(set(body) - set(fields))
        if extra:
            raise ApiError(f"{extra[0]}: not a field of this request (it takes {list(fields)})", extra[0])
        return found


def _code(error: ReftRequestError) -> str:
    return {404: "model_not_found", 403: "forbidden", 409: "conflict", 503: "overloaded"}.get(error.status,
                                                                                               "invalid_request")


class _BodyTimeout:
    """ASGI middleware: a request's body is read whole first, and one that does not arrive within ``seconds`` (a
    Content-Length larger than what is sent) is answered 408 and closed, instead of holding its connection forever."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, first = [], None
        try:
            async with asyncio.timeout(self.seconds):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        first = message
                        break
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            body = json.dumps({"error": {"message": f"the request's body did not arrive within {self.seconds} s (is "
                                                    "Content-Length larger than the body?)",
                                         "type": "invalid_request_error", "param": None, "code": "timeout"}}).encode()
            await send({"type": "http.response.start", "status": 408,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        replayed = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return replayed.pop() if replayed else await receive()

        await self.app(scope, replay, send)


def build_app(many: MultiReftModel, tokenizer, **options) -> ReftServer:
    """The server of ``many`` (its manager started): ``.app`` for uvicorn, ``.close()`` to stop generating."""
    return ReftServer(many, tokenizer, **options)
