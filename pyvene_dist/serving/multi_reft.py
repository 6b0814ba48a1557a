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
folder, onto this base, and the interventions are kept; ``reft_folder.load_folder`` says what NoReFT needs besides). A
``generate`` registers one hook per hooked module (a forward hook for an output component, a pre-hook for
an input one) for the ReFTs its rows name, runs the base model's ``generate`` once for the whole batch,
and removes the hooks. Each hook
applies, in pyvene's order, every intervention of every ReFT that acts on that module to the rows
naming that ReFT, at their positions: the representations are gathered by row and position
(advanced indexing), intervened on with pyvene's ``do_intervention`` and written back in place, as
pyvene's ``unit="pos"`` hooks do. Rows of other ReFTs and bare rows are not touched. The LoReFTs of
two ReFTs or more at one module go together through batched matmuls (``_row_hooks.StackedLoreft``): a step then
costs the same few kernels whatever the number of ReFTs.

Beam search and ``num_return_sequences`` run the forwards on copies of each row (``generate`` repeats row ``i``
in place); each copy takes its row's ReFT, as ``ReftModel.generate`` gives that row alone.

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
import os
from collections.abc import Mapping, Sequence

import torch
from pyvene import SourcelessIntervention
from pyvene.models.modeling_utils import get_dimension_by_component, get_internal_model_type, type_to_module_mapping
from torch import nn

from .. import is_patched, patched
from .._optional import import_pyreft
from ..mechanisms.parametrization_cache import cached_parametrizations
from ..positions import parse_positions
from ..reft_folder import (SETTINGS, load_folder, location_count_problem, representation, saved_config, saved_settings,
                           saved_state)
from ._row_hooks import left_padded, register_hook, rows_by_module
from .batching import generate_batch, init_manager, paused

#: Caches ``generate`` builds without compiling (others are compiled on a GPU unless ``disable_compile``).
EAGER_CACHES = (None, "dynamic")
#: ``generate``'s keywords for assisted decoding, whose forwards hold several new tokens.
ASSISTED = frozenset({"assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"})


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
        self._continuous = None  # the ReFTs of a continuous batching manager, while one exists (batching.py)

    @property
    def names(self) -> list[str]:
        return sorted(self.refts)

    def load(self, name: str, folder: str | os.PathLike, *, positions: str | None = None,
             share_weights: bool | None = None) -> LoadedReft:
        """Load the ReFT that ``ReftModel.save`` wrote to ``folder`` onto this base model, as ``name``.
        ``positions`` (pyreft's ``f1+l1``) and ``share_weights``: as in training; by default from the folder's
        ``train_settings.json`` (docs/examples/train_reft.py writes it)."""
        import_pyreft("pyvene_dist.serving serves ReFTs")  # missing, it fails here, first

        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty string, found {name!r}")
        if name in self.refts:
            raise ValueError(f"name {name!r}: a ReFT of that name is loaded already (from {self.refts[name].folder});"
                             " unload it first")
        folder = os.fspath(folder)
        config = saved_config(folder)
        settings = saved_settings(folder)
        positions = positions if positions is not None else settings.get("positions")
        if positions is None:
            raise ValueError(f"positions: {folder} has no {SETTINGS}; pass the positions of training, e.g. "
                             "positions='f1+l1'")
        first, last = parse_positions(positions)  # refuses a malformed form, and one that selects no position
        if share_weights is not None and not isinstance(share_weights, bool):
            raise TypeError(f"share_weights: expected True, False or None (from {SETTINGS}), found {share_weights!r}")
        share_weights = share_weights if share_weights is not None else settings.get("share_weights", False)
        if not isinstance(share_weights, bool):
            raise TypeError(f"share_weights: {folder}'s {SETTINGS} holds {share_weights!r}; expected true or false")
        _check_against_base(self.model, folder, config)
        # pyvene_dist's checkpoints fix restores every weight in the dtype it was saved in (stock pyreft
        # rebuilds LoReFT's learned_source in bfloat16): load under the patch, as serve_reft.py does.
        patching = contextlib.nullcontext() if is_patched() else patched()
        with patching:
            reft_model = load_folder(folder, self.model, config)
        loaded = LoadedReft(name, folder, positions, share_weights,
                            tuple(_intervention(reft_model, key, index) for index, key in
                                  enumerate(reft_model.sorted_keys)))
        expected = location_count_problem(first, last, share_weights, len(loaded.interventions))
        if expected is not None:
            raise ValueError(expected.format(folder=folder, positions=positions, share_weights=share_weights))
        self.refts[name] = loaded
        if self._continuous is not None:
            try:
                with paused(self._continuous):
                    self._continuous.add(name)
            except BaseException:
                del self.refts[name]
                raise
        return loaded

    def unload(self, name: str) -> None:
        """Forget the ReFT ``name``; refused while a continuous batching request names it."""
        if name not in self.refts:
            raise KeyError(f"name {name!r}: no ReFT of that name is loaded; loaded: {self.names}")
        if self._continuous is not None:
            with paused(self._continuous):
                self._continuous.remove(name)
        del self.refts[name]

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, *,
                                 workload_hints=None):
        """transformers' ``model.init_continuous_batching`` whose requests name their ReFT:
        ``add_request(ids, reft="poet", intervene_on_prompt=True, ...)`` (``batching.ReftBatchingManager``; how
        a step applies the ReFTs: ``continuous``)."""
        return init_manager(self, generation_config, continuous_batching_config, workload_hints=workload_hints)

    def generate_batch(self, inputs, *, refts, intervene_on_prompt: bool = True, max_new_tokens: int | None = None,
                       generation_config=None, continuous_batching_config=None, timeout: float = 600.0) -> dict:
        """transformers' ``model.generate_batch`` (lists of token ids, continuous batching), prompt ``i`` with the
        ReFT ``refts[i]`` (None: the bare model): request id -> ``GenerationOutput``, in the order of ``inputs``."""
        return generate_batch(self, inputs, refts=refts, intervene_on_prompt=intervene_on_prompt,
                              max_new_tokens=max_new_tokens, generation_config=generation_config,
                              continuous_batching_config=continuous_batching_config, timeout=timeout)

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
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"inputs['input_ids']: expected a tensor of shape (rows, tokens), as "
                            f"tokenizer(..., return_tensors='pt', padding=True) gives, found {type(input_ids).__name__}")
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
        assisted = sorted(set(generate_kwargs) & ASSISTED)
        if assisted and not intervene_on_prompt:
            raise ValueError(f"{assisted[0]}: assisted decoding checks several candidate tokens in one forward, and "
                             "every-token mode intervenes on one new token per forward; use intervene_on_prompt=True "
                             "or leave assisted decoding out")
        mask = inputs.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"inputs['attention_mask']: expected a tensor as input_ids, found {type(mask).__name__}")
        lengths, offsets = left_padded(mask, input_ids)
        calls = rows_by_module(self.refts, refts, lengths, offsets, intervene_on_prompt, input_ids.device)
        handles = [register_hook(module, pre, entries, intervene_on_prompt, rows)
                   for (module, pre), entries in calls.items()]
        try:
            with cached_parametrizations():
                return self.model.generate(**inputs, **generate_kwargs)
        finally:
            for handle in handles:
                handle.remove()


# --- loading ----------------------------------------------------------------------------------------------

def _check_against_base(model: nn.Module, folder: str, config: dict) -> None:
    """The saved ReFT fits this base: its layers, the width of each representation (pyvene saves each
    intervention's width; the weights' shapes say it too), and the dtype of its weights."""
    model_type = get_internal_model_type(model)
    mapping = type_to_module_mapping.get(model_type, {})
    layer_count = getattr(model.config, "num_hidden_layers", None)
    base_dtype = next(model.parameters()).dtype
    for index, key in enumerate(config["sorted_keys"]):
        fields = representation(config, index)
        component, unit, layer = fields["component"], fields["unit"], fields["layer"]
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
        width = None if width is None else width * int(fields["max_number_of_units"])
        saved_width = (config.get("intervention_dimensions") or [None] * (index + 1))[index]
        if width is not None and saved_width is not None and saved_width != width:
            raise ValueError(f"folder {folder}: intervention {index} ({key}) is {saved_width} wide; the base model's "
                             f"{component} is {width} wide (a ReFT of another base model?)")
        path = os.path.join(folder, f"intkey_{key}.bin")
        for tensor_name, tensor in saved_state(folder, key).items():
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
