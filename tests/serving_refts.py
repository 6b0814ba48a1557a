"""The ReFTs the serving tests load (``REFTS``), saved with ``ReftModel.save`` beside a ``train_settings.json`` as
docs/examples/train_reft.py saves them, what pyreft alone generates with each (``Alone``), and the server
(``running_server``): shared by tests/test_serving.py (padded batches), tests/test_continuous_batching.py,
tests/test_openai_server.py (the server) and tests/test_inputs.py's serving section. tests/conftest.py saves them once
per session (``save_all``: ``serving_saved``) and starts one server for all (``serving_server``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import pyreft
import pytest
import torch
import transformers

import pyvene_dist
from pyvene_dist.serving import SETTINGS, MultiReftModel
from pyvene_dist.serving.batching import require_transformers
from pyvene_dist.versions import UnsupportedVersionError
from pyvene_dist.testing.models import save_checkpoint

#: New tokens of every answer compared, and the server's --max_tokens: within them each ReFT changes the tokens of
#: every prompt it serves (the tests check it, so that equality is not the bare model's twice).
NEW_TOKENS = 4
#: The base's positions: tests/test_continuous_batching.py's prompts reach 200 tokens.
POSITIONS = 512
#: The tiny tokenizer has no chat template; the server's chat completions need one.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
#: The ReFTs the session's server starts with (``lo2`` is loaded over HTTP by a test), and its body timeout (s).
SERVED = ("lo", "no", "di")
BODY_TIMEOUT = 2
#: name: (pyreft class, layers, positions, share_weights, component)


def needs_transformers(*requirement: str) -> pytest.MarkDecorator:
    """Skips a test on a transformers the serving path refuses (``batching.require_transformers(*requirement)``),
    its refusal the reason; tests/test_serving.py tests the refusals."""
    try:
        require_transformers(*requirement)
    except UnsupportedVersionError as error:
        return pytest.mark.skip(reason=str(error))
    return pytest.mark.usefixtures()


REFTS = {
    "lo": ("LoreftIntervention", (0, 1), "f1+l1", False, "block_output"),
    "no": ("NoreftIntervention", (1,), "l1", False, "block_output"),
    "di": ("DireftIntervention", (0,), "f2+l2", True, "mlp_output"),
    "lo2": ("LoreftIntervention", (0,), "l1", False, "block_output"),  # with "lo" on layer 0: stacked
}

def save_reft(base, folder: Path, name: str, seed: int):
    """The ReFT ``name`` of ``REFTS`` on ``base``, its weights drawn from ``seed``, saved to ``folder``; returned."""
    kind, layers, positions, share_weights, component = REFTS[name]
    first, last = pyreft.parse_positions(positions)
    per_layer = 2 if first and last and not share_weights else 1
    hidden = base.config.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        representations = [{"layer": layer, "component": component, "low_rank_dimension": 4,
                            "intervention": getattr(pyreft, kind)(embed_dim=hidden, low_rank_dimension=4,
                                                                  dtype=base.dtype, add_bias=True)}
                           for layer in list(layers) * per_layer]
        reft_model = pyreft.get_reft_model(base, pyreft.ReftConfig(representations=representations))
        for intervention in reft_model.interventions.values():  # large enough to change greedy tokens
            torch.nn.init.normal_(intervention.learned_source.weight, std=1.0)
            torch.nn.init.normal_(intervention.learned_source.bias, std=4.0)
    reft_model.save(str(folder))
    (folder / SETTINGS).write_text(json.dumps({"model": base.name_or_path, "positions": positions,
                                               "share_weights": share_weights,
                                               "dtype": str(base.dtype).removeprefix("torch.")}))
    return reft_model


def save_refts(base_folder, root: Path, names=tuple(REFTS)) -> tuple[dict, dict]:
    """Each ReFT of ``names`` saved under ``root`` (``save_reft``, seed = its place in ``names``) on a fresh load of
    the base, under the patch as train_reft.py saves: (name -> folder, name -> the ReFT model as saved)."""
    folders, trained = {}, {}
    with pyvene_dist.patched():
        for seed, name in enumerate(names):
            base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
            folders[name] = root / name
            trained[name] = save_reft(base, folders[name], name, seed).eval()
    return folders, trained


def generated(ids: torch.Tensor, start: int, eos: int) -> list[int]:
    """The tokens after ``start``, up to and with the first end of sequence (a batch pads after it)."""
    tokens = ids[start:].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def settings(tokenizer, on_prompt: bool = True, new_tokens: int = NEW_TOKENS) -> dict:
    """Greedy, ``NEW_TOKENS`` at most; every-token mode leaves the first new token alone, and the tiny model often
    ends there, so that mode makes exactly ``NEW_TOKENS``."""
    return dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **({} if on_prompt else {"min_new_tokens": new_tokens}))


def patched():
    """``pyvene_dist.patched()``, or nothing where the caller patched already (a patch and unpatch take 0.4 s: a
    test asking pyreft for many answers patches once around them)."""
    return contextlib.nullcontext() if pyvene_dist.is_patched() else pyvene_dist.patched()


@dataclasses.dataclass
class Saved:
    """What the serving modules share (``save_all``): the base's folder, each ReFT's folder and model as saved, the
    tokenizer (no padding side set; chat template given), and pyreft's answers, memoised across modules."""
    base_folder: Path
    folders: dict
    trained: dict
    tokenizer: object
    alone: "Alone"


def save_all(root: Path) -> Saved:
    """The base (``POSITIONS`` positions, its tokenizer saved with ``CHAT_TEMPLATE``) and every ReFT of ``REFTS`` on it,
    saved under ``root``."""
    base_folder = save_checkpoint(root / "base", positions=POSITIONS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base_folder)
    folders, trained = save_refts(base_folder, root)
    return Saved(base_folder, folders, trained, tokenizer, Alone(base_folder, folders, trained, tokenizer))


class Alone:
    """``alone(name, prompt, on_prompt, **extra)``: the prompt's tokens generated with that ReFT alone through pyreft
    (patched, as serve_reft.py is), or with the bare model for None; memoised. Each ReFT is loaded once, onto a
    base of its own. pyreft's ``ReftModel.load`` cannot rebuild NoReFT (``KeyError: 'add_bias'``): that one
    generates as it was saved (``trained``). ``new_tokens``: as ``settings``."""

    def __init__(self, base_folder, folders: dict, trained: dict, tokenizer, new_tokens: int = NEW_TOKENS):
        self.base_folder, self.folders, self.trained, self.tokenizer = base_folder, folders, trained, tokenizer
        self.new_tokens = new_tokens
        self.found, self.loaded = {}, {}

    def model(self, name):
        if name not in self.loaded:
            base = transformers.AutoModelForCausalLM.from_pretrained(self.base_folder).eval()
            if name is None:
                self.loaded[name] = base
            elif REFTS[name][0] == "NoreftIntervention":
                self.loaded[name] = self.trained[name]
            else:
                with patched():
                    self.loaded[name] = pyreft.ReftModel.load(str(self.folders[name]), base)
                self.loaded[name].set_device("cpu")
                self.loaded[name].eval()
        return self.loaded[name]

    def __call__(self, name, prompt, on_prompt=True, **extra):
        """The generated tokens; a list of them, one per sequence, for ``num_return_sequences`` in ``extra``."""
        key = (name, prompt if isinstance(prompt, str) else tuple(prompt), on_prompt, tuple(sorted(extra.items())))
        if key not in self.found:
            tokenizer = self.tokenizer
            inputs = tokenizer(prompt, return_tensors="pt") if isinstance(prompt, str) else \
                {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.int64)}
            options = {**settings(tokenizer, on_prompt, self.new_tokens), **extra}
            with torch.no_grad(), patched():
                if name is None:
                    ids = self.model(None).generate(**inputs, **options)
                else:
                    reft_model = self.model(name)
                    _, _, positions, share_weights, _ = REFTS[name]
                    first, last = pyreft.parse_positions(positions)
                    where = pyreft.get_intervention_locations(
                        last_position=inputs["input_ids"].shape[1], first_n=first, last_n=last, pad_mode="last",
                        num_interventions=len(reft_model.interventions), share_weights=share_weights)
                    locations = {"sources->base": (None, [[w] for w in where])} if on_prompt else None
                    _, ids = reft_model.generate(inputs, unit_locations=locations, intervene_on_prompt=on_prompt,
                                                 **options)
            rows = [generated(row, inputs["input_ids"].shape[1], tokenizer.eos_token_id) for row in ids]
            self.found[key] = rows if "num_return_sequences" in extra else rows[0]
        return self.found[key]


def small_cache(**options) -> transformers.ContinuousBatchingConfig:
    """A paged cache sized for the tiny model (left to itself, transformers sizes it from the machine's memory, and
    the CPU step builds a mask that wide: 30 s for three prompts)."""
    return transformers.ContinuousBatchingConfig(page_size=16, num_blocks=160, max_batch_tokens=64,
                                                 max_requests_per_batch=8, **options)


def load_many(saved: Saved, names=tuple(REFTS)) -> MultiReftModel:
    """A ``MultiReftModel`` of the ReFTs ``names`` on a fresh load of the base (sdpa attention, as pyvene-dist serve
    loads it), loaded under one patch (``MultiReftModel.load`` patches and unpatches for itself otherwise)."""
    many = MultiReftModel(transformers.AutoModelForCausalLM.from_pretrained(saved.base_folder,
                                                                            attn_implementation="sdpa").eval())
    with patched():
        for name in names:
            many.load(name, saved.folders[name])
    return many


@contextlib.contextmanager
def running_server(refts: dict, *flags: str, timeout: float = 180):
    """``python -m pyvene_dist serve --reft NAME=FOLDER ... --port 0 FLAGS`` as docs/serving.md starts it, on a free
    port of the loopback, with one intra-op thread (``OMP_NUM_THREADS=1``: see tests/conftest.py's ``one_thread``):
    yields its base URL (``http://127.0.0.1:PORT``); stopped (by its pid) after."""
    import re
    import subprocess
    import sys
    import tempfile
    import time

    arguments = [argument for name, folder in refts.items() for argument in ("--reft", f"{name}={folder}")]
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen([sys.executable, "-m", "pyvene_dist", "serve", *arguments, "--port", "0", *flags],
                                   stdout=subprocess.PIPE, stderr=errors, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline, line = time.monotonic() + timeout, ""
            while "/v1" not in line:  # pyvene prints a note first
                line = process.stdout.readline()
                if not line and process.poll() is not None or time.monotonic() > deadline:
                    errors.seek(0)
                    raise AssertionError(f"the server did not start: {errors.read()[-3000:]}")
            yield re.search(r"on (http://[\d.]+:\d+)/v1", line).group(1)
        finally:
            process.terminate()
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
