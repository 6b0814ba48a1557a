"""``ReftModel.save`` writes what one device loads; ``ReftModel.load`` restores every weight exactly, in the dtype
it was saved in.

- ``ReftModel.load(folder, model)`` (pyvene's ``IntervenableModel.load``) rebuilds each intervention from the saved
  config, which records no dtype, so LoReFT's ``learned_source`` comes back in pyreft's default, bfloat16, whatever
  it was saved in: on a float32 model the first forward fails with ``RuntimeError: mat1 and mat2 must have the same
  dtype, but got Float and BFloat16``, and float32 weights are rounded to bfloat16 silently. LoReFT's rotation came
  back only to rounding (its parametrization is rebuilt from the saved rotation). ``save`` now also writes
  ``intervention_states.pt`` (the weights whole), and ``load`` restores every parameter in the dtype it was saved
  in, from that file (exact) or, for folders without it, from pyreft's files. Interventions saved in one dtype
  onto a base model of another (FSDP2's float32 master weights under ``--bf16``, served in bf16) compute in their
  saved dtype (``mechanisms.own_dtype``), as they did in training (``fixes.fsdp``).
- ``save`` gathered nothing: under ZeRO-3 it wrote the interventions' empty partitions, from every rank, and a
  trainable base weight (``include_model``) as this rank's partition or ``DTensor`` shard. It now gathers like
  ``save_intervention`` and rank 0 writes (``mechanisms.base_weights``); ``load(..., include_model=True)`` loads into a
  partitioned or sharded base too.
- ``save`` wrote pyvene's ``intkey_*.bin`` with each intervention's tensors as held: a folder saved on a GPU held
  CUDA tensors, which pyvene's ``load`` (``torch.load`` without ``map_location``) cannot read on a machine without
  one. Every file it writes now holds CPU copies; with ``save_to_hf_hub=True`` those files are what is uploaded.
- ``load`` reads every file with ``weights_only=True`` first; an unreadable one raises
  ``UnreadableCheckpointError`` naming it (``mechanisms.saved_files``), before the user's model is touched.

After this load, ``fixes.deepspeed`` gives the interventions a ZeRO-3 half-precision partition's dtype again and
``fixes.orthogonal`` adopts LoReFT's rotations, each by its own wrap of ``load`` outside this one.

Wraps ``pyvene.models.intervenable_base.IntervenableModel.save`` and ``load``.
"""

from __future__ import annotations

import os

import torch
from huggingface_hub import HfApi, snapshot_download
from pyvene.models.intervenable_base import IntervenableModel
from torch import nn

from ..._records import Fix, Site
from ...gather import gathered, is_main_process
from ...mechanisms.arguments import bound
from ...mechanisms.base_weights import (loaded_base_weights, load_base_weights, read_model_file, trainable_base_weights,
                                        whole_copies)
from ...mechanisms.own_dtype import compute_in_own_dtype, floating_dtype
from ...mechanisms.saved_files import MODEL_FILE, SAVED_STATES_FILE, check_readable, cpu_copies, device_of, read_saved



def _wrap_save(wrapped, instance, args, kwargs):
    arguments = bound(wrapped, args, kwargs).arguments
    save_directory, include_model = arguments["save_directory"], arguments["include_model"]
    base = trainable_base_weights(instance) if include_model else {}
    with gathered(instance, base=base):  # whole inside, for pyvene's reads and the exact states
        weights = whole_copies(base)
        if is_main_process():  # the other ranks hold the same
            wrapped(save_directory, False, arguments["hf_repo_name"], include_model=False)  # its config; uploads below
            files = {name: cpu_copies(instance.interventions[key].state_dict())  # pyvene wrote them as held: on a
                     for key in instance.interventions  # GPU CUDA tensors, which a CPU machine could not load
                     if os.path.exists(os.path.join(save_directory, name := f"intkey_{key}.bin"))}
            files[SAVED_STATES_FILE] = cpu_copies(instance.interventions.state_dict())
            if include_model:  # pyvene wrote each parameter as held here: a ZeRO-3 or FSDP2 shard
                files[MODEL_FILE] = weights
            for name, content in files.items():
                torch.save(content, os.path.join(save_directory, name))
            if arguments["save_to_hf_hub"]:
                _upload(save_directory, [*files, "config.json"], arguments["hf_repo_name"])


def _upload(directory: str, names: list[str], repo: str) -> None:
    """What ``save(..., save_to_hf_hub=True)`` uploads: the files written, into ``repo`` (made if it is not there,
    as pyvene does)."""
    api = HfApi()
    api.create_repo(repo, exist_ok=True)
    for name in names:
        api.upload_file(path_or_fileobj=os.path.join(directory, name), path_in_repo=name, repo_id=repo,
                        repo_type="model")


def _wrap_load(wrapped, instance, args, kwargs):
    arguments = bound(wrapped, args, kwargs).arguments
    load_directory, local_directory = arguments["load_directory"], arguments["local_directory"]
    if arguments["from_huggingface_hub"] or not os.path.exists(load_directory):  # as pyvene does: the folder
        load_directory = snapshot_download(repo_id=load_directory, local_dir=local_directory)  # is known here
    check_readable(load_directory)
    loaded = wrapped(load_directory, arguments["model"], local_directory=local_directory, include_model=False)
    _restore_as_saved(loaded, load_directory)
    hidden = floating_dtype(loaded.model)
    if hidden is not None:  # float32 interventions (FSDP2's master weights under --bf16) onto a bf16 base
        compute_in_own_dtype(loaded, hidden)
    if arguments["include_model"]:  # also into a base that ZeRO-3 partitions (zero.Init) or FSDP2 shards
        saved = read_model_file(load_directory)
        base = loaded_base_weights(loaded, saved)
        with gathered(loaded, modify=True, base=base):
            load_base_weights(loaded, saved, base)
    return loaded


def _restore_as_saved(model, directory: str) -> None:
    """Every intervention's parameters in the dtype and with the values they were saved with: from
    ``intervention_states.pt`` where ``save`` wrote it, else from each intervention's own file, read
    again where pyvene had loaded it into another dtype. (A base model that ZeRO-3 partitioned in bf16 or fp16
    then gives them its dtype again: ``fixes.deepspeed``'s own wrap of ``load``, outside this one.)"""
    states_file = os.path.join(directory, SAVED_STATES_FILE)
    if os.path.exists(states_file):
        state = read_saved(states_file)
        _take_saved_dtypes(model.interventions, state)
        model.interventions.load_state_dict(state)
    else:
        for key, intervention in model.interventions.items():
            path = os.path.join(directory, f"intkey_{key}.bin")
            if not os.path.exists(path):
                continue
            state = read_saved(path, map_location=device_of(intervention))
            if _take_saved_dtypes(intervention, _module_names(state)):
                intervention.load_state_dict(state)


def _module_names(state: dict) -> dict:
    """A saved intervention state under ``nn.Module``'s names: pyreft's compact LoReFT form holds
    ``learned_source``'s entries and the rotation (in its parametrization's dtype) as ``rotate_layer``."""
    if not isinstance(state.get("rotate_layer"), torch.Tensor):
        return state
    names = {f"learned_source.{key}": value for key, value in state.items() if key != "rotate_layer"}
    names["rotate_layer.parametrizations.weight.original"] = state["rotate_layer"]
    return names


def _take_saved_dtypes(module: nn.Module, state: dict) -> bool:
    """Give each floating-point parameter and buffer of ``module`` that ``state`` holds the saved dtype, in
    place (the same ``Parameter`` objects); whether any changed."""
    changed = False
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        saved = state.get(name)
        if isinstance(saved, torch.Tensor) and saved.is_floating_point() and tensor.is_floating_point() \
                and saved.dtype != tensor.dtype:
            tensor.data = tensor.data.to(saved.dtype)
            changed = True
    return changed


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "save"), _wrap_save),
        Site((IntervenableModel, "load"), _wrap_load),
    ),
    upstream=("pyvene",),
)
