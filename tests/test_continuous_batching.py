"""ReFTs inside transformers' continuous batching (``MultiReftModel.init_continuous_batching``): every request's tokens
equal the same ReFT alone through pyreft's ``ReftModel.generate`` (``serving_refts.Alone``), float32, greedy, on the
CPU, for 16 requests over 4 ReFTs and the bare model, prompts of 2 to 200 tokens arriving in three waves while the
batch runs, prefills split across steps (``max_batch_tokens=64``), in pyreft's prompt mode and in every-token mode
(the 16 of each mode in one run of one manager, 32 requests in all); then the compiled step's refusal, the refusals,
and ReFTs loaded and unloaded while the manager runs. The base, the ReFTs and pyreft's answers are the session's
(tests/conftest.py's ``serving_saved``), one intra-op thread (``one_thread``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyreft")

import transformers  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.serving.continuous import ReftRequestError  # noqa: E402
from serving_refts import NEW_TOKENS, load_many, needs_transformers, small_cache  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_transformers()]

LENGTHS = [2, 3, 4, 5, 7, 9, 12, 16, 23, 31, 45, 64, 90, 120, 160, 200]
#: The ReFT of each request (DiReFT's f2+l2 needs 4 tokens: never on the two shortest).
NAMES = ["lo", None, "no", "lo2", "di", "lo", None, "no", "lo2", "di", "lo", "no", None, "lo2", "di", "lo"]
#: Requests join the running batch in three waves, each after the previous wave's first answer.
WAVES = [range(0, 6), range(6, 11), range(11, 16)]
TEXT = "red cat runs fast big dog small bird sits on the tree cold river stone green tree blue house light dark "
MODES = {True: "prompt", False: "every-token"}


@pytest.fixture(scope="module")
def setup(serving_saved):
    """The session's base (512 positions, for the 200-token prompts), its tokenizer, the prompts, pyreft's answers."""
    tokenizer = serving_saved.tokenizer
    words = tokenizer(TEXT * 30)["input_ids"]
    prompts = [words[index * 7:index * 7 + length] for index, length in enumerate(LENGTHS)]
    return serving_saved, tokenizer, prompts, serving_saved.alone


@pytest.fixture(scope="module")
def many(setup):
    """Every ReFT on one base, shared by the tests that leave it as they found it (each starts and stops its own
    manager)."""
    return load_many(setup[0])


def config(tokenizer, on_prompt: bool) -> transformers.GenerationConfig:
    """Greedy, NEW_TOKENS at most. Every-token mode generates exactly NEW_TOKENS with no end of sequence (pyreft's
    side: min_new_tokens), so that the ReFT acts on every request (its first token comes from the prompt alone)."""
    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                         eos_token_id=tokenizer.eos_token_id if on_prompt else -1)


def run_in_waves(manager, prompts, names, eos: int) -> dict[tuple[bool, int], list[int]]:
    """Add the requests wave by wave into the running manager, each prompt of a wave once in either mode (prompt mode
    stops at the end of sequence ``eos``; every-token mode makes exactly NEW_TOKENS, as pyreft's side with
    min_new_tokens, so that the ReFT acts on every request: its first token comes from the prompt alone);
    (prompt mode, request index) -> generated tokens."""
    results: dict[str, list[int]] = {}

    def collect(until: int, deadline: float):
        while len(results) < until:
            assert time.monotonic() < deadline, f"only {len(results)} of {until} requests answered"
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result.generated_tokens

    manager.start()
    try:
        for wave in WAVES:
            for index in wave:
                for on_prompt, mode in MODES.items():
                    manager.add_request(prompts[index], request_id=f"{mode}-{index}", max_new_tokens=NEW_TOKENS,
                                        eos_token_id=eos if on_prompt else -1, reft=names[index],
                                        intervene_on_prompt=on_prompt)
            collect(len(results) + 1, time.monotonic() + 60)
        collect(2 * len(prompts), time.monotonic() + 120)
    finally:
        manager.stop(block=True, timeout=30)
    return {(on_prompt, index): results[f"{mode}-{index}"] for on_prompt, mode in MODES.items()
            for index in range(len(prompts))}


def answers(manager, ids: list[str], timeout: float = 120) -> list:
    """The finished results of the requests ``ids``, in their order."""
    found, deadline = {}, time.monotonic() + timeout
    while len(found) < len(ids):
        assert time.monotonic() < deadline, f"answered {sorted(found)} of {ids}"
        result = manager.get_result(timeout=0.5)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            found[result.request_id] = result
    return [found[rid] for rid in ids]


@pytest.fixture(scope="module")
def in_waves(setup, many):
    """The 16 requests in both modes through one manager (``run_in_waves``), and pyreft's answers for each, patched
    once for all of them."""
    _, tokenizer, prompts, alone = setup
    found = run_in_waves(many.init_continuous_batching(config(tokenizer, True), small_cache()), prompts, NAMES,
                         tokenizer.eos_token_id)
    with pyvene_dist.patched():
        expected = {(on_prompt, index): alone(name, prompt, on_prompt) for on_prompt in MODES
                    for index, (name, prompt) in enumerate(zip(NAMES, prompts))}
        bare = {(on_prompt, index): alone(None, prompt, on_prompt) for on_prompt in MODES
                for index, prompt in enumerate(prompts)}
    return found, expected, bare


@pytest.mark.parametrize("on_prompt", [True, False], ids=["prompt", "every-token"])
def test_each_request_equals_its_reft_alone(setup, many, in_waves, on_prompt):
    _, _, prompts, _ = setup
    found, expected, bare = ({index: answers[(on_prompt, index)] for index in range(len(prompts))}
                             for answers in in_waves)
    assert found == expected
    for index, name in enumerate(NAMES):  # not vacuous: each ReFT changes what its prompts generate
        if name is not None:
            assert expected[index] != bare[index], (name, LENGTHS[index])
    assert torch.equal(many.model.generate(torch.tensor([prompts[5]]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, 9:],
                       torch.tensor(bare[5])), "outside the manager's steps the model is the bare model"


@pytest.mark.parametrize("options", [
    dict(varlen_compile_config=transformers.CompileConfig(backend="eager")), dict(default_compile_level=1),
    dict(use_cuda_graph=True)], ids=["compile-config", "compile-level", "cuda-graphs"])
def test_a_compiled_step_is_refused(setup, many, options):
    """No silent fallback: a compiled step that dynamo reused for a later manager ran a mixed batch without some of
    its interventions (dynamo guards no module hook), so compiling and CUDA graphs are refused, naming the setting."""
    _, tokenizer, _, _ = setup
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name}=.*: a continuous batching step with ReFTs runs eagerly"):
        many.init_continuous_batching(config(tokenizer, True), small_cache(**options))


def test_refusals(setup, many):
    _, tokenizer, prompts, _ = setup
    manager = many.init_continuous_batching(config(tokenizer, True), small_cache())
    with pytest.raises(ReftRequestError, match=r"ReFT 'poet' is not loaded; loaded: \['di', 'lo', 'lo2', 'no'\]"):
        manager.add_request(prompts[2], reft="poet", max_new_tokens=2)
    with pytest.raises(ReftRequestError, match=r"request a: ReFT 'di''s positions 'f2\+l2' take the first 2 and last 2 "
                                               r"tokens, .* a prompt of 3 tokens is too short \(pyreft would intervene at "
                                               r"position 3, past the prompt's last position 2\); it needs at least 4"):
        manager.add_request(prompts[1], request_id="a", reft="di", max_new_tokens=2)
    with pytest.raises(ReftRequestError, match="max_new_tokens=1 would intervene nowhere"):
        manager.add_request(prompts[2], reft="lo", max_new_tokens=1, intervene_on_prompt=False)
    with pytest.raises(ReftRequestError, match="a prompt of 200 tokens and max_new_tokens=400 need 600 positions; the "
                                               "model has 512"):
        manager.add_request(prompts[-1], max_new_tokens=400)
    with pytest.raises(KeyError, match=r"refts\[1\]: .*'poet' is not loaded"):
        manager.add_requests(prompts[:2], refts=["lo", "poet"])
    assert not many._continuous.requests, "a refused request is not left in flight"
    manager.stop(block=True)


def test_refts_load_and_unload_while_the_manager_runs(setup):
    """A ReFT loaded into the running manager serves the next request; one unloaded is refused after, and an unload
    while a request names it is refused."""
    saved, tokenizer, prompts, alone = setup
    with pyvene_dist.patched():  # pyreft's answers first, patched once
        expected = {"late": alone("di", prompts[5]), "long": alone("lo", prompts[15])}
    many = load_many(saved, ["lo"])
    manager = many.init_continuous_batching(config(tokenizer, True), small_cache())
    manager.start()
    try:
        many.load("di", saved.folders["di"])
        manager.add_request(prompts[5], request_id="late", reft="di", max_new_tokens=NEW_TOKENS)
        assert answers(manager, ["late"])[0].generated_tokens == expected["late"]
        with manager.pause():  # the request waits in the queue while the unload is asked for
            manager.add_request(prompts[15], request_id="long", reft="lo", max_new_tokens=NEW_TOKENS)
            with pytest.raises(ReftRequestError, match=r"ReFT 'lo' serves 1 request\(s\) in flight \(\['long'\]\)"):
                many.unload("lo")
        assert answers(manager, ["long"])[0].generated_tokens == expected["long"]
        many.unload("di")
        with pytest.raises(ReftRequestError, match="ReFT 'di' is not loaded"):
            manager.add_request(prompts[5], reft="di", max_new_tokens=2)
    finally:
        manager.stop(block=True, timeout=30)


def test_the_benchmark_smoke_writes_every_provider(tmp_path):
    """benchmarks/continuous_refts.py --smoke, in this process (its CPU rows,
    benchmarks/results/continuous-refts-cpu.jsonl, are the same script on 64 requests): every provider's row, with
    the ratios to the bare model's manager, and the ReFTs' answers differing from the bare ones."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import continuous_refts

    out = tmp_path / "rows.jsonl"
    assert continuous_refts.main(["--smoke", "--out", str(out)]) == 0
    rows = {row["provider"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"bare-cb", "refts-cb", "one-reft-cb"}
    assert rows["refts-cb"]["differs_from_bare"] and len(rows["refts-cb"]["tokens_per_s_rounds"]) == 1
    assert all(row["tokens_per_s_ratio_median"] > 0 and row["ttft_ratio_median"] > 0 and row["machine"]
               and row["commit"] and row["run_id"] for row in rows.values())


@pytest.mark.parametrize("on_prompt, active", [(True, [True, False, False, False]), (False, [False, True, True, True])],
                         ids=["prompt", "every-token"])
def test_only_steps_that_intervene_run_the_hooks(setup, many, monkeypatch, on_prompt, active):
    """A step is given the ReFTs' inputs (and its hooks act) only where a token of it is intervened on: prompt mode's
    prefill, every-token mode's decoding steps (at 84643cd every decoding step of prompt mode ran them for nothing);
    the request alone in its batch still gets pyreft's tokens (test_each_request_equals_its_reft_alone mixes the
    modes, so its decoding steps always hold an every-token request)."""
    from pyvene_dist.serving.continuous import ContinuousRefts

    _, tokenizer, prompts, alone = setup
    given, step_inputs = [], ContinuousRefts.step_inputs
    monkeypatch.setattr(ContinuousRefts, "step_inputs",
                        lambda self, processor: given.append(step_inputs(self, processor)) or given[-1])
    manager = many.init_continuous_batching(config(tokenizer, False), small_cache())
    manager.start()
    try:
        manager.add_request(prompts[3], request_id="one", reft="lo", max_new_tokens=NEW_TOKENS,
                            intervene_on_prompt=on_prompt)
        found = answers(manager, ["one"])[0].generated_tokens
    finally:
        manager.stop(block=True, timeout=30)
    assert [bool(inputs) for inputs in given] == active
    with pyvene_dist.patched():
        assert found == alone("lo", prompts[3], on_prompt, min_new_tokens=NEW_TOKENS)


def test_a_reft_the_tables_cannot_hold_is_refused_before_any_hook(setup):
    """A LoReFT with another activation than pyreft's default identity (the tables stack linear interventions) is
    refused naming the ReFT and the activation, and the model is left without the manager's hooks."""
    saved, tokenizer, _, _ = setup
    many = load_many(saved, ["lo"])
    many.refts["lo"].interventions[0].intervention.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="ReFT 'lo': LoreftIntervention with activation GELU: continuous batching "
                                         "stacks pyreft's interventions with their default identity activation"):
        many.init_continuous_batching(config(tokenizer, True), small_cache())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in many.model.modules())
