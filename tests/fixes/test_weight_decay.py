"""HF Trainer decays ordinary intervention weights, and never a parametrization's original
(fixes.weight_decay)."""

import torch

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import train_with_trainer
from pyvene_dist.testing.models import reft_model, tiny_llama


def test_weight_decay_applies_to_intervention_weights_but_never_to_originals(patched, tmp_path):
    import pyreft
    from transformers import TrainingArguments

    model = reft_model(tiny_llama())
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    decayed = set(pyreft.ReftTrainer(model=model, args=args).get_decay_parameter_names(model))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    key = next(iter(model.interventions))
    assert f"interventions.{key}.learned_source.weight" in decayed
    assert f"interventions.{key}.learned_source.bias" not in decayed
    assert f"interventions.{key}.rotate_layer.parametrizations.weight.original" in trainable
    assert not any(name.endswith(".original") for name in decayed)


def test_rotation_stays_orthonormal_with_weight_decay(patched, tmp_path):
    record = train_with_trainer(ParityCase(steps=3, weight_decay=0.1), str(tmp_path))
    assert len(record.losses) == 3
    model_weights = record.weights
    originals = [name for name in model_weights if name.endswith("parametrizations.weight.original")]
    assert originals
    for name in originals:
        diagonal = torch.diagonal(model_weights[name])
        assert diagonal.abs().eq(1).all(), f"{name}: the sign diagonal was decayed to {diagonal}"
