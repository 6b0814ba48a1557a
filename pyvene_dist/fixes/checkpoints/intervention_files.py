"""``save_intervention`` saves once with whole weights; ``load_intervention`` loads them onto each
intervention's own device, into the existing parameters, exactly.

- ``IntervenableModel.load_intervention`` loads with ``map_location='cuda:0'``: on a CPU machine ``RuntimeError:
  Attempting to deserialize object on a CUDA device``, on rank 1 a copy on the wrong GPU. It now loads onto each
  intervention's own device, into the existing parameters, keeping their dtypes (as ``load_state_dict`` does).
- ``save_intervention`` wrote what each rank holds, from every rank: under ZeRO-3 the interventions' empty
  partitions. Every rank now gathers what is partitioned (``pyvene_dist.gather``), every rank taking part, and
  rank 0 writes CPU copies (``_files``); a trainable base weight (``include_model``) is written whole
  (``_base_weights``).
- pyreft's compact form stores LoReFT's rotation, not the parametrization's ``original`` that an optimizer's state
  refers to, so a run resumed from it did not continue exactly. ``save_intervention`` also writes
  ``intervention_states.bin`` (every intervention's ``nn.Module`` state), which ``load_intervention`` prefers.
- Files are read with ``weights_only=True``; an unreadable one raises ``UnreadableCheckpointError`` naming it.

Replaces ``pyvene.models.intervenable_base.IntervenableModel.save_intervention`` and ``load_intervention``.
"""

from __future__ import annotations

import os

import torch
from pyvene.models.intervenable_base import IntervenableModel
from pyvene.models.interventions import TrainableIntervention

from ..._records import Fix, Site
from ...gather import gathered, is_main_process
from ...mechanisms.arguments import bound
from ...mechanisms.base_weights import (loaded_base_weights, load_base_weights, read_model_file, trainable_base_weights,
                                        whole_copies)
from ...mechanisms.saved_files import MODEL_FILE, STATES_FILE, cpu_copies, device_of, read_saved



def _wrap_save_intervention(wrapped, instance, args, kwargs):
    arguments = bound(wrapped, args, kwargs).arguments
    include_model = arguments["include_model"]
    base = trainable_base_weights(instance) if include_model else {}
    with gathered(instance, base=base):
        # The plain reads first: pyreft's compact form calls the rotation's parametrization, a module
        # call after which ZeRO-3 partitions its parameter again, gathered block or not.
        files = {STATES_FILE: cpu_copies(instance.interventions.state_dict())}
        files.update({
            f"intkey_{key}.bin": cpu_copies(intervention.state_dict())
            for key, intervention in instance.interventions.items()
            if isinstance(intervention, TrainableIntervention)
        })
        if include_model:
            files[MODEL_FILE] = whole_copies(base)
    if is_main_process():
        os.makedirs(arguments["save_directory"], exist_ok=True)
        for name, content in files.items():
            torch.save(content, os.path.join(arguments["save_directory"], name))


def _wrap_load_intervention(wrapped, instance, args, kwargs):
    arguments = bound(wrapped, args, kwargs).arguments
    load_directory, include_model = arguments["load_directory"], arguments["include_model"]
    states_file = os.path.join(load_directory, STATES_FILE)
    saved_base = read_model_file(load_directory) if include_model else {}
    base = loaded_base_weights(instance, saved_base)
    with gathered(instance, modify=True, base=base):
        if os.path.exists(states_file):
            instance.interventions.load_state_dict(read_saved(states_file))
        else:
            for key, intervention in instance.interventions.items():
                if isinstance(intervention, TrainableIntervention):
                    path = os.path.join(load_directory, f"intkey_{key}.bin")
                    intervention.load_state_dict(read_saved(path, map_location=device_of(intervention)))
        if include_model:
            load_base_weights(instance, saved_base, base)


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "save_intervention"), _wrap_save_intervention, kind="replace"),
        Site((IntervenableModel, "load_intervention"), _wrap_load_intervention, kind="replace"),
    ),
    upstream=("pyvene",),
)
