"""The position mapping for a sequence split over ranks, against a simulated split (no process group)."""

import pytest
import torch

from pyvene_dist.sequence_parallel import local_positions, shard_sequence


@pytest.mark.parametrize("layout", ["contiguous", "load_balanced"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_position_is_read_from_exactly_one_rank_and_equals_the_whole(layout, world_size):
    generator = torch.Generator().manual_seed(world_size)
    hidden = torch.randn(3, 16, 5, generator=generator)
    locations = torch.randint(16, (3, 4), generator=generator)
    expected = hidden[torch.arange(3)[:, None], locations]
    found = torch.zeros_like(expected)
    owners = torch.zeros(locations.shape, dtype=torch.long)
    for rank in range(world_size):
        local, mask = local_positions(locations, 16, world_size, rank, layout)
        piece = shard_sequence(hidden, world_size, rank, layout)
        read = piece[torch.arange(3)[:, None], local]
        found[mask] = read[mask]
        owners += mask.long()
    assert torch.equal(owners, torch.ones_like(owners))
    assert torch.equal(found, expected)


def test_load_balanced_gives_rank_0_the_first_and_the_last_chunk():
    local, mask = local_positions(torch.tensor([0, 3, 4, 11, 12, 15]), 16, 2, 0, "load_balanced")
    assert mask.tolist() == [True, True, False, False, True, True]
    assert local[mask].tolist() == [0, 3, 4, 7]


@pytest.mark.parametrize("arguments, message", [
    ((torch.tensor([1]), 10, 4, 0, "contiguous"), "seq_len 10 does not split into 4"),
    ((torch.tensor([1]), 16, 2, 0, "load_balanced"), None),
    ((torch.tensor([16]), 16, 2, 0, "contiguous"), r"locations must lie in \[0, 16\), found 16..16"),
    ((torch.tensor([1]), 16, 2, 2, "contiguous"), "rank 2 is not in a world of size 2"),
    ((torch.tensor([1]), 16, 2, 0, "ring"), "layout 'ring' is not one of"),
])
def test_bad_arguments_are_named(arguments, message):
    if message is None:
        local_positions(*arguments)
        return
    with pytest.raises(ValueError, match=message):
        local_positions(*arguments)
