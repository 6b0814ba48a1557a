"""Save once with whole weights, load onto the right device into the existing parameters, resume exactly.

What fails today:

- ``LoreftIntervention.state_dict`` returns pyreft's compact form (``weight``, ``bias``, and the rotation
  as ``rotate_layer``) even when a parent module asks for its part of a state dict: the parent ignores
  the returned dict, so ``reft_model.state_dict()`` silently lacks every LoReFT weight (HF Trainer,
  accelerate and FSDP checkpoints included). When nested, it now gives ``nn.Module``'s entries; called
  on its own (as pyvene's ``save_intervention`` does) it keeps pyreft's file format, the rotation read
  without calling its parametrization as a module where the rotation is whole here: ZeRO-3's module
  hooks run on that call, and on rank 0 alone (``if rank == 0: reft_model.save(...)``) they left the
  ranks out of step, so the next collective hung.
- ``LoreftIntervention.load_state_dict`` builds a new rotation layer, so an optimizer (or DDP, FSDP,
  DeepSpeed) keeps updating the old parameters. It now copies into the existing ones: the rotation
  through the parametrization's ``right_inverse``, in float32 where it was saved in half precision
  (torch's QR has no bf16 kernel on the CPU: a folder saved under DeepSpeed's bf16 mode failed to load
  there with ``NotImplementedError: "geqrf_cpu" not implemented for 'BFloat16'``), and exactly: the
  reloaded weight is the saved rotation bit for bit (``load_rotation``); the rest in place.
- ``IntervenableModel.load_intervention`` loads with ``map_location='cuda:0'``: on a CPU machine
  ``RuntimeError: Attempting to deserialize object on a CUDA device``, on rank 1 a copy on the wrong
  GPU. It now loads onto each intervention's own device.
- ``ReftModel.load(folder, model)`` (pyvene's ``IntervenableModel.load``) rebuilds each intervention from
  the saved config, which records no dtype, so LoReFT's ``learned_source`` comes back in pyreft's default,
  bfloat16, whatever it was saved in: on a float32 model the first forward fails with ``RuntimeError:
  mat1 and mat2 must have the same dtype, but got Float and BFloat16``, and float32 weights are rounded
  to bfloat16 silently. LoReFT's rotation came back only to rounding (its parametrization is rebuilt
  from the saved rotation). ``save`` now also writes ``intervention_states.pt`` (the weights whole, see
  below), and ``load`` restores every parameter in the dtype it was saved in,
  from that file (exact) or, for folders without it, from pyreft's files. A base model ZeRO-3 partitioned
  in bf16 or fp16 under ``zero.Init`` gives the interventions its dtype (``fixes.deepspeed``), as
  DeepSpeed needs; one partitioned in float32 does not. (Any partitioned base used to keep pyvene's
  rebuild: pyreft's multi-GPU example reloads after training under ZeRO-3, where HF's ``from_pretrained``
  partitions the new base in float32 while the ZeRO-3 ``TrainingArguments`` lives, and got bfloat16.)
  ``load_intervention`` loads into existing parameters and keeps their dtypes, as ``load_state_dict`` does.
- Resuming HF Trainer from a ``ReftTrainer`` checkpoint fails with ``ValueError: Can't find a valid
  checkpoint at .../checkpoint-N`` (pyreft writes ``intervenable_model/`` there, HF Trainer looks for
  ``model.safetensors``). It now loads ``intervenable_model/``. Since pyreft's compact form stores the
  rotation and not the parametrization's ``original`` that the optimizer's state refers to,
  ``save_intervention`` also writes ``intervention_states.bin`` (every intervention's ``nn.Module``
  state), which ``load_intervention`` prefers: the resumed run then continues exactly.
- ``ReftTrainer.save_model`` saves on rank 0 only, which is right for whole weights and deadlocks for
  partitioned ones (ZeRO-3). Every rank now calls ``save_intervention``, which gathers what is
  partitioned (``pyvene_dist.gather``) and writes on rank 0. ``ReftTrainerForCausalLMDistributed``
  overrides ``save_model`` to call it on rank 0 alone, which then waits forever for the other ranks; it
  now calls it on every rank too. ``ReftTrainer.save_model`` (and ``_load_best_model``) called
  ``save_intervention`` on ``trainer.model``: pyreft's multi-GPU example hands the trainer a
  ``DistributedDataParallel`` wrapper, and the first checkpoint failed with ``AttributeError:
  'DistributedDataParallel' object has no attribute 'save_intervention'``. They now reach the pyvene
  model inside whatever wraps it.
- A base weight trained beside the interventions (a head: pyreft's GLUE example with
  ``--allow_cls_grad``, a reward model's ``score``) is what ``include_model`` writes to
  ``pytorch_model.bin`` (``save_intervention``'s default, ``save(include_model=True)``). It was written
  as this rank holds it: under ZeRO-3 the empty partition, under FSDP2 a ``DTensor`` shard, and one
  device failed to load it (``RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: size
  mismatch for lm_head.weight: copying a param with shape torch.Size([0]) from checkpoint``, or
  ``aten.copy_.default got mixed torch.Tensor and DTensor``); a whole saved weight did not load into a
  partitioned or sharded model either. Each is now gathered whole once (ZeRO-3: with the interventions;
  a ``DTensor``: all-gathered), every rank taking part, and rank 0 writes it; a load copies the whole
  value into the gathered partition (ZeRO's fp32 master weights too) or cuts each rank's shard from it.
  ``save`` (pyreft's ``ReftModel.save``) gathered nothing: under ZeRO-3 it also wrote the interventions'
  empty partitions, from every rank. It now gathers like ``save_intervention`` and rank 0 writes;
  ``load(..., include_model=True)`` loads into a partitioned base too.
- ``save`` wrote pyvene's ``intkey_*.bin`` with each intervention's tensors as held: a folder saved on a GPU
  held CUDA tensors, which pyvene's ``load`` (``torch.load`` without ``map_location``) cannot read on a
  machine without one. Every file it writes now holds CPU copies (``save_intervention`` wrote them so
  already); with ``save_to_hf_hub=True`` those files are what is uploaded.
- ``ReftModel.load`` hands the loaded interventions to a new ``ReftModel`` and drops the model pyvene's
  ``load`` built, whose state gave LoReFT's rotations ``fixes.orthogonal``'s forward: they went back to
  torch's, which has no half-precision kernel on the CPU (``"orgqr_cpu" not implemented for 'BFloat16'``
  at the first forward of a bf16 folder). ``load`` adopts them on their own. Interventions saved in one
  dtype onto a base model of another (FSDP2's float32 master weights under ``--bf16``, served in bf16)
  compute in their saved dtype (``_compute_dtype``), as they did in training (``fixes.fsdp``).
- ``load`` and ``load_intervention`` of a folder with an empty or corrupt file (``intkey_*.bin``,
  ``pytorch_model.bin``, the states file) failed with a bare ``EOFError``, or with torch's advice to retry
  with ``weights_only=False``, which would run whatever code the file holds. Every file is read with
  ``weights_only=True`` first, and one that cannot be read raises ``UnreadableCheckpointError``, naming the
  file, what it holds and what to do.

Checked on pyvene 0.1.8 and pyreft 0.1.0 with transformers 5.17 and 5.24.
"""

from __future__ import annotations

import collections
import os
import pickle

import torch
from torch import nn

from .._records import Fix, Site
from ._compute_dtype import compute_in_own_dtype, floating_dtype

PYVENE = "pyvene.models.intervenable_base"
PYREFT = "pyreft"
TRANSFORMERS = "transformers.trainer"
FIX = Fix(
    __name__,
    sites=(
        Site(f"{PYVENE}:IntervenableModel.save_intervention", "_wrap_save_intervention", kind="replace"),
        Site(f"{PYVENE}:IntervenableModel.load_intervention", "_wrap_load_intervention", kind="replace"),
        Site(f"{PYVENE}:IntervenableModel.save", "_wrap_save"),
        Site(f"{PYVENE}:IntervenableModel.load", "_wrap_load"),
        Site("pyreft.interventions:LoreftIntervention.state_dict", "_wrap_loreft_state_dict"),
        Site("pyreft.interventions:LoreftIntervention.load_state_dict", "_wrap_loreft_load_state_dict",
             kind="replace"),
        Site("pyreft.reft_trainer:ReftTrainer.save_model", "_wrap_save_model", kind="replace"),
        Site("pyreft.reft_trainer:ReftTrainerForCausalLMDistributed.save_model", "_wrap_save_model_on_every_rank",
             kind="replace"),
        Site("pyreft.reft_trainer:ReftTrainer._load_best_model", "_wrap_load_best_model"),
        Site(f"{TRANSFORMERS}:Trainer._load_from_checkpoint", "_wrap_load_from_checkpoint"),
    ),
    # orthogonal: its rotations adopted again after a load (see _wrap_load), its state kept coherent.
    after=("orthogonal",),
    upstream=("pyvene", "pyreft"),
)
#: Written by ``save_intervention`` beside pyreft's files: the exact state of every intervention.
STATES_FILE = "intervention_states.bin"
#: The same, written by ``save`` beside pyvene's files (not a ``.bin``: pyvene's own tests count those).
SAVED_STATES_FILE = "intervention_states.pt"
#: pyvene's file of the base model's trainable weights (``include_model``), each whole.
MODEL_FILE = "pytorch_model.bin"
INTERVENTIONS_DIR = "intervenable_model"


class UnreadableCheckpointError(ValueError):
    """A saved file that ``torch.load(..., weights_only=True)`` cannot read."""


def read_saved(path: str, map_location="cpu") -> dict:
    """``torch.load(path, weights_only=True)``, or an ``UnreadableCheckpointError`` naming ``path``, what it holds
    and what to do: never torch's advice to load it with ``weights_only=False``, which runs the file's own code."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except (EOFError, RuntimeError, ValueError, OSError, pickle.UnpicklingError) as error:
        size = os.path.getsize(path)
        if size == 0:
            found = "it is empty (0 bytes)"
        elif isinstance(error, EOFError):
            found = f"it is cut short ({size} bytes)"
        else:
            found = f"its {size} bytes are not a state dict torch.save wrote"
        raise UnreadableCheckpointError(
            f"{path} cannot be read: {found} ({type(error).__name__}); expected a state dict that ReftModel.save or "
            "save_intervention wrote, read with weights_only=True. Save the interventions again (or copy the "
            "folder again, if a transfer cut it short)") from None


def _check_readable(directory: str) -> None:
    """Read the files pyvene's ``load`` reads with a bare ``torch.load`` (the ``intkey_*.bin``) before it does: an
    unreadable one is named here. The states file and the base model's file are read once, later, through
    ``read_saved``, which names them the same way (and before the user's model is touched)."""
    for name in sorted(name for name in os.listdir(directory) if name.startswith("intkey_") and name.endswith(".bin")):
        read_saved(os.path.join(directory, name))


# -- LoReFT's state ------------------------------------------------------------------------------


def _wrap_loreft_state_dict(wrapped, instance, args, kwargs):
    if args or kwargs:  # a parent module collecting its state: nn.Module's entries, into its destination
        return nn.Module.state_dict(instance, *args, **kwargs)
    from ..gather import whole_here

    if not whole_here(instance.rotate_layer.parametrizations.weight.original):
        return wrapped()  # partitioned here (ZeRO-3): pyreft's read, whose module call gathers the rotation
    state = collections.OrderedDict(instance.learned_source.state_dict())
    state["rotate_layer"] = rotation_without_hooks(instance.rotate_layer).data
    return state


def rotation_without_hooks(layer: nn.Module) -> torch.Tensor:
    """A parametrized layer's ``weight``, computed by each parametrization's own ``forward`` instead of a
    call of the module: a read fires no module hooks. ZeRO-3's hooks fetch and release parameters and
    count the calls, which every rank must make alike; a save on rank 0 alone would otherwise leave the
    ranks out of step, and their next collective would hang."""
    weights = layer.parametrizations.weight
    value = weights.original
    for parametrization in weights:
        value = type(parametrization).forward(parametrization, value)
    return value


def _wrap_loreft_load_state_dict(wrapped, instance, args, kwargs):
    state = args[0] if args else kwargs["state_dict"]
    if "rotate_layer" not in state:  # nn.Module's own form
        return nn.Module.load_state_dict(instance, *args, **kwargs)
    source = {key: value for key, value in state.items() if key != "rotate_layer"}
    instance.learned_source.load_state_dict(source)
    load_rotation(instance.rotate_layer, state["rotate_layer"])
    return None


#: Dtypes in which torch's QR (``geqrf``, behind the orthogonal map's ``right_inverse``) runs on every device.
_QR_DTYPES = (torch.float32, torch.float64)


@torch.no_grad()
def load_rotation(layer: nn.Module, rotation: torch.Tensor) -> None:
    """Give a layer whose ``weight`` is parametrized the saved ``rotation`` as that weight, written into the
    existing parameter (so optimizers and wrappers keep it), exactly.

    The value goes back through each parametrization's ``right_inverse``, as assigning ``layer.weight`` does. For
    the orthogonal map that is a QR decomposition, which has no half-precision kernel on the CPU: a rotation saved
    in bf16 (DeepSpeed's bf16 mode casts it) failed to load there with ``NotImplementedError: "geqrf_cpu" not
    implemented for 'BFloat16'``. It runs in float32 here, and the raw matrix it gives is copied into the
    parameter in the parameter's own dtype. The orthogonal map (with torch's default trivialization) completes the
    rotation into a square orthogonal ``base`` buffer by QR, whose first columns equal the rotation only to
    rounding; they are set to the saved values (as pyreft's own ``load_state_dict`` does), so that the layer's
    weight is the saved rotation bit for bit."""
    from torch.nn.utils.parametrizations import _Orthogonal

    weights = layer.parametrizations.weight
    original = weights.original
    value = rotation.to(original.device)
    value = value if value.dtype in _QR_DTYPES else value.float()
    saved = value
    for parametrization in reversed(weights):
        value = parametrization.right_inverse(value)
    original.copy_(value)
    if len(weights) == 1 and isinstance(weights[0], _Orthogonal) and getattr(weights[0], "base", None) is not None:
        tall = saved if saved.size(-2) >= saved.size(-1) else saved.mT
        weights[0].base[..., :tall.size(-1)] = tall.to(weights[0].base.dtype)


# -- saving and loading --------------------------------------------------------------------------


def _wrap_save_intervention(wrapped, instance, args, kwargs):
    from pyvene.models.interventions import TrainableIntervention

    from ..gather import gathered, is_main_process

    save_directory, include_model = _bind_directory(args, kwargs, default_include_model=True)
    base = trainable_base_weights(instance) if include_model else {}
    with gathered(instance, base=base):
        # The plain reads first: pyreft's compact form calls the rotation's parametrization, a module
        # call after which ZeRO-3 partitions its parameter again, gathered block or not.
        files = {STATES_FILE: _cpu(instance.interventions.state_dict())}
        files.update({
            f"intkey_{key}.bin": _cpu(intervention.state_dict())
            for key, intervention in instance.interventions.items()
            if isinstance(intervention, TrainableIntervention)
        })
        if include_model:
            files[MODEL_FILE] = _whole_copies(base)
    if is_main_process():
        os.makedirs(save_directory, exist_ok=True)
        for name, content in files.items():
            torch.save(content, os.path.join(save_directory, name))


def _wrap_load_intervention(wrapped, instance, args, kwargs):
    from pyvene.models.interventions import TrainableIntervention

    from ..gather import gathered

    load_directory, include_model = _bind_directory(args, kwargs, default_include_model=True)
    states_file = os.path.join(load_directory, STATES_FILE)
    saved_base = _read_model_file(load_directory) if include_model else {}
    base = _loaded_base_weights(instance, saved_base)
    with gathered(instance, modify=True, base=base):
        if os.path.exists(states_file):
            state = read_saved(states_file)
            instance.interventions.load_state_dict(state)
        else:
            for key, intervention in instance.interventions.items():
                if isinstance(intervention, TrainableIntervention):
                    path = os.path.join(load_directory, f"intkey_{key}.bin")
                    intervention.load_state_dict(read_saved(path, map_location=_device_of(intervention)))
        if include_model:
            _load_base_weights(instance, saved_base, base)


def trainable_base_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base model's trainable parameters (a head trained beside the interventions), by their names in
    its state dict: what ``include_model`` saves."""
    return {name: parameter for name, parameter in model.model.named_parameters() if parameter.requires_grad}


def _whole_copies(weights: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """CPU copies of ``weights``, each whole (inside ``gathered``; a ``DTensor``'s all-gather is a
    collective, which every rank enters, one weight at a time)."""
    from ..gather import whole

    return {name: whole(parameter).detach().cpu().clone() for name, parameter in weights.items()}


def _read_model_file(directory: str) -> dict[str, torch.Tensor]:
    return read_saved(os.path.join(directory, MODEL_FILE))


def _loaded_base_weights(model: nn.Module, saved: dict) -> dict[str, nn.Parameter]:
    """The base model's parameters that ``saved`` holds a value for: those to hold whole while loading."""
    return {name: parameter for name, parameter in model.model.named_parameters() if name in saved}


def _load_base_weights(model: nn.Module, saved: dict, parameters: dict[str, nn.Parameter]) -> None:
    """Load whole saved base weights into ``model``'s base as pyvene does (``strict=False``), inside
    ``gathered(..., base=parameters)``: a ZeRO-3 partition is whole there; each ``DTensor`` shard takes
    its own part of the whole value."""
    from ..gather import placed_like

    state = {name: placed_like(value, parameters[name]) if name in parameters else value
             for name, value in saved.items()}
    model.model.load_state_dict(state, strict=False)


def _wrap_save(wrapped, instance, args, kwargs):
    from ..gather import gathered, is_main_process

    save_directory, save_to_hf_hub, hf_repo_name, include_model = _save_arguments(*args, **kwargs)
    base = trainable_base_weights(instance) if include_model else {}
    with gathered(instance, base=base):  # whole inside, for pyvene's reads and the exact states
        weights = _whole_copies(base)
        if is_main_process():  # the other ranks hold the same
            wrapped(save_directory, False, hf_repo_name, include_model=False)  # its config; uploads below
            files = {name: _cpu(instance.interventions[key].state_dict())  # pyvene wrote them as held: on a GPU
                     for key in instance.interventions  # CUDA tensors, which a CPU machine could not load
                     if os.path.exists(os.path.join(save_directory, name := f"intkey_{key}.bin"))}
            files[SAVED_STATES_FILE] = _cpu(instance.interventions.state_dict())
            if include_model:  # pyvene wrote each parameter as held here: a ZeRO-3 or FSDP2 shard
                files[MODEL_FILE] = weights
            for name, content in files.items():
                torch.save(content, os.path.join(save_directory, name))
            if save_to_hf_hub:
                _upload(save_directory, [*files, "config.json"], hf_repo_name)


def _upload(directory: str, names: list[str], repo: str) -> None:
    """What ``save(..., save_to_hf_hub=True)`` uploads: the files written, into ``repo`` (made if it is not there,
    as pyvene does)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, exist_ok=True)
    for name in names:
        api.upload_file(path_or_fileobj=os.path.join(directory, name), path_in_repo=name, repo_id=repo,
                        repo_type="model")


def _save_arguments(save_directory, save_to_hf_hub=False, hf_repo_name="my-awesome-model", include_model=False):
    return save_directory, save_to_hf_hub, hf_repo_name, include_model


def _wrap_load(wrapped, instance, args, kwargs):
    from ..gather import gathered

    load_directory, model, local_directory, from_hub, include_model = _load_arguments(*args, **kwargs)
    if from_hub or not os.path.exists(load_directory):  # as pyvene does, so that the folder is known here
        from huggingface_hub import snapshot_download

        load_directory = snapshot_download(repo_id=load_directory, local_dir=local_directory)
    from . import orthogonal

    _check_readable(load_directory)
    loaded = wrapped(load_directory, model, local_directory=local_directory, include_model=False)
    # pyreft's ReftModel.load hands these interventions to a new ReftModel and drops this model, whose state
    # gave LoReFT's rotations fixes.orthogonal's forward: owned by themselves, they keep it (torch's own has no
    # half-precision kernel on the CPU: '"orgqr_cpu" not implemented for 'BFloat16'' at the first forward).
    orthogonal.adopt(loaded.interventions)
    _restore_as_saved(loaded, load_directory)
    hidden = floating_dtype(loaded.model)
    if hidden is not None:  # float32 interventions (FSDP2's master weights under --bf16) onto a bf16 base
        compute_in_own_dtype(loaded, hidden)
    if include_model:  # also into a base that ZeRO-3 partitions (zero.Init) or FSDP2 shards
        saved = _read_model_file(load_directory)
        base = _loaded_base_weights(loaded, saved)
        with gathered(loaded, modify=True, base=base):
            _load_base_weights(loaded, saved, base)
    return loaded


def _load_arguments(load_directory, model, local_directory=None, from_huggingface_hub=False, include_model=False):
    return load_directory, model, local_directory, from_huggingface_hub, include_model


def _restore_as_saved(model, directory: str) -> None:
    """Every intervention's parameters in the dtype and with the values they were saved with: from
    ``intervention_states.pt`` where ``save`` wrote it, else from each intervention's own file, read
    again where pyvene had loaded it into another dtype. A base model that ZeRO-3 partitioned in bf16 or
    fp16 (``zero.Init``) then gives the interventions its dtype, as DeepSpeed needs (``fixes.deepspeed``);
    one partitioned in float32 (HF's ``from_pretrained`` while a ZeRO-3 ``TrainingArguments`` lives) does not."""
    from .deepspeed import take_partitioned_dtype

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
            state = read_saved(path, map_location=_device_of(intervention))
            if _take_saved_dtypes(intervention, _module_names(state)):
                intervention.load_state_dict(state)
    take_partitioned_dtype(model)


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


def _wrap_save_model(wrapped, instance, args, kwargs):
    import torch.distributed as dist

    from ..gather import is_main_process
    from ._models import unwrap_intervenable_model

    output_dir = args[0] if args else kwargs.get("output_dir") or instance.args.output_dir
    target = os.path.join(output_dir, INTERVENTIONS_DIR)
    skip = [is_main_process() and os.path.isdir(target) and bool(os.listdir(target))]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(skip, src=0)  # every rank must agree: saving may gather
    if skip[0]:
        from transformers.utils import logging

        logging.get_logger(__name__).warning(f"{target} already holds files; not overwriting them (as pyreft)")
        return
    unwrap_intervenable_model(instance.model).save_intervention(save_directory=target, include_model=True)


def _wrap_save_model_on_every_rank(wrapped, instance, args, kwargs):
    from pyreft.reft_trainer import ReftTrainer

    return ReftTrainer.save_model(instance, *args, **kwargs)  # writes once, on rank 0, itself


def _wrap_load_best_model(wrapped, instance, args, kwargs):
    from transformers.utils import logging

    from ._models import unwrap_intervenable_model

    best = instance.state.best_model_checkpoint
    logging.get_logger(__name__).warning(f"Loading best model from {best} (score: {instance.state.best_metric}).")
    unwrap_intervenable_model(instance.model).load_intervention(os.path.join(best, INTERVENTIONS_DIR),
                                                               include_model=True)


def _wrap_load_from_checkpoint(wrapped, instance, args, kwargs):
    from ._models import holds_intervenable_model, unwrap_intervenable_model

    checkpoint = args[0] if args else kwargs["resume_from_checkpoint"]
    model = (args[1] if len(args) > 1 else kwargs.get("model")) or instance.model
    directory = os.path.join(checkpoint, INTERVENTIONS_DIR)
    if not (holds_intervenable_model(model) and os.path.isdir(directory)):
        return wrapped(*args, **kwargs)
    unwrap_intervenable_model(model).load_intervention(directory, include_model=True)
    return None


def _bind_directory(args, kwargs, *, default_include_model: bool):
    directory = args[0] if args else kwargs.get("save_directory", kwargs.get("load_directory"))
    include_model = args[1] if len(args) > 1 else kwargs.get("include_model", default_include_model)
    return directory, include_model


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _cpu(state: dict) -> dict:
    return {key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}
