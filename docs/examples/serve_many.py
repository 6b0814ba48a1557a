"""An OpenAI-style completions server for several ReFTs on one base model, batching requests that arrive
together into one ``generate``, whatever ReFT each names.

    python docs/examples/serve_many.py --reft poet=out/poet/reft --reft coder=out/coder/reft --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "poet", "prompt": "What colour is snow?", "max_tokens": 16}'

``POST /v1/completions`` takes ``model`` (a ReFT's name; ``null``, absent or ``--base_name`` for the bare
model), ``prompt`` (a string, or a list of strings: one choice each), ``max_tokens`` (default 16) and
``temperature`` (0 or absent: greedy decoding is all it does); ``"return_token_ids": true`` adds each
choice's generated token ids. ``GET /v1/models`` lists the names. Every folder is what
docs/examples/train_reft.py saved (pyreft's format with its ``train_settings.json``): the base model's folder
and the dtype are read from there (all folders must name the same), ``--model`` and ``--dtype`` override them.

A worker thread takes the requests waiting (up to ``--max_batch`` prompts, after waiting ``--batch_wait_ms``
for more), pads them on the left and generates them in one batch, each row with its ReFT's interventions
at its own prompt positions (``pyvene_dist.serving.MultiReftModel``); each answer equals generating that
prompt alone with its ReFT (tests/test_serving.py asks the server over the loopback).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import transformers

from pyvene_dist import flags
from pyvene_dist.serving import SETTINGS, MultiReftModel

#: The most tokens one request may ask for.
MAX_TOKENS_LIMIT = 4096


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None, code: str):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


def base_settings(refts: dict[str, str], model: str | None, dtype: str | None) -> tuple[str, str]:
    """The base model's folder and dtype: the flags, else what every folder's ``train_settings.json`` says."""
    found = {}
    for name, folder in refts.items():
        path = os.path.join(folder, SETTINGS)
        saved = json.load(open(path)) if os.path.isfile(path) else {}
        for key in ("model", "dtype"):
            if key in saved:
                found.setdefault(key, {})[name] = saved[key]
    chosen = {}
    for key, given in (("model", model), ("dtype", dtype)):
        values = set(found.get(key, {}).values())
        if given is not None:
            chosen[key] = given
        elif len(values) == 1:
            chosen[key] = values.pop()
        elif key == "dtype" and not values:
            chosen[key] = "float32"
        else:
            raise SystemExit(f"serve_many.py: pass --{key}: the folders' {SETTINGS} name "
                             f"{found.get(key) or 'none'}")
    return chosen["model"], chosen["dtype"]


def load(model_path: str, refts: dict[str, str], dtype: str = "float32"):
    """The tokenizer (padding on the left) and the base model with every ReFT loaded, on the first device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    many = MultiReftModel(model)
    for name, folder in refts.items():
        many.load(name, folder)
    return tokenizer, many


class Batcher:
    """Generates the prompts waiting, in batches: ``submit`` returns a future of one prompt's answer."""

    def __init__(self, many: MultiReftModel, tokenizer, *, max_batch: int = 8, wait_s: float = 0.005,
                 base_name: str = "base", verbose: bool = True):
        self.many, self.tokenizer, self.max_batch, self.wait_s = many, tokenizer, max_batch, wait_s
        self.base_name, self.verbose = base_name, verbose
        self.pending: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="serve_many-batcher", daemon=True)
        self.thread.start()

    def submit(self, reft: str | None, prompt: str, max_tokens: int) -> Future:
        future: Future = Future()
        self.pending.put((reft, prompt, max_tokens, future))
        return future

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            first = self.pending.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                try:
                    item = self.pending.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self.pending.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                answers = self.generate([(reft, prompt, tokens) for reft, prompt, tokens, _ in batch])
            except Exception as error:  # noqa: BLE001  (each request gets the error)
                for *_, future in batch:
                    future.set_exception(error)
                continue
            for (*_, future), answer in zip(batch, answers):
                future.set_result(answer)

    def generate(self, requests: list[tuple[str | None, str, int]]) -> list[dict]:
        """One ``generate`` of every request's prompt, as long as the longest asks; each answer cut to its own
        ``max_tokens`` and its first end of sequence (greedy rows do not depend on each other's lengths)."""
        if self.verbose:  # before the answers go out: a client that has its answer can read the line
            print(f"batch of {len(requests)}: {', '.join(reft or self.base_name for reft, *_ in requests)}", flush=True)
        device = next(self.many.model.parameters()).device
        inputs = self.tokenizer([prompt for _, prompt, _ in requests], return_tensors="pt", padding=True).to(device)
        longest = max(tokens for *_, tokens in requests)
        ids = self.many.generate(inputs, refts=[reft for reft, *_ in requests], max_new_tokens=longest,
                                 do_sample=False, eos_token_id=self.tokenizer.eos_token_id,
                                 pad_token_id=self.tokenizer.pad_token_id)
        answers = []
        for row, (_, _, tokens) in enumerate(requests):
            generated = ids[row, inputs["input_ids"].shape[1]:][:tokens].tolist()
            stop = self.tokenizer.eos_token_id in generated
            if stop:
                generated = generated[:generated.index(self.tokenizer.eos_token_id) + 1]
            answers.append({"token_ids": generated, "finish_reason": "stop" if stop else "length",
                            "text": self.tokenizer.decode(generated, skip_special_tokens=True),
                            "prompt_tokens": int(inputs["attention_mask"][row].sum())})
        return answers


def completion(batcher: Batcher, request: dict, base_name: str) -> dict:
    """The response to one ``/v1/completions`` request, in OpenAI's form."""
    model = request.get("model")
    reft = None if model in (None, "", base_name) else model
    if reft is not None and reft not in batcher.many.refts:
        raise RequestError(404, f"model {model!r} is not served; expected one of "
                                f"{[base_name, *batcher.many.names]} (or none, for the base model)", "model",
                           "model_not_found")
    prompts = request.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(400, f"prompt: expected a non-empty string or list of them, found {request.get('prompt')!r}",
                           "prompt", "invalid_prompt")
    max_tokens = request.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise RequestError(400, f"max_tokens: expected an integer from 1 to {MAX_TOKENS_LIMIT}, found {max_tokens!r}",
                           "max_tokens", "invalid_max_tokens")
    if request.get("temperature", 0) not in (0, 0.0, None):
        raise RequestError(400, f"temperature: this server decodes greedily (0), found {request['temperature']!r}",
                           "temperature", "unsupported")
    futures = [batcher.submit(reft, prompt, max_tokens) for prompt in prompts]
    answers = [future.result() for future in futures]
    choices = [{"index": index, "text": answer["text"], "logprobs": None, "finish_reason": answer["finish_reason"],
                **({"token_ids": answer["token_ids"]} if request.get("return_token_ids") else {})}
               for index, answer in enumerate(answers)]
    prompt_tokens = sum(answer["prompt_tokens"] for answer in answers)
    completion_tokens = sum(len(answer["token_ids"]) for answer in answers)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model if reft is not None else base_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def handler(batcher: Batcher, base_name: str):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.rstrip("/") != "/v1/models":
                return self._reply(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error",
                                                   "param": None, "code": "not_found"}})
            names = [base_name, *batcher.many.names]
            self._reply(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "serve_many"}
                                                         for name in names]})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/completions":
                return self._reply(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error",
                                                   "param": None, "code": "not_found"}})
            try:
                length = int(self.headers.get("Content-Length", 0))
                try:
                    request = json.loads(self.rfile.read(length) or b"null")
                except json.JSONDecodeError as error:
                    raise RequestError(400, f"the body is not JSON: {error}", None, "invalid_json") from None
                if not isinstance(request, dict):
                    raise RequestError(400, f"the body: expected a JSON object, found {request!r}", None,
                                       "invalid_json")
                self._reply(200, completion(batcher, request, base_name))
            except RequestError as error:
                self._reply(error.status, error.body())
            except Exception as error:  # noqa: BLE001  (a failed generate: the client hears why)
                self._reply(500, {"error": {"message": f"{type(error).__name__}: {error}", "type": "server_error",
                                            "param": None, "code": None}})

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002  (the base class's name)
            if self.server.verbose:
                super().log_message(format, *args)

    return Handler


def serve(many: MultiReftModel, tokenizer, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          batch_wait_ms: float = 5.0, base_name: str = "base", verbose: bool = True) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving: call ``serve_forever``; ``port=0`` takes a free port, then
    ``server.server_address``). ``server.batcher`` is its batcher; ``shutdown`` then ``batcher.close()`` stop it.
    ``verbose``: each request, and each batch's size and names (``batch of 3: poet, base, coder``), are logged."""
    batcher = Batcher(many, tokenizer, max_batch=max_batch, wait_s=batch_wait_ms / 1000, base_name=base_name,
                      verbose=verbose)
    server = ThreadingHTTPServer((host, port), handler(batcher, base_name))
    server.batcher, server.verbose = batcher, verbose
    return server


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reft", action="append", required=True, metavar="NAME=FOLDER",
                        help="a ReFT to serve, by the name requests give as 'model' (repeat for each)")
    parser.add_argument("--model", help=f"the base model's folder, with its tokenizer (default: from {SETTINGS})")
    parser.add_argument("--dtype", type=functools.partial(flags.dtype_name, program="serve_many.py"),
                        choices=flags.DTYPES, help=f"the model's dtype (default: from {SETTINGS}, else float32)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_batch", "--max-batch", type=int, default=8, help="prompts per generate, at most")
    parser.add_argument("--batch_wait_ms", "--batch-wait-ms", type=float, default=5.0,
                        help="how long the first waiting prompt waits for others to batch with")
    parser.add_argument("--base_name", "--base-name", default="base", help="the 'model' naming the bare model")
    options = parser.parse_args(argv)
    refts = {}
    for given in options.reft:
        name, sep, folder = given.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--reft {given!r}: expected NAME=FOLDER")
        if name in refts or name == options.base_name:
            parser.error(f"--reft {given!r}: the name {name!r} is taken (by another --reft or --base_name)")
        refts[name] = folder
    options.refts = refts
    return options


def main(argv=None):
    options = parse_arguments(argv)
    model_path, dtype = base_settings(options.refts, options.model, options.dtype)
    tokenizer, many = load(model_path, options.refts, dtype)
    server = serve(many, tokenizer, host=options.host, port=options.port, max_batch=options.max_batch,
                   batch_wait_ms=options.batch_wait_ms, base_name=options.base_name)
    host, port = server.server_address[:2]
    print(f"serving {options.base_name} and {many.names} on http://{host}:{port}/v1/completions", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.batcher.close()


if __name__ == "__main__":
    main()
