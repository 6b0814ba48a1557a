"""One row of ``unit_locations`` for the whole batch applies to every example (fixes.locations).

The expected outputs are stock pyvene's, unpatched, given the row repeated for every example. Stock
pyvene given the one row intervenes on example 0 alone; the tests show that too, so they cannot pass
by both sides ignoring the row. Refusals of other mismatches are in test_user_errors.py.
"""

import pytest
import torch

import helpers
import pyvene_dist
from pyvene_dist.testing import models

BATCH, LENGTH = 4, 8


@pytest.fixture
def patch_later():
    """Stock pyvene first, then ``helpers.patch`` when the test calls it; unpatched afterwards."""
    yield helpers.patch
    pyvene_dist.unpatch()


def _ids(batch=BATCH, seed=0):
    return torch.randint(models.VOCAB_SIZE, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


ROWS = [[[3, 5]], [[1, 6]]]  # per intervention, one row of two positions
ONE_ROW_FORMS = {
    "lists": lambda: (None, ROWS),
    "tensor": lambda: (None, torch.tensor(ROWS)),  # pyreft's layout: [interventions, rows, positions]
    "tensor per intervention": lambda: (None, [torch.tensor(rows) for rows in ROWS]),
}


@pytest.mark.parametrize("form", ONE_ROW_FORMS)
def test_one_row_of_reft_locations_applies_to_every_example(patch_later, form):
    reft_model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2)
    ids = _ids()
    _, expected = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, [r * BATCH for r in ROWS])})
    _, stock = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, ROWS)})
    torch.testing.assert_close(stock.logits[0], expected.logits[0])  # stock: example 0 alone gets the row
    assert not torch.equal(stock.logits[1:], expected.logits[1:])

    patch_later()
    _, found = reft_model({"input_ids": ids}, unit_locations={"sources->base": ONE_ROW_FORMS[form]()})
    torch.testing.assert_close(found.logits, expected.logits, rtol=0, atol=0)
    assert ROWS == [[[3, 5]], [[1, 6]]]  # the caller's lists are left as they were


def test_one_row_of_source_and_base_locations_applies_to_every_example(patch_later):
    """pyvene's own ``test_local_load_positive``: an interchange of two sources into the base, the locations
    of both sides given as one row for a batch of 10."""
    import pyvene as pv

    config = pv.IntervenableConfig([{"layer": layer, "component": "block_output", "unit": "pos",
                                     "max_number_of_units": 1} for layer in (0, 1)],
                                   intervention_types=pv.VanillaIntervention)
    model = pv.IntervenableModel(config, models.tiny_gpt2())
    base, source = {"input_ids": _ids(10, seed=1)}, {"input_ids": _ids(10, seed=2)}
    one_row = {"sources->base": ([[[3]], [[4]]], [[[3]], [[4]]])}
    every_row = {"sources->base": ([[[3]] * 10, [[4]] * 10], [[[3]] * 10, [[4]] * 10])}
    _, expected = model(base, [source, source], every_row)
    _, stock = model(base, [source, source], one_row)
    assert not torch.equal(stock.logits[1:], expected.logits[1:])

    patch_later()
    _, found = model(base, [source, source], one_row)
    torch.testing.assert_close(found.logits, expected.logits, rtol=0, atol=0)


def test_one_row_of_head_and_position_locations_applies_to_every_example(patch_later):
    """``h.pos`` on GPT-2's heads: the nested (heads, positions) locations, each level one row."""
    import pyvene as pv

    config = pv.IntervenableConfig([{"layer": 1, "component": "head_attention_value_output", "unit": "h.pos"}],
                                   intervention_types=pv.VanillaIntervention)
    model = pv.IntervenableModel(config, models.tiny_gpt2())
    base, source = {"input_ids": _ids(3, seed=1)}, {"input_ids": _ids(3, seed=2)}
    heads, positions = [[1, 3]], [[4, 5]]
    one_row = {"sources->base": ([(heads, positions)], [(heads, positions)])}
    every = (heads * 3, positions * 3)
    _, expected = model(base, [source], {"sources->base": ([every], [every])})
    _, stock = model(base, [source], one_row)
    assert not torch.equal(stock.logits[1:], expected.logits[1:])

    patch_later()
    _, found = model(base, [source], one_row)
    torch.testing.assert_close(found.logits, expected.logits, rtol=0, atol=0)
