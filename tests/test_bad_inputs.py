"""Every public entry point rejects bad input with a clear error naming the argument."""

import pytest
import torch

import dgemma_sampler as ds

R, W, V, H = 2, 3, 50, 8


def args(**over):
    a = dict(logits=torch.randn(R, W, V), temperature=torch.tensor([0.5, 1.0]),
             seeds=torch.tensor([1, 2]), draws=torch.tensor([0, 0]))
    a.update(over)
    return a


@pytest.mark.parametrize("over, exc, match", [
    (dict(logits=torch.randn(R, V)), ValueError, "logits must be 3-D"),
    (dict(logits=torch.randint(0, 5, (R, W, V))), TypeError, "logits must have dtype"),
    (dict(logits=torch.randn(R, W, 2 * V)[..., ::2]), ValueError, "contiguous in the vocabulary"),
    (dict(logits=torch.randn(R, W, 0)), ValueError, "non-empty vocabulary"),
    (dict(temperature=torch.tensor([0.5])), ValueError, "temperature must have shape"),
    (dict(temperature=torch.tensor([0.5, -1.0])), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([0.5, float("nan")])), ValueError, "temperature must be finite"),
    (dict(seeds=torch.tensor([1.0, 2.0])), TypeError, "seeds must have dtype"),
    (dict(draws=torch.tensor([0])), ValueError, "draws must have shape"),
    (dict(seeds=[1, 2]), TypeError, "seeds must be a torch.Tensor"),
    (dict(top_k=torch.tensor([-1, 3])), ValueError, "top_k must be >= 0"),
    (dict(top_p=torch.tensor([0.0, 0.5])), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([0.5, 1.5])), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(allowed=torch.ones(R, V + 1, dtype=torch.bool)), ValueError, "allowed must have shape"),
    (dict(softcap=-1.0), ValueError, "softcap must be"),
    (dict(sample_block=100), ValueError, "sample_block must be a power of two"),
    (dict(sample_block=8), ValueError, "sample_block must be a power of two"),
])
def test_row_stats_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        ds.row_stats(**args(**over), backend="torch")


def test_unknown_backend_and_triton_without_cuda(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        ds.row_stats(**args(), backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ds.row_stats(**args(), backend="triton")


def test_soft_embedding_rejects():
    a = args()
    s = ds.row_stats(**a, backend="torch")
    e = torch.randn(V, H)
    call = dict(logits=a["logits"], temperature=a["temperature"], lse=s.lse, embed_weight=e,
                normalizer=2.0, backend="torch")
    with pytest.raises(ValueError, match="must lie inside the logits vocabulary"):
        ds.soft_embedding(**{**call, "embed_weight": torch.randn(V + 1, H)})
    with pytest.raises(ValueError, match="must lie inside"):
        ds.soft_embedding(**{**call, "vocab_start": 1})
    with pytest.raises(ValueError, match="lse must have shape"):
        ds.soft_embedding(**{**call, "lse": s.lse[:1]})
    with pytest.raises(TypeError, match="keep must have dtype"):
        ds.soft_embedding(**{**call, "keep": torch.ones(R, W)})
    with pytest.raises(ValueError, match="embed_weight must be contiguous"):
        ds.soft_embedding(**{**call, "embed_weight": torch.randn(H, V).t()})
    with pytest.raises(ValueError, match="normalizer must be a scalar"):
        ds.soft_embedding(**{**call, "normalizer": torch.ones(2)})
    with pytest.raises(ValueError, match="out must have shape"):
        ds.soft_embedding(**{**call, "out": torch.empty(R, W, H + 1)})


@pytest.mark.parametrize("over, exc, match", [
    (dict(logits=torch.randn(R, W, V).to(torch.int32)), TypeError, "logits must have dtype"),
    (dict(lse=torch.zeros(R, W, dtype=torch.float64)), TypeError, "lse must have dtype"),
    (dict(lse=torch.zeros(R, W, device="meta")), ValueError, "lse must be on cpu"),
    (dict(embed_weight=torch.randn(V, H).to(torch.int8)), TypeError, "embed_weight must have dtype"),
    (dict(vocab_start=1.0), TypeError, "vocab_start must be an int"),
    (dict(keep=torch.ones(R, W + 1, dtype=torch.bool)), ValueError, "keep must have shape"),
    (dict(threshold=torch.zeros(R, W, dtype=torch.float64)), TypeError, "threshold must have dtype"),
    (dict(allowed=torch.ones(R + 1, V, dtype=torch.bool)), ValueError, "allowed must have shape"),
    (dict(normalizer="1"), TypeError, "normalizer must be a float"),
    (dict(softcap=-1.0), ValueError, "softcap must be None"),
    (dict(softcap=float("inf")), ValueError, "softcap must be None"),
    (dict(out=torch.empty(R, W, H, dtype=torch.float64)), TypeError, "out must have dtype"),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_soft_embedding_rejects_every_argument(over, exc, match, backend, monkeypatch):
    """Validation happens before the backend is chosen: the Triton kernels only assert."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (no kernel runs: every call is rejected first)
    call = dict(logits=torch.randn(R, W, V), temperature=torch.tensor([0.5, 1.0]),
                lse=torch.zeros(R, W), embed_weight=torch.randn(V, H), normalizer=2.0,
                backend=backend)
    with pytest.raises(exc, match=match):
        ds.soft_embedding(**{**call, **over})


def make_sampler():
    cfg = ds.SamplerConfig(canvas_length=W)
    state = ds.DiffusionState(3, cfg, V, H)
    return state, ds.DiffusionSampler(cfg, state, torch.randn(V, H), 1.0, backend="torch")


def test_state_rejects():
    state, _ = make_sampler()
    with pytest.raises(ValueError, match="slot must be an int in"):
        state.add_request(3)
    with pytest.raises(ValueError, match="seed_canvas must hold exactly 3"):
        state.add_request(0, seed_canvas=[1, 2])
    with pytest.raises(ValueError, match="pinned positions need a seed_canvas"):
        state.add_request(0, pinned=[0])
    with pytest.raises(ValueError, match="pinned positions must be in"):
        state.add_request(0, seed_canvas=[1, 2, 3], pinned=[3])
    with pytest.raises(ValueError, match="allowed_ids must be"):
        state.add_request(0, allowed_ids=[V])
    with pytest.raises(ValueError, match="top_p must be in"):
        state.add_request(0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        state.add_request(0, top_k=-2)
    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        state.add_request(0, seed=2**64)
    with pytest.raises(ValueError, match="max_num_reqs"):
        ds.DiffusionState(0, ds.SamplerConfig(), V, H)


def test_sampler_rejects():
    state, sampler = make_sampler()
    with pytest.raises(ValueError, match="holds no request"):
        sampler.step(torch.randn(W, V), [0])
    state.add_request(0, seed=1)
    state.add_request(1, seed=2)
    sampler.prefill([0, 1])
    with pytest.raises(ValueError, match="expected 6 rows"):
        sampler.step(torch.randn(W, V), [0, 1])
    with pytest.raises(ValueError, match="slots must not repeat"):
        sampler.step(torch.randn(2 * W, V), [0, 0])
    with pytest.raises(ValueError, match="valid_len must hold one length per slot"):
        sampler.step(torch.randn(2 * W, V), [0, 1], valid_len=[W + 1, W - 1])
    with pytest.raises(ValueError, match="logits vocabulary"):
        sampler.step(torch.randn(2 * W, V + 1), [0, 1])
    with pytest.raises(ValueError, match="embed_weight must have hidden size"):
        ds.DiffusionSampler(sampler.cfg, state, torch.randn(V, H + 1), 1.0)
    with pytest.raises(TypeError, match="cfg must be a SamplerConfig"):
        ds.DiffusionSampler({}, state, torch.randn(V, H), 1.0)


def test_empty_batch_is_a_no_op():
    state, sampler = make_sampler()
    before = state.canvas.clone()
    out = sampler.step(torch.randn(0, V), [])
    assert out.num_sampled.numel() == 0 and torch.equal(state.canvas, before)
    s = ds.row_stats(torch.randn(0, W, V), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                     torch.zeros(0, dtype=torch.int64), backend="torch")
    assert s.argmax.shape == (0, W)


def test_nan_row_does_not_poison_its_neighbours():
    x = torch.randn(1, 3, V)
    clean = ds.row_stats(x, torch.tensor([0.7]), torch.tensor([9]), torch.tensor([0]), backend="torch")
    x[0, 1, 7] = float("nan")
    dirty = ds.row_stats(x, torch.tensor([0.7]), torch.tensor([9]), torch.tensor([0]), backend="torch")
    assert dirty.has_nan[0].tolist() == [False, True, False]
    for name in ("argmax", "sample", "entropy", "lse"):
        a, b = getattr(clean, name)[0, [0, 2]], getattr(dirty, name)[0, [0, 2]]
        assert torch.equal(a, b), name
