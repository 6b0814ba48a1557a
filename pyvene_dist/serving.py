"""Several ReFTs on one base model, in one batch: each row names its ReFT, or none for the bare model.

    import transformers
    from pyvene_dist.serving import MultiReftModel

    base = transformers.AutoModelForCausalLM.from_pretrained("path/to/model")
    tokenizer = transformers.AutoTokenizer.from_pretrained("path/to/model", padding_side="left")
    many = MultiReftModel(base)
    many.load("poet", "out/poet/reft")                    # positions from its train_settings.json
    many.load("coder", "out/coder/reft", positions="f1+l1")
    inputs = tokenizer(["a poem", "2 + 2", "hello"], return_tensors="pt", padding=True)
    ids = many.generate(inputs, refts=["poet", "coder", None], max_new_tokens=32, do_sample=False)

Each row's tokens are those of generating it alone with its ReFT (``ReftModel.load`` and
``reft_model.generate``, as ``docs/examples/serve_reft.py`` does), or with the bare model for a row
named ``None``; the test (tests/test_serving.py) checks it for LoReFT, NoReFT and DiReFT in float32 on
the CPU, in pyreft's prompt mode and in pyvene's every-token mode.

How: the base model is held once; each ReFT adds only its interventions (``ReftModel.load`` reads the
folder, onto this base, and the interventions are kept; ``_load`` says what NoReFT needs besides). A
``generate`` registers one hook per hooked module (a forward hook for an output component, a pre-hook for
an input one) for the ReFTs its rows name, runs the base model's ``generate`` once for the whole batch,
and removes the hooks. Each hook
applies, in pyvene's order, every intervention of every ReFT that acts on that module to the rows
naming that ReFT, at their positions: the representations are gathered by row and position
(advanced indexing), intervened on with pyvene's ``do_intervention`` and written back in place, as
pyvene's ``unit="pos"`` hooks do. Rows of other ReFTs and bare rows are not touched. The LoReFTs of
two ReFTs or more at one module go together through batched matmuls (``_serving_hooks.StackedLoreft``): a step then
costs the same few kernels whatever the number of ReFTs.

Modes, as pyvene's ``generate`` has them:

- ``intervene_on_prompt=True`` (pyreft's mode): on the prompt's forward only, at each row's first and
  last positions (the ReFT's ``positions``, e.g. ``f1+l1``, and ``share_weights``, as pyreft's
  ``get_intervention_locations`` places them on the row's own prompt). Prompts are padded on the left;
  a row's positions count from its first token, so a padded row is intervened where it would be alone.
- ``intervene_on_prompt=False`` (every-token): the prompt's forward is left alone and position 0 of
  every later forward (with the KV cache, the token just generated) is intervened on.

The rotations of LoReFT and DiReFT are built once per ``generate`` (``parametrize.cached()``, entered as
``mechanisms.parametrization_cache.cached_parametrizations`` enters it for the fast path: under its lock).

What it refuses, with the argument named: an unknown ReFT name in ``refts``, a folder whose interventions
are of another width (another base, another hidden size), a layer the base lacks, weights saved in
another dtype than the base model's, units other than ``"pos"`` and head-level components, interventions
that need a source, prompts padded on the right, a prompt too short for its
ReFT's positions, and a cache that ``generate`` would compile (``cache_implementation="static"`` without
``disable_compile=True``): the hooks run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import torch
from pyvene import SourcelessIntervention
from pyvene.models.basic_utils import get_type_from_string
from pyvene.models.configuration_intervenable_model import RepresentationConfig
from pyvene.models.modeling_utils import get_dimension_by_component, get_internal_model_type, type_to_module_mapping
from torch import nn

from . import is_patched, patched
from ._serving_hooks import left_padded, register_hook, rows_by_module
from .fixes.checkpoints import read_saved
from .mechanisms.parametrization_cache import cached_parametrizations
from .positions import parse_positions

#: Written by docs/examples/train_reft.py beside the interventions: the positions and shared weights of training.
SETTINGS = "train_settings.json"
#: Caches ``generate`` builds without compiling (others are compiled on a GPU unless ``disable_compile``).
EAGER_CACHES = (None, "dynamic")


@dataclasses.dataclass(frozen=True, eq=False)
class Intervention:
    """One intervention of a loaded ReFT: where it acts and its place in pyreft's locations."""

    module: nn.Module          # the hooked module of the base model
    pre: bool                  # a forward pre-hook (an input component), else a forward hook
    intervention: nn.Module
    index: int                 # its place in the ReFT's ``sorted_keys``: which of pyreft's locations are its


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedReft:
    """A ReFT held by ``MultiReftModel``: its interventions and the prompt positions it was trained at."""

    name: str
    folder: str
    positions: str
    share_weights: bool
    interventions: tuple[Intervention, ...]

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for i in self.interventions for p in i.intervention.parameters())


class MultiReftModel:
    """One base model and any number of ReFTs loaded onto it, generating batches of rows that each name
    their ReFT (``refts=``) or none. See the module's docstring."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.refts: dict[str, LoadedReft] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self.refts)

    def load(self, name: str, folder: str | os.PathLike, *, positions: str | None = None,
             share_weights: bool | None = None) -> LoadedReft:
        """Load the ReFT that ``ReftModel.save`` wrote to ``folder`` onto this base model, as ``name``.
        ``positions`` (pyreft's ``f1+l1``) and ``share_weights``: as in training; by default from the folder's
        ``train_settings.json`` (docs/examples/train_reft.py writes it)."""
        import pyreft  # noqa: F401 -- optional, installed where ReFTs are served: missing, it fails here, first

        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty string, found {name!r}")
        if name in self.refts:
            raise ValueError(f"name {name!r}: a ReFT of that name is loaded already (from {self.refts[name].folder});"
                             " unload it first")
        folder = os.fspath(folder)
        config = _saved_config(folder)
        settings = _settings(folder)
        positions = positions if positions is not None else settings.get("positions")
        if positions is None:
            raise ValueError(f"positions: {folder} has no {SETTINGS}; pass the positions of training, e.g. "
                             "positions='f1+l1'")
        first, last = parse_positions(positions)  # refuses a malformed form, and one that selects no position
        share_weights = bool(share_weights if share_weights is not None else settings.get("share_weights", False))
        _check_against_base(self.model, folder, config)
        # pyvene_dist's checkpoints fix restores every weight in the dtype it was saved in (stock pyreft
        # rebuilds LoReFT's learned_source in bfloat16): load under the patch, as serve_reft.py does.
        patching = contextlib.nullcontext() if is_patched() else patched()
        with patching:
            reft_model = _load(folder, self.model, config)
        loaded = LoadedReft(name, folder, positions, share_weights,
                            tuple(_intervention(reft_model, key, index) for index, key in
                                  enumerate(reft_model.sorted_keys)))
        expected = _location_count(first, last, share_weights, len(loaded.interventions))
        if expected is not None:
            raise ValueError(expected.format(folder=folder, positions=positions, share_weights=share_weights))
        self.refts[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        if name not in self.refts:
            raise KeyError(f"name {name!r}: no ReFT of that name is loaded; loaded: {self.names}")
        del self.refts[name]

    def memory(self) -> dict:
        """Bytes of the base model's parameters and buffers, and of each ReFT's parameters."""
        base = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        return {"base_bytes": base, "reft_bytes": {name: reft.parameter_bytes for name, reft in self.refts.items()}}

    @torch.no_grad()
    def generate(self, inputs: Mapping, *, refts: Sequence[str | None], intervene_on_prompt: bool = True,
                 **generate_kwargs) -> torch.Tensor:
        """``model.generate`` of the batch ``inputs`` (``input_ids``, and ``attention_mask`` for prompts padded on
        the left), row ``i`` with the ReFT named ``refts[i]`` (``None``: the bare model). Returns the token ids,
        as ``model.generate`` does (prompt included)."""
        input_ids = inputs["input_ids"]
        if input_ids.dim() != 2:
            raise ValueError(f"inputs['input_ids']: expected a batch of shape (rows, tokens), found shape "
                             f"{tuple(input_ids.shape)}")
        rows = input_ids.shape[0]
        if isinstance(refts, str) or len(refts) != rows:
            found = repr(refts) if isinstance(refts, str) else f"{len(refts)} names"
            raise ValueError(f"refts: expected one name (or None) per row, {rows} in all, found {found}")
        for row, name in enumerate(refts):
            if name is not None and name not in self.refts:
                raise KeyError(f"refts[{row}]: expected a loaded ReFT or None, found {name!r}; loaded: {self.names}")
        cache = generate_kwargs.get("cache_implementation")
        if cache not in EAGER_CACHES and not generate_kwargs.get("disable_compile"):
            raise ValueError(f"cache_implementation={cache!r}: generate compiles the decoding step with it (on a "
                             "GPU), and the mixed-ReFT hooks run eagerly; pass disable_compile=True or use "
                             "the dynamic cache")
        mask = inputs.get("attention_mask")
        lengths, offsets = left_padded(mask, input_ids)
        calls = rows_by_module(self.refts, refts, lengths, offsets, intervene_on_prompt, input_ids.device)
        handles = [register_hook(module, pre, entries, intervene_on_prompt) for (module, pre), entries in calls.items()]
        try:
            with cached_parametrizations():
                return self.model.generate(**inputs, **generate_kwargs)
        finally:
            for handle in handles:
                handle.remove()


# --- loading ----------------------------------------------------------------------------------------------

def _saved_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"folder: expected a folder ReftModel.save wrote (with config.json), found {folder!r}"
                         + ("" if os.path.isdir(folder) else ", which does not exist"))
    with open(path) as file:
        config = json.load(file)
    if "representations" not in config or "sorted_keys" not in config:
        raise ValueError(f"folder: {path} is no saved ReFT's config (it lacks representations and sorted_keys)")
    return config


def _settings(folder: str) -> dict:
    path = os.path.join(folder, SETTINGS)
    if not os.path.isfile(path):
        return {}
    with open(path) as file:
        return json.load(file)


def _representation(config: dict, index: int) -> dict:
    """The saved representation ``index`` by field name (pyvene saves each as a list, in
    ``RepresentationConfig``'s field order)."""
    saved = config["representations"][index]
    return dict(zip(RepresentationConfig._fields, saved)) if isinstance(saved, list) else dict(saved)


def _check_against_base(model: nn.Module, folder: str, config: dict) -> None:
    """The saved ReFT fits this base: its layers, the width of each representation (pyvene saves each
    intervention's width; the weights' shapes say it too), and the dtype of its weights."""
    model_type = get_internal_model_type(model)
    mapping = type_to_module_mapping.get(model_type, {})
    layer_count = getattr(model.config, "num_hidden_layers", None)
    base_dtype = next(model.parameters()).dtype
    for index, key in enumerate(config["sorted_keys"]):
        representation = _representation(config, index)
        component, unit, layer = representation["component"], representation["unit"], representation["layer"]
        if unit != "pos":
            raise ValueError(f"folder {folder}: representation {index} has unit {unit!r}; mixed-ReFT batches "
                             "take unit 'pos'")
        if len(mapping.get(component, ())) > 2:  # pyvene splits it (heads): not one representation per position
            raise ValueError(f"folder {folder}: representation {index} is at component {component!r}, which is "
                             "split into heads; mixed-ReFT batches take whole components (block_output, ...)")
        if layer_count is not None and "%s" in mapping.get(component, ("",))[0] and not 0 <= layer < layer_count:
            raise ValueError(f"folder {folder}: representation {index} is at layer {layer}; the base model has "
                             f"layers 0 to {layer_count - 1}")
        width = get_dimension_by_component(model_type, model.config, component)
        width = None if width is None else width * int(representation["max_number_of_units"])
        saved_width = (config.get("intervention_dimensions") or [None] * (index + 1))[index]
        if width is not None and saved_width is not None and saved_width != width:
            raise ValueError(f"folder {folder}: intervention {index} ({key}) is {saved_width} wide; the base model's "
                             f"{component} is {width} wide (a ReFT of another base model?)")
        path = os.path.join(folder, f"intkey_{key}.bin")
        for tensor_name, tensor in _saved_state(folder, key).items():
            if not torch.is_floating_point(tensor):
                continue
            if width is not None and tensor.dim() == 2 and width not in tensor.shape:
                raise ValueError(f"folder {folder}: {os.path.basename(path)}'s {tensor_name} has shape "
                                 f"{tuple(tensor.shape)}; the base model's {component} is {width} wide (a ReFT "
                                 "of another base model?)")
            if tensor.dtype != base_dtype:
                raise ValueError(f"folder {folder}: {os.path.basename(path)}'s {tensor_name} was saved in "
                                 f"{str(tensor.dtype).removeprefix('torch.')}, the base model is "
                                 f"{str(base_dtype).removeprefix('torch.')}: load the base in the dtype of "
                                 "training (train_settings.json's dtype)")


#: pyreft's interventions that read ``add_bias`` when built, which pyvene's saved config does not hold.
NEED_ADD_BIAS = ("NoreftIntervention", "NodireftIntervention")


def _load(folder: str, model: nn.Module, config: dict):
    """``pyreft.ReftModel.load(folder, model)``, the path docs/examples/serve_reft.py takes; for NoReFT and
    NodiReFT, which it cannot rebuild (``KeyError: 'add_bias'``: pyvene saves no constructor argument beyond
    the representation), the same interventions built with ``add_bias`` read from the saved weights (a
    ``proj_layer.bias`` or none), in the dtype saved, and loaded with ``load_intervention``."""
    import pyreft  # optional: installed where ReFTs are served

    types = [get_type_from_string(name) for name in config["intervention_types"]]
    if not any(kind.__name__ in NEED_ADD_BIAS for kind in types):
        return pyreft.ReftModel.load(folder, model)
    representations = []
    for index, (key, kind) in enumerate(zip(config["sorted_keys"], types)):
        fields = _representation(config, index)
        state = _saved_state(folder, key)
        dtypes = [tensor.dtype for tensor in state.values() if torch.is_floating_point(tensor)]
        width = get_dimension_by_component(get_internal_model_type(model), model.config, fields["component"])
        built = {**fields, "embed_dim": width * int(fields["max_number_of_units"]), "use_fast": False,
                 "add_bias": any(name.endswith("proj_layer.bias") for name in state),
                 **({"dtype": dtypes[0]} if dtypes else {})}
        kept = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension")
        representations.append({name: fields[name] for name in kept} | {"intervention": kind(**built)})
    reft_model = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations), set_device=False)
    if list(reft_model.interventions) != list(config["sorted_keys"]):
        raise ValueError(f"folder {folder}: its interventions {config['sorted_keys']} were rebuilt as "
                         f"{list(reft_model.interventions)}")
    reft_model.load_intervention(folder, include_model=False)
    return reft_model


def _saved_state(folder: str, key: str) -> dict:
    path = os.path.join(folder, f"intkey_{key}.bin")
    return read_saved(path) if os.path.isfile(path) else {}


def _intervention(reft_model, key: str, index: int) -> Intervention:
    intervention = reft_model.interventions[key]
    if not isinstance(intervention, SourcelessIntervention):
        raise ValueError(f"intervention {key}: {type(intervention).__name__} takes a source; mixed-ReFT batches "
                         "serve pyreft's sourceless interventions (LoReFT, NoReFT, DiReFT, ...)")
    register = reft_model.intervention_hooks[key]
    module = register.__self__
    device = next(module.parameters(), next(reft_model.model.parameters())).device
    intervention.to(device).eval()
    for parameter in intervention.parameters():
        parameter.requires_grad_(False)
    return Intervention(module, register.__name__ == "register_forward_pre_hook", intervention, index)


def _location_count(first: int, last: int, share_weights: bool, interventions: int) -> str | None:
    """Why pyreft's locations for these positions would not pair with ``interventions``, or None."""
    if first and last and not share_weights and interventions % 2:
        return ("positions: {positions!r} with share_weights={share_weights} gives the first and the last "
                f"positions their own interventions (an even number), but {{folder}} holds {interventions}; "
                "pass share_weights=True if training shared them")
    return None
