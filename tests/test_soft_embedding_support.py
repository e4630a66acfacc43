"""The tail-tolerant soft embedding: the bound, the tiers, kernels against the oracle.

CPU: ``TRITON_INTERPRET=1 pytest -q tests/test_soft_embedding_support.py`` (small awkward
shapes); GPU (``-m gpu``): the production vocabulary. The float64 reference is written here
from the spec: ``z`` in fp32 as ``reference.py`` defines it, then ``softmax(z) @ E`` in float64.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from conftest import capture_step

import dgemma_sampler as ds
from dgemma_sampler import reference
from dgemma_sampler import support as sp
from dgemma_sampler.backend import kernels

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
EPS = 2.0**-10
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


def peaked_logits(r, w, v, *, device=DEVICE, dtype=torch.float32, seed=0):
    """Rows from broad (Gaussian) to peaked (one token 1 - 10^-k of the mass, Zipf tail)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, w, v, generator=g) * 1.5
    zipf = -torch.log(torch.arange(1, v + 1, dtype=torch.float32))
    for i in range(w):
        kind = i % 8
        if kind == 0:
            continue  # broad
        perm = torch.randperm(v, generator=g)
        tail = zipf[perm] + 0.1 * torch.randn(v, generator=g)
        top = int(perm[0])
        # head mass 1 - 10^-k against the tail's softmax: head = log((1 - d)/d) + lse(tail)
        k = min(kind, 6)
        d = 10.0 ** -k
        head = math.log((1 - d) / d) + float(torch.logsumexp(tail, 0))
        tail[top] = head
        x[:, i] = tail
    return x.to(dtype).to(device)


def exact_soft(x, temperature, embed, normalizer, *, softcap=None, threshold=None, allowed=None,
               vocab_start=0):
    """float64 ``normalizer * softmax(z) @ E`` of the columns E covers; z as reference.py."""
    r, w, v = x.shape
    xf = reference.softcapped(x.reshape(r * w, v).cpu(), softcap)
    inv_t = reference.inverse_temperature(temperature.cpu()).repeat_interleave(w)
    z = torch.clamp(xf * inv_t[:, None], max=reference.FLT_MAX)
    masked = torch.isnan(xf) | (xf == -math.inf)
    if threshold is not None:
        masked |= xf < threshold.reshape(-1, 1).cpu()
    if allowed is not None:
        masked |= ~allowed.cpu().repeat_interleave(w, 0)
    z = torch.where(masked, -math.inf, z).double()
    p = torch.softmax(z, dim=-1).nan_to_num(0.0)
    e = embed.cpu().double()
    p = p[:, vocab_start:vocab_start + e.shape[0]]
    return (normalizer * p @ e).view(r, w, -1)


def stats_of(x, temperature, **kw):
    r = x.shape[0]
    seeds = torch.arange(r, device=x.device)
    draws = torch.zeros(r, dtype=torch.int64, device=x.device)
    return ds.row_stats(x, temperature, seeds, draws, backend="torch", **kw)


# -- the bound -------------------------------------------------------------------------------

def test_entropy_skip_is_the_maximum_entropy_of_a_small_support():
    k, v = 5, 1000
    h = sp.entropy_skip(EPS, k, v)
    # the extremal distribution: uniform 1 - eps over K tokens, uniform eps over the rest
    f64 = torch.float64
    p = torch.cat([torch.full((k,), (1 - EPS) / k, dtype=f64),
                   torch.full((v - k,), EPS / (v - k), dtype=f64)])
    assert abs(float(-(p * p.log()).sum()) - h) < 1e-12
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        kk = int(torch.randint(1, k + 1, (1,), generator=g))
        head = torch.rand(kk, generator=g, dtype=torch.float64)
        tail = torch.rand(v - kk, generator=g, dtype=torch.float64) ** 8
        m = float(torch.rand((), generator=g)) * EPS
        q = torch.cat([head / head.sum() * (1 - m), tail / tail.sum() * m])
        assert float(-(q * q.log()).sum()) <= h + 1e-12
    assert sp.entropy_skip(0.0, k, v) == math.inf
    assert sp.entropy_skip(0.5, 600, 1000) == math.inf  # K / V >= 1 - eps: no bound
    assert sp.entropy_skip_f32(EPS, k, v) >= h


def test_bin_weights_round_up_exactly():
    w = sp.default_bin_weights()
    assert w[-1] == 0 and w.numel() == sp.NUM_BINS
    for j in range(sp.NUM_BINS - 1):
        wj = int(w[j])
        e = 4 * sp.FIXED_BITS - j
        if e >= 0:
            assert wj**4 >= 2**e and (wj - 1) ** 4 < 2**e
        else:
            assert wj == 1
    assert sp.tail_budget(EPS) == 2**46


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_oracle_support_mass_against_float64(softcap):
    x = peaked_logits(2, 16, 700, device="cpu")
    x[:, 0] *= 0.02  # flat rows: top probability below (1 - eps) / K
    t = torch.tensor([0.6, 0.4])
    st = stats_of(x, t, softcap=softcap)
    flat = x.reshape(-1, 700)
    req = torch.arange(2).repeat_interleave(16)
    s = sp.support_rows(flat, req, t, st.lse.reshape(-1), tail_eps=EPS, softcap=softcap,
                        argmax=st.argmax.reshape(-1))
    z = torch.clamp(reference.softcapped(flat, softcap) * reference.inverse_temperature(t)[req, None],
                    max=reference.FLT_MAX).double()
    p = torch.softmax(z, -1)
    sparse = s.sparse()
    assert int(sparse.sum()) >= 20  # the peaked rows
    for n in torch.nonzero(sparse).flatten().tolist():
        c = int(s.count[n])
        ids = s.ids[n, :c].long()
        assert (s.ids[n, c:] == -1).all() and bool((ids[1:] > ids[:-1]).all())
        assert 1 - float(p[n, ids].sum()) <= EPS
        # minimal within the bins' factor: the set of tolerance eps / 2^(1/4) is no smaller
        order = p[n].sort(descending=True)
        need = int((order.values.cumsum(0) < 1 - EPS / 2**0.25).sum()) + 1
        assert c <= need
    # the dense rows really need more than K tokens, or a cut below eps / K (the mass under
    # that level alone exceeds the tolerance of the bins); the filtered ones for the whole eps
    for n in torch.nonzero(s.path == sp.PATH_SUPPORT_DENSE).flatten().tolist():
        top_k = float(p[n].sort(descending=True).values[:sp.MAX_SUPPORT].sum())
        below = float(p[n][p[n] <= EPS / sp.MAX_SUPPORT].sum())
        assert top_k < 1 - EPS / 2**0.25 or below > EPS / 2**0.25 * (1 - 1e-4)
    filtered = torch.nonzero(s.path == sp.PATH_STATS_DENSE).flatten().tolist()
    assert filtered  # the broad rows, by their top probability
    for n in filtered:
        assert float(p[n].sort(descending=True).values[:sp.MAX_SUPPORT].sum()) < 1 - EPS


def _find(backend, x, t, eps, k=sp.MAX_SUPPORT):
    """The support decision of ``backend`` over flat rows ``x`` of request 0, tiers 2 off."""
    lse = torch.logsumexp(x.double() * reference.inverse_temperature(t.cpu()).double().to(x.device),
                          dim=1).float()
    return sp.decide_support(kernels(backend).support_rows, x,
                             torch.zeros(x.shape[0], dtype=torch.int64, device=x.device), t, lse,
                             tail_eps=eps, max_support=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_needs_a_cut_below_eps_over_k_is_dense(backend):
    """One head token, 60 tokens at 0.9 eps / K each and a thin tail of 0.5 eps: the 61 tokens
    would hold all but 0.5 eps, but only with a cut below eps / K. The row is dense, and the
    mass below that level within (eps, 2 eps]: past the budget, so its count is 2K + 1."""
    v, k = 4000, sp.MAX_SUPPORT
    p = torch.full((v,), 0.5 * EPS / (v - 61), dtype=torch.float64)
    p[1:61] = 0.9 * EPS / k
    p[0] = 1 - float(p[1:].sum())
    x = p.log().float().unsqueeze(0).to(DEVICE)
    s = _find(backend, x, torch.ones(1, device=DEVICE), EPS)
    assert s.path.tolist() == [sp.PATH_SUPPORT_DENSE] and s.count.tolist() == [2 * k + 1]
    below = float(p[p <= EPS / k].sum())
    assert EPS < below <= 2 * EPS


@pytest.mark.parametrize("backend", BACKENDS)
def test_tail_budget_just_below_two_to_the_31(backend):
    """budget = 2^31 - 1 (eps just below 2^-25): budget + 1 must not wrap in the kernel (an
    int argument below 2^31 arrives as int32). A head token and a tail of 20 eps under the
    lowest cut: dense with count 2K + 1, as the oracle says (the wrapped sum read as sparse with
    an empty S)."""
    eps = (2**31 - 1) * 2.0**-56
    assert sp.tail_budget(eps) == 2**31 - 1
    v = 4096
    p = torch.full((v,), 20 * eps / (v - 1), dtype=torch.float64)
    p[0] = 1 - 20 * eps
    x = p.log().float().unsqueeze(0).to(DEVICE)
    s = _find(backend, x, torch.ones(1, device=DEVICE), eps)
    assert s.path.tolist() == [sp.PATH_SUPPORT_DENSE]
    assert s.count.tolist() == [2 * sp.MAX_SUPPORT + 1]


def test_tiers_and_special_rows():
    v = 500
    x = peaked_logits(1, 8, v, device="cpu")
    x[0, 0] = torch.randn(v) * 0.1  # broad: entropy near log V
    x[0, 2, 17] = float("nan")  # a NaN entry: masked, as on the dense path
    x[0, 3] = -math.inf  # nothing kept: lse -inf, an empty support (zero)
    t = torch.tensor([0.5])
    st = stats_of(x, t)
    flat = x.reshape(-1, v)
    req = torch.zeros(8, dtype=torch.int64)
    keep = torch.ones(8, dtype=torch.bool)
    keep[7] = False
    h = sp.entropy_skip_f32(EPS, sp.MAX_SUPPORT, v)
    s = sp.support_rows(flat, req, t, st.lse.reshape(-1), tail_eps=EPS, keep=keep,
                        argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1),
                        entropy_bound=h)
    assert s.path[0] == sp.PATH_STATS_DENSE  # broad
    assert s.path[6] == sp.PATH_TOP1 and s.ids[6, 0] == st.argmax[0, 6]  # 1 - 1e-6 on one token
    assert s.path[2] == sp.PATH_TOP1  # its NaN entry is masked, the row stays peaked
    assert s.path[3] == sp.PATH_TOP1 and s.count[3] == 0
    assert s.path[7] == sp.PATH_NOT_KEPT
    assert s.path_rows().sum() == 8


def test_greedy_rows_take_the_tied_maxima():
    v = 300
    x = torch.randn(1, 3, v)
    x[0, 0, [5, 9, 200]] = 8.0  # three tied maxima
    x[0, 1, 42] = 8.0
    t = torch.tensor([0.0])
    st = stats_of(x, t)
    e = torch.randn(v, 24)
    s = sp.support_rows(x.reshape(-1, v), torch.zeros(3, dtype=torch.int64), t,
                        st.lse.reshape(-1), tail_eps=EPS, argmax=st.argmax.reshape(-1))
    assert s.path[0] == sp.PATH_SUPPORT and s.ids[0, :3].tolist() == [5, 9, 200]
    assert s.count[1] == 1 and s.ids[1, 0] == 42
    got = ds.soft_embedding(x, t, st.lse, e, 2.0, backend="torch", tail_eps=EPS,
                            argmax=st.argmax, entropy=st.entropy)
    dense = ds.soft_embedding(x, t, st.lse, e, 2.0, backend="torch")
    torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ties", [130, 200])
def test_many_greedy_ties_do_not_overflow_the_tail_sum(backend, ties):
    # >= 128 tokens in bin 0 (weight 2^56): the unsaturated int64 tail sum wrapped, the cut
    # became 0 and the row was written as zero.
    v, h = 300, 16
    x = torch.randn(1, 2, v, device=DEVICE)
    x[0, :, :ties] = 8.0
    t = torch.tensor([0.0], device=DEVICE)
    st = stats_of(x, t)
    # bf16 E: an fp32 E multiplies in tf32 on the GPU's dense path, far from the float64 sum
    e = torch.randn(v, h, device=DEVICE).to(torch.bfloat16)
    for k in (sp.MAX_SUPPORT, 256):  # dense by the support size, then sparse over the ties
        find = kernels(backend).support_rows
        s = sp.decide_support(find, x.reshape(-1, v), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                              t, st.lse.reshape(-1), tail_eps=2.0**-12, max_support=k,
                              argmax=st.argmax.reshape(-1))
        # dense: more than 2K candidates, counted up to 2K + 1
        assert s.count.tolist() == [ties if ties <= k else min(ties, 2 * k + 1)] * 2
        want_path = sp.PATH_SUPPORT if ties <= k else sp.PATH_SUPPORT_DENSE
        assert s.path.tolist() == [want_path] * 2
    # no entropy: the tier-2 filter would send these rows to the dense path before the pass
    got = ds.soft_embedding(x, t, st.lse, e, 2.0, backend=backend, tail_eps=2.0**-12,
                            argmax=st.argmax)
    want = 2.0 * e[:ties].double().cpu().sum(0)  # greedy: p = 1 at each tied maximum
    torch.testing.assert_close(got.reshape(2, h).double().cpu(), want.expand(2, h), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_logits_keep_the_bound(backend):
    v, h = 300, 16
    x = torch.randn(1, 3, v, device=DEVICE)
    x[0, 0, 7] = math.inf  # one +inf: all the mass on it (z clamps to FLT_MAX)
    x[0, 1, [3, 150]] = math.inf  # two: half each
    for t_value in (0.0, 0.8):
        t = torch.tensor([t_value], device=DEVICE)
        st = stats_of(x, t)
        # bf16 E: with fp32 E the GPU's dense path multiplies in tf32 and the gather does not
        e = torch.randn(v, h, device=DEVICE).to(torch.bfloat16)
        got = ds.soft_embedding(x, t, st.lse, e, 1.0, backend=backend, tail_eps=EPS,
                                argmax=st.argmax, entropy=st.entropy)
        dense = ds.soft_embedding(x, t, st.lse, e, 1.0, backend=backend)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[0, :2], dense[0, :2], rtol=1e-5, atol=1e-5)
        scale = float(e.float().abs().max())
        assert float((got[0, 2] - dense[0, 2]).abs().max()) <= (EPS + 2.0**-8) * scale


# -- the soft embedding: bound, masks, eps = 0 -------------------------------------------------

def check_bound(got, want, embed, normalizer, dense_rows, dense_tol):
    """Sparse rows within eps * normalizer * max|E| of float64 (plus fp32 rounding of p);
    dense rows within the dense path's own tolerance."""
    scale = normalizer * float(embed.float().abs().max())
    err = (got.double().cpu() - want).abs().amax(-1)
    sparse_err = err[~dense_rows]
    assert float(sparse_err.max()) <= (EPS + 2.0**-16) * scale
    if dense_rows.any():
        assert float(err[dense_rows].max()) <= dense_tol * scale



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["plain", "softcap", "threshold", "allowed", "bf16", "keep"])
def test_soft_embedding_within_the_bound(backend, case):
    r, w, v, h = 2, 11, 900, 36
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    x = peaked_logits(r, w, v, dtype=dtype, seed=3)
    t = torch.tensor([0.7, 0.45], device=DEVICE)
    kw = {}
    if case == "softcap":
        kw["softcap"] = 30.0
    if case == "allowed":
        kw["allowed"] = torch.rand(r, v, device=DEVICE) < 0.8
        x[:, :, :] = x.float().where(kw["allowed"][:, None, :], x.float() - 3.0).to(dtype)
    stats_kw = dict(kw)
    if case == "threshold":
        stats_kw["top_k"] = torch.tensor([50, 0], device=DEVICE)
        stats_kw["top_p"] = torch.tensor([1.0, 0.9], device=DEVICE)
    st = stats_of(x, t, **stats_kw)
    if case == "threshold":
        kw["threshold"] = st.threshold
    keep = None
    if case == "keep":
        keep = torch.rand(r, w, device=DEVICE) < 0.6
    e = (torch.randn(v, h, device=DEVICE) * 0.05).to(torch.bfloat16)
    got = ds.soft_embedding(x, t, st.lse, e, 4.0, keep=keep, backend=backend, tail_eps=EPS,
                            argmax=st.argmax, entropy=st.entropy, **kw)
    want = exact_soft(x, t, e, 4.0, softcap=kw.get("softcap"), threshold=kw.get("threshold"),
                      allowed=kw.get("allowed"))
    if keep is not None:
        want = torch.where(keep.cpu()[..., None], want, 0.0)
    fns = kernels("torch")
    flat = x.reshape(r * w, v)
    req = torch.arange(r, device=DEVICE).repeat_interleave(w)
    _, s = sp.soft_embedding_tail(fns, flat, req, t, st.lse.reshape(-1), e, 4.0, tail_eps=EPS,
                                  keep=None if keep is None else keep.reshape(-1),
                                  threshold=None if "threshold" not in kw else st.threshold.reshape(-1),
                                  allowed=kw.get("allowed"), softcap=kw.get("softcap"),
                                  argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1))
    assert int(s.sparse().sum()) > 0
    dense_tol = 2.0**-8 if backend == "triton" else 1e-5  # bf16 probabilities on the kernel
    check_bound(got.reshape(r * w, h), want.reshape(r * w, h), e, 4.0, s.dense().cpu(), dense_tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eps_zero_is_the_dense_result(backend):
    x = peaked_logits(1, 6, 400)
    t = torch.tensor([0.5], device=DEVICE)
    st = stats_of(x, t)
    e = torch.randn(400, 20, device=DEVICE).to(torch.bfloat16)
    a = ds.soft_embedding(x, t, st.lse, e, 1.5, backend=backend, tail_eps=0.0, argmax=st.argmax)
    b = ds.soft_embedding(x, t, st.lse, e, 1.5, backend=backend)
    assert torch.equal(a, b)


def test_rejects_bad_tail_eps():
    x = peaked_logits(1, 2, 100, device="cpu")
    t = torch.tensor([0.5])
    st = stats_of(x, t)
    e = torch.randn(100, 8)
    for bad in (-1e-3, 0.5, 1e-12, float("nan")):
        with pytest.raises(ValueError, match="tail_eps"):
            ds.soft_embedding(x, t, st.lse, e, 1.0, backend="torch", tail_eps=bad)
    with pytest.raises(ValueError, match="tail_eps"):
        ds.SamplerConfig(tail_eps=0.3)
    assert ds.SamplerConfig().tail_eps == EPS and ds.SamplerConfig(tail_eps=0).tail_eps == 0
    assert ds.SamplerConfig(tail_eps=2.0**-30).tail_eps == 2.0**-30
    with pytest.raises(ValueError, match="tail_eps"):
        sp.soft_embedding_tail(kernels("torch"), x.reshape(2, 100),
                               torch.zeros(2, dtype=torch.int64), t, st.lse.reshape(-1), e, 1.0,
                               tail_eps=0.0)


def test_slice_share_below_the_smallest_tolerance_is_dense():
    # one rule for the step (V_local / V) and the sharded soft embedding (1 / world)
    assert sp.slice_tail_eps(2.0**-10, 0.5) == 2.0**-11
    assert sp.slice_tail_eps(2.0**-30, 0.5) == 0.0 and sp.slice_tail_eps(0.0, 0.25) == 0.0
    from dgemma_sampler import tensor_parallel as tp

    x = peaked_logits(1, 3, 64, device="cpu", seed=2)
    t = torch.tensor([0.5])
    st = stats_of(x, t)
    e = torch.randn(64, 8)
    a = tp.soft_embedding_sharded(x, t, st.lse, e, 2.0, backend="torch", tail_eps=2.0**-30)
    assert torch.equal(a, ds.soft_embedding(x, t, st.lse, e, 2.0, backend="torch", tail_eps=2.0**-30))


def test_vocabulary_slices_keep_the_global_bound():
    """Ranks sum their slices' shares, each with eps / world: the sum stays within eps."""
    r, w, v, h = 1, 12, 1024, 16
    x = peaked_logits(r, w, v, device="cpu", seed=5)
    t = torch.tensor([0.6])
    st = stats_of(x, t)
    e = torch.randn(v, h) * 0.1
    bounds = [0, 300, 301, 700, 1024]  # uneven, one single-token slice
    world = len(bounds) - 1
    total = torch.zeros(r, w, h)
    for a, b in itertools.pairwise(bounds):
        total += ds.soft_embedding(x[..., a:b].contiguous(), t, st.lse, e[a:b].contiguous(), 2.0,
                                   backend="torch", tail_eps=EPS / world)
    want = exact_soft(x, t, e, 2.0)
    err = (total.double() - want).abs().amax()
    assert float(err) <= (EPS + 2.0**-16) * 2.0 * float(e.abs().max())


def test_sharded_soft_embedding_takes_the_tolerance():
    """Without a process group (world 1) the sharded call is the single-GPU one."""
    from dgemma_sampler import tensor_parallel as tp

    x = peaked_logits(1, 6, 256, device="cpu", seed=9)
    t = torch.tensor([0.5])
    st = stats_of(x, t)
    e = torch.randn(256, 12)
    a = tp.soft_embedding_sharded(x, t, st.lse, e, 2.0, backend="torch", tail_eps=EPS)
    b = ds.soft_embedding(x, t, st.lse, e, 2.0, backend="torch", tail_eps=EPS)
    assert torch.equal(a, b)


# -- kernels against the oracle ---------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("case", ["plain", "softcap_bf16", "threshold_allowed", "slice", "greedy"])
def test_support_kernel_matches_oracle(case):
    from dgemma_sampler.kernels.soft_embedding_support import support_rows as kernel_support

    r, w, v = 2, 9, 1100
    dtype = torch.bfloat16 if case == "softcap_bf16" else torch.float32
    x = peaked_logits(r, w, v, dtype=dtype, seed=7)
    x[0, 4, 3] = float("nan")
    x[1, 5, 10] = float("inf")
    t = torch.tensor([0.0 if case == "greedy" else 0.65, 0.4], device=DEVICE)
    softcap = 30.0 if case == "softcap_bf16" else None
    kw = dict(softcap=softcap)
    stats_kw = dict(softcap=softcap)
    if case == "threshold_allowed":
        stats_kw["top_p"] = torch.tensor([0.95, 1.0], device=DEVICE)
        stats_kw["allowed"] = kw["allowed"] = torch.rand(r, v, device=DEVICE) < 0.9
    st = stats_of(x, t, **stats_kw)
    if case == "threshold_allowed":
        kw["threshold"] = st.threshold.reshape(-1)
    vocab_start, v_local = (256, 600) if case == "slice" else (0, v)
    flat = x.reshape(r * w, v)
    req = torch.arange(r, device=DEVICE).repeat_interleave(w)
    keep = torch.ones(r * w, dtype=torch.bool, device=DEVICE)
    keep[3] = False
    h = sp.entropy_skip_f32(EPS, sp.MAX_SUPPORT, v)
    args = (flat, req, t, st.lse.reshape(-1))
    common = dict(tail_eps=EPS, bin_weights=sp.weights_on(flat.device),
                  budget=sp.tail_budget(EPS), lowest=sp.lowest_cut(EPS, sp.MAX_SUPPORT),
                  vocab_start=vocab_start, v_local=v_local,
                  keep=keep, argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1),
                  entropy_bound=h, **kw)
    # the rows per path, added by both to what is there
    rows_oracle, rows_kernel = (torch.full((sp.NUM_PATHS,), 3, dtype=torch.int64, device=DEVICE)
                                for _ in range(2))
    want = sp.support_rows(*args, **common, path_rows=rows_oracle)
    path, count, ids = kernel_support(*args, **common, path_rows=rows_kernel)
    assert torch.equal(path.cpu(), want.path.cpu())
    assert torch.equal(count.cpu(), want.count.cpu())
    assert torch.equal(ids.cpu(), want.ids.cpu())
    assert set(path.tolist()) >= {sp.PATH_NOT_KEPT, sp.PATH_SUPPORT}
    counted = torch.bincount(path.cpu().long(), minlength=sp.NUM_PATHS) + 3
    assert torch.equal(rows_kernel.cpu(), counted) and torch.equal(rows_oracle.cpu(), counted)


def _block_runs(x, t, blocks, filters=True):
    """The Triton support pass of ``x`` ([r, w, v] logits) with each block width in ``blocks``;
    ``filters`` False: no argmax or entropy, every row takes the pass."""
    from dgemma_sampler.kernels.soft_embedding_support import support_rows as kernel_support

    r, w, v = x.shape
    st = stats_of(x, t)
    flat = x.reshape(r * w, v)
    req = torch.arange(r, device=x.device).repeat_interleave(w)
    filt = {}
    if filters:
        filt = dict(argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1),
                    entropy_bound=sp.entropy_skip_f32(EPS, sp.MAX_SUPPORT, v))
    runs = [sp.decide_support(kernel_support, flat, req, t, st.lse.reshape(-1), tail_eps=EPS,
                              block_v=b, **filt) for b in blocks]
    return [(s.path, s.count, s.ids, s.path_rows()) for s in runs]


@needs_triton
def test_support_kernel_result_does_not_depend_on_its_block():
    """The pass's block (chosen by the launch's row count) changes no row's path, count, S or
    the rows per path: heavy tails stopped early and rows past 2K candidates included (k = 1..6
    rows)."""
    x = peaked_logits(2, 8, 3000, seed=5)
    x[1, :3] = torch.randn(3, 3000, device=DEVICE) * 0.5  # broad rows: many candidates
    x[1, 3, :200] = 30.0  # 200 tied tokens: past 2K candidates, but a light tail
    for filters in (True, False):
        runs = _block_runs(x, torch.tensor([0.65, 0.9], device=DEVICE), (32, 256, 1024), filters)
        paths = set(runs[0][0].tolist())
        assert sp.PATH_SUPPORT in paths and (filters or sp.PATH_SUPPORT_DENSE in paths)
        for run in runs[1:]:
            for a, b in zip(runs[0], run):
                assert torch.equal(a, b)


@needs_triton
def test_inverse_temperature_from_the_caller_is_checked():
    from dgemma_sampler.kernels.soft_embedding_support import support_rows as kernel_support

    x = peaked_logits(1, 4, 300, seed=2).reshape(4, 300)
    t = torch.tensor([0.5], device=DEVICE)
    req = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    lse = torch.logsumexp(x / 0.5, dim=-1)
    with pytest.raises(AssertionError, match="inv_t"):
        sp.decide_support(kernel_support, x, req, t, lse, tail_eps=EPS,
                          inv_t=torch.full((4,), 2.0, device=DEVICE))  # per row, not per request


@needs_triton
def test_a_heavy_tail_below_the_lowest_cut_is_dense_early():
    """A row whose mass below the lowest cut alone passes eps (1% spread evenly: each token far
    below eps / K) is dense whatever its candidates; the kernel may stop reading it at the
    first look at that sum (a few blocks in), and both report 2K + 1, as for a row with too
    many candidates. A lighter even tail (eps / 4) stays sparse."""
    from dgemma_sampler.kernels.soft_embedding_support import support_rows as kernel_support

    v = 8192
    rows = []
    for tail in (1e-2, EPS / 4):
        z = torch.full((v,), math.log(tail / (v - 1)))
        z[4321] = math.log(1 - tail)
        rows.append(z)
    x = torch.stack(rows).to(DEVICE)
    req = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    t = torch.ones(1, device=DEVICE)
    lse = torch.logsumexp(x, dim=1)
    common = dict(tail_eps=EPS, bin_weights=sp.weights_on(x.device), budget=sp.tail_budget(EPS),
                  lowest=sp.lowest_cut(EPS, sp.MAX_SUPPORT))
    want = sp.support_rows(x, req, t, lse, **common)
    path, count, ids = kernel_support(x, req, t, lse, **common, block_v=256)
    assert want.path.tolist() == [sp.PATH_SUPPORT_DENSE, sp.PATH_SUPPORT]
    assert want.count.tolist() == [2 * sp.MAX_SUPPORT + 1, 1]
    assert torch.equal(path.cpu(), want.path.cpu()) and torch.equal(count.cpu(), want.count.cpu())
    assert torch.equal(ids.cpu(), want.ids.cpu())


@needs_triton
def test_gather_kernel_matches_oracle_and_is_batch_independent():
    from dgemma_sampler.kernels.soft_embedding_gather import gather_rows as kernel_gather

    r, w, v, h = 2, 10, 800, 70
    x = peaked_logits(r, w, v, seed=11)
    t = torch.tensor([0.55, 0.8], device=DEVICE)
    st = stats_of(x, t)
    flat = x.reshape(r * w, v)
    req = torch.arange(r, device=DEVICE).repeat_interleave(w)
    s = sp.support_rows(flat, req, t, st.lse.reshape(-1), tail_eps=EPS,
                        argmax=st.argmax.reshape(-1))
    e = torch.randn(v, h, device=DEVICE).to(torch.bfloat16)
    out = torch.full((r * w, h), float("nan"), device=DEVICE)
    want = sp.gather_rows(flat, req, t, st.lse.reshape(-1), e, 3.0, s.path, s.count, s.ids,
                          out=out.clone())
    got = kernel_gather(flat, req, t, st.lse.reshape(-1), e, 3.0, s.path, s.count, s.ids,
                        out=out.clone())
    sparse = s.sparse()
    if INTERPRET:  # the same fp32 operations in the same order
        assert torch.equal(got[sparse], want[sparse])
    else:  # the kernel fuses p * e + acc into one FMA
        torch.testing.assert_close(got[sparse], want[sparse], rtol=1e-5, atol=1e-6)
    assert torch.isnan(got[~sparse]).all()  # other rows left alone
    # one row alone, through a slot index and another H tiling: the same bits
    n = int(torch.nonzero(sparse & (s.count > 1)).flatten()[0])
    alone = torch.zeros(3, h, device=DEVICE)
    kernel_gather(flat[n:n + 1], req[n:n + 1], t, st.lse.reshape(-1)[n:n + 1], e, 3.0,
                  s.path[n:n + 1], s.count[n:n + 1], s.ids[n:n + 1], out=alone,
                  out_index=torch.tensor([2], device=DEVICE), block_h=32)
    assert torch.equal(alone[2], got[n])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_production_vocabulary(dtype):
    """V = 262144, H = 2816: kernels against the oracle (S bit for bit), the bound against float64."""
    r, w, v, h = 2, 64, 262144, 2816
    x = peaked_logits(r, w, v, dtype=dtype, device="cpu", seed=13).cuda()
    t = torch.tensor([0.6, 0.4], device="cuda")
    st = ds.row_stats(x, t, torch.arange(r, device="cuda"),
                      torch.zeros(r, dtype=torch.int64, device="cuda"))
    e = (torch.randn(v, h, device="cuda") * 0.03).to(torch.bfloat16)
    flat = x.reshape(r * w, v)
    req = torch.arange(r, device="cuda").repeat_interleave(w)
    _, s_k = sp.soft_embedding_tail(kernels("triton"), flat, req, t,
                                    st.lse.reshape(-1), e, 5.0, tail_eps=EPS,
                                    argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1))
    s_o = sp.support_rows(flat, req, t, st.lse.reshape(-1), tail_eps=EPS,
                          argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1),
                          entropy_bound=sp.entropy_skip_f32(EPS, sp.MAX_SUPPORT, v))
    assert (s_k.path == s_o.path).float().mean() > 0.99  # fp32 ulps may move a boundary row
    same = s_k.path == s_o.path
    assert torch.equal(s_k.ids[same], s_o.ids[same])
    got = ds.soft_embedding(x, t, st.lse, e, 5.0, tail_eps=EPS, argmax=st.argmax,
                            entropy=st.entropy)
    rows = torch.nonzero(s_k.sparse()).flatten()[:32]
    assert rows.numel() >= 16
    # float64 on the device for those rows (E in float64 on the CPU would take minutes)
    inv_t = reference.inverse_temperature(t)[req[rows]]
    z = torch.clamp(flat[rows].float() * inv_t[:, None], max=reference.FLT_MAX).double()
    want = 5.0 * torch.softmax(z, dim=-1) @ e.double()
    err = (got.reshape(r * w, h)[rows].double() - want).abs().max()
    assert float(err) <= (EPS + 2.0**-16) * 5.0 * float(e.float().abs().max())


@pytest.mark.gpu
def test_gpu_support_blocks_agree_at_the_production_vocabulary():
    """The two blocks the launch picks between (1024 x 4 warps with many rows, 4096 x 16 with few)
    give the same path, count, S and rows per path."""
    x = peaked_logits(4, 64, 262144, device="cpu", seed=17).cuda()
    x[3, :16] = torch.randn(16, 262144, device="cuda") * 0.5
    small, large = _block_runs(x, torch.tensor([0.6, 0.4, 0.8, 0.7], device="cuda"), (1024, 4096))
    for a, b in zip(small, large):
        assert torch.equal(a, b)


# -- the decode step ------------------------------------------------------------------------------

def _sampler(backend, device, n, canvas, vocab, hidden, embed, budget_bytes=None, **cfg_kw):
    cfg = ds.SamplerConfig(canvas_length=canvas, max_denoising_steps=1000, confidence_threshold=0.0,
                           **cfg_kw)
    state = ds.DiffusionState(n + 1, cfg, vocab, hidden, device)
    for j in range(n):
        state.add_request(j + 1, seed=100 + j)
    sampler = ds.DiffusionSampler(cfg, state, embed, 3.0, backend=backend, budget_bytes=budget_bytes)
    sampler.prefill(list(range(1, n + 1)))
    return sampler


def test_step_reports_paths_and_keeps_the_bound():
    """Both backends: the step's soft embedding is within the bound of the dense one (eps = 0),
    and ``sc_path_rows`` counts every row of the step once."""
    n, canvas, vocab, hidden = 2, 8, 600, 24
    embed = (torch.randn(vocab, hidden) * 0.1).to(torch.bfloat16)
    x = peaked_logits(n, canvas, vocab, device="cpu", seed=21).reshape(n * canvas, vocab)
    backends = ["torch"] + (["triton"] if INTERPRET else [])
    ref_rows = None
    for backend in backends:
        tail = _sampler(backend, "cpu", n, canvas, vocab, hidden, embed)
        dense = _sampler("torch", "cpu", n, canvas, vocab, hidden, embed, tail_eps=0.0)
        out = tail.step(x, [1, 2])
        ref = dense.step(x, [1, 2])
        assert ref.sc_path_rows is None
        rows = out.sc_path_rows
        ref_rows = rows if ref_rows is None else ref_rows
        assert rows.shape == (sp.NUM_PATHS,) and int(rows.sum()) == n * canvas
        assert int(rows[sp.PATH_TOP1] + rows[sp.PATH_SUPPORT]) > 0
        a = tail.state.self_conditioning_embeds
        b = dense.state.self_conditioning_embeds
        scale = 3.0 * float(embed.float().abs().max())
        tol = (EPS + 2.0**-8) if backend == "triton" else (EPS + 2.0**-16)
        assert float((a - b).abs().max()) <= tol * scale
        assert torch.equal(out.sampled, ref.sampled)
    # hidden-state input, one request per tile (logits = x @ I): the tiles' counts add up
    tiled = _sampler("torch", "cpu", n, canvas, vocab, hidden, embed, budget_bytes=1)
    out = tiled.step(None, [1, 2], hidden_states=x, output_weight=torch.eye(vocab))
    assert tiled.last_tile_requests == 1
    assert torch.equal(out.sc_path_rows, ref_rows)


@pytest.mark.gpu
def test_gpu_step_with_support_is_graph_captured():
    device, n, canvas, vocab, hidden = "cuda", 3, 64, 32768, 256
    embed = (torch.randn(vocab, hidden, device=device) * 0.05).to(torch.bfloat16)
    eager = _sampler("triton", device, n, canvas, vocab, hidden, embed)
    graphed = _sampler("triton", device, n, canvas, vocab, hidden, embed)
    slots = list(range(1, n + 1))
    logits = torch.empty(n * canvas, vocab, device=device)
    source = [peaked_logits(n, canvas, vocab, device=device, seed=s).reshape(n * canvas, vocab)
              for s in range(5)]
    run = graphed.graphable(slots)

    def warm_up():
        logits.copy_(source[0])
        run(logits)
        eager.step(logits, slots)

    graph, captured = capture_step(lambda: run(logits), warm_up)
    for s in range(1, 5):
        logits.copy_(source[s])
        graph.replay()
        ref = eager.step(logits, slots)
        torch.cuda.synchronize()
        assert torch.equal(captured.sc_path_rows, ref.sc_path_rows)
        assert int(ref.sc_path_rows[sp.PATH_TOP1] + ref.sc_path_rows[sp.PATH_SUPPORT]) > 0
        assert torch.equal(graphed.state.self_conditioning_embeds, eager.state.self_conditioning_embeds)


@pytest.mark.gpu
def test_gpu_torch_backend_does_not_sync():
    """The torch oracle path (support, dense rows, gather) on CUDA runs without a host sync."""
    r, w, v, h = 2, 9, 2000, 64
    x = peaked_logits(r, w, v, device="cuda")
    t = torch.tensor([0.7, 0.0], device="cuda")
    st = stats_of(x, t)
    e = torch.randn(v, h, device="cuda").to(torch.bfloat16)
    sp.weights_on(x.device)  # built once per device, outside the checked region
    req = torch.arange(r, device="cuda").repeat_interleave(w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, s = sp.soft_embedding_tail(kernels("torch"), x.reshape(r * w, v), req, t,
                                        st.lse.reshape(-1), e, 2.0, tail_eps=EPS,
                                        argmax=st.argmax.reshape(-1), entropy=st.entropy.reshape(-1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = exact_soft(x, t, e, 2.0)
    check_bound(out, want.reshape(r * w, h), e, 2.0, s.dense().cpu(), 1e-5)
