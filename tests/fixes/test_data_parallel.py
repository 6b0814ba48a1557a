"""nn.DataParallel replicas: independent hooks and state, their own device, a batch-consistent scatter.

CPU part: replicas are made the way torch's ``replicate`` makes them (shallow module copies, weights as
plain tensors), then run in two threads that meet at a barrier after pyvene has registered its hooks,
which is when shared hook dicts let one replica's intervention fire in the other.
GPU part (2 GPUs): the real nn.DataParallel, raw and through HF Trainer, against one GPU.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pyvene_dist.testing import ParityCase, Record, Strategy, assert_parity, train
from pyvene_dist.testing.models import reft_model, tiny_llama
from pyvene_dist.testing.generators import forward_call

SCRIPTS = Path(__file__).parents[1] / "scripts"


def replicate_like_torch(network, copies):
    """torch.nn.parallel.replicate without the device broadcast (which needs CUDA)."""
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    replicas = [[module._replicate_for_data_parallel() for module in modules] for _ in range(copies)]
    for i, module in enumerate(modules):
        for tree in replicas:
            for key, child in module._modules.items():
                tree[i]._modules[key] = None if child is None else tree[index[child]]
            for key, parameter in module._parameters.items():
                setattr(tree[i], key, None if parameter is None else parameter.view_as(parameter))
            for key, buffer in module._buffers.items():
                tree[i]._buffers[key] = buffer
    return [tree[0] for tree in replicas]


def run_in_threads(model, calls, *, independent):
    """Each replica runs its call in its own thread; they wait for each other at the embedding.

    The barrier is a hook of the original model, so every replica inherits it, as user hooks are.
    """
    barrier = threading.Barrier(len(calls), timeout=30)

    def meet(module, args):
        barrier.wait()  # returns an index; a pre-hook's return value would replace the inputs

    handle = model.model.model.embed_tokens.register_forward_pre_hook(meet)
    replicas = two_replicas(model, independent=independent)
    handle.remove()
    results, errors = [None] * len(replicas), []

    def work(i):
        try:
            with torch.no_grad():
                results[i] = replicas[i](**calls[i].arguments)[1].logits
        except Exception as error:  # noqa: BLE001 -- reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results, errors


def expected_logits(model, calls):
    with torch.no_grad():
        return [model(**call.arguments)[1].logits for call in calls]


def two_replicas(model, *, independent):
    from pyvene_dist.fixes.data_parallel import _make_independent

    replicas = replicate_like_torch(model, 2)
    if independent:
        for replica in replicas:
            _make_independent(replica, model, torch.device("cpu"))
    return replicas


CALLS = [forward_call(batch=3, seed=1), forward_call(batch=2, seed=2, location_format="tensor")]


def test_replicas_in_threads_give_what_the_model_gives_alone(patched):
    model = reft_model(tiny_llama())
    model.eval()
    expected = expected_logits(model, CALLS)
    hooks_before = [dict(m._forward_hooks) for m in model.modules()]
    results, errors = run_in_threads(model, CALLS, independent=True)
    assert not errors, errors
    for result, want in zip(results, expected):
        torch.testing.assert_close(result, want, rtol=1e-5, atol=1e-6)
    assert [dict(m._forward_hooks) for m in model.modules()] == hooks_before


def test_shallow_replicas_interfere_which_is_what_the_fix_prevents(patched):
    model = reft_model(tiny_llama())
    model.eval()
    expected = expected_logits(model, CALLS)
    results, errors = run_in_threads(model, CALLS, independent=False)
    wrong = any(r is None or r.shape != e.shape or not torch.allclose(r, e) for r, e in zip(results, expected))
    assert errors or wrong


def test_replica_knows_its_device(patched):
    model = reft_model(tiny_llama())
    plain, = replicate_like_torch(model, 1)
    with pytest.raises(StopIteration):
        plain.get_device()  # HF's model.device finds no parameter on a replica
    fixed, = two_replicas(model, independent=True)[:1]
    assert fixed.get_device() == torch.device("cpu")


def test_get_device_reads_the_first_parameter_without_walking_the_modules(patched, monkeypatch):
    """pyvene asks get_device twice per intervention per forward and per generated token; transformers'
    model.device walks the modules to the first parameter each time (some 290 Python calls per token of
    every-token generation with 4 interventions). After the first call no walk: the parameter is read
    through its path, so a module replaced since is still seen."""
    model = reft_model(tiny_llama())
    assert model.get_device() == torch.device("cpu")
    walked = []
    named_parameters = torch.nn.Module.named_parameters
    monkeypatch.setattr(torch.nn.Module, "named_parameters",
                        lambda module, *args, **kwargs: walked.append(module) or named_parameters(module, *args, **kwargs))
    assert [model.get_device() for _ in range(3)] == [torch.device("cpu")] * 3
    assert walked == []
    embedding = model.model.model.embed_tokens
    model.model.model.embed_tokens = torch.nn.Embedding(*embedding.weight.shape, device="meta")
    assert model.get_device() == torch.device("meta")


def test_replica_hooks_point_at_its_own_modules(patched):
    model = reft_model(tiny_llama())
    replica = two_replicas(model, independent=True)[0]
    for key, register in replica.intervention_hooks.items():
        assert register.__self__ is not model.intervention_hooks[key].__self__
        assert any(register.__self__ is module for module in replica.model.modules())


def test_a_replica_copies_the_hook_dicts_of_its_hooked_modules_only(patched):
    """With fixes.hooks, pyvene adds and removes hooks on the modules its interventions sit on only, so a
    replica copies those modules' hook dicts and shares the rest (read-only) with the original; it copied
    every module's five dicts before, per replica per forward: 2,856 Python calls for an 8-layer model,
    143 now. The threads test above shows the replicas stay independent."""
    model = reft_model(tiny_llama())
    replica = two_replicas(model, independent=True)[0]
    hooked = {id(register.__self__) for register in replica.intervention_hooks.values()}
    originals = dict(zip(map(id, replica.modules()), model.modules()))
    for module in replica.modules():
        shared = module._forward_hooks is originals[id(module)]._forward_hooks
        assert shared != (id(module) in hooked), type(module).__name__


def test_which_hooks_pyvene_removes_is_asked_once_per_model(patched, monkeypatch):
    """Whether pyvene removes only its own hooks (the hooks fix applied, or carried by pyvene) cannot change while
    patched: it is found at a model's first replicate and kept in its state. It ran the fix-selection code
    (reading pyvene's FIXES) for every replica of every forward before."""
    from pyvene_dist.fixes import data_parallel

    asked, ask = [], data_parallel.removes_only_its_hooks
    monkeypatch.setattr(data_parallel, "removes_only_its_hooks", lambda: asked.append(1) or ask())
    model = reft_model(tiny_llama())
    for _ in range(3):  # three forwards of two replicas
        two_replicas(model, independent=True)
    assert len(asked) == 1
    two_replicas(reft_model(tiny_llama()), independent=True)
    assert len(asked) == 2  # another model: asked for it


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpus(2)
@pytest.mark.parametrize("case", [
    pytest.param(ParityCase(model="llama"), id="llama-fp32"),
    pytest.param(ParityCase(model="gpt2", component="mlp_output"), id="gpt2-mlp-fp32"),
    pytest.param(ParityCase(model="llama", dtype="bfloat16", lr=1e-3), id="llama-bf16"),
])
def test_raw_data_parallel_matches_one_gpu(patched, case):
    reference = train(case, Strategy("cuda:0"))
    candidate = train(case, "dataparallel")
    print(f"{case.model} {case.dtype}: losses {reference.losses} vs {candidate.losses}")
    assert candidate.world_size == torch.cuda.device_count()
    assert_parity(reference, candidate, case.tolerance)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("call", [
    forward_call(batch=8, location_format="nested-list"),
    forward_call(batch=5, location_format="tensor"),
    forward_call(batch=7, location_format="with-none", seed=3),
    forward_call(batch=1, interventions=3),
    forward_call(batch=6, location_format="broadcast-int"),
], ids=["lists", "tensor-uneven", "with-none", "one-example", "broadcast"])
def test_inference_under_data_parallel_equals_one_gpu(patched, call):
    from pyvene_dist.fixes.data_parallel import _to_device

    model = reft_model(tiny_llama(), layers=tuple(i % 2 for i in range(call.interventions))).to("cuda:0").eval()
    arguments = {k: v for k, v in call.arguments.items() if k != "labels"}
    with torch.no_grad():
        expected = model(**_to_device(arguments, torch.device("cuda:0")))[1].logits
        model.use_fast = False
        actual = torch.nn.DataParallel(model)(**arguments)[1].logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _trainer_record(tmp_path, trainer, visible):
    out = tmp_path / f"{trainer}-{visible.replace(',', '')}.pt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    result = subprocess.run([sys.executable, str(SCRIPTS / "train_with_trainer.py"), str(out), "--trainer", trainer],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, f"{trainer} on GPUs {visible} failed:\n{result.stdout}\n{result.stderr}"
    return Record(**torch.load(out))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("trainer", ["ReftTrainer", "ReftTrainerForCausalLM"])
def test_hf_trainer_data_parallel_matches_one_gpu(tmp_path, trainer):
    one = _trainer_record(tmp_path, trainer, "0")
    two = _trainer_record(tmp_path, trainer, "0,1")  # no torchrun: HF Trainer wraps nn.DataParallel
    print(f"{trainer}: 1 GPU {one.losses}\n{trainer}: 2 GPUs {two.losses}")
    assert_parity(one, two, ParityCase().tolerance)
