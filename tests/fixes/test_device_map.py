"""device_map: interventions on the device of the module they hook; CPU and disk offload on CPU, a
two-GPU split on GPUs; training and greedy generation equal to the plain model."""

import pytest
import torch

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.models import reft_model, tiny_llama

LAYERS = 4
OFFLOAD_MAP = {
    "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
    "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
}
SPLIT_MAP = {
    "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1, "model.layers.3": 1,
    "model.norm": 1, "model.rotary_emb": 0, "lm_head": 1,
}


def dispatched(device_map, tmp_path, main_device):
    from accelerate import dispatch_model

    model = tiny_llama(layers=LAYERS)
    return dispatch_model(model, device_map, main_device=main_device, offload_dir=str(tmp_path / "offload"))


def train_steps(model, device, steps=3):
    optimizer = torch.optim.Adam(model.get_trainable_parameters(), lr=1e-2)
    losses = []
    for batch in ParityCase(steps=steps).batches():
        _, out = model({"input_ids": batch["input_ids"].to(device)},
                       unit_locations={"sources->base": (None, batch["locations"][:2].tolist())},
                       labels=batch["labels"].to(device))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.interventions.state_dict().items()}


def generate(model, device, every_token):
    """Greedy; the interventions act on the prompt's last position, or (every_token) on each new token."""
    prompt = {"input_ids": torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3)).to(device)}
    locations = None if every_token else {"sources->base": (None, [[[5]] * 2] * 2)}
    _, out = model.generate(prompt, unit_locations=locations, intervene_on_prompt=not every_token,
                            max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out.cpu()


def check_against_plain(split_model, device, component="block_output"):
    plain = reft_model(tiny_llama(layers=LAYERS), layers=(1, 3), component=component)
    split = reft_model(split_model, layers=(1, 3), component=component)
    expected_losses, expected_state = train_steps(plain, "cpu")
    losses, state = train_steps(split, device)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for every_token in (False, True):
        assert torch.equal(generate(split, device, every_token), generate(plain, "cpu", every_token)), every_token
    return split


@pytest.mark.parametrize("component", ["block_output", "mlp_output"])
def test_cpu_and_disk_offload_train_and_generate_like_the_plain_model(patched, tmp_path, component):
    split = check_against_plain(dispatched(OFFLOAD_MAP, tmp_path, "cpu"), "cpu", component)
    assert {str(p.device) for p in split.interventions.parameters()} == {"cpu"}


def test_interventions_sit_on_their_modules_devices_and_the_model_stays(patched, tmp_path):
    model = reft_model(dispatched(OFFLOAD_MAP, tmp_path, "cpu"), layers=(1, 3))
    offloaded = [p for p in model.model.parameters() if p.device.type == "meta"]
    assert offloaded  # set_device did not try to move the offloaded layers
    assert model.hf_device_map == OFFLOAD_MAP


@pytest.mark.gpus(2)
def test_two_gpu_split_trains_and_generates_like_one_device(patched, tmp_path):
    split = check_against_plain(dispatched(SPLIT_MAP, tmp_path, "cuda:0"), "cuda:0")
    placed = {key: str(next(intervention.parameters()).device) for key, intervention in split.interventions.items()}
    print("intervention placement:", placed)
    assert sorted(placed.values()) == ["cuda:0", "cuda:1"]


@pytest.mark.gpus(2)
def test_hf_trainer_treats_a_split_model_as_model_parallel(patched, tmp_path):
    import pyreft
    from transformers import TrainingArguments

    model = reft_model(dispatched(SPLIT_MAP, tmp_path, "cuda:0"), layers=(1, 3))
    trainer = pyreft.ReftTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[]))
    assert trainer.is_model_parallel and trainer.args.n_gpu == 1  # no nn.DataParallel on top
