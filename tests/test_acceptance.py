"""Entropy-bound acceptance on hand-made entropy vectors."""

import torch

from dgemma_sampler.step import acceptance_mask


def test_lowest_entropy_always_accepted():
    e = torch.tensor([[5.0, 3.0, 4.0]])
    assert acceptance_mask(e, 0.1).tolist() == [[False, True, False]]


def test_exact_prefix_sums():
    # Exactly representable values: sorted 0.0625, 0.125, 0.3125, 1.0, 4.0 have sums before
    # 0, 0.0625, 0.1875, 0.5 (== bound: accepted), 1.5 (rejected).
    e = torch.tensor([[0.3125, 0.0625, 4.0, 0.125, 1.0]])
    got = acceptance_mask(e, 0.5)[0].tolist()
    assert got == [True, True, False, True, True]


def test_ties_all_equal():
    e = torch.full((1, 6), 0.25)
    # before-sums 0, .25, .5, .75, ...: the first three by position are accepted
    assert acceptance_mask(e, 0.5)[0].tolist() == [True, True, True, False, False, False]


def test_bound_smaller_than_every_entropy():
    e = torch.tensor([[2.0, 1.0, 3.0, 1.0]])
    # ties at the minimum: the lower position wins the first rank
    assert acceptance_mask(e, 0.5)[0].tolist() == [False, True, False, False]


def test_zero_entropy_all_accepted():
    e = torch.zeros(2, 7)
    assert acceptance_mask(e, 0.1).all()


def test_outside_positions_never_accepted_unless_first():
    e = torch.tensor([[0.0, 0.0, float("inf"), float("inf")]])
    assert acceptance_mask(e, 0.1)[0].tolist() == [True, True, False, False]
