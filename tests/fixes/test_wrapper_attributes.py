"""The wrapper answers what HF Trainer asks of the model it wraps (fixes.wrapper_attributes): its
gradient checkpointing switch."""

import warnings

from pyvene_dist.testing import ParityCase, assert_parity

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.2x renames gradient_* to activation_*


def test_hf_trainer_gradient_checkpointing_matches_training_without(patched, tmp_path):
    from transformers import TrainingArguments

    from pyvene_dist.testing.hf import train_with_trainer

    flag = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else \
        "gradient_checkpointing"
    case = ParityCase(component="mlp_output")
    plain = train_with_trainer(case, str(tmp_path / "plain"))
    checkpointed = train_with_trainer(case, str(tmp_path / "checkpointed"), **{flag: True})
    assert_parity(plain, checkpointed, case.tolerance)
