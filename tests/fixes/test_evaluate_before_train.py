"""``evaluate_before_train``: HF Trainer's ``evaluate()``, then ``train()``, then ``evaluate()`` on 2 CPU processes,
under DDP and DeepSpeed ZeRO-3, in one world: both eval losses equal one process's (pyreft's trainer, a tiny Llama
saved with its tokenizer, pyreft's data helper). HF's FSDP arguments are not run here: on CPUs accelerate runs them
as DDP (the DDP case), and ``testing.STRATEGIES``' FSDP2 arguments (``cpu_ram_efficient_loading``) are refused there
(``sync_module_states=True is not supported on cpu``)."""

import copy
import os

import pytest

import helpers
import pyvene_dist

STRATEGIES = ("ddp", "zero3")
#: A ZeRO-3 config with an optimizer of its own (torch's AdamW, as HF's ``adamw_torch``: one process's numbers):
#: the evaluation's inference engine must leave it in the config for ``train()``.
ZERO3_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                               "torch_adam": True}}


def _evaluate_train_evaluate(base, out, strategy=None):
    """pyreft's quickstart on the folder (``testing.models.reft_model``: LoReFT at layers 0 and 1, at the last
    prompt position of 8 prompts answered " red"), with ``strategy``'s ``TrainingArguments``
    (``pyvene_dist.testing.STRATEGIES``), made after the model is loaded, as pyreft's examples do: the eval loss
    before and after 2 training steps, and the DeepSpeed config's optimizer section before and after the first
    evaluation."""
    import pyreft
    import transformers

    from pyvene_dist.testing import STRATEGIES as REGISTRY
    from pyvene_dist.testing.models import WORDS, reft_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    reft = reft_model(model, layers=(0, 1))
    prompts = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(8)]
    data = pyreft.make_multiple_position_supervised_data_module(tokenizer, model, prompts, [" red"] * len(prompts),
                                                                positions="l1", num_interventions=2)
    world = int(os.environ.get("WORLD_SIZE", 1))
    switch_on = REGISTRY[strategy].trainer_arguments() if strategy else {}
    if strategy == "zero3":
        switch_on["deepspeed"] = {**switch_on["deepspeed"], "optimizer": ZERO3_OPTIMIZER}
    arguments = transformers.TrainingArguments(
        output_dir=out, max_steps=2, learning_rate=0.1, lr_scheduler_type="constant", weight_decay=0.0,
        per_device_train_batch_size=4 // world, per_device_eval_batch_size=1, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, seed=0, data_seed=0,
        train_sampling_strategy="sequential", **switch_on)
    trainer = pyreft.ReftTrainerForCausalLM(model=reft, processing_class=tokenizer, args=arguments,
                                            train_dataset=data["train_dataset"], eval_dataset=data["train_dataset"],
                                            data_collator=data["data_collator"])
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config if strategy == "zero3" else {}
    given = copy.deepcopy(config.get("optimizer"))
    before = trainer.evaluate()["eval_loss"]
    left = config.get("optimizer")
    trainer.train()
    return {"before": before, "after": trainer.evaluate()["eval_loss"], "optimizer": (given, left)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The checkpoint folder, and the eval losses of one process."""
    from pyvene_dist.testing.models import save_checkpoint

    out = tmp_path_factory.mktemp("evaluate_before_train")
    save_checkpoint(out / "base")
    helpers.patch()
    try:
        return {"base": str(out / "base"), **_evaluate_train_evaluate(out / "base", str(out / "one"))}
    finally:
        pyvene_dist.unpatch()


@pytest.mark.world_size(2)
def test_evaluate_then_train_then_evaluate_equals_one_process(one_process, tmp_path):
    """Without the fix, DDP trained every rank alone (after-training loss 5.65627, one process's 5.65667) and ZeRO-3's first backward failed (``'NoneType' object has no attribute 'backward'``), its
    config's optimizer section gone."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    helpers.patch()
    for strategy in STRATEGIES:
        found = _evaluate_train_evaluate(one_process["base"], str(tmp_path / f"{strategy}-{dist.get_rank()}"), strategy)
        for when in ("before", "after"):
            assert found[when] == pytest.approx(one_process[when], rel=1e-5), (strategy, when, found, one_process)
        given, left = found["optimizer"]
        assert left == given and (given is not None) == (strategy == "zero3"), (strategy, given, left)
        AcceleratorState._reset_state(True)  # the next strategy's Trainer builds its own
