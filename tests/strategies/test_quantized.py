"""LoReFT over a base quantized by bitsandbytes (4-bit nf4, 8-bit LLM.int8), loaded as users load it
(``from_pretrained(quantization_config=BitsAndBytesConfig(...))``), under each strategy, against one process of
the same quantized model (pyvene_dist/quantized.py, docs/quantized.md). CPU: bitsandbytes' CPU backend."""

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import assert_parity, differences, tolerance, train

bitsandbytes = pytest.importorskip("bitsandbytes", reason="the quantize extra is not installed")

from pyvene_dist.testing import models  # noqa: E402
from pyvene_dist.testing.quantized_cases import QuantizedCase, bits_and_bytes_config  # noqa: E402

#: Two steps of two micro-batches (CI's time); bf16 compares at lr 1e-3, as the harness's other bf16 cases do
#: (case.py: Adam's sign noise at 1e-2).
FP32_4BIT = QuantizedCase(quantize="4bit", steps=2)
FP32_8BIT = QuantizedCase(quantize="8bit", steps=2)
BF16_4BIT = QuantizedCase(quantize="4bit", dtype="bfloat16", lr=1e-3, steps=2)
BF16_8BIT = QuantizedCase(quantize="8bit", dtype="bfloat16", lr=1e-3, steps=2)

_references: dict = {}


def reference(case: QuantizedCase):
    """One process of ``case`` (checkpointing does not change the result: compared with the plain run), once
    per rank process: the worlds of the plugin serve every test of a size."""
    plain = dataclasses.replace(case, checkpointing=None)
    if plain not in _references:
        _references[plain] = train(plain, "single")
    return _references[plain]


PARITY = [
    pytest.param(FP32_4BIT, "ddp", id="4bit-fp32-ddp"),
    pytest.param(FP32_4BIT, "fsdp2", id="4bit-fp32-fsdp2"),
    pytest.param(FP32_4BIT, "zero3", id="4bit-fp32-zero3"),
    pytest.param(BF16_4BIT, "fsdp2", id="4bit-bf16-fsdp2"),
    pytest.param(BF16_4BIT, "zero3", id="4bit-bf16-zero3"),
    pytest.param(FP32_8BIT, "ddp", id="8bit-fp32-ddp"),
    pytest.param(FP32_8BIT, "zero3", id="8bit-fp32-zero3"),
    pytest.param(BF16_8BIT, "ddp", id="8bit-bf16-ddp"),
    pytest.param(dataclasses.replace(FP32_4BIT, checkpointing="non-reentrant"), "fsdp2", id="4bit-fp32-fsdp2-ckpt"),
    pytest.param(FP32_4BIT, "accelerate", id="4bit-fp32-accelerate"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case, strategy", PARITY)
def test_a_quantized_base_trains_as_in_one_process(case, strategy):
    helpers.patch()
    candidate = train(case, strategy)
    if dist.get_rank() == 0:
        expected = reference(case)
        print(f"{case.quantize} {case.dtype} {strategy}: {differences(expected, candidate)}; parameter bytes on "
              f"rank 0: {candidate.parameter_bytes} of {expected.parameter_bytes}")
        assert_parity(expected, candidate, tolerance(case, strategy))
        if strategy in ("fsdp2", "zero3"):  # the quantized base is sharded, not replicated
            assert candidate.parameter_bytes < 0.6 * expected.parameter_bytes


@pytest.mark.world_size(2)  # the parity tests' world: no other to start
def test_fsdp_refuses_an_8bit_base_before_sharding_it():
    """Unpatched, fully_shard took the 8-bit model and the first forward failed inside bitsandbytes with
    ``AttributeError: 'Parameter' object has no attribute 'CB'``."""
    from pyvene_dist.fully_shard import fully_shard_model
    from pyvene_dist.quantized import UnshardableQuantization

    helpers.patch()
    model = FP32_8BIT.build()
    with pytest.raises(UnshardableQuantization, match=r"FSDP2 \(fully_shard\) cannot shard a base model quantized "
                                                      r"to 8 bits .* 'model.model.layers.0.self_attn.q_proj'"):
        fully_shard_model(model)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [None, "3"], ids=["ddp", "zero3"])
def test_reft_trainer_over_a_4bit_base_matches_one_process(tmp_path, stage):
    """pyreft's ReftTrainer over the 4-bit base: HF Trainer's DDP, and its DeepSpeed ZeRO-3 (``deepspeed=`` a
    ZeRO-3 config, so that ``from_pretrained`` builds the quantized base partitioned, as under the launcher)."""
    from pyvene_dist.testing.hf import deepspeed_config, train_with_trainer

    helpers.patch()
    expected = reference(FP32_4BIT) if dist.get_rank() == 0 else None  # before HF's ZeRO-3 config exists
    settings = {} if stage is None else {"deepspeed": deepspeed_config(stage)}
    candidate = train_with_trainer(FP32_4BIT, str(tmp_path / f"rank{dist.get_rank()}"), **settings)
    if dist.get_rank() == 0:
        torch.testing.assert_close(torch.tensor(candidate.losses), torch.tensor(expected.losses), rtol=1e-5, atol=1e-5)
        for name, weight in expected.weights.items():
            torch.testing.assert_close(candidate.weights[name], weight, rtol=1e-5, atol=1e-5 * weight.abs().max())


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Llama with a real BPE tokenizer, saved as users' checkpoints are."""
    return models.save_checkpoint(tmp_path_factory.mktemp("quantized") / "model", hidden=64)


def load(folder, quantize: str, dtype=torch.float32, storage=None, quant_type="nf4"):
    from transformers import AutoModelForCausalLM

    config = bits_and_bytes_config(quantize, dtype, storage)
    if quantize == "4bit":
        config.bnb_4bit_quant_type = quant_type
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LLM.int8 says it casts to float16 on the CPU
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype)


FORMATS = [
    pytest.param("4bit", "nf4", torch.uint8, "Linear4bit", id="nf4-uint8"),
    pytest.param("4bit", "fp4", torch.uint8, "Linear4bit", id="fp4-uint8"),
    pytest.param("4bit", "nf4", torch.bfloat16, "Linear4bit", id="nf4-bf16-storage"),
    pytest.param("4bit", "nf4", torch.float32, "Linear4bit", id="nf4-fp32-storage"),
    pytest.param("8bit", None, None, "Linear8bitLt", id="llm-int8"),
]


@pytest.mark.parametrize("quantize, quant_type, storage, layer", FORMATS)
def test_the_cpu_backend_runs_forward_and_backward_through_a_frozen_quantized_base(model_folder, quantize,
                                                                                   quant_type, storage, layer):
    """What docs/quantized.md says bitsandbytes' CPU backend runs, loaded from a saved folder: the layers are
    quantized (packed in ``storage``), and a gradient reaches the hidden states through them."""
    from transformers import AutoTokenizer

    model = load(model_folder, quantize, storage=storage, quant_type=quant_type)
    projection = model.model.layers[0].self_attn.q_proj
    assert type(projection).__name__ == layer
    if storage is not None:
        assert projection.weight.dtype == storage and projection.weight.quant_state.quant_type == quant_type
    else:
        assert projection.weight.dtype == torch.int8
    ids = AutoTokenizer.from_pretrained(model_folder)(["red cat runs fast"], return_tensors="pt").input_ids
    hidden = model.model.embed_tokens(ids).detach().requires_grad_(True)
    model(inputs_embeds=hidden).logits.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    quantized = [module for module in model.modules() if type(module).__name__ == layer]
    assert len(quantized) == 14 and all(module.weight.grad is None for module in quantized)  # 7 a layer, frozen


def test_a_4bit_base_saved_with_its_reft_reloads_with_the_same_tokens(patched, model_folder, tmp_path):
    """Trained (two steps), saved with ``ReftModel.save``, loaded on a fresh 4-bit base: the same greedy tokens."""
    import pyreft
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    reft = models.reft_model(load(model_folder, "4bit"), layers=(0, 1), seed=1)
    optimizer = torch.optim.AdamW(reft.get_trainable_parameters() if hasattr(reft, "get_trainable_parameters")
                                  else [p for p in reft.interventions.parameters() if p.requires_grad], lr=5e-2)
    prompt = tokenizer(["red cat runs", "big dog sits"], return_tensors="pt")
    locations = {"sources->base": (None, [[[2]] * 2, [[2]] * 2])}
    for _ in range(2):
        _, out = reft(dict(prompt), unit_locations=locations, labels=prompt["input_ids"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    reft.eval()
    settings = dict(unit_locations=locations, intervene_on_prompt=True, max_new_tokens=6, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id)
    _, before = reft.generate(dict(prompt), **settings)
    reft.save(save_directory=str(tmp_path / "reft"))
    loaded = pyreft.ReftModel.load(str(tmp_path / "reft"), load(model_folder, "4bit"))
    loaded.eval()
    for key, intervention in reft.interventions.items():
        for name, value in intervention.state_dict().items():
            torch.testing.assert_close(loaded.interventions[key].state_dict()[name].float(), value.float())
    _, after = loaded.generate(dict(prompt), **settings)
    assert torch.equal(before, after), (tokenizer.batch_decode(before), tokenizer.batch_decode(after))


def test_check_quantize_4bit_agrees_here(capsys):
    """``pyvene-dist check --quantize 4bit`` (docs/quantized.md): the reference and FSDP2 over the same 4-bit base,
    on this machine's CPU ranks; a strategy that cannot take the base is a usage error naming it."""
    import json

    from pyvene_dist.__main__ import main

    assert main(["check", "--quantize", "4bit", "--strategies", "fsdp2", "--steps", "2", "--json"]) == 0
    rows = {row["strategy"]: row["verdict"] for row in json.loads(capsys.readouterr().out)}
    assert rows == {"single": "reference", "fsdp2": "agrees"}
    assert main(["check", "--quantize", "8bit", "--strategies", "fsdp2"]) == 2
    assert "--strategies fsdp2 with --quantize 8bit: check runs a 8bit base under ddp, accelerate, zero3" in \
        capsys.readouterr().err
