"""Reading a ReFT folder: the interventions ``ReftModel.save`` wrote, and ``train_settings.json`` beside them
(docs/examples/train_reft.py writes it: the base model, the positions and ``share_weights`` of training).

Serving (``pyvene_dist.serving``) and evaluation (``pyvene_dist.evaluation``) read folders through this module,
each naming its own argument in the errors (``folder`` for ``MultiReftModel.load``, ``reft`` for lm-eval's
``--model_args``).
"""

from __future__ import annotations

import json
import os

import torch
from pyvene.models.basic_utils import get_type_from_string
from pyvene.models.configuration_intervenable_model import RepresentationConfig
from pyvene.models.modeling_utils import get_dimension_by_component, get_internal_model_type
from torch import nn

from ._optional import import_pyreft
from .mechanisms.saved_files import read_saved

#: Written by docs/examples/train_reft.py beside the interventions: the positions and shared weights of training.
SETTINGS = "train_settings.json"
#: pyreft's interventions that read ``add_bias`` when built, which pyvene's saved config does not hold.
NEED_ADD_BIAS = ("NoreftIntervention", "NodireftIntervention")


def saved_config(folder: str, argument: str = "folder") -> dict:
    """The folder's ``config.json``, refused (naming ``argument`` and the folder) where ``ReftModel.save`` did not
    write it."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{argument}: expected a folder ReftModel.save wrote (with config.json), found {folder!r}"
                         + ("" if os.path.isdir(folder) else ", which does not exist"))
    with open(path) as file:
        config = json.load(file)
    if "representations" not in config or "sorted_keys" not in config:
        raise ValueError(f"{argument}: {path} is no saved ReFT's config (it lacks representations and sorted_keys)")
    return config


def saved_settings(folder: str) -> dict:
    """The folder's ``train_settings.json``, or ``{}`` where it has none."""
    path = os.path.join(folder, SETTINGS)
    if not os.path.isfile(path):
        return {}
    with open(path) as file:
        return json.load(file)


def representation(config: dict, index: int) -> dict:
    """The saved representation ``index`` by field name (pyvene saves each as a list, in
    ``RepresentationConfig``'s field order)."""
    saved = config["representations"][index]
    return dict(zip(RepresentationConfig._fields, saved)) if isinstance(saved, list) else dict(saved)


def saved_state(folder: str, key: str) -> dict:
    """The weights saved for intervention ``key`` (``intkey_<key>.bin``), or ``{}`` where it has none."""
    path = os.path.join(folder, f"intkey_{key}.bin")
    return read_saved(path) if os.path.isfile(path) else {}


def load_folder(folder: str, model: nn.Module, config: dict, argument: str = "folder"):
    """``pyreft.ReftModel.load(folder, model)``, the path docs/examples/serve_reft.py takes; for NoReFT and
    NodiReFT, which it cannot rebuild (``KeyError: 'add_bias'``: pyvene saves no constructor argument beyond
    the representation), the same interventions built with ``add_bias`` read from the saved weights (a
    ``proj_layer.bias`` or none), in the dtype saved, and loaded with ``load_intervention``."""
    pyreft = import_pyreft("pyvene_dist reads ReFT folders")

    types = [get_type_from_string(name) for name in config["intervention_types"]]
    if not any(kind.__name__ in NEED_ADD_BIAS for kind in types):
        return pyreft.ReftModel.load(folder, model)
    representations = []
    for index, (key, kind) in enumerate(zip(config["sorted_keys"], types)):
        fields = representation(config, index)
        state = saved_state(folder, key)
        dtypes = [tensor.dtype for tensor in state.values() if torch.is_floating_point(tensor)]
        width = get_dimension_by_component(get_internal_model_type(model), model.config, fields["component"])
        built = {**fields, "embed_dim": width * int(fields["max_number_of_units"]), "use_fast": False,
                 "add_bias": any(name.endswith("proj_layer.bias") for name in state),
                 **({"dtype": dtypes[0]} if dtypes else {})}
        kept = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension")
        representations.append({name: fields[name] for name in kept} | {"intervention": kind(**built)})
    reft_model = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations), set_device=False)
    if list(reft_model.interventions) != list(config["sorted_keys"]):
        raise ValueError(f"{argument} {folder}: its interventions {config['sorted_keys']} were rebuilt as "
                         f"{list(reft_model.interventions)}")
    reft_model.load_intervention(folder, include_model=False)
    return reft_model


def location_count_problem(first: int, last: int, share_weights: bool, interventions: int) -> str | None:
    """Why pyreft's locations for these positions would not pair with ``interventions``, or None (a format
    string of ``folder``, ``positions`` and ``share_weights``)."""
    if first and last and not share_weights and interventions % 2:
        return ("positions: {positions!r} with share_weights={share_weights} gives the first and the last "
                f"positions their own interventions (an even number), but {{folder}} holds {interventions}; "
                "pass share_weights=True if training shared them")
    return None
