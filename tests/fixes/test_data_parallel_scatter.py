"""Splitting pyvene's forward arguments by batch: shapes, round trips, and whole-batch equivalence.

In-process on CPU for many world sizes (hypothesis); the real nn.DataParallel runs are GPU tests.
"""

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pyvene_dist.mechanisms.batch_split import chunk_sizes, split_forward_arguments
from pyvene_dist.testing.models import reft_model, tiny_llama
from pyvene_dist.testing.generators import BROADCAST_FORMATS, forward_call, forward_calls, world_sizes


@functools.lru_cache(maxsize=None)
def model_with(interventions: int):
    layers = tuple(i % 2 for i in range(interventions))  # repeated layers are separate interventions
    model = reft_model(tiny_llama(), layers=layers)
    model.eval()  # unpatched pyvene's eval() returns None
    return model


def locations_of(piece):
    """The [interventions][batch][positions] lists of a piece (None where pyvene acts everywhere)."""
    (key, value), = piece["unit_locations"].items()
    side = value if key == "base" else value[1]
    return [None if entry is None else torch.as_tensor(entry).tolist() for entry in side]


@given(batch=st.integers(1, 64), chunks=st.integers(1, 8))
def test_chunk_sizes_are_torch_chunks(batch, chunks):
    expected = [len(c) for c in torch.arange(batch).chunk(chunks)]
    assert chunk_sizes(batch, chunks) == expected


EDGES = [
    (forward_call(batch=1, interventions=3), 8),                               # fewer examples than GPUs
    (forward_call(batch=5, location_format="tensor"), 2),                      # uneven last chunk
    (forward_call(batch=7, location_format="with-none", seed=3), 4),           # 4 chunks: 2, 2, 2, 1
    (forward_call(batch=6, location_format="base-key", with_subspaces=True), 4),  # 3 chunks only
]


def with_edges(test):
    for call, world_size in EDGES:
        test = example(call=call, world_size=world_size)(test)
    return test


@with_edges
@given(call=forward_calls(), world_size=world_sizes())
def test_pieces_have_each_replicas_batch_and_concatenate_back(call, world_size):
    model = model_with(call.interventions)
    sizes = chunk_sizes(call.batch, world_size)
    pieces = split_forward_arguments(model, call.arguments, sizes)
    assert len(pieces) == len(sizes) <= world_size and sum(sizes) == call.batch
    start = 0
    for piece, size in zip(pieces, sizes):
        assert piece["base"]["input_ids"].shape[0] == size
        assert torch.equal(piece["base"]["input_ids"], call.arguments["base"]["input_ids"][start:start + size])
        assert torch.equal(piece["labels"], call.arguments["labels"][start:start + size])
        if call.location_format in BROADCAST_FORMATS:
            assert piece["unit_locations"] == call.arguments["unit_locations"]
        else:
            for i, entry in enumerate(locations_of(piece)):
                if entry is not None:
                    assert entry == call.locations[i, start:start + size].tolist()
        if "subspaces" in call.arguments:
            assert piece["subspaces"] == [s[start:start + size] for s in call.arguments["subspaces"]]
        start += size


@with_edges
@settings(max_examples=40)
@given(call=forward_calls(max_batch=8), world_size=world_sizes())
def test_shard_by_shard_equals_the_whole_batch(call, world_size):
    model = model_with(call.interventions)
    arguments = {k: v for k, v in call.arguments.items() if k != "subspaces"}  # LoReFT ignores subspaces
    with torch.no_grad():
        model.use_fast = False  # pyvene leaves it set after a broadcast call
        whole = model(**arguments)[1].logits
        parts = []
        for piece in split_forward_arguments(model, arguments, chunk_sizes(call.batch, world_size)):
            model.use_fast = False
            parts.append(model(**piece)[1].logits)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)


def split(call, world_size=2, **changes):
    arguments = {**call.arguments, **changes}
    return split_forward_arguments(model_with(call.interventions), arguments, chunk_sizes(call.batch, world_size))


def test_location_batch_that_differs_names_both_sizes():
    call = forward_call(batch=8, interventions=2)
    short = {"sources->base": (None, [entry[:6] for entry in call.locations.tolist()])}
    with pytest.raises(ValueError, match=r"unit_locations\['sources->base'\]\[1\]\[0\] has batch size 6 but the base input has 8"):
        split(call, unit_locations=short)


def test_location_tensor_in_the_wrong_layout_is_refused():
    call = forward_call(batch=8, interventions=2)
    batch_first = call.locations.permute(1, 0, 2)  # pyreft's collated layout, not pyvene's
    with pytest.raises(ValueError, match=r"has shape \(8, 2, 2\); expected \[interventions, batch 8, ...\]"):
        split(call, unit_locations={"sources->base": (None, batch_first)})


def test_one_entry_per_intervention_is_required():
    call = forward_call(batch=4, interventions=2)
    with pytest.raises(ValueError, match="has 3 entries; expected one per intervention \\(2\\)"):
        split(call, unit_locations={"sources->base": (None, call.locations.tolist() + [None])})


def test_unsplittable_formats_say_which_argument_and_why():
    call = forward_call(batch=4, interventions=1)
    with pytest.raises(ValueError, match=r"unit_locations cannot be split by batch: expected a dict"):
        split(call, unit_locations=[[[1]] * 4])
    with pytest.raises(ValueError, match=r"intervention_additional_kwargs holds tensors"):
        split(call, intervention_additional_kwargs={"scale": torch.ones(4)})
    with pytest.raises(ValueError, match=r"labels has batch size 3 but the base input has 4"):
        split(call, labels=torch.zeros(3, 8))


def test_nested_units_split_both_levels():
    import pyvene as pv

    base = tiny_llama()
    config = pv.IntervenableConfig([{"layer": 0, "component": "head_attention_value_output", "unit": "h.pos",
                                     "intervention_type": pv.VanillaIntervention}])
    model = pv.IntervenableModel(config, base)
    heads = [[0, 1], [1, 0], [0, 0]]
    positions = [[2], [5], [7]]
    arguments = {"base": {"input_ids": torch.zeros(3, 8, dtype=torch.long)},
                 "unit_locations": {"sources->base": ([[heads, positions]], [[heads, positions]])}}
    pieces = split_forward_arguments(model, arguments, chunk_sizes(3, 2))
    assert pieces[0]["unit_locations"]["sources->base"][1] == [[heads[:2], positions[:2]]]
    assert pieces[1]["unit_locations"]["sources->base"][0] == [[heads[2:], positions[2:]]]


def interchange_model():
    import pyvene as pv

    config = pv.IntervenableConfig([{"layer": 1, "component": "block_output", "intervention_type": pv.VanillaIntervention}])
    model = pv.IntervenableModel(config, tiny_llama())
    model.eval()
    return model


@pytest.mark.parametrize("batch, world_size", [(5, 2), (3, 4), (8, 3)])
def test_sources_split_with_their_base(batch, world_size):
    model = interchange_model()
    generator = torch.Generator().manual_seed(batch)
    base = {"input_ids": torch.randint(97, (batch, 6), generator=generator)}
    source = {"input_ids": torch.randint(97, (batch, 6), generator=generator)}
    locations = torch.randint(6, (1, batch, 2), generator=generator)
    arguments = {"base": base, "sources": [source], "unit_locations": {"sources->base": (locations.tolist(), locations.flip(-1).tolist())}}
    with torch.no_grad():
        whole = model(**arguments)[1].logits
        pieces = split_forward_arguments(model, arguments, chunk_sizes(batch, world_size))
        parts = torch.cat([model(**piece)[1].logits for piece in pieces])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    assert [p["sources"][0]["input_ids"].shape[0] for p in pieces] == chunk_sizes(batch, world_size)


def test_source_representations_split_with_their_base():
    model = interchange_model()
    key = model.sorted_keys[0]
    base = {"input_ids": torch.randint(97, (6, 5), generator=torch.Generator().manual_seed(0))}
    activations = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(1))
    arguments = {"base": base, "source_representations": {key: activations},
                 "unit_locations": {"sources->base": (None, [[[4]] * 6])}}
    pieces = split_forward_arguments(model, arguments, [4, 2])  # first: pyvene's forward empties the dict
    with torch.no_grad():
        whole = model(**arguments)[1].logits
        parts = torch.cat([model(**piece)[1].logits for piece in pieces])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_a_source_with_another_batch_size_is_refused():
    model = interchange_model()
    arguments = {"base": {"input_ids": torch.zeros(4, 5, dtype=torch.long)},
                 "sources": [{"input_ids": torch.zeros(3, 5, dtype=torch.long)}]}
    with pytest.raises(ValueError, match=r"sources\[0\]\['input_ids'\] has batch size 3 but the base input has 4"):
        split_forward_arguments(model, arguments, [2, 2])
