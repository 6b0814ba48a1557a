"""``pyvene_dist.positions_from_attention_mask``: each row's positions as pyreft's own ``get_intervention_locations``
gives them for that row's prompt alone, shifted by the row's padding (pyreft issue #105)."""

import pytest
import torch

import pyvene_dist
from pyvene_dist.testing import models

LENGTHS = (1, 2, 3, 6, 9)


def _mask(lengths, side: str) -> torch.Tensor:
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1 if side == "left" else 0
        if side == "right":
            mask[row, :length] = 1
    return mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("positions, interventions, share", [
    ("f1+l1", 2, False), ("f2+l2", 4, False), ("f3+l1", 2, False), ("f1+l1", 3, True), ("l1", 1, False),
    ("l3", 2, False), ("f2", 1, False), ("f2+l3", 1, True)])
def test_each_row_gets_pyrefts_positions_for_its_prompt_alone(side, positions, interventions, share):
    from pyreft.dataset import get_intervention_locations

    lengths = LENGTHS[1:] if "+" in positions and not share else LENGTHS[2:]  # pyreft leaves 1 token none
    mask = _mask(lengths, side)
    found = pyvene_dist.positions_from_attention_mask(mask, positions, num_interventions=interventions,
                                                      share_weights=share)
    assert found.dtype == torch.long and found.shape[:2] == (interventions, len(lengths))
    for row, length in enumerate(lengths):
        start = mask.shape[1] - length if side == "left" else 0
        # pyreft's pad slots (pad_mode="last") point at position `length`, past the prompt: here a repeat
        expected = get_intervention_locations(last_position=length, positions=positions, pad_mode="last",
                                              num_interventions=interventions, share_weights=share)
        for entry in range(interventions):
            ours = (found[entry, row] - start).tolist()
            theirs = expected[entry]
            real = [p for p in theirs if p != length]
            assert ours[:len(real)] == real, (row, entry, ours, theirs)
            assert len(ours) == len(theirs) and set(ours[len(real):]) <= {real[-1]}, (row, entry, ours, theirs)


@pytest.mark.parametrize("arguments, message", [
    (dict(positions="l1+f1"), r"positions='l1\+f1': expected pyreft's form"),
    (dict(positions="f0"), "selects no position"),
    (dict(positions="f0+l0"), "selects no position"),
    (dict(positions="l1\n"), r"positions='l1\\n': expected pyreft's form"),
    (dict(positions=" f1"), r"positions=' f1': expected pyreft's form"),
    (dict(positions="f1+l1", num_interventions=3), "num_interventions=3: .* must be even"),
    (dict(num_interventions=0), "num_interventions=0: expected a positive int"),
    (dict(attention_mask=torch.ones(4)), r"attention_mask: expected a \[batch, length\] tensor, found \(4,\)"),
    (dict(attention_mask=torch.tensor([[1, 0, 1]])), "row 0: its tokens are not contiguous"),
    (dict(attention_mask=torch.tensor([[1, 1], [0, 0]])), "row 1 has no token"),
    (dict(attention_mask=torch.tensor([[0, 1]]), positions="l1"), "row 0 has 1 token"),
])
def test_bad_input_is_refused_by_name(arguments, message):
    arguments = {"attention_mask": torch.ones(2, 4, dtype=torch.long), "positions": "l1", **arguments}
    with pytest.raises(ValueError, match=message):
        pyvene_dist.positions_from_attention_mask(**arguments)


def test_stock_pyvene_takes_them_as_lists():
    """No patch: the positions' ``tolist()`` is the form pyreft's own calls pass."""
    reft = models.reft_model(models.tiny_llama(seed=0), layers=(0, 1), seed=1)
    reft.eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    prompt = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    locations = pyvene_dist.positions_from_attention_mask(prompt["attention_mask"], "f1+l1", num_interventions=2)
    assert locations.tolist() == [[[2], [0]], [[4], [4]]]
    _, out = reft.generate(prompt, unit_locations={"sources->base": (None, locations.tolist())},
                           intervene_on_prompt=True, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)
