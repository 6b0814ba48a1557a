"""Several ReFTs on one base in one batch (``pyvene_dist.serving``) and the HTTP server on it
(docs/examples/serve_many.py): each row's tokens equal generating its prompt alone with its ReFT.

The folders are saved here as users have them: a tiny Llama and a real BPE tokenizer (``save_checkpoint``),
LoReFT, NoReFT and DiReFT at different layers and positions saved with ``ReftModel.save`` beside a
``train_settings.json``, their weights drawn large enough that each changes the greedy tokens (checked, so
that equality is not the bare model's twice). "Alone" is pyreft's own path on a fresh copy of the base:
``ReftModel.load`` and ``reft_model.generate`` on the one unpadded prompt, its locations from pyreft's
``get_intervention_locations``, as docs/examples/serve_reft.py answers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyreft")

import pyreft  # noqa: E402
import transformers  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist import _serving_hooks  # noqa: E402
from pyvene_dist.serving import SETTINGS, MultiReftModel  # noqa: E402
from pyvene_dist.testing.models import save_checkpoint  # noqa: E402

EXAMPLES = Path(__file__).parents[1] / "docs" / "examples"
NEW_TOKENS = 6
#: name: (pyreft class, layers, positions, share_weights, component)
REFTS = {
    "lo": ("LoreftIntervention", (0, 1), "f1+l1", False, "block_output"),
    "no": ("NoreftIntervention", (1,), "l1", False, "block_output"),
    "di": ("DireftIntervention", (0,), "f2+l2", True, "mlp_output"),
    "lo2": ("LoreftIntervention", (0,), "l1", False, "block_output"),  # with "lo" on layer 0: stacked
}
#: Prompts of 2 to 11 tokens (the byte-level BPE splits words outside WORDS), padded on the left in a batch;
#: DiReFT's f2+l2 needs 4.
PROMPTS = ["red cat runs fast", "big dog", "small bird sits on the tree", "cold river stone sits", "green tree",
           "the red river runs", "blue house light dark"]
ROWS = ["lo", None, "no", "di", "lo", "di", "lo2"]


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


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The base model's folder, each ReFT's, saved under the patch as docs/examples/train_reft.py saves, and each
    ReFT as it was saved (on a base of its own)."""
    root = tmp_path_factory.mktemp("serving")
    base_folder = save_checkpoint(root / "base")
    folders, trained = {}, {}
    with pyvene_dist.patched():
        for seed, name in enumerate(REFTS):
            base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
            folders[name] = root / name
            trained[name] = save_reft(base, folders[name], name, seed).eval()
    return base_folder, folders, trained


@pytest.fixture(scope="module")
def tokenizer(saved):
    return transformers.AutoTokenizer.from_pretrained(saved[0], padding_side="left")


@pytest.fixture(scope="module")
def many(saved):
    base_folder, folders, _ = saved
    many = MultiReftModel(transformers.AutoModelForCausalLM.from_pretrained(base_folder).eval())
    for name, folder in folders.items():
        many.load(name, folder)
    return many


def generated(ids: torch.Tensor, start: int, eos: int) -> list[int]:
    """The tokens after ``start``, up to and with the first end of sequence (a batch pads after it)."""
    tokens = ids[start:].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def settings(tokenizer, on_prompt: bool = True) -> dict:
    """Greedy, ``NEW_TOKENS`` at most; every-token mode leaves the first new token alone, and the tiny model often
    ends there, so that mode makes exactly ``NEW_TOKENS``."""
    return dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **({} if on_prompt else {"min_new_tokens": NEW_TOKENS}))


@pytest.fixture(scope="module")
def alone(saved, tokenizer):
    """``alone(name, prompt, on_prompt)``: the prompt's tokens generated with that ReFT alone through pyreft
    (patched, as serve_reft.py is), or with the bare model for None; memoised. Each ReFT is loaded once, onto a
    base of its own. pyreft's ``ReftModel.load`` cannot rebuild NoReFT (``KeyError: 'add_bias'``): that one
    generates as it was saved."""
    base_folder, folders, trained = saved
    found, loaded = {}, {}

    def model(name):
        if name not in loaded:
            base = transformers.AutoModelForCausalLM.from_pretrained(base_folder).eval()
            if name is None:
                loaded[name] = base
            elif REFTS[name][0] == "NoreftIntervention":
                loaded[name] = trained[name]
            else:
                with pyvene_dist.patched():
                    loaded[name] = pyreft.ReftModel.load(str(folders[name]), base)
                loaded[name].set_device("cpu")
                loaded[name].eval()
        return loaded[name]

    def generate(name, prompt, on_prompt=True):
        key = (name, prompt, on_prompt)
        if key not in found:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad(), pyvene_dist.patched():
                if name is None:
                    ids = model(None).generate(**inputs, **settings(tokenizer, on_prompt))
                else:
                    reft_model = model(name)
                    _, _, positions, share_weights, _ = REFTS[name]
                    first, last = pyreft.parse_positions(positions)
                    where = pyreft.get_intervention_locations(
                        last_position=inputs["input_ids"].shape[1], first_n=first, last_n=last, pad_mode="last",
                        num_interventions=len(reft_model.interventions), share_weights=share_weights)
                    locations = {"sources->base": (None, [[w] for w in where])} if on_prompt else None
                    _, ids = reft_model.generate(inputs, unit_locations=locations, intervene_on_prompt=on_prompt,
                                                 **settings(tokenizer, on_prompt))
            found[key] = generated(ids[0], inputs["input_ids"].shape[1], tokenizer.eos_token_id)
        return found[key]

    return generate


@pytest.mark.parametrize("on_prompt", [True, False], ids=["prompt", "every-token"])
def test_each_row_equals_its_reft_alone(many, tokenizer, alone, on_prompt, monkeypatch):
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 2, "the prompts must pad to different lengths"
    stacked = []  # "lo" and "lo2" on layer 0 go through the stacked LoReFT
    stacked_apply = _serving_hooks.StackedLoreft.apply
    monkeypatch.setattr(_serving_hooks.StackedLoreft, "apply",
                        lambda self, hidden: stacked.append(len(self.stages)) or stacked_apply(self, hidden))
    ids = many.generate(inputs, refts=ROWS, intervene_on_prompt=on_prompt, **settings(tokenizer, on_prompt))
    assert stacked == ([2] if on_prompt else [2] * (NEW_TOKENS - 1)), stacked
    width = inputs["input_ids"].shape[1]
    for row, (name, prompt) in enumerate(zip(ROWS, PROMPTS)):
        assert generated(ids[row], width, tokenizer.eos_token_id) == alone(name, prompt, on_prompt), \
            f"row {row} ({name}, {prompt!r})"
    for name in REFTS:  # not vacuous: every ReFT changes the tokens of the prompts it serves
        for prompt in [p for p, chosen in zip(PROMPTS, ROWS) if chosen == name]:
            assert alone(name, prompt, on_prompt) != alone(None, prompt, on_prompt), \
                f"{name} leaves {prompt!r} unchanged"


def test_one_reft_batch_and_bare_batch(many, tokenizer, alone):
    """Every row of one ReFT (no bare rows), then every row bare: the base model is left as it was."""
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    width = inputs["input_ids"].shape[1]
    ids = many.generate(inputs, refts=["lo"] * len(PROMPTS), **settings(tokenizer))  # one ReFT: not stacked
    assert [generated(r, width, tokenizer.eos_token_id) for r in ids] == [alone("lo", p) for p in PROMPTS]
    bare = many.model.generate(**inputs, **settings(tokenizer))
    assert torch.equal(many.generate(inputs, refts=[None] * len(PROMPTS), **settings(tokenizer)), bare)
    assert [generated(r, width, tokenizer.eos_token_id) for r in bare] == [alone(None, p) for p in PROMPTS]
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in many.model.modules())


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.fixture(scope="module")
def server(saved, tmp_path_factory):
    """docs/examples/serve_many.py started as docs/serving.md launches it, on a free port of the loopback, with a
    long batching window so that requests sent together land in one generate; its stdout, line by line."""
    _, folders, _ = saved
    refts = [argument for name, folder in folders.items() for argument in ("--reft", f"{name}={folder}")]
    errors = open(tmp_path_factory.mktemp("server") / "stderr.txt", "w+")
    process = subprocess.Popen([sys.executable, str(EXAMPLES / "serve_many.py"), *refts, "--port", "0",
                                "--batch_wait_ms", "500"], stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        printed = []
        while not printed or printed[-1] and "/v1/completions" not in printed[-1]:  # pyvene prints a note first
            printed.append(process.stdout.readline())
        found = re.search(r"on (http://[\d.]+:\d+)/v1/completions", printed[-1])
        assert found, f"serve_many.py printed {printed}; stderr: {Path(errors.name).read_text()}"
        yield found.group(1), process.stdout
    finally:
        process.terminate()
        process.communicate(timeout=60)
        errors.close()


def batches(log, prompts: int) -> list[str]:
    """The server's lines for the batches that served the last ``prompts`` prompts (printed before answering)."""
    lines = []
    while prompts > 0:
        lines.append(log.readline().strip())
        prompts -= int(re.match(r"batch of (\d+): ", lines[-1]).group(1))
    return lines


def test_server_answers_each_model_as_alone(server, alone, tokenizer):
    url, log = server
    asked = [("lo", PROMPTS[0]), (None, PROMPTS[1]), ("no", PROMPTS[2]), ("di", PROMPTS[3]), ("base", PROMPTS[4]),
             ("lo", PROMPTS[5])]
    with ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda item: post(f"{url}/v1/completions", {
            **({"model": item[0]} if item[0] is not None else {}), "prompt": item[1], "max_tokens": NEW_TOKENS,
            "temperature": 0, "return_token_ids": True}), asked))
    for (model, prompt), (status, body) in zip(asked, replies):
        assert status == 200, body
        expected = alone(None if model == "base" else model, prompt)
        choice = body["choices"][0]
        assert choice["token_ids"] == expected, (model, prompt)
        assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert body["model"] == (model or "base") and body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == len(expected)
    served = batches(log, len(asked))
    assert len(served) < len(asked), f"no two requests shared a generate: {served}"

    # two prompts in one request, cut shorter by max_tokens
    status, body = post(f"{url}/v1/completions", {"model": "no", "prompt": PROMPTS[:2], "max_tokens": 3,
                                                  "return_token_ids": True})
    assert status == 200, body
    assert [c["token_ids"] for c in body["choices"]] == [alone("no", p)[:3] for p in PROMPTS[:2]]
    batches(log, 2)

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        assert [m["id"] for m in json.load(response)["data"]] == ["base", "di", "lo", "lo2", "no"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "poet", "prompt": "red cat"}, 404, "model"),
    ({"model": "lo", "prompt": ""}, 400, "prompt"),
    ({"model": "lo", "prompt": "red cat", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "lo", "prompt": "red cat", "temperature": 0.7}, 400, "temperature"),
], ids=["unknown-model", "empty-prompt", "no-tokens", "sampling"])
def test_server_refuses(server, body, status, param):
    code, reply = post(f"{server[0]}/v1/completions", body)
    assert (code, reply["error"]["param"]) == (status, param), reply
    assert repr(body[param]) in reply["error"]["message"]


# --- bad input --------------------------------------------------------------------------------------------

def test_unknown_name_and_row_count(many, tokenizer):
    inputs = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with pytest.raises(KeyError, match=r"refts\[1\]: expected a loaded ReFT or None, found 'poet'; "
                                       r"loaded: \['di', 'lo', 'lo2', 'no'\]"):
        many.generate(inputs, refts=["lo", "poet"], max_new_tokens=2)
    with pytest.raises(ValueError, match="refts: expected one name .* 2 in all, found 3 names"):
        many.generate(inputs, refts=["lo", None, "no"], max_new_tokens=2)


def test_padding_on_the_right_and_short_prompts(many, tokenizer):
    right = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path, padding_side="right")
    inputs = right(PROMPTS[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match=r"attention_mask'\]: row 1 is not padded on the left"):
        many.generate(inputs, refts=["lo", "lo"], max_new_tokens=2)
    short = tokenizer(["red", "red cat runs"], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="row 0's prompt has 1 tokens, too few for ReFT 'lo''s positions 'f1\\+l1'"):
        many.generate(short, refts=["lo", None], max_new_tokens=2)


def test_compiled_cache_refused(many, tokenizer):
    inputs = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="cache_implementation='static': .*disable_compile=True"):
        many.generate(inputs, refts=["lo", None], max_new_tokens=2, cache_implementation="static")


@pytest.mark.parametrize("other, message", [
    (dict(hidden=64, heads=4, kv_heads=2),
     r"intervention 0 \(layer_0_comp_block_output_unit_pos_nunit_1#0\) is 64 wide; the base model's block_output is "
     r"32 wide"),
    (dict(layers=4), r"representation 1 is at layer 3; the base model has layers 0 to 1"),
    (dict(dtype=torch.bfloat16), r"was saved in bfloat16, the base model is float32"),
], ids=["hidden-size", "layer", "dtype"])
def test_folder_of_another_base(saved, many, tmp_path, other, message):
    """A ReFT trained on a base of another width, depth or dtype is refused at load, naming what differs."""
    save_checkpoint(tmp_path / "other", **other)
    dtype = other.get("dtype", torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "other", dtype=dtype)
    layers = (0, base.config.num_hidden_layers - 1)
    with pyvene_dist.patched(), torch.random.fork_rng(devices=[]):
        representations = [{"layer": layer, "component": "block_output", "low_rank_dimension": 4,
                            "intervention": pyreft.LoreftIntervention(embed_dim=base.config.hidden_size,
                                                                      low_rank_dimension=4, dtype=base.dtype)}
                           for layer in layers]
        pyreft.get_reft_model(base, pyreft.ReftConfig(representations=representations)).save(str(tmp_path / "reft"))
    with pytest.raises(ValueError, match=message):
        many.load("other", tmp_path / "reft", positions="l1")
    assert "other" not in many.refts


def test_load_refusals(saved, many, tmp_path):
    _, folders, _ = saved
    with pytest.raises(ValueError, match="name 'lo': a ReFT of that name is loaded already"):
        many.load("lo", folders["lo"])
    with pytest.raises(ValueError, match="folder: expected a folder ReftModel.save wrote .*, which does not exist"):
        many.load("x", tmp_path / "missing", positions="l1")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((folders["no"] / "config.json").read_text())
    with pytest.raises(ValueError, match="positions: .* has no train_settings.json; pass the positions of training"):
        many.load("x", tmp_path / "bare")
    with pytest.raises(ValueError, match="positions='last': expected pyreft's form 'f<n>\\+l<m>', 'f<n>' or 'l<m>'"):
        many.load("x", folders["no"], positions="last")
    with pytest.raises(ValueError, match="positions='f0' selects no position"):  # would serve the bare model's
        many.load("x", folders["no"], positions="f0")


def test_the_benchmark_smoke_writes_every_provider(tmp_path):
    """benchmarks/mixed_refts.py --smoke, in this process (its CPU rows, benchmarks/results/mixed-refts-cpu.jsonl,
    are the same script on the tiny model): every provider's row, the mixed rows equal to their groups alone."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import mixed_refts

    out = tmp_path / "rows.jsonl"
    assert mixed_refts.main(["--smoke", "--refts", "2", "--batch", "2", "--out", str(out)]) == 0
    rows = {row["provider"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"one-reft-batch", "mixed-refts", "each-group-alone", "pyreft-one-reft", "bare"}
    assert rows["mixed-refts"]["same_as_alone"] and rows["mixed-refts"]["differs_from_bare"]
    assert rows["one-reft-batch"]["same_as_pyreft"]
    assert rows["mixed-refts"]["groups"] == 2 and len(rows["mixed-refts"]["ratio_rounds"]) == 2
    assert rows["bare"]["base_per_reft_bytes"] == 2 * rows["bare"]["base_bytes"] + rows["bare"]["reft_bytes"]
    assert all(row["commit"] and row["run_id"] and row["machine"] and row["versions"]["torch"] for row in rows.values())
