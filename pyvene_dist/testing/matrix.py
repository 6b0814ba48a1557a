"""One configuration of the generated matrix: an architecture, an attention implementation, a pyvene
component, layers, pyreft positions, an intervention type, a dtype and a padding side, built the way
pyreft's ``examples/loreft/train.py`` builds them (``configurations()`` in ``strategies`` draws them).

    configuration = Configuration("llama", "sdpa", "attention_value_output", layers=(0, 2), positions="f1+l2")
    model = configuration.build()                 # a tiny model from its config, pyreft's ReFT model on it
    batch = configuration.batch()                 # padded variable-length examples, their locations

Locations are pyreft's ``get_intervention_locations`` with pyreft's ``pad_mode="first"``: each example
gets one pad token in front, which the padding locations (``-1`` before the shift) point at. Examples
are then padded to one length on ``padding``'s side, the locations moved with their tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType

import torch
from pyvene.models.intervenable_modelcard import type_to_module_mapping

from . import models

ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "gpt2", "gpt-neox")
#: pyreft 0.1.0's intervention types (pyreft/interventions.py).
INTERVENTIONS = ("LoreftIntervention", "NoreftIntervention", "ConsreftIntervention", "LobireftIntervention",
                 "DireftIntervention", "NodireftIntervention")
#: The depth of every matrix model: 1-3 of its layers are intervened on.
LAYERS = 3
PAD = 0
#: The models' width: 4 heads of 8. flex attention's CUDA kernels need heads of at least 16 (``NYI: embedding
#: dimension ... at least 16``), so its draws, and their eager references, are twice as wide.
HIDDEN = 32
HIDDEN_FLEX = 64


@functools.cache
def _model_class(architecture: str) -> type:
    return type(models.BASE_MODELS[architecture](layers=1))


def components(architecture: str) -> tuple[str, ...]:
    """Every component pyvene maps for ``architecture`` (its ``type_to_module_mapping``), in its order."""
    return tuple(type_to_module_mapping[_model_class(architecture)])


#: The model class's flag that says transformers lets it use each implementation (eager: every model).
SUPPORTS = MappingProxyType({"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
            "flex_attention": "_supports_flex_attn"})


def attentions(architecture: str) -> tuple[str, ...]:
    """The attention implementations transformers lets ``architecture`` use, as its model class says: Gemma2
    has no sdpa (its soft-capped scores are eager's, flash's or flex's only), GPT-2 no flex."""
    model_class = _model_class(architecture)
    return tuple(a for a in models.ATTENTIONS if a == "eager" or getattr(model_class, SUPPORTS[a], False))


@dataclasses.dataclass(frozen=True)
class Configuration:
    architecture: str
    attention: str
    component: str
    layers: tuple[int, ...] = (0,)
    positions: str = "f1+l1"  # pyreft's spelling: first n, last n, or both
    share_weights: bool = False
    intervention: str = "LoreftIntervention"
    dtype: str = "float32"
    padding: str = "right"
    lengths: tuple[int, ...] = (6, 4, 5)  # tokens of each example, before pyreft's pad token
    seed: int = 0
    hidden: int = 0  # 0: HIDDEN, or HIDDEN_FLEX under flex attention

    def __post_init__(self) -> None:
        if not self.hidden:
            object.__setattr__(self, "hidden", HIDDEN_FLEX if self.attention == "flex_attention" else HIDDEN)
        if self.padding not in ("left", "right"):
            raise ValueError(f"padding must be 'left' or 'right', got {self.padding!r}")
        if self.component not in components(self.architecture):
            raise ValueError(f"component {self.component!r} is not one pyvene maps for {self.architecture}: "
                             f"{components(self.architecture)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def first_last(self) -> tuple[int, int]:
        return models.import_pyreft().parse_positions(self.positions)

    @property
    def intervened_layers(self) -> tuple[int, ...]:
        """One intervention per layer, or, as pyreft's train.py does for ``f+l`` without shared weights, two:
        the first half for the first positions, the second for the last."""
        both = "+" in self.positions
        return self.layers + self.layers if both and not self.share_weights else self.layers

    def with_attention(self, attention: str) -> "Configuration":
        """The same draw under another attention implementation, as wide as this one."""
        return dataclasses.replace(self, attention=attention, hidden=self.hidden)

    def build(self):
        base = models.BASE_MODELS[self.architecture](
            seed=self.seed, dtype=self.torch_dtype, layers=LAYERS, hidden=self.hidden, attention=self.attention)
        return models.reft_model(base, layers=self.intervened_layers, component=self.component, rank=2,
                                 intervention=self.intervention, dtype=self.torch_dtype, seed=self.seed + 1)

    def batch(self) -> dict:
        """``base`` (input ids, attention mask), ``labels`` (the second half of each example's tokens, -100
        elsewhere: no masked position predicts a label) and ``unit_locations``."""
        first_n, last_n = self.first_last
        get_intervention_locations = models.import_pyreft().get_intervention_locations
        generator = torch.Generator().manual_seed(self.seed + 2)
        width = max(self.lengths) + 1
        input_ids = torch.full((len(self.lengths), width), PAD)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        locations = []
        for row, length in enumerate(self.lengths):
            tokens = torch.randint(3, models.VOCAB_SIZE, (length,), generator=generator)
            start = width - (length + 1) if self.padding == "left" else 0
            input_ids[row, start + 1 : start + 1 + length] = tokens  # pyreft's pad token stays in front
            attention_mask[row, start + 1 : start + 1 + length] = 1  # pyreft masks its pad token too
            answer = length // 2  # the prompt's tokens are no labels, as in pyreft's instruction data
            labels[row, start + 1 + length - answer : start + 1 + length] = tokens[length - answer :]
            positions = get_intervention_locations(
                last_position=length, first_n=first_n, last_n=last_n, pad_mode="first",
                num_interventions=len(self.intervened_layers), share_weights=self.share_weights)
            locations.append([[start + 1 + p for p in each] for each in positions])  # -1: the pad token
        per_intervention = [list(example) for example in zip(*locations)]  # [interventions][batch][positions]
        if self.component.startswith("head_"):  # unit "h.pos": a head of each example, then its positions
            heads = torch.randint(models.TINY_KV_HEADS, (len(per_intervention), len(self.lengths), 1),
                                  generator=generator).tolist()
            per_intervention = [(h, p) for h, p in zip(heads, per_intervention)]
        return {
            "base": {"input_ids": input_ids, "attention_mask": attention_mask},
            "labels": labels,
            "unit_locations": {"sources->base": (None, per_intervention)},
        }
