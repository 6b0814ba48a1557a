"""A checkpoint of an FSDP2 run of a pyvene model no longer gathers the whole base to save it again.

HF Trainer saves FSDP's own model checkpoint beside the others (``save_fsdp_model``, for its resume): with
``fsdp_state_dict_type`` FULL_STATE_DICT, accelerate's and the docs' default, every rank gathers every weight of
the model whole (``get_model_state_dict(full_state_dict=True)``) and rank 0 writes them all, the frozen base
included: each checkpoint of a model that no rank could hold whole needs it whole on rank 0, and writes again
what the model folder already holds. A ``ReftTrainer`` checkpoint holds what the run trains in its own folder
(``intervenable_model/``: the interventions, and any base weight trained beside them, which ``include_model``
writes), and HF Trainer resumes from that folder (``hf_resume``), so FSDP's copy is now left out where that folder
was written; the optimizer's checkpoint is written as before. A checkpoint without that folder (another trainer)
is saved as HF Trainer saves it.

Wraps ``accelerate.utils.fsdp_utils.save_fsdp_model`` where HF Trainer looks it up. Run on the CPU (FSDP2 over
gloo, accelerate 1.16, transformers 5.24).
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from ..._records import Fix, Site
from ...gather import is_main_process
from ...mechanisms.arguments import bound
from ...mechanisms.saved_files import INTERVENTIONS_DIR
from ...mechanisms.wrapped_models import holds_intervenable_model

log = logging.getLogger("pyvene_dist")


def _wrap_save_fsdp_model(wrapped, instance, args, kwargs):
    call = bound(wrapped, args, kwargs).arguments
    folder = os.path.join(call["output_dir"], INTERVENTIONS_DIR)
    written = [is_main_process() and os.path.isdir(folder)]  # rank 0 wrote it; the others may not see it yet
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(written, src=0)  # every rank must agree: the save gathers
    if not (holds_intervenable_model(call["model"]) and written[0]):
        return wrapped(*args, **kwargs)
    log.info(f"pyvene_dist: FSDP's model checkpoint left out of {call['output_dir']}: the trained weights are in "
             f"{folder}, and the base is the model folder's")
    return None


FIX = Fix(
    __name__,
    sites=(Site("accelerate.utils.fsdp_utils:save_fsdp_model", _wrap_save_fsdp_model,
                reexported_in=("accelerate.utils", "transformers.trainer")),),  # HF Trainer's own name for it
    # No requires or after: the wrap leaves FSDP's copy out only where intervenable_model/ is there (trainer_saves,
    # or pyreft carrying it, wrote it), and hf_resume (or pyreft) reads it back; it stacks on no other fix's site.
    upstream=(),  # runtime-only: HF Trainer, accelerate and DeepSpeed save a frozen base; docs/upstreaming.md
)
