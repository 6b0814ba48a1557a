"""Several ReFTs on one base in one padded batch (``MultiReftModel.generate``): each row's tokens equal generating its
prompt alone with its ReFT. The server: tests/test_openai_server.py; continuous batching:
tests/test_continuous_batching.py.

The folders are saved once per session (tests/conftest.py's ``serving_saved``, tests/serving_refts.py) as users have
them: a tiny Llama and a real BPE tokenizer (``save_checkpoint``),
LoReFT, NoReFT and DiReFT at different layers and positions saved with ``ReftModel.save`` beside a
``train_settings.json``, their weights drawn large enough that each changes the greedy tokens (checked, so
that equality is not the bare model's twice). "Alone" is pyreft's own path on a fresh copy of the base:
``ReftModel.load`` and ``reft_model.generate`` on the one unpadded prompt, its locations from pyreft's
``get_intervention_locations``, as docs/examples/serve_reft.py answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyreft")

import pyreft  # noqa: E402
import transformers  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.serving import _row_hooks  # noqa: E402
from pyvene_dist.testing.models import save_checkpoint  # noqa: E402
from serving_refts import NEW_TOKENS, REFTS, generated, load_many, settings  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: Prompts of 2 to 11 tokens (the byte-level BPE splits words outside WORDS), padded on the left in a batch;
#: DiReFT's f2+l2 needs 4.
PROMPTS = ["red cat runs fast", "big dog", "small bird sits on the tree", "cold river stone sits", "green tree",
           "the red river runs", "blue house light dark"]
ROWS = ["lo", None, "no", "di", "lo", "di", "lo2"]


@pytest.fixture(scope="module")
def saved(serving_saved):
    """The base model's folder, each ReFT's, saved under the patch as docs/examples/train_reft.py saves, and each
    ReFT as it was saved (on a base of its own): the session's (``serving_saved``)."""
    return serving_saved


@pytest.fixture(scope="module")
def tokenizer(saved):
    return transformers.AutoTokenizer.from_pretrained(saved.base_folder, padding_side="left")


@pytest.fixture(scope="module")
def many(saved):
    return load_many(saved)


@pytest.fixture(scope="module")
def alone(saved):
    """What pyreft alone generates (``serving_refts.Alone``), memoised for the session."""
    return saved.alone


@pytest.mark.parametrize("on_prompt", [True, False], ids=["prompt", "every-token"])
def test_each_row_equals_its_reft_alone(many, tokenizer, alone, on_prompt, monkeypatch):
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 2, "the prompts must pad to different lengths"
    stacked = []  # "lo" and "lo2" on layer 0 go through the stacked LoReFT
    stacked_apply = _row_hooks.StackedLoreft.apply
    monkeypatch.setattr(_row_hooks.StackedLoreft, "apply",
                        lambda self, hidden, copies=1: stacked.append(len(self.stages)) or stacked_apply(self, hidden, copies))
    ids = many.generate(inputs, refts=ROWS, intervene_on_prompt=on_prompt, **settings(tokenizer, on_prompt))
    assert stacked == ([2] if on_prompt else [2] * (NEW_TOKENS - 1)), stacked
    width = inputs["input_ids"].shape[1]
    with pyvene_dist.patched():  # pyreft's answers, patched once for all of them (not the batch above)
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
    bare = many.model.generate(**inputs, **settings(tokenizer))
    with pyvene_dist.patched():  # pyreft's answers, patched once for all of them (not the batches)
        expected, expected_bare = [alone("lo", p) for p in PROMPTS], [alone(None, p) for p in PROMPTS]
    assert [generated(r, width, tokenizer.eos_token_id) for r in ids] == expected
    assert torch.equal(many.generate(inputs, refts=[None] * len(PROMPTS), **settings(tokenizer)), bare)
    assert [generated(r, width, tokenizer.eos_token_id) for r in bare] == expected_bare
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in many.model.modules())


def test_beams_and_return_sequences_keep_each_rows_reft(many, tokenizer, alone):
    """generate repeats each row in place for beams and return sequences: every copy keeps its row's ReFT, as pyreft's
    generate gives that row alone (at 09d6d98 the hooks indexed the unexpanded batch: the ReFT's row got bare
    tokens, or swapped ones). One generation holds both: 3 beams a row (the hooks see 3 copies of each) and 2 of
    them returned (each compared)."""
    prompts, names, extra = [PROMPTS[0], PROMPTS[2], PROMPTS[5]], [None, "lo", "di"], dict(num_beams=3,
                                                                                            num_return_sequences=2)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    ids = many.generate(inputs, refts=names, **settings(tokenizer), **extra)
    width, copies = inputs["input_ids"].shape[1], extra["num_return_sequences"]
    rows = [generated(row, width, tokenizer.eos_token_id) for row in ids]
    with pyvene_dist.patched():  # pyreft's answers, patched once for all of them (not the batch above)
        for index, (name, prompt) in enumerate(zip(names, prompts)):
            expected = alone(name, prompt, **extra)
            assert rows[index * copies:(index + 1) * copies] == expected, (name, prompt)
            if name is not None:  # not vacuous: the ReFT changes this prompt's beams
                assert expected != alone(None, prompt, **extra), name


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


def test_refusals_of_issue_50(saved, many, tokenizer):
    """share_weights as a string (truthy: loaded with shared weights at 09d6d98), and tokenizer output without
    return_tensors (a cryptic AttributeError there) are refused, naming the argument and what it expects."""
    folders = saved.folders
    with pytest.raises(TypeError, match="share_weights: expected True, False or None .*found 'False'"):
        many.load("x", folders["lo"], share_weights="False")
    assert "x" not in many.refts
    with pytest.raises(TypeError, match=r"inputs\['input_ids'\]: expected a tensor of shape \(rows, tokens\), as "
                                        r"tokenizer\(\.\.\., return_tensors='pt', padding=True\) gives, found list"):
        many.generate(tokenizer(PROMPTS[:2]), refts=["lo", None], max_new_tokens=2)
    inputs = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens: assisted decoding checks several"):
        many.generate(inputs, refts=["lo", None], intervene_on_prompt=False, prompt_lookup_num_tokens=2,
                      max_new_tokens=2)


def test_load_refusals(saved, many, tmp_path):
    folders = saved.folders
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


def test_an_older_transformers_is_refused_naming_the_versions(saved, many, monkeypatch):
    """transformers 5.17's continuous batching has no manager pause and no ``page_size`` (the tests failed with
    "ContinuousBatchingConfig.__init__() got an unexpected keyword argument 'page_size'"), and the ``transformers
    serve`` internals of 5.18-5.23 and of 5.25 (an ImportError) differ from those openai_api builds on: each entry
    refuses them naming the release found and the one needed, before a manager starts; the padded ``generate``
    (above) runs on all."""
    from pyvene_dist.serving import command
    from pyvene_dist.serving.batching import require_transformers
    from pyvene_dist.versions import UnsupportedVersionError, installed

    real_version, found = installed.version, {}
    monkeypatch.setattr(installed, "version", lambda name: found.get(name) or real_version(name))
    found["transformers"] = "5.17.0"
    refused = ("ReFT continuous batching needs transformers >=5.18 (found 5.17.0): pip install 'transformers>=5.18'; "
               "MultiReftModel.generate (padded batches) works on 5.17.0")
    with pytest.raises(UnsupportedVersionError) as error:
        many.init_continuous_batching()
    assert str(error.value) == refused
    with pytest.raises(UnsupportedVersionError) as error:
        many.generate_batch([[1, 2, 3]], refts=[None])
    assert str(error.value) == refused
    assert many._continuous is None  # refused before any hook went on the model
    found["transformers"] = "5.23.0"
    require_transformers()  # continuous batching runs from 5.18
    with pytest.raises(SystemExit) as stopped:
        command.main(["--model", str(saved.base_folder)])
    assert stopped.value.code == (
        "pyvene-dist serve needs transformers >=5.24,<5.25 (found 5.23.0): pip install 'transformers>=5.24,<5.25'; "
        "MultiReftModel.generate (padded batches) and continuous batching (init_continuous_batching, generate_batch) "
        "work on 5.23.0")
    found["transformers"] = "5.25.0"  # transformers serve rewritten: its modules are gone (ImportError before)
    with pytest.raises(SystemExit) as stopped:
        command.main(["--model", str(saved.base_folder)])
    assert stopped.value.code.startswith("pyvene-dist serve needs transformers >=5.24,<5.25 (found 5.25.0)")
