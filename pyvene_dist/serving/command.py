"""``pyvene-dist serve``: the OpenAI-compatible server (``openai_api``) of a base model and the ReFTs it is given.

    pyvene-dist serve --reft poet=out/poet/reft --reft coder=out/coder/reft --port 8000

Each ``--reft NAME=FOLDER`` is a folder docs/examples/train_reft.py saved (pyreft's format with its
``train_settings.json``): the base model's folder and dtype are read from there (all must name the same), and
``--model`` and ``--dtype`` override them. It prints ``serving base and ['coder', 'poet'] on http://HOST:PORT/v1``
once it listens (``--port 0``: a free port).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket

import torch
import transformers

from .. import flags
from ..versions import UnsupportedVersionError
from .batching import SERVER, require_transformers
from .multi_reft import SETTINGS, MultiReftModel


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {text!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(prog="pyvene-dist serve", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("--reft", action="append", default=[], metavar="NAME=FOLDER",
                       help="a ReFT to serve, under the name requests give as 'model' (repeat for each)")
    found.add_argument("--model", help=f"the base model's folder, with its tokenizer (default: from {SETTINGS})")
    found.add_argument("--dtype", type=functools.partial(flags.dtype_name, program="pyvene-dist serve"),
                       choices=flags.DTYPES, help=f"the model's dtype (default: from {SETTINGS}, else float32)")
    found.add_argument("--host", default="127.0.0.1")
    found.add_argument("--port", type=int, default=8000, help="0: a free port")
    found.add_argument("--base_name", "--base-name", default="base", help="the 'model' naming the bare model")
    found.add_argument("--max_requests", "--max-requests", type=_positive(int), default=32,
                       help="requests in one step of the running batch, at most")
    found.add_argument("--max_batch_tokens", "--max-batch-tokens", type=_positive(int), default=256,
                       help="tokens in one step, at most (a longer prefill is split across steps)")
    found.add_argument("--num_blocks", "--num-blocks", type=_positive(int), default=256,
                       help="blocks of the paged KV cache")
    found.add_argument("--page_size", "--page-size", type=_positive(int), default=32, help="tokens per cache block")
    found.add_argument("--max_queue", "--max-queue", type=_positive(int), default=1024,
                       help="requests waiting at most; past it, 503")
    found.add_argument("--max_tokens", "--max-tokens", type=_positive(int), default=16,
                       help="a request's max_tokens when it gives none")
    found.add_argument("--body_timeout", "--body-timeout", type=_positive(float), default=30.0,
                       help="seconds a request's body may take to arrive; past it, 408")
    found.add_argument("--attn_implementation", "--attn-implementation", default="sdpa",
                       help="sdpa, paged|sdpa, flash_attention_2, ...")
    found.add_argument("--allow_runtime_loading", "--allow-runtime-loading", action="store_true",
                       help="take POST /v1/load_reft and /v1/unload_reft")
    return found


def parse_arguments(argv=None) -> argparse.Namespace:
    options = parser().parse_args(argv)
    refts = {}
    for given in options.reft:
        name, sep, folder = given.partition("=")
        if not sep or not name or not folder:
            parser().error(f"--reft {given!r}: expected NAME=FOLDER")
        if name in refts or name == options.base_name:
            parser().error(f"--reft {given!r}: the name {name!r} is taken (by another --reft or --base_name)")
        if not os.path.isdir(folder):
            parser().error(f"--reft {given!r}: {folder} is no folder")
        refts[name] = folder
    if not refts and options.model is None:
        parser().error("give the base model (--model FOLDER) or a ReFT (--reft NAME=FOLDER)")
    options.refts = refts
    return options


def base_settings(refts: dict[str, str], model: str | None, dtype: str | None) -> tuple[str, str]:
    """The base model's folder and dtype: the flags, else what every folder's ``train_settings.json`` says."""
    found: dict[str, dict] = {}
    for name, folder in refts.items():
        path = os.path.join(folder, SETTINGS)
        with open(path) if os.path.isfile(path) else open(os.devnull) as file:
            saved = json.loads(file.read() or "{}")
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
            raise SystemExit(f"pyvene-dist serve: pass --{key}: the folders' {SETTINGS} name {found.get(key) or 'none'}")
    if not os.path.isdir(chosen["model"]):
        raise SystemExit(f"pyvene-dist serve: the base model's folder {chosen['model']!r} is no folder (pass --model)")
    return chosen["model"], chosen["dtype"]


def main(argv=None) -> int:
    options = parse_arguments(argv)
    try:
        require_transformers(SERVER, "pyvene-dist serve")  # before transformers serve's modules are imported
    except UnsupportedVersionError as error:
        raise SystemExit(str(error)) from None
    # The serve extra's (uvicorn; fastapi in openai_api), optional: here, so that --help works without them.
    import uvicorn
    from .openai_api import build_app

    model_path, dtype = base_settings(options.refts, options.model, options.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), attn_implementation=options.attn_implementation).to(device).eval()
    many = MultiReftModel(model)
    for name, folder in options.refts.items():
        many.load(name, folder)
    batching = transformers.ContinuousBatchingConfig(
        page_size=options.page_size, num_blocks=options.num_blocks, max_batch_tokens=options.max_batch_tokens,
        max_requests_per_batch=options.max_requests, max_queue_size=options.max_queue)
    server = build_app(many, tokenizer, model_id=model_path, base_name=options.base_name, batching=batching,
                       default_max_tokens=options.max_tokens, body_timeout=options.body_timeout,
                       allow_runtime_loading=options.allow_runtime_loading)
    listening = socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((options.host, options.port))
    listening.listen(2048)
    host, port = listening.getsockname()[:2]
    print(f"serving {options.base_name} and {many.names} on http://{host}:{port}/v1", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(server.app, log_level="warning", timeout_keep_alive=5)).run(sockets=[listening])
    finally:
        server.close()
    return 0
