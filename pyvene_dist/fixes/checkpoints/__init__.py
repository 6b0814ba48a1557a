"""Saving, loading and resuming: a group of fixes, one module per failure mode.

``checkpoints`` names them all wherever a fix name is taken (``patch(only=..., exclude=...)``, a package's
``FIXES``, ``PYVENE_DIST_TEST_WITHOUT``):

- ``loreft_state_dict``: LoReFT's weights in its parent's state dict (pyreft).
- ``loreft_load``: LoReFT loads into its existing parameters, exactly, on any device (pyreft).
- ``intervention_files``: ``save_intervention`` saves once with whole weights, ``load_intervention`` loads onto
  each intervention's own device, in place, exactly (pyvene).
- ``saved_dtypes``: ``ReftModel.save`` writes what one device loads, ``ReftModel.load`` restores every weight in
  the dtype it was saved in (pyvene).
- ``trainer_saves``: ``ReftTrainer`` saves on every rank, through whatever wraps the model (pyreft).
- ``hf_resume``: HF Trainer resumes from a ``ReftTrainer`` checkpoint, exactly (pyreft).
- ``fsdp_base_unsaved``: a checkpoint of an FSDP2 run does not gather the whole base to save it again (pyreft).
- ``zero3_base_unsaved``: a checkpoint of a DeepSpeed run does not write the ranks' parts of the frozen base (pyreft).

What they share is in ``mechanisms`` (never in the group, so that code outside it needs no fix module): the
files' names and the one reader that names an unreadable file (``mechanisms.saved_files``, whose names this package
re-exports as before), and the whole trainable base weights that ``include_model`` writes
(``mechanisms.base_weights``).
"""

from ...mechanisms.saved_files import (INTERVENTIONS_DIR, MODEL_FILE, SAVED_STATES_FILE, STATES_FILE,
                                       UnreadableCheckpointError, read_saved)
from . import (fsdp_base_unsaved, hf_resume, intervention_files, loreft_load, loreft_state_dict, saved_dtypes,
               trainer_saves, zero3_base_unsaved)

#: The group's fix modules (``fixes.GROUPS``; tests/test_fix_groups.py keeps it equal to the folder).
ALL = (fsdp_base_unsaved, hf_resume, intervention_files, loreft_load, loreft_state_dict, saved_dtypes, trainer_saves,
       zero3_base_unsaved)

__all__ = ("INTERVENTIONS_DIR", "MODEL_FILE", "SAVED_STATES_FILE", "STATES_FILE", "UnreadableCheckpointError",
           "read_saved")
