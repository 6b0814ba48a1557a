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

What they share: the files' names and the one reader that names an unreadable file (``_files``), and the whole
trainable base weights that ``include_model`` writes (``_base_weights``).
"""

from ._files import (INTERVENTIONS_DIR, MODEL_FILE, SAVED_STATES_FILE, STATES_FILE, UnreadableCheckpointError,
                     read_saved)

__all__ = ("INTERVENTIONS_DIR", "MODEL_FILE", "SAVED_STATES_FILE", "STATES_FILE", "UnreadableCheckpointError",
           "read_saved")
