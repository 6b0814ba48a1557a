"""A tiny Llama and a trained BPE tokenizer saved in a folder and loaded with ``Auto*`` as users do, and
LoReFT and ``TrainingArguments`` as pyreft's examples write them: shared by pyreft's flows
(upstream/test_pyreft_flows.py) and the trainer's loss tests (fixes/test_reft_compute_loss_batch_mean.py)."""

import torch

SENTENCES = [
    "who are you?", "I am a tiny model trained for a test.", "what is the capital of France?",
    "Paris is the capital of France.", "how many legs does a cat have?", "a cat has four legs.",
    "say something nice", "you are doing great today.",
]
PROMPT = "<s>user: %s\nassistant: "
ALPACA_PROMPT = (  # pyreft's template for examples without an input, in the tokenizer's corpus so it stays short
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n### Response:\n"
)


def build_folder(folder) -> str:
    """A tiny Llama and a trained BPE tokenizer, saved together in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator((SENTENCES + [ALPACA_PROMPT]) * 4, trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>", model_max_length=256)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def load(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype)
    return model, AutoTokenizer.from_pretrained(folder, padding_side="right")


def loreft(model, layers, rank=2, dtype=torch.float32):
    import pyreft

    torch.manual_seed(1)
    return pyreft.ReftConfig(representations=[{
        "layer": layer, "component": "block_output", "low_rank_dimension": rank,
        "intervention": pyreft.LoreftIntervention(embed_dim=model.config.hidden_size, low_rank_dimension=rank,
                                                  dtype=dtype),
    } for layer in layers])


def arguments(output_dir, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=4e-3,
                    report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0)
    return TrainingArguments(**{**settings, **overrides})
