"""LoReFT with pyreft's ReftTrainer (HF Trainer) after pyvene_dist.patch(): one process, or any launcher.

    python docs/examples/train_reft.py
    torchrun --nproc_per_node 2 docs/examples/train_reft.py
    torchrun --nproc_per_node 2 docs/examples/train_reft.py --deepspeed docs/configs/deepspeed-zero3.json
"""

import argparse

import torch

import pyvene_dist

pyvene_dist.patch()  # before pyreft builds the model

import pyreft  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed", help="a DeepSpeed JSON config, e.g. docs/configs/deepspeed-zero3.json")
options = parser.parse_args()

# Your model: AutoModelForCausalLM.from_pretrained(...). Here a tiny Llama built from a config, so nothing
# is downloaded. Every process builds the same model and interventions: seed first.
torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)

# LoReFT, rank 4, on the output of both decoder layers.
reft_config = pyreft.ReftConfig(representations=[
    {"layer": layer, "component": "block_output", "low_rank_dimension": 4,
     "intervention": pyreft.LoreftIntervention(embed_dim=config.hidden_size, low_rank_dimension=4, dtype=model.dtype)}
    for layer in range(config.num_hidden_layers)
])
reft_model = pyreft.get_reft_model(model, reft_config)
reft_model.print_trainable_parameters()

# pyreft's examples: tokens, labels, and the positions each intervention acts on ([interventions, positions]).
tokens = torch.randint(config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(1))
examples = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
             "intervention_locations": torch.tensor([[7], [7]])} for ids in tokens]

arguments = TrainingArguments(
    output_dir="/tmp/train_reft", per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
    logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
    deepspeed=options.deepspeed,
)
trainer = pyreft.ReftTrainer(model=reft_model, args=arguments, train_dataset=examples)
trainer.train()

# Leave the process group HF Trainer joined under torchrun before the interpreter exits: gloo's threads
# otherwise outlive it ("terminate called without an active exception"). The barrier first, so that no
# rank tears its connections down while another still uses them.
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
