"""Tensor parallel (world 2) and 2-D meshes (world 4) against one process, every component pyvene offers
on Llama and Qwen2. One spawned world per mesh shape trains every case; the parent compares them."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, Record, assert_parity, differences, spawn, train

LLAMA_COMPONENTS = (
    "block_input", "block_output", "attention_input", "attention_output", "mlp_input", "mlp_output",
    "mlp_activation", "attention_value_output", "head_attention_value_output", "query_output", "key_output",
    "value_output", "head_query_output", "head_key_output", "head_value_output",
)
#: Qwen2 differs from Llama by the biases of q, k and v (column-wise slices of a bias).
QWEN2_COMPONENTS = ("attention_output", "query_output", "head_key_output")
#: The 2-D mesh runs torch's own styles by hand (o_proj then takes a DTensor input): one component of
#: each kind pyvene_dist handles differently (whole residual, copied output, gathered slice, head split).
MESH_COMPONENTS = ("block_output", "attention_input", "attention_output", "mlp_activation",
                   "attention_value_output", "head_attention_value_output", "query_output", "head_key_output")

def case(model: str, component: str) -> ParityCase:
    """The default real data (padding, labels on answers, two micro-batches a step), without the trainable
    head: the tensor-parallel builds (``from_pretrained(tp_plan=...)``, ``parallelize_by_hand``) train the
    interventions only, so the head TP shards (``lm_head``, a DTensor) is not compared; and
    ``save_intervention`` writes a trainable head beside the interventions, which the round trips' load
    cannot copy into that DTensor (``aten.copy_.default got mixed torch.Tensor and DTensor``). lr 1e-3: Adam
    moves a weight whose gradient is near zero by up to lr either way; at 1e-2 one element of 128 of
    mlp_input's LoReFT source weight differed by 3x the fp32 bound (gradients agreed to 2.7e-6)."""
    return ParityCase(model=model, component=component, steps=2, trainable_head=False, lr=1e-3)


def key(strategy: str, parity_case: ParityCase) -> str:
    return f"{strategy}/{parity_case.model}/{parity_case.component}"


def _train_cases(jobs, out, roundtrips=()):
    """Every rank: train each job (an error is recorded, not raised: the parent says which component
    failed), then the save/load round trips; rank 0 writes what came out."""
    helpers.patch()
    records = {}
    for strategy, parity_case in jobs:
        try:
            records[key(strategy, parity_case)] = dataclasses.asdict(train(parity_case, strategy))
        except Exception as error:  # raised alike on every rank: the model and data are the same
            records[key(strategy, parity_case)] = {"error": f"{type(error).__name__}: {error}"}
    for strategy, parity_case, saved_by_one, saved_by_ranks in roundtrips:
        records[key(strategy, parity_case) + "/roundtrip"] = _roundtrip(strategy, parity_case, saved_by_one,
                                                                       saved_by_ranks)
    if dist.get_rank() == 0:
        torch.save(records, out)


def _roundtrip(strategy, parity_case, saved_by_one, saved_by_ranks):
    """Load what one process saved, infer (no grad), take one step, save for one process to load."""
    from pyvene_dist.testing import STRATEGIES, intervention_weights
    from pyvene_dist.testing.training import summed_loss

    run = STRATEGIES[strategy]()
    model = run.build(parity_case)
    model.load_intervention(saved_by_one)
    first, second = parity_case.batches()[:2]
    with torch.no_grad():
        inferred = summed_loss(model, first, run.device).item()
    _step(model, second, run.device)
    model.save_intervention(saved_by_ranks)
    return {"inferred": inferred, "weights": intervention_weights(model)}


def _step(model, batch, device):
    from pyvene_dist.testing.training import summed_loss

    optimizer = torch.optim.SGD([p for p in model.interventions.parameters() if p.requires_grad], lr=0.5)
    optimizer.zero_grad(set_to_none=True)
    summed_loss(model, batch, device).backward()
    optimizer.step()


def _world(tmp_path_factory, world_size, jobs, roundtrips=()):
    workdir = tmp_path_factory.mktemp(f"world{world_size}")
    out = workdir / "records.pt"
    outcome = spawn(_train_cases, world_size=world_size, workdir=workdir, timeout=600,
                    kwargs={"jobs": jobs, "out": str(out), "roundtrips": roundtrips})
    if outcome.failed:
        pytest.fail(outcome.report(), pytrace=False)
    return torch.load(out)


TP_JOBS = [("tp", case("llama", c)) for c in LLAMA_COMPONENTS] + \
          [("tp", case("qwen2", c)) for c in QWEN2_COMPONENTS] + \
          [("tp-by-hand", case("llama", "attention_value_output"))]
MESH_JOBS = [("tp-fsdp2", case("llama", c)) for c in MESH_COMPONENTS] + [("hsdp", case("llama", "block_output"))]


#: Saved by one process, loaded under TP (and the reverse): a gathered component and a copied one.
ROUNDTRIPS = [("tp", case("llama", "attention_value_output")), ("tp-fsdp2", case("llama", "attention_output"))]


@pytest.fixture(scope="module")
def saved_by_one(tmp_path_factory):
    """Per round trip: the folder one process saved its interventions to after one step, and the model."""
    helpers.patch()
    folders = {}
    for strategy, parity_case in ROUNDTRIPS:
        model = parity_case.build()
        _step(model, parity_case.batches()[0], torch.device("cpu"))
        folder = tmp_path_factory.mktemp("saved-by-one")
        model.save_intervention(str(folder))
        folders[key(strategy, parity_case)] = (str(folder), model)
    return folders


def _roundtrips(tmp_path_factory, saved_by_one, world_size):
    return [(strategy, parity_case, saved_by_one[key(strategy, parity_case)][0],
             str(tmp_path_factory.mktemp("saved-by-ranks")))
            for strategy, parity_case in ROUNDTRIPS if (strategy == "tp") == (world_size == 2)]


@pytest.fixture(scope="module")
def tp_records(tmp_path_factory, saved_by_one):
    roundtrips = _roundtrips(tmp_path_factory, saved_by_one, 2)
    return _world(tmp_path_factory, 2, TP_JOBS, roundtrips), roundtrips


@pytest.fixture(scope="module")
def mesh_records(tmp_path_factory, saved_by_one):
    roundtrips = _roundtrips(tmp_path_factory, saved_by_one, 4)
    return _world(tmp_path_factory, 4, MESH_JOBS, roundtrips), roundtrips


@pytest.fixture(scope="module")
def references():
    helpers.patch()
    return {}


def _compare(records, references, strategy, parity_case):
    records, _ = records
    if parity_case not in references:
        references[parity_case] = train(parity_case, "single")
    found = records[key(strategy, parity_case)]
    if "error" in found:
        pytest.fail(f"{strategy} {parity_case.model} {parity_case.component}: {found['error']}", pytrace=False)
    reference, candidate = references[parity_case], Record(**found)
    print(f"{strategy} {parity_case.model} {parity_case.component}: {differences(reference, candidate)}")
    assert_parity(reference, candidate, parity_case.tolerance)


@pytest.mark.parametrize("strategy,parity_case", TP_JOBS, ids=[f"{s}-{c.model}-{c.component}" for s, c in TP_JOBS])
def test_tensor_parallel_matches_one_process(tp_records, references, strategy, parity_case):
    _compare(tp_records, references, strategy, parity_case)


@pytest.mark.parametrize("strategy,parity_case", MESH_JOBS, ids=[f"{s}-{c.model}-{c.component}" for s, c in MESH_JOBS])
def test_two_dimensional_mesh_matches_one_process(mesh_records, references, strategy, parity_case):
    _compare(mesh_records, references, strategy, parity_case)


@pytest.mark.parametrize("strategy,parity_case", ROUNDTRIPS, ids=[f"{s}-{c.component}" for s, c in ROUNDTRIPS])
def test_interventions_saved_by_one_process_load_under_tensor_parallel_and_back(
    request, saved_by_one, strategy, parity_case
):
    """One process's interventions infer the same under TP; what the TP ranks save after a step (rank 0
    writes it once) loads in one process to the weights the ranks hold, and infers as one process that
    took the same step."""
    from pyvene_dist.testing import intervention_weights
    from pyvene_dist.testing.training import summed_loss

    records, roundtrips = request.getfixturevalue("tp_records" if strategy == "tp" else "mesh_records")
    found = records[key(strategy, parity_case) + "/roundtrip"]
    folder, model = saved_by_one[key(strategy, parity_case)]
    first, second = parity_case.batches()[:2]
    with torch.no_grad():
        expected = summed_loss(model, first, torch.device("cpu")).item()
    assert found["inferred"] == pytest.approx(expected, rel=1e-6)
    saved_by_ranks = next(r[3] for r in roundtrips if r[:2] == (strategy, parity_case))
    loaded = parity_case.build()
    loaded.load_intervention(saved_by_ranks)
    for name, weight in intervention_weights(loaded).items():
        torch.testing.assert_close(weight, found["weights"][name], rtol=1e-5, atol=1e-6, msg=f"saved {name}")
    _step(model, second, torch.device("cpu"))  # the same step in one process: the same interventions
    with torch.no_grad():
        assert summed_loss(loaded, first, torch.device("cpu")).item() == pytest.approx(
            summed_loss(model, first, torch.device("cpu")).item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpus(1)
@pytest.mark.world_size(1, backend="nccl")
@pytest.mark.parametrize("component", ("attention_output", "attention_value_output", "head_query_output"))
def test_tensor_parallel_of_one_gpu_matches_one_gpu(component):
    """TP size 1 on one GPU through the same hooks (DTensor weights, DTensor o_proj inputs):
    bash scripts/gpu_checks.sh tests/fixes/test_tensor_parallel.py -k one_gpu"""
    helpers.patch()
    parity_case = case("llama", component)
    for strategy in ("tp-by-hand", "tp"):
        candidate = train(parity_case, strategy)
        reference = train(parity_case, "single")
        print(f"{strategy} x1 GPU {component}: {differences(reference, candidate)}")
        assert_parity(reference, candidate, parity_case.tolerance)


# ------------------------------------------------------------------------------- per-model facts
def _forward(model, batch):
    with torch.no_grad():
        return model({"input_ids": batch["input_ids"]}, unit_locations={"sources->base": (None, batch["locations"])})


def _counting_walks(monkeypatch) -> list:
    """Every model ``mechanisms.dtensors.has_dtensor_parameters`` walks from now on."""
    import torch.distributed.tensor  # noqa: F401  (FSDP2 and transformers import it; the walk runs only then)

    from pyvene_dist.mechanisms import dtensors

    walked, walk = [], dtensors.has_dtensor_parameters
    monkeypatch.setattr(dtensors, "has_dtensor_parameters", lambda model: walked.append(model) or walk(model))
    return walked


def test_the_parameters_are_walked_at_the_first_forward_only(patched, monkeypatch):
    """Whether a model is tensor-parallel is found once and kept in its state: every parameter was walked on
    each forward before (three walks here), some 1,900 Python calls per forward of an 8-layer model."""
    walked = _counting_walks(monkeypatch)
    parity_case = ParityCase()
    model = parity_case.build()
    for batch in parity_case.batches(3):
        _forward(model, batch)
    assert walked == [model.model]


@pytest.mark.world_size(1)
def test_fully_shard_after_a_forward_makes_the_model_looked_at_again(monkeypatch):
    """A forward before fully_shard found plain parameters; fully_shard of the pyvene model (its parameters
    now DTensors) makes the next forward look again, and find them."""
    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    walked = _counting_walks(monkeypatch)
    parity_case = ParityCase()
    model = parity_case.build()
    first, second = parity_case.batches()[:2]
    unsharded = _forward(model, first)[1].logits
    fully_shard_model(model)
    sharded = _forward(model, first)[1].logits
    _forward(model, second)
    assert walked == [model.model, model.model]
    from pyvene_dist._registry import MODELS
    from pyvene_dist.mechanisms.dtensors import TensorParallelState

    assert MODELS.get(model, TensorParallelState).dtensor_parameters is True
    torch.testing.assert_close(sharded, unsharded, rtol=0, atol=0)


def test_tp_is_unavailable_where_transformers_cannot_split_the_vocabulary(monkeypatch):
    """transformers 5.17-5.20's from_pretrained(tp_plan=...) refused the tiny model's lm_head (97 tokens) over 2
    ranks (the version matrix's oldest column); the check says so instead of failing, and runs tp from 5.21."""
    from pyvene_dist.testing import requirements
    from pyvene_dist.testing.strategies import STRATEGIES

    monkeypatch.setattr(requirements, "version", lambda name: "5.17.0")  # as it reads the installed release
    assert STRATEGIES["tp"].unavailable(2, 0) == ("transformers 5.17.0's tp_plan needs the vocabulary (97) divisible "
                                                  "by the world size (2); 5.21 and newer shard it unevenly")
    assert STRATEGIES["tp"].unavailable(1, 0) is None
    assert STRATEGIES["tp-by-hand"].unavailable(2, 0) is None  # parallelize_module with the base model's plan
    monkeypatch.setattr(requirements, "version", lambda name: "5.21.0")
    assert STRATEGIES["tp"].unavailable(2, 0) is None
