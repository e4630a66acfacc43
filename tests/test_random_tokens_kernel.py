"""The keyed random-token kernel against its PyTorch twin (bit for bit), and its use in the step."""

import pytest
import torch

from dgemma_sampler import keyed_noise
from dgemma_sampler.keyed_noise import Stream

BOTH = (Stream.RENOISE, Stream.CANVAS)


def torch_twin(seeds, draws, width, streams, vocab):
    pos = torch.arange(width, device=seeds.device).unsqueeze(0)
    return torch.stack([keyed_noise.random_tokens(seeds.unsqueeze(1), draws.unsqueeze(1), pos, s, vocab)
                        for s in streams])


def edge_keys(n, device, gen):
    """Seeds over the whole int64 range (both ends included) and draw counters past 2^32."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen).to(device)
    draws = torch.randint(0, 2**62, (n,), generator=gen).to(device)
    seeds[0], draws[0] = 2**63 - 1, 2**32 + 3
    if n > 1:
        seeds[1], draws[1] = -(2**63), 2**32 - 1
    if n > 2:
        seeds[2], draws[2] = -1, 0
    return seeds, draws


def launch(seeds, draws, width, streams, vocab):
    from dgemma_sampler.kernels.random_tokens import random_tokens_canvas

    out = torch.full((len(streams), seeds.numel(), width), -7, dtype=torch.int64, device=seeds.device)
    got = random_tokens_canvas(seeds, draws, width, streams, vocab, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (got >= 0).all() and (got < vocab).all(), "an element was not written"
    return got


@pytest.mark.parametrize("n,width,vocab", [(1, 1, 7), (3, 37, 4099), (5, 300, 262144),
                                           (2, 33, 2**31 - 1)])
@pytest.mark.parametrize("streams", [BOTH, (Stream.CANVAS,), (Stream.RENOISE,)])
def test_random_tokens_kernel_matches_torch_twin(interpret, n, width, vocab, streams):
    gen = torch.Generator().manual_seed(n * 1000 + width)
    seeds, draws = edge_keys(n, interpret, gen)
    got = launch(seeds, draws, width, streams, vocab)
    assert torch.equal(got, torch_twin(seeds, draws, width, streams, vocab))


def test_random_tokens_kernel_asserts_its_arguments(interpret):
    """Only asserted: the step builds these arguments."""
    from dgemma_sampler.kernels.random_tokens import random_tokens_canvas

    s = torch.zeros(3, dtype=torch.int64, device=interpret)
    with pytest.raises(AssertionError, match="streams"):
        random_tokens_canvas(s, s, 4, (), 10)
    with pytest.raises(AssertionError, match="streams"):
        random_tokens_canvas(s, s, 4, (1, 2, 3), 10)
    with pytest.raises(AssertionError, match="int64"):
        random_tokens_canvas(s.int(), s, 4, BOTH, 10)
    with pytest.raises(AssertionError, match="same shape"):
        random_tokens_canvas(s, s[:2], 4, BOTH, 10)
    with pytest.raises(AssertionError, match="vocab_size"):
        random_tokens_canvas(s, s, 4, BOTH, 0)
    with pytest.raises(AssertionError, match="out must"):
        random_tokens_canvas(s, s, 4, BOTH, 10, out=torch.empty(2, 3, 5, dtype=torch.int64))
    assert random_tokens_canvas(s[:0], s[:0], 4, BOTH, 10).shape == (2, 0, 4)


def test_step_noise_is_the_same_from_kernel_and_torch(interpret):
    """``denoise_update`` with the kernel's tokens leaves the state exactly as with the twin's."""
    import dgemma_sampler as ds
    from dgemma_sampler import step as step_mod
    from dgemma_sampler.reference import RowStats

    n, canvas, vocab = 3, 9, 4099
    cfg = ds.SamplerConfig(canvas_length=canvas, max_denoising_steps=3, confidence_threshold=5.0)
    states = []
    for _ in range(2):
        st = ds.DiffusionState(n + 1, cfg, vocab, 8, interpret)
        for j in range(n):
            st.add_request(j + 1, seed=2**63 - 1 - j, canvas_width=[9, 7, 8][j])
        st.finish_prefill([1, 2, 3])
        st.is_encoder_phase[3] = True  # one request commits: it takes a fresh canvas
        states.append(st)
    slots = torch.tensor([1, 2, 3], device=interpret)
    width = torch.tensor([9, 7, 8], device=interpret)
    for it in range(3):
        gen = torch.Generator().manual_seed(it)
        ent = torch.rand(n, canvas, generator=gen) * 0.2
        stats = RowStats(
            argmax=torch.randint(0, vocab, (n, canvas), generator=gen),
            sample=torch.randint(0, vocab, (n, canvas), generator=gen),
            entropy=ent, lse=torch.rand(n, canvas, generator=gen),
            threshold=torch.full((n, canvas), float("-inf")),
            has_nan=torch.zeros(n, canvas, dtype=torch.bool),
        )
        stats = RowStats(*(t.to(interpret) for t in stats.as_tuple()))
        outs = [step_mod.denoise_update(st, slots, stats, width, width, canvas,
                                        confidence_threshold=cfg.confidence_threshold,
                                        entropy_bound=0.05, vocab_size=vocab, noise_backend=b)
                for st, b in zip(states, ("triton", "torch"))]
        for a, b in zip(outs[0], outs[1]):
            assert torch.equal(a, b)
        for name in ("canvas", "argmax_canvas", "accepted_canvas_history", "step", "draws",
                     "is_encoder_phase"):
            assert torch.equal(getattr(states[0], name), getattr(states[1], name)), name
    assert (states[0].canvas[1:4] != states[0].argmax_canvas[1:4]).any()  # renoise happened


@pytest.mark.gpu
def test_random_tokens_kernel_matches_torch_twin_gpu():
    gen = torch.Generator().manual_seed(3)
    seeds, draws = edge_keys(33, "cuda", gen)
    for width, vocab in ((256, 262144), (255, 262145)):
        got = launch(seeds, draws, width, BOTH, vocab)
        assert torch.equal(got, torch_twin(seeds, draws, width, BOTH, vocab))
