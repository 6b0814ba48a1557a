"""ReFT generation with transformers' compiled decoding step (``fixes.fast_path.compiled_decoding``), forced on the
CPU (``compile_config._compile_all_devices``, the static cache), and batched prompts of different lengths.
With ``PYVENE_DIST_TEST_DEVICE=cuda`` the same tests run on a GPU under transformers' default compile (inductor,
``reduce-overhead``: CUDA graphs), the graphs counted by dynamo's own counter (issue 46).

Before: with the bare model's step compiled first the ReFT's interventions were dropped without a word (dynamo
does not guard on module hooks), and with the ReFT first every generated token compiled again (a guard on
pyvene's per-hook counters) up to dynamo's recompile limit. The GPU half (CUDA graphs, both orders in fresh
processes) is benchmarks/gpu_generation_check.py."""

import os

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import pyvene_dist
from pyvene_dist.fixes.fast_path import CompiledGenerationError
from pyvene_dist.testing import models

NEW = 5
LAYERS = (0,)  # one layer, one intervention: each compile traces as little as it can
graphs = []  # one entry per graph dynamo hands to the backend


def counting_backend(graph_module, example_inputs, **options):
    graphs.append(graph_module)
    return graph_module.forward


DEVICE = torch.device(os.environ.get("PYVENE_DIST_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"


def compiled() -> dict:
    if ON_GPU:  # transformers' own default: inductor with CUDA graphs
        return {"cache_implementation": "static", "compile_config": CompileConfig()}
    config = CompileConfig(backend=counting_backend)  # transformers' defaults otherwise (fullgraph off)
    config._compile_all_devices = True  # the CPU compiles the decoding step only when told to
    return {"cache_implementation": "static", "compile_config": config}


def _base():
    return models.tiny_llama(seed=0, layers=1).to(DEVICE)


SETTINGS = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    graphs.clear()
    yield
    torch._dynamo.reset()


def _where(mode: str, prompt: dict) -> dict:
    if mode == "every token":
        return {"unit_locations": None, "intervene_on_prompt": False}
    locations = pyvene_dist.positions_from_attention_mask(prompt["attention_mask"], "f1+l1",
                                                          num_interventions=len(LAYERS), share_weights=True)
    return {"unit_locations": {"sources->base": (None, locations)}, "intervene_on_prompt": True}


def _prompt(lengths=(7, 7), seed=0) -> dict:
    """Left-padded prompts of these lengths, as a tokenizer with padding_side='left' gives them."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, models.VOCAB_SIZE, (length,), generator=generator)
        mask[row, width - length:] = 1
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}


def _generate(reft, mode: str, prompt: dict, **extra):
    return reft.generate(prompt, **_where(mode, prompt), **SETTINGS, **extra)[1]


def _graphs_made(run) -> tuple:
    count = (lambda: counters["stats"]["unique_graphs"]) if ON_GPU else (lambda: len(graphs))  # noqa: E731
    before = count()
    found = run()
    return found, count() - before


def test_bare_model_compiled_first_then_the_reft_in_both_modes(patched):
    """A server that answered the bare model first: its compiled step has no hooks (they come at the ReFT's
    first call). The ReFT's steps are their own, one graph per mode, and the bare model's stays clean. The
    batch is left-padded (prompts of 3, 7 and 5 tokens), each row intervened at its own first and last."""
    base = _base()
    reft = models.reft_model(base, layers=LAYERS, seed=1)
    reft.eval()
    prompt = _prompt((3, 7, 5), seed=2)
    bare, bare_graphs = _graphs_made(lambda: base.generate(**prompt, **SETTINGS, **compiled()))
    every, every_graphs = _graphs_made(lambda: _generate(reft, "every token", prompt, **compiled()))
    on_prompt, prompt_graphs = _graphs_made(lambda: _generate(reft, "prompt", prompt, **compiled()))
    again, again_graphs = _graphs_made(lambda: _generate(reft, "every token", prompt, **compiled()))
    assert (bare_graphs, every_graphs, prompt_graphs, again_graphs) == (1, 1, 1, 0)  # not one per token
    eager_bare = base.generate(**prompt, **SETTINGS)
    for found, mode in ((every, "every token"), (again, "every token"), (on_prompt, "prompt")):
        eager = _generate(reft, mode, prompt)
        assert not torch.equal(eager, eager_bare), mode  # the interventions change the tokens
        assert torch.equal(found, eager), mode
    assert torch.equal(bare, eager_bare)


def test_reft_compiled_first_then_the_bare_model(patched):
    """The order that recompiled at every token (and crashed under CUDA graphs on the GPU); then again after
    ``unpatch()`` and ``patch()``, whose new plan compiles its own step (the old one traced the old hooks)."""
    base = _base()
    reft = models.reft_model(base, layers=LAYERS, seed=1)
    reft.eval()
    prompt = _prompt()
    every, every_graphs = _graphs_made(lambda: _generate(reft, "every token", prompt, **compiled()))
    again, again_graphs = _graphs_made(lambda: _generate(reft, "every token", prompt, **compiled()))
    bare, bare_graphs = _graphs_made(lambda: base.generate(**prompt, **SETTINGS, **compiled()))
    from helpers import patch

    pyvene_dist.unpatch()  # the plan and its hooks go; patched again, a new plan has new hooks
    patch()
    repatched, repatched_graphs = _graphs_made(lambda: _generate(reft, "every token", prompt, **compiled()))
    assert (every_graphs, again_graphs, bare_graphs, repatched_graphs) == (1, 0, 1, 1)
    eager = _generate(reft, "every token", prompt)
    eager_bare = base.generate(**prompt, **SETTINGS)
    assert not torch.equal(eager, eager_bare)
    assert torch.equal(every, eager) and torch.equal(again, eager) and torch.equal(bare, eager_bare)
    assert torch.equal(repatched, eager)


def test_the_general_path_refuses_a_compiled_decoding_step():
    """pyvene's general path registers its hooks at every call: a compiled step would drop them, or keep them
    for the bare model's later calls. Refused by name, not compiled."""
    pyvene_dist.patch(fast_path=False)
    try:
        reft = models.reft_model(_base(), layers=LAYERS, seed=1)
        prompt = _prompt()
        with pytest.raises(CompiledGenerationError, match="general path.*fast_path is off.*disable_compile=True"):
            reft.generate(prompt, unit_locations=None, intervene_on_prompt=False, **SETTINGS, **compiled())
        assert graphs == []
        _, eager = reft.generate(prompt, unit_locations=None, intervene_on_prompt=False, **SETTINGS,
                                 **compiled(), disable_compile=True)
        assert eager.shape == (2, 7 + NEW)
    finally:
        pyvene_dist.unpatch()


@pytest.mark.parametrize("mode, cache", [("prompt", "dynamic"), ("prompt", "static"), ("every token", "static")])
def test_left_padded_rows_generate_as_each_prompt_alone(patched, cache, mode):
    """Prompts of 3, 7 and 5 tokens in one left-padded batch: each row's new tokens are those of its prompt
    generated alone (eager, dynamic cache), in prompt mode with each row's own first and last positions. (The
    compiled step gives the batch's eager tokens: test_bare_model_compiled_first_then_the_reft_in_both_modes.)"""
    reft = models.reft_model(_base(), layers=LAYERS, seed=1)
    reft.eval()
    lengths = (3, 7, 5)
    batch = _prompt(lengths, seed=2)
    extra = {"dynamic": {}, "static": {"cache_implementation": "static"}}[cache]
    together = reft.generate(batch, **_where(mode, batch), **SETTINGS, **extra)[1][:, max(lengths):]
    for row, length in enumerate(lengths):
        alone = {key: value[row:row + 1, max(lengths) - length:] for key, value in batch.items()}
        expected = reft.generate(alone, **_where(mode, alone), **SETTINGS)[1][:, length:]
        assert torch.equal(together[row:row + 1], expected), (row, together[row], expected[0])


def test_a_base_model_compiled_before_the_refts_first_call_is_warned_of(patched):
    """Its compiled code, where it ran before, has no hooks to run (the interventions dropped): said, not silent."""
    base = _base()
    reft = models.reft_model(base, layers=LAYERS, seed=1)
    base.compile(backend=counting_backend)
    prompt = _prompt()
    with torch.compiler.set_stance("force_eager"), pytest.warns(RuntimeWarning, match="compiled before its ReFT's"):
        reft(prompt, unit_locations={"sources->base": (None, [[[0]] * 2] * len(LAYERS))})


def test_inductors_cpu_failure_compiles_the_step_again_with_fusion_limited(monkeypatch):
    """torch 2.13's Inductor C++ code generator raised ``KeyError: 'buf61'`` in ``try_outer_loop_fusion_with_local_buf``
    compiling a ReFT's every-token step on the CPU (issue 46; reproduced at 09d6d98 with the bare model's step compiled
    first, hidden 64, a LoReFT at layer 1: ~80 s of C++ compiling, so the failure is stood in for here). The step is
    compiled again with ``max_fusion_size=1``, which generated the eager tokens; any other error is raised as it was."""
    from transformers import CompileConfig

    from pyvene_dist.fixes import _fast_path_decoding

    compiled = []

    def fake_compile(step, **settings):
        compiled.append(settings)
        if len(compiled) == 1:
            def try_outer_loop_fusion_with_local_buf(*args, **kwargs):
                raise KeyError("buf61")
            return try_outer_loop_fusion_with_local_buf
        return lambda *args, **kwargs: "generated"

    monkeypatch.setattr(_fast_path_decoding.torch, "compile", fake_compile)
    config = CompileConfig(backend="inductor", options={"epilogue_fusion": False})
    step = _fast_path_decoding._FusionFallback(torch.nn.Identity(), config)
    with pytest.warns(RuntimeWarning, match="try_outer_loop_fusion_with_local_buf.*max_fusion_size"):
        assert step() == "generated"
    assert step() == "generated" and len(compiled) == 2  # compiled again once
    assert compiled[1]["mode"] is None and compiled[1]["options"] == {"epilogue_fusion": False, "max_fusion_size": 1}

    other = []
    monkeypatch.setattr(_fast_path_decoding.torch, "compile", lambda step, **settings: other.append(1) or (
        lambda *args, **kwargs: (_ for _ in ()).throw(KeyError("another"))))
    with pytest.raises(KeyError, match="another"):
        _fast_path_decoding._FusionFallback(torch.nn.Identity(), config)()
    assert other == [1]
