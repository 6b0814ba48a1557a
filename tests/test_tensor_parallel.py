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
#: Torch's own styles by hand hook differently (DTensor inputs to o_proj): one component of each kind.
BY_HAND_COMPONENTS = ("block_output", "attention_output", "mlp_activation", "attention_value_output",
                      "query_output", "head_key_output")
#: Qwen2 differs from Llama by the biases of q, k and v (column-wise slices of a bias): the components
#: that read those projections, and one of each other kind.
QWEN2_COMPONENTS = ("block_output", "attention_output", "mlp_activation", "head_attention_value_output",
                    "query_output", "head_key_output")


def case(model: str, component: str) -> ParityCase:
    return ParityCase(model=model, component=component, steps=2)


def key(strategy: str, parity_case: ParityCase) -> str:
    return f"{strategy}/{parity_case.model}/{parity_case.component}"


def _train_cases(jobs, out):
    helpers.patch()
    records = {}
    for strategy, parity_case in jobs:
        records[key(strategy, parity_case)] = dataclasses.asdict(train(parity_case, strategy))
    if dist.get_rank() == 0:
        torch.save(records, out)


def _world(tmp_path_factory, world_size, jobs):
    workdir = tmp_path_factory.mktemp(f"world{world_size}")
    out = workdir / "records.pt"
    outcome = spawn(_train_cases, world_size=world_size, workdir=workdir, timeout=600,
                    kwargs={"jobs": jobs, "out": str(out)})
    if outcome.failed:
        pytest.fail(outcome.report(), pytrace=False)
    return {key: Record(**value) for key, value in torch.load(out).items()}


TP_JOBS = [("tp", case("llama", c)) for c in LLAMA_COMPONENTS] + \
          [("tp", case("qwen2", c)) for c in QWEN2_COMPONENTS] + \
          [("tp-by-hand", case("llama", "attention_value_output"))]
MESH_JOBS = [("tp-fsdp2", case("llama", c)) for c in MESH_COMPONENTS] + [("hsdp", case("llama", "block_output"))]


@pytest.fixture(scope="module")
def tp_records(tmp_path_factory):
    return _world(tmp_path_factory, 2, TP_JOBS)


@pytest.fixture(scope="module")
def mesh_records(tmp_path_factory):
    return _world(tmp_path_factory, 4, MESH_JOBS)


@pytest.fixture(scope="module")
def references():
    helpers.patch()
    return {}


def _compare(records, references, strategy, parity_case):
    if parity_case not in references:
        references[parity_case] = train(parity_case, "single")
    reference, candidate = references[parity_case], records[key(strategy, parity_case)]
    print(f"{strategy} {parity_case.model} {parity_case.component}: {differences(reference, candidate)}")
    assert_parity(reference, candidate, parity_case.tolerance)


@pytest.mark.parametrize("strategy,parity_case", TP_JOBS, ids=[f"{s}-{c.model}-{c.component}" for s, c in TP_JOBS])
def test_tensor_parallel_matches_one_process(tp_records, references, strategy, parity_case):
    _compare(tp_records, references, strategy, parity_case)


@pytest.mark.parametrize("strategy,parity_case", MESH_JOBS, ids=[f"{s}-{c.model}-{c.component}" for s, c in MESH_JOBS])
def test_two_dimensional_mesh_matches_one_process(mesh_records, references, strategy, parity_case):
    _compare(mesh_records, references, strategy, parity_case)
