"""pyreft's own flows as its README and examples write them, on a model and tokenizer loaded from a folder.

The folder is made once per module: a tiny Llama saved with ``save_pretrained`` beside a real BPE
tokenizer trained with the ``tokenizers`` package, both loaded back with ``Auto*`` as users do.
"""

import os

import pytest
import torch
import torch.distributed as dist

import helpers
from pyreft_setup import PROMPT, SENTENCES, arguments, build_folder, load, loreft


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("tiny-llama"))


def test_readme_quickstart_passes_tokenizer_to_the_trainer(patched, model_folder, tmp_path):
    """pyreft's README: ``ReftTrainerForCausalLM(model=..., tokenizer=tokenizer, ...)``. transformers 5
    renamed the keyword: ``TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'``."""
    import pyreft
    import transformers

    model, tokenizer = load(model_folder)
    reft_model = pyreft.get_reft_model(model, loreft(model, [1]))
    data_module = pyreft.make_last_position_supervised_data_module(
        tokenizer, model, [PROMPT % s for s in SENTENCES[0::2]], SENTENCES[1::2])
    before = {k: v.clone() for k, v in reft_model.interventions.state_dict().items()}
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, tokenizer=tokenizer, args=arguments(tmp_path),
                                            **data_module)
    assert trainer.processing_class is tokenizer
    trainer.train()
    after = reft_model.interventions.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    if "tokenizer" not in __import__("inspect").signature(transformers.Trainer.__init__).parameters:
        with pytest.raises(TypeError, match="tokenizer"):  # HF Trainer itself is left as it is for everyone else
            transformers.Trainer(model=model, tokenizer=tokenizer, args=arguments(tmp_path / "plain"))


def alpaca_flow(model_folder, output_dir, **arguments_overrides):
    """pyreft's examples/alpaca/train_multigpu.py on a process group: position ``f1+l1`` at every layer, the
    DDP-wrapped model handed to the trainer, checkpoints saved while training, the model saved on rank 0,
    then ``ReftModel.load`` on every rank. ``arguments_overrides`` are the example's other flags."""
    import datasets
    import pyreft
    import transformers
    from torch.nn.parallel import DistributedDataParallel

    helpers.patch()
    # bfloat16 as in the example, which is also what ReftModel.load builds LoReFT's weights in (pyreft's default)
    model, tokenizer = load(model_folder, torch.bfloat16)
    layers = list(range(model.config.num_hidden_layers))
    layers += layers  # "+" in the position and no shared weights: one intervention per layer and side
    reft_model = pyreft.get_reft_model(model, loreft(model, layers, dtype=torch.bfloat16))
    reft_model_ddp = DistributedDataParallel(reft_model)
    examples = [{"instruction": q, "input": "", "output": a} for q, a in zip(SENTENCES[0::2], SENTENCES[1::2])]
    train_dataset = pyreft.ReftSupervisedDataset(
        "alpaca", None, tokenizer, dataset=datasets.Dataset.from_list(examples * 2), seed=0,
        input_field="input", instruction_field="instruction", output_field="output",
        num_interventions=len(layers), position="f1+l1", share_weights=False)
    collator = pyreft.ReftDataCollator(data_collator=transformers.DataCollatorForSeq2Seq(
        tokenizer=tokenizer, model=model, label_pad_token_id=-100, padding="longest"))
    args = arguments(output_dir, per_device_train_batch_size=2, save_strategy="steps", save_steps=1,
                     remove_unused_columns=False, **arguments_overrides)
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model_ddp, tokenizer=tokenizer, args=args,
                                            train_dataset=train_dataset, data_collator=collator)
    trainer.train()
    if dist.get_rank() == 0:
        trainer.save_state()
        reft_model_ddp.module.save(save_directory=str(output_dir))
    dist.barrier()  # the example has none: rank 1 would read before rank 0 has written
    loaded = pyreft.ReftModel.load(str(output_dir), model)
    return trainer, reft_model, loaded


@pytest.mark.world_size(2)
def test_alpaca_multigpu_example_saves_checkpoints_and_loads_on_every_rank(model_folder, tmp_path):
    trainer, trained, loaded = alpaca_flow(model_folder, tmp_path / "out")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(loss > 0 for loss in losses), losses  # labels survived the template
    for step in (1, 2):  # ReftTrainer.save_model, as HF Trainer calls it for each checkpoint
        files = os.listdir(tmp_path / "out" / f"checkpoint-{step}" / "intervenable_model")
        assert "intkey_layer_0_comp_block_output_unit_pos_nunit_1#1.bin" in files, files
    assert list(loaded.interventions) == list(trained.interventions)
    for key, intervention in trained.interventions.items():
        for name, value in intervention.state_dict().items():
            torch.testing.assert_close(loaded.interventions[key].state_dict()[name], value, rtol=0, atol=1e-6,
                                       msg=f"{key}.{name}")


@pytest.mark.world_size(2, timeout=120)
def test_alpaca_multigpu_example_logging_on_rank_0_only_is_refused_on_every_rank(model_folder, tmp_path):
    """The example sets ``logging_steps = 1`` on rank 0 only; saving every step, rank 0's loss and FLO gathers
    met rank 1's checkpoint collectives and the run hung at the first checkpoint (the issue saw ``Parent
    directory .../checkpoint-2 does not exist`` in 2 of 3 runs). Now every rank refuses it before a step."""
    rank = dist.get_rank()
    with pytest.raises(ValueError) as error:
        alpaca_flow(model_folder, tmp_path / "out", logging_steps=1 if rank == 0 else 500)
    assert "the ranks' TrainingArguments differ: logging_steps is 1 on rank 0, 500 on rank 1." in str(error.value)
    assert "pass --logging_steps 1" in str(error.value)
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.world_size(2)
def test_alpaca_multigpu_example_trains_with_gradient_checkpointing(model_folder, tmp_path):
    """The example with ``--gradient_checkpointing``: HF Trainer enabled it on the DDP wrapper it was handed,
    ``AttributeError: 'DistributedDataParallel' object has no attribute 'gradient_checkpointing_enable'``.
    Now the base model inside checkpoints, and training matches the same run without checkpointing."""
    plain, plain_model, _ = alpaca_flow(model_folder, tmp_path / "plain")
    trainer, trained, loaded = alpaca_flow(model_folder, tmp_path / "checkpointing", gradient_checkpointing=True)
    assert trained.model.is_gradient_checkpointing and not plain_model.model.is_gradient_checkpointing
    assert trainer.args.gradient_checkpointing  # switched off only while Trainer.train ran
    losses = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (plain, trainer)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for key, intervention in trained.interventions.items():
        for name, value in intervention.state_dict().items():
            torch.testing.assert_close(value, plain_model.interventions[key].state_dict()[name], msg=f"{key}.{name}")
            torch.testing.assert_close(loaded.interventions[key].state_dict()[name], value, rtol=0, atol=1e-6,
                                       msg=f"{key}.{name} as loaded")


@pytest.mark.world_size(1, timeout=300)
def test_zero3_refuses_a_model_partitioned_in_another_precision(model_folder, tmp_path):
    """A bf16 run under ZeRO-3 whose model ``from_pretrained`` partitioned in float32: loaded while an earlier
    float32 run's arguments were alive (two runs in one process, each in the README's order: load, then make
    the arguments), or after its own arguments with a DeepSpeed config lacking ``"bf16"``. DeepSpeed then
    trained the first step in float32 and the rest in bf16 (resuming it from its own checkpoint ended 3.4e-5
    off). Refused at ``train``; HF's order (arguments first, ``"bf16": "auto"``) trains."""
    import pyreft

    from pyvene_dist.testing.hf import deepspeed_config

    helpers.patch()
    config = deepspeed_config("3")
    no_section = {key: value for key, value in config.items() if key not in ("bf16", "fp16")}
    on = {"use_cpu": not torch.cuda.is_available()}  # DeepSpeed takes the GPU where there is one
    earlier = arguments(tmp_path / "earlier", deepspeed=config, **on)  # noqa: F841 -- alive, as in a notebook

    def trainer(deepspeed, args_first: bool):
        args = arguments(tmp_path / "run", deepspeed=deepspeed, bf16=True, **on) if args_first else None
        model, tokenizer = load(model_folder, torch.bfloat16)
        reft_model = pyreft.get_reft_model(model, loreft(model, [1], dtype=torch.bfloat16))
        data_module = pyreft.make_last_position_supervised_data_module(
            tokenizer, model, [PROMPT % s for s in SENTENCES[0::2]], SENTENCES[1::2])
        args = args or arguments(tmp_path / "run", deepspeed=deepspeed, bf16=True, **on)
        return pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=args, **data_module)

    refused = r"ReftTrainerForCausalLM.train: DeepSpeed ZeRO-3 partitioned the model in torch.float32 .* \(bf16=True\) " \
              r"train in torch.bfloat16; .* \"bf16\" section"
    for deepspeed, args_first in ((config, False), (no_section, True)):
        with pytest.raises(ValueError, match=refused):
            trainer(deepspeed, args_first).train()
    trainer(config, args_first=True).train()
