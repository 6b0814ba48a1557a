"""What every workload shares: the checkpoint folder (a tiny Llama beside a trained BPE tokenizer, and the
example scripts' data files), loading it as users do, sentences, the ReFT model, the ``TrainingArguments`` a
strategy switches on (from the harness's ``STRATEGIES``), and a Trainer run recorded as the harness records one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from pyvene_dist.testing import STRATEGIES, models

STEPS, GLOBAL_BATCH, SEED, LR = 3, 4, 0, 2e-2
CHECKPOINTING = (False, True)
#: Sentences draw 1 to n of ``models.WORDS`` and these, which split into several tokens: the examples of a
#: workload differ in length and in their number of label tokens, so batches are padded and the ranks
#: hold different numbers of label tokens (as real data does; equal lengths hide loss-normalisation bugs).
RARE_WORDS = ("riverbank", "stonewall", "greenhouse")  # not in the tokenizer's corpus whole: several tokens
LABELS = 3  # classes of the classification workloads
HIDDEN_SIZE = 32  # of the checkpoint's tiny Llama
EVALUATED = 2  # examples of loreft's generation-based evaluation (greedy)
#: A chat template for pyreft's ReftRewardDataset (``apply_chat_template``).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"


@dataclasses.dataclass
class Run:
    """One workload's record (``pyvene_dist.testing.Record``) and what else it produced: generated token
    ids, evaluation metrics, whether its rank-0 save loaded back."""

    record: object
    extras: dict = dataclasses.field(default_factory=dict)


# --- the checkpoint folder ---------------------------------------------------------------------------

def make_checkpoint(folder: Path) -> Path:
    """A tiny Llama saved with ``save_pretrained`` beside a BPE tokenizer trained with ``tokenizers``."""
    from tokenizers import Tokenizer, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from pyreft.dataset import prompt_no_input

    bpe = Tokenizer(BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(models.WORDS), prompt_no_input, "say : user assistant the correct answer is 0 1 2 3 4 5 6 7 8 9"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    # A BOS first, as Llama's tokenizers do: loreft's generation-based evaluation finds the left padding by it
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_max_length=128, padding_side="right")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_data(folder / "data")
    return folder


def write_data(folder: Path) -> None:
    """The scripts' data files, in the formats their readers take (``load_dataset("json", ...)``):
    loreft's ``<task>/{train,test}.json`` and alpaca's ``alpaca_data.json``."""
    import json

    count = GLOBAL_BATCH * STEPS
    answers = [str(n) for n in torch.randint(100, (count,), generator=torch.Generator().manual_seed(SEED)).tolist()]
    files = {
        "commonsense/train.json": [{"instruction": i, "answer": a} for i, a in
                                   zip(sentences(count, 6, 20), sentences(count, 2, 21))],
        "math/train.json": [{"instruction": i, "output": f"{o} so the answer is {a}", "answer": a} for i, o, a in
                            zip(sentences(count, 4, 22), sentences(count, 5, 23), answers)],
        "alpaca_data.json": [{"instruction": i, "input": x if n % 2 else "", "output": o} for n, (i, x, o) in
                             enumerate(zip(sentences(count, 4, 24), sentences(count, 3, 25), sentences(count, 5, 26)))],
    }
    for task in ("commonsense", "math"):  # the generation-based evaluation's examples: their first EVALUATED
        files[f"{task}/test.json"] = files[f"{task}/train.json"][:EVALUATED]
    for name, rows in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(rows))


def load(folder: Path, kind: str = "causal", num_labels: int = LABELS):
    """``AutoTokenizer`` and ``AutoModelFor*`` from ``folder``, as users load a checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(SEED)  # the classifier's new head is drawn from it, the same on every rank
    if kind == "classifier":
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=num_labels,
                                                                   attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return tokenizer, model


def sentences(count: int, length: int, offset: int = 0) -> list[str]:
    """``count`` sentences of 1 to ``length`` words (``models.WORDS`` and RARE_WORDS), the same on every rank."""
    generator = torch.Generator().manual_seed(SEED + offset)
    vocabulary = models.WORDS + RARE_WORDS
    picks = torch.randint(len(vocabulary), (count, length), generator=generator)
    lengths = torch.randint(1, length + 1, (count,), generator=generator)
    return [" ".join(vocabulary[i] for i in row[:n]) for row, n in zip(picks.tolist(), lengths.tolist())]


def reft(model, layers, *, intervention="LoreftIntervention", rank=4, component="block_output", **representation):
    import pyreft

    torch.manual_seed(SEED + 1)
    hidden = model.config.hidden_size
    representations = [{
        "layer": layer, "component": component, "low_rank_dimension": rank, **representation,
        "intervention": getattr(pyreft, intervention)(embed_dim=hidden, low_rank_dimension=rank,
                                                      dtype=model.dtype, add_bias=True),
    } for layer in layers]
    return pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations))


# --- what users switch on ----------------------------------------------------------------------------

def arguments(output_dir: str, strategy: str, checkpointing: bool, **overrides):
    from transformers import TrainingArguments

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    flag = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else \
        "gradient_checkpointing"
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world_size, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
        logging_steps=1, save_strategy="no", report_to=[], seed=SEED, data_seed=SEED,
        train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        remove_unused_columns=False, **{flag: checkpointing},
    )
    switch_on = STRATEGIES[strategy].trainer_arguments if strategy in STRATEGIES else None
    if switch_on is None:
        raise ValueError(f"strategy {strategy!r} has no HF Trainer arguments in pyvene_dist.testing.STRATEGIES; "
                         f"those that do: {sorted(n for n, r in STRATEGIES.items() if r.trainer_arguments)}")
    settings.update(switch_on())
    settings.update(overrides)
    return TrainingArguments(**settings)


def train(trainer, model, resume_from_checkpoint=None) -> object:
    """``trainer.train()``, recorded as the parity harness records a run. A base-model parameter the flow
    trains beside the interventions (a classifier or score head) is recorded with them, as ``head.NAME``:
    its gradient is what HF Trainer's ``model.zero_grad()`` must clear between steps."""
    from transformers import TrainerCallback

    from pyvene_dist.testing import Record, intervention_weights
    from pyvene_dist.testing.hf import InterventionGradients

    class HeadGradients(TrainerCallback):
        def __init__(self):
            self.steps, self.left_over = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            # What the previous step left in the heads' gradients: nothing, if it was cleared. (Runs that
            # keep summing do so alike in one process and under DDP, where parity alone cannot see it.)
            if not args.deepspeed:
                self.left_over.append(max((0.0 if p.grad is None else p.grad.abs().max().item()
                                           for p in _heads(model).values()), default=0.0))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not args.deepspeed:  # as InterventionGradients: DeepSpeed has stepped inside backward
                self.steps.append({name: parameter.grad.detach().float().cpu().clone()
                                   for name, parameter in _heads(model).items()})

    gradients, heads = InterventionGradients(model), HeadGradients()
    trainer.add_callback(gradients)
    trainer.add_callback(heads)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    grads = [{**interventions, **head} for interventions, head in zip(gradients.steps, heads.steps)]
    return Record(type(trainer).__name__, world_size, losses, grads,
                  {**intervention_weights(model), **head_weights(model)},
                  metrics={"head_gradient_left_over": max(heads.left_over, default=0.0)})


def _heads(model) -> dict:
    return {f"head.{name}": parameter for name, parameter in model.model.named_parameters() if parameter.requires_grad}


def head_weights(model) -> dict:
    """CPU copies of the base model's trainable parameters, whole also under ZeRO-3 (a collective)."""
    weights = {}
    for name, parameter in _heads(model).items():
        if hasattr(parameter, "ds_id"):
            from deepspeed.utils import safe_get_full_fp32_param

            parameter = safe_get_full_fp32_param(parameter)
        weights[name] = parameter.detach().float().cpu().clone()
    return weights


def process_rank() -> int:
    return int(os.environ.get("RANK", 0))
