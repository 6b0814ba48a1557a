"""Tiny models built from configs (nothing is downloaded) and ReFT models on top of them.

Every rank of the harness and every ``pyvene-dist`` command imports this module: transformers' model classes
are read from its lazy top-level module by the builder that uses them (``transformers.LlamaForCausalLM``), so
that each loads its own architecture's modules only (seconds for all of them). pyvene is imported where used (it
prints on import, onto the commands' output), and pyreft, optional, through ``import_pyreft``.
"""

from __future__ import annotations

import shutil
import tempfile
from types import MappingProxyType
from typing import Sequence

import torch
import torch.distributed as dist
import tokenizers
import transformers

from .._optional import REFT_INSTALL, import_pyreft  # noqa: F401 -- the harness's and tests' names for them

VOCAB_SIZE = 97
#: The fewest heads (key/value heads) of the tiny models: head-level locations name one of these.
TINY_KV_HEADS = 2


#: What ``attention`` may name: transformers' implementations that need no kernel package. flash and flex
#: run on a CUDA device only.
ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flex_attention")


def tiny_llama(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
               attention: str = "eager"):

    config = transformers.LlamaConfig(**_tiny_decoder(layers, hidden))
    return _build(transformers.LlamaForCausalLM, config, seed, dtype, attention)


def tiny_qwen2(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
               attention: str = "eager"):
    """A Qwen2-class model (biases on q, k, v) of the tiny Llama's shape."""
    config = transformers.Qwen2Config(**_tiny_decoder(layers, hidden))
    return _build(transformers.Qwen2ForCausalLM, config, seed, dtype, attention)


def tiny_mistral(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
                 attention: str = "eager"):

    config = transformers.MistralConfig(**_tiny_decoder(layers, hidden))
    return _build(transformers.MistralForCausalLM, config, seed, dtype, attention)


def tiny_gemma2(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
                attention: str = "eager"):
    """A Gemma2 (sliding-window and global layers alternating, logits soft-capped) of the tiny Llama's shape."""
    config = transformers.Gemma2Config(**_tiny_decoder(layers, hidden), head_dim=hidden // 4, sliding_window=8)
    return _build(transformers.Gemma2ForCausalLM, config, seed, dtype, attention)


def _tiny_decoder(layers: int, hidden: int) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def tiny_gpt2(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
              attention: str = "eager"):

    config = transformers.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _build(transformers.GPT2LMHeadModel, config, seed, dtype, attention)


def tiny_gpt_neox(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
                  attention: str = "eager"):
    """A GPT-NeoX (Pythia's architecture: parallel attention and MLP, fused query/key/value)."""
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=1,  # GPT-NeoX's own 0 and 50256 lie outside the tiny vocabulary
        eos_token_id=2,
    )
    return _build(transformers.GPTNeoXForCausalLM, config, seed, dtype, attention)


def tiny_llama_classifier(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
                          attention: str = "eager"):
    """A tiny Llama with a 3-way classification head; token 0 is padding (the head pools the last other)."""
    config = tiny_llama(seed=seed, layers=layers, hidden=hidden).config
    config.num_labels = NUM_LABELS
    config.pad_token_id = 0
    return _build(transformers.LlamaForSequenceClassification, config, seed, dtype, attention)


def llama_1b(*, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 22, hidden: int = 2048,
             attention: str = "eager"):
    """TinyLlama-1.1B's shape (1.1B parameters, vocabulary 32000), built from a config with random weights."""
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=5632 * hidden // 2048,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return _build(transformers.LlamaForCausalLM, config, seed, dtype, attention)


#: Llama shapes the benchmarks build (``llama``): a tiny one, and released models' shapes with random weights.
LLAMA_SHAPES = MappingProxyType({
    "tiny": dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=True),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       tie_word_embeddings=False),
})


def llama(shape: str, *, dtype: torch.dtype, device, attention: str = "sdpa", checkpointing: bool = False,
          seed: int = 0, layers: int | None = None):
    """A Llama of ``shape`` (a key of ``LLAMA_SHAPES``), its random weights made on ``device`` in ``dtype``;
    ``checkpointing``: non-reentrant activation checkpointing of every decoder layer; ``layers``: that many
    decoder layers instead."""
    if shape not in LLAMA_SHAPES:
        raise ValueError(f"model shape {shape!r} is not one of {sorted(LLAMA_SHAPES)}")
    shape_and_layers = {**LLAMA_SHAPES[shape], **({} if layers is None else {"num_hidden_layers": layers})}
    config = transformers.LlamaConfig(**shape_and_layers)
    model = _build(transformers.LlamaForCausalLM, config, seed, dtype, attention, device=device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


NUM_LABELS = 3
BASE_MODELS = MappingProxyType({"llama": tiny_llama, "qwen2": tiny_qwen2, "mistral": tiny_mistral, "gemma2": tiny_gemma2,
               "gpt2": tiny_gpt2, "gpt-neox": tiny_gpt_neox, "llama-cls": tiny_llama_classifier, "llama-1b": llama_1b})
CLASSIFIERS = frozenset({"llama-cls"})


def _build(model_class, config, seed: int, dtype: torch.dtype, attention: str = "eager", device=None):
    """``model_class(config)`` with weights drawn from ``seed``. Eager attention by default: identical
    arithmetic on every backend and device. ``device``: the weights made there, in ``dtype`` (a 7B model in
    seconds on a GPU, where the host would take minutes); by default on the host, then cast."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is None:
            model = model_class(config)
        else:
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    model = model_class(config)
            finally:
                torch.set_default_dtype(default)
    if _zero3_enabled():
        model = reload_pretrained(model)
    return model.to(dtype)


def reload_pretrained(model, **from_pretrained_kwargs):
    """The same weights through ``from_pretrained``, as users' models arrive: under HF's DeepSpeed ZeRO-3
    config built partitioned (``deepspeed.zero.Init``) and loaded into the partitions; with
    ``tp_plan="auto"`` split over the ranks. In a process group HF writes on rank 0 only, so the ranks
    share rank 0's folder."""
    grouped = dist.is_available() and dist.is_initialized()
    directory = [tempfile.mkdtemp(prefix="pyvene-dist-model") if not grouped or dist.get_rank() == 0 else None]
    if grouped:
        dist.broadcast_object_list(directory, src=0)
    model.save_pretrained(directory[0])
    if grouped:
        dist.barrier()
    reloaded = type(model).from_pretrained(directory[0], attn_implementation=model.config._attn_implementation,
                                           **from_pretrained_kwargs)
    if grouped:
        dist.barrier()
    if not grouped or dist.get_rank() == 0:
        shutil.rmtree(directory[0])
    return reloaded


def _zero3_enabled() -> bool:
    return transformers.integrations.is_deepspeed_zero3_enabled()  # loaded by the model classes


def reft_model(
    base,
    *,
    layers: Sequence[int] = (0, 1),
    component: str = "block_output",
    rank: int = 4,
    intervention: str = "LoreftIntervention",
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    seed: int = 0,
):
    """``pyreft.get_reft_model`` with one ``intervention`` per layer, its weights drawn from ``seed``."""
    pyreft = import_pyreft()
    intervention_class = getattr(pyreft, intervention)
    hidden = component_width(base, component)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        representations = [
            {
                "layer": layer,
                "component": component,
                "low_rank_dimension": rank,
                **({"unit": "h.pos"} if component.startswith("head_") else {}),
                "intervention": intervention_class(
                    embed_dim=hidden, low_rank_dimension=rank, dtype=dtype, dropout=dropout, add_bias=True
                ),
            }
            for layer in layers
        ]
    return pyreft.get_reft_model(base, pyreft.ReftConfig(representations=representations))


def component_width(base, component: str) -> int:
    """The last dimension of the representation at ``component``: the hidden size for the residual stream,
    a projection's width for ``query_output`` and the like, one head's for ``head_*`` components."""
    from pyvene.models import constants, modeling_utils  # here: pyvene prints on import

    model_type = modeling_utils.get_internal_model_type(base)
    if component not in modeling_utils.type_to_module_mapping.get(model_type, {}):  # a module path: the residual width
        return base.config.hidden_size
    path, hook, *splits = modeling_utils.type_to_module_mapping[model_type][component]
    module = modeling_utils.getattr_for_torch_module(base, path % 0 if "%s" in path else path)
    if not isinstance(module, torch.nn.Linear):
        return int(modeling_utils.get_dimension_by_component(model_type, base.config, component))
    width = module.in_features if hook == constants.CONST_INPUT_HOOK else module.out_features
    for _, heads in splits:
        width //= int(modeling_utils.get_dimension_by_component(model_type, base.config, heads))
    return width


#: Words the checkpoints' tokenizers learn whole (``save_checkpoint``'s and the workload suite's): every example
#: of ``instruction_examples`` has the same number of tokens (ranks then average equal-sized losses, and DDP's
#: mean equals one process's); the workloads' sentences mix them with words split into several tokens.
WORDS = ("red", "green", "blue", "cat", "dog", "bird", "runs", "jumps", "sits", "big", "small", "fast", "slow",
         "tree", "house", "river", "stone", "light", "dark", "warm", "cold")


def save_checkpoint(folder, *, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    intermediate: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                    positions: int = 128):
    """A checkpoint folder as users bring one: a Llama (random weights from ``seed``, ``positions`` positions) and
    a real byte-level BPE tokenizer trained on ``WORDS`` with the ``tokenizers`` package, both written with
    ``save_pretrained``; ``AutoTokenizer`` and ``AutoModelForCausalLM`` load it."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    bpe.train_from_iterator([" ".join(WORDS)] * 4, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>", pad_token="<pad>", model_max_length=positions)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                                      intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=positions, tie_word_embeddings=False,
                                      bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def instruction_examples(count: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``count`` {"instruction", "output"} pairs of ``WORDS``: three words in, two out, so every example
    is 3 prompt tokens and 3 supervised ones (two words and the end of sequence)."""
    generator = torch.Generator().manual_seed(seed)
    words = [[WORDS[i] for i in torch.randint(len(WORDS), (5,), generator=generator)] for _ in range(count)]
    return [{"instruction": " ".join(chosen[:3]), "output": " " + " ".join(chosen[3:])} for chosen in words]
