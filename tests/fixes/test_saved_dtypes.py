"""``ReftModel.load`` in a process of its own gives back the trained model exactly, in the dtype it was saved in
(fixes.checkpoints.saved_dtypes: ``IntervenableModel.save`` and ``load``).

pyreft 0.1.0 rebuilt LoReFT's ``learned_source`` in bfloat16 whatever it was saved in (on a float32 model
the first forward failed: ``mat1 and mat2 must have the same dtype, but got Float and BFloat16``), and
LoReFT's rotation came back only to rounding.
"""

import contextlib
import sys
import traceback

import pytest
import torch

import helpers
from pyvene_dist.testing import _preloaded, models

#: A process of its own, forked from the preloaded server (pyvene_dist.testing._preloaded: torch, transformers and
#: pyvene imported, nothing patched, no model built; a fresh interpreter where that server is not used): patched as
#: the tests patch (PYVENE_DIST_TEST_WITHOUT applies), the checkpoint loaded
#: with Auto*, the interventions with pyreft's ReftModel.load, then the same forward as the trained model's.
LOAD_AND_ANSWER = """
import sys, torch
import helpers
helpers.patch()
import pyreft, transformers
folder, saved, dtype, out = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype),
                                                          attn_implementation="eager")
reft_model = pyreft.ReftModel.load(saved, model)
reft_model.eval()
inputs = torch.load(out)
with torch.no_grad():
    _, answer = reft_model({"input_ids": inputs["ids"]}, unit_locations=inputs["locations"])
torch.save({**inputs, "logits": answer.logits}, out)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return models.save_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def _in_process(argv, log: str) -> None:
    with open(log, "w") as stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        try:
            sys.argv = ["load_and_answer", *argv]
            exec(compile(LOAD_AND_ANSWER, "<LOAD_AND_ANSWER>", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1)


def _load_and_answer(*argv: str) -> None:
    """LOAD_AND_ANSWER in a process of its own (forked from the preloaded server: the 5 of 7 seconds a fresh
    interpreter takes to import torch, transformers and pyvene here are not paid again); fails the test with its
    output if it fails."""
    log = argv[-1] + ".log"
    process = _preloaded.context().Process(target=_in_process, args=(argv, log), daemon=True)
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
        pytest.fail("LOAD_AND_ANSWER still running after 300 s")
    if process.exitcode != 0:
        with open(log) as output:
            pytest.fail(f"LOAD_AND_ANSWER failed (exit {process.exitcode}):\n{output.read()}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reloaded_interventions_answer_exactly_as_trained(patched, checkpoint, tmp_path, dtype):
    import pyreft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype),
                                                              attn_implementation="eager")
    reft_model = models.reft_model(model, layers=(0, 1), rank=2, dtype=getattr(torch, dtype))
    examples = models.instruction_examples(8)
    data_module = pyreft.make_last_position_supervised_data_module(
        tokenizer, model, [e["instruction"] for e in examples], [e["output"] for e in examples], num_interventions=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                                          learning_rate=5e-2, report_to=[], use_cpu=True, save_strategy="no")
    pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=args, **data_module).train()
    saved = tmp_path / "saved"
    reft_model.save(str(saved))

    reft_model.eval()
    ids = tokenizer([e["instruction"] for e in examples[:2]], return_tensors="pt")["input_ids"]
    locations = {"sources->base": (None, [[[0, ids.shape[1] - 1]] * 2] * 2)}
    with torch.no_grad():
        _, trained = reft_model({"input_ids": ids}, unit_locations=locations)
    out = tmp_path / "answer.pt"
    torch.save({"ids": ids, "locations": locations}, out)
    _load_and_answer(str(checkpoint), str(saved), dtype, str(out))
    reloaded = torch.load(out)["logits"]
    assert reloaded.dtype == trained.logits.dtype == getattr(torch, dtype)
    torch.testing.assert_close(reloaded, trained.logits, rtol=0, atol=0)


def test_pyrefts_own_files_load_in_the_dtype_they_were_saved_in(patched, tmp_path):
    """A folder without ``intervention_states.pt`` (stock pyreft's ``save``, a hub upload): every weight in
    its saved dtype, the rotation to rounding (its parametrization is rebuilt from the saved rotation)."""
    import pyreft

    reft_model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2)
    reft_model.save(str(tmp_path))
    (tmp_path / "intervention_states.pt").unlink(missing_ok=True)
    loaded = pyreft.ReftModel.load(str(tmp_path), models.tiny_llama())
    assert {name: p.dtype for name, p in loaded.interventions.named_parameters()} == \
        {name: p.dtype for name, p in reft_model.interventions.named_parameters()}
    ids = torch.randint(models.VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, found = (model({"input_ids": ids}, unit_locations={"base": 3})[1].logits
                           for model in (reft_model, loaded))
    torch.testing.assert_close(found, expected)


@pytest.mark.world_size(1, timeout=300)
@pytest.mark.parametrize("states_file", [True, False], ids=["save", "pyrefts-files-only"])
def test_reload_onto_a_base_zero3_partitions_in_float32_keeps_the_saved_dtypes(tmp_path, states_file):
    """pyreft's multi-GPU example reloads after training: with ZeRO-3, its ``TrainingArguments`` still alive
    make HF's ``from_pretrained`` partition the new base under ``zero.Init``, in float32. The interventions
    come back in the float32 they were saved in (pyvene's rebuild left LoReFT's ``learned_source`` in
    bfloat16: the ZeRO-3 workload of pyreft's alpaca example failed its reload), from the states file
    bit for bit, from pyreft's files alone to rounding (the rotation's parametrization is rebuilt)."""
    import pyreft
    import transformers

    from pyvene_dist.testing.hf import deepspeed_config

    helpers.patch()
    checkpoint = models.save_checkpoint(tmp_path / "checkpoint")
    trained = models.reft_model(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), layers=(0, 1), rank=2)
    saved = tmp_path / "saved"
    trained.save(str(saved))
    if not states_file:
        (saved / "intervention_states.pt").unlink()
    zero3 = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), deepspeed=deepspeed_config("3"),
                                           report_to=[], use_cpu=not torch.cuda.is_available())
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(hasattr(p, "ds_id") and p.dtype == torch.float32 for p in base.parameters())
    loaded = pyreft.ReftModel.load(str(saved), base)
    del zero3
    expected, found = ({f"{key}.{name}": value for key, module in model.interventions.items()
                        for name, value in module.state_dict().items()} for model in (trained, loaded))
    assert {name: value.dtype for name, value in found.items()} == \
        {name: value.dtype for name, value in expected.items()}
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, **({"rtol": 0, "atol": 0} if states_file else {}), msg=name)
