"""Interventions saved in half precision reload on the CPU, exactly, and every save writes CPU tensors
(fixes.checkpoints.saved_dtypes; the compact rotation's own load is test_loreft_load's).

DeepSpeed's bf16 mode casts the interventions' parameters to bf16 (``fixes.deepspeed``), LoReFT's rotation included,
and ``ReftModel.load`` of such a folder on the CPU failed in the LoReFT ``load_state_dict`` of the ``loreft_load`` fix:
``rotate_layer.weight = rotation`` runs the orthogonal map's ``right_inverse``, a QR decomposition, and
``NotImplementedError: "geqrf_cpu" not implemented for 'BFloat16'``.
"""

import pytest
import torch

from pyvene_dist.testing import models

#: pyreft's intervention classes: LoReFT loads its compact form through ``right_inverse``; the others load
#: ``nn.Module``'s entries (Lobireft, Direft and Consreft hold an orthogonal rotation too). Noreft and Nodireft do
#: not reload through pyvene at all, in any dtype: their constructor needs ``add_bias``, which pyvene's config does
#: not keep (``KeyError: 'add_bias'``).
INTERVENTIONS = ["LoreftIntervention", "ConsreftIntervention", "LobireftIntervention", "DireftIntervention"]
IDS = torch.randint(models.VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))


def as_deepspeed_bf16_leaves_it(reft_model):
    """Every intervention parameter in bf16, as ``fixes.deepspeed`` casts them under a bf16 ZeRO-3 base (the
    parameters only: the rotation's float32 ``base`` buffer stays), after a step's worth of change."""
    with torch.no_grad():
        for parameter in reft_model.interventions.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 1e-2)
            parameter.data = parameter.data.to(torch.bfloat16)
    return reft_model


def answer(reft_model):
    with torch.no_grad():
        return reft_model({"input_ids": IDS}, unit_locations={"base": 3})[1].logits


def rotations(reft_model):
    return {key: intervention.rotate_layer.weight for key, intervention in reft_model.interventions.items()
            if hasattr(intervention, "rotate_layer")}


@pytest.mark.parametrize("states_file", [True, False], ids=["save", "pyrefts-files-only"])
@pytest.mark.parametrize("intervention", INTERVENTIONS)
def test_bf16_interventions_reload_exactly_on_the_cpu(patched, tmp_path, intervention, states_file):
    """``ReftModel.load`` of a folder whose interventions were saved in bf16 answers as the saved model, bit for bit,
    each weight in bf16; also from pyreft's files alone (a folder stock pyreft saved: the rotation from its compact
    form, whose QR now runs in float32)."""
    import pyreft

    trained = as_deepspeed_bf16_leaves_it(models.reft_model(models.tiny_llama(dtype=torch.bfloat16), rank=2,
                                                            intervention=intervention, dtype=torch.bfloat16))
    trained.save(str(tmp_path))
    if not states_file:
        (tmp_path / "intervention_states.pt").unlink()
    loaded = pyreft.ReftModel.load(str(tmp_path), models.tiny_llama(dtype=torch.bfloat16))
    assert {name: p.dtype for name, p in loaded.interventions.named_parameters()} == \
        {name: torch.bfloat16 for name, _ in trained.interventions.named_parameters()}
    expected, found = rotations(trained), rotations(loaded)
    for key, rotation in expected.items():
        torch.testing.assert_close(found[key], rotation, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(answer(loaded), answer(trained), rtol=0, atol=0)


class Elsewhere(torch.Tensor):
    """A tensor held off the CPU as far as saving can tell (a CUDA tensor, on a machine without one): it stays
    this class through ``detach``, ``clone``, views and arithmetic, and ``.cpu()`` or ``.to("cpu")`` alone gives a
    plain CPU tensor. Written as held, ``torch.save`` stores this class, which ``torch.load`` (weights only, no
    ``map_location``) refuses, as a CPU machine refuses a CUDA tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = super().__torch_function__(func, types, args, kwargs)
        leaving = func is torch.Tensor.cpu or (func is torch.Tensor.to and torch.device("cpu") in [
            *(a for a in args[1:] if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"),
            *([torch.device(kwargs["device"])] if "device" in kwargs else [])])
        return result.as_subclass(torch.Tensor) if leaving and isinstance(result, torch.Tensor) else result

    def __deepcopy__(self, memo):  # pyvene's save deep-copies its config, which holds the interventions
        copied = self.detach().clone()
        if isinstance(self, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=self.requires_grad)
        memo[id(self)] = copied
        return copied


def held_elsewhere(reft_model):
    for module in reft_model.interventions.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None:
                module._parameters[name] = torch.nn.Parameter(parameter.data.as_subclass(Elsewhere),
                                                              requires_grad=parameter.requires_grad)
    return reft_model


def every_tensor_loaded(folder):
    """(file, name, tensor) for every tensor in every file of ``folder``, read with ``torch.load`` as pyvene reads
    them: no ``map_location``."""
    for path in sorted(folder.iterdir()):
        if path.suffix in (".bin", ".pt"):
            for name, value in torch.load(path, weights_only=True).items():
                yield path.name, name, value


SAVES = {
    "save": lambda model, folder: model.save(str(folder)),
    "save-include-model": lambda model, folder: model.save(str(folder), include_model=True),
    "save_intervention": lambda model, folder: model.save_intervention(str(folder)),
}


@pytest.mark.parametrize("save", SAVES)
def test_saved_tensors_are_cpu_tensors(patched, tmp_path, save):
    """Every file a save writes holds plain CPU tensors, whatever device the weights are on: ``save`` wrote
    pyvene's ``intkey_*.bin`` as held (a folder saved on a GPU held CUDA tensors)."""
    reft_model = held_elsewhere(models.reft_model(models.tiny_llama(), rank=2))
    reft_model.model.lm_head.weight.requires_grad_(True)  # a trained head: include_model writes it
    assert isinstance(next(reft_model.interventions.parameters()), Elsewhere)
    SAVES[save](reft_model, tmp_path)
    found = list(every_tensor_loaded(tmp_path))
    assert {file for file, _, _ in found} >= {"intkey_layer_0_comp_block_output_unit_pos_nunit_1#0.bin"}
    for file, name, value in found:
        assert type(value) is torch.Tensor and value.device == torch.device("cpu"), (file, name, type(value))


def test_float32_interventions_serve_on_a_bf16_base(patched, tmp_path):
    """A folder of float32 interventions (what FSDP2 under accelerate's ``--bf16`` saves: its master weights) loaded
    onto a bf16 base answers: each intervention computes in float32, the hidden states cast to it and back (pyreft's
    LoReFT met them as given: ``mat1 and mat2 must have the same dtype, but got BFloat16 and Float``). Its answer is
    the float32 model's to bf16's rounding; the weights stay float32."""
    import pyreft

    trained = as_deepspeed_bf16_leaves_it(models.reft_model(models.tiny_llama(), rank=2))
    for parameter in trained.interventions.parameters():
        parameter.data = parameter.data.float()
    trained.save(str(tmp_path))
    loaded = pyreft.ReftModel.load(str(tmp_path), models.tiny_llama(dtype=torch.bfloat16))
    assert {p.dtype for p in loaded.interventions.parameters()} == {torch.float32}
    found, expected = answer(loaded), answer(trained)
    assert found.dtype == torch.bfloat16
    torch.testing.assert_close(found.float(), expected, rtol=2 ** -6, atol=2 ** -6 * expected.abs().max().item())
