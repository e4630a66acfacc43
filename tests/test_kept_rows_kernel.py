"""The kept-rows-first order of the soft-embedding GEMMs against its twin, a stable argsort."""

import pytest
import torch


def twin(keep):
    return torch.argsort(keep.logical_not().to(torch.uint8), stable=True), keep.sum(dtype=torch.int32)


def check(keep):
    from dgemma_sampler.kernels.kept_rows import kept_first

    order, count = kept_first(keep)
    want_order, want_count = twin(keep)
    assert order.dtype == torch.int64 and order.shape == keep.shape
    assert count.dtype == torch.int32 and count.shape == (1,)
    assert torch.equal(order, want_order)
    assert int(count) == int(want_count)


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1000])
@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_kept_first_matches_a_stable_argsort(interpret, n, fraction):
    gen = torch.Generator().manual_seed(n)
    check((torch.rand(n, generator=gen) < fraction).to(interpret))


def test_kept_first_by_blocks_of_rows(interpret):
    """Whole runs kept and dropped, across the kernel's blocks (256 rows in the interpreter)."""
    keep = torch.zeros(777, dtype=torch.bool)
    keep[100:300] = True
    keep[600:] = True
    check(keep.to(interpret))


def test_kept_first_of_no_rows(interpret):
    check(torch.zeros(0, dtype=torch.bool, device=interpret))


def test_kept_first_asserts_its_input(interpret):
    from dgemma_sampler.kernels.kept_rows import kept_first

    with pytest.raises(AssertionError, match="bool"):
        kept_first(torch.zeros(4, dtype=torch.int32, device=interpret))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 8192, 20000, 65536 + 3])
def test_gpu_kept_first_matches_a_stable_argsort(n):
    gen = torch.Generator().manual_seed(n)
    for fraction in (0.0, 0.03, 0.5, 1.0):
        check((torch.rand(n, generator=gen) < fraction).cuda())
