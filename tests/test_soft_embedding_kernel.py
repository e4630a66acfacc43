"""The Triton self-conditioning GEMM against a float64 oracle and the torch backend.

CPU: run through the interpreter (``TRITON_INTERPRET=1 pytest -q tests/test_soft_embedding_kernel.py``)
on small awkward shapes (rows 2 x 37, vocab ~1500, hidden 72), where the interpreter tile
(32 x 64 x 128) and its 4 pretend SMs give several M/N tiles, a split-K tail and ragged edges.
GPU (``-m gpu``): the production shape (1 and 32 requests x 256 rows x 262144 vocab, H 2816).

The float64 oracle is written here from the spec (``reference`` module docstring): ``z`` in fp32
as specified, then ``exp(z - lse) @ E`` in float64.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dgemma_sampler import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)

from dgemma_sampler.kernels import soft_embedding_dispatch as se  # noqa: E402
from dgemma_sampler.kernels import tile_schedule  # noqa: E402
from dgemma_sampler.kernels.soft_embedding import half_last_n  # noqa: E402

FLT_MAX = torch.finfo(torch.float32).max
DEVICE = "cpu" if INTERPRET else "cuda"
# Relative Frobenius error vs float64, per embedding dtype: the probabilities are rounded to
# E's dtype before the MMA (fp32 E multiplies in tf32 on the GPU, exactly in the interpreter).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5 if INTERPRET else 5e-3}
POISON = float("nan")

cpu_only = pytest.mark.skipif(not INTERPRET, reason="small-shape checks run in the interpreter")
gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------
# float64 oracle
# ---------------------------------------------------------------------------------------------


def masked_z(x_rows, inv_t_rows, threshold_rows, allowed_rows, softcap):
    """fp32 ``z`` and the mask of a block of rows, as the spec defines them."""
    x = reference.softcapped(x_rows, softcap)
    masked = torch.isnan(x) | (x == float("-inf"))
    if threshold_rows is not None:
        masked |= x < threshold_rows.unsqueeze(1)
    if allowed_rows is not None:
        masked |= ~allowed_rows
    z = torch.clamp(x * inv_t_rows.unsqueeze(1), max=FLT_MAX)
    return z, masked


def float64_lse(logits, row_request, temperature, *, threshold=None, allowed=None, softcap=None,
                chunk=256):
    """Full-vocabulary logsumexp of the masked ``z`` (float64, returned as fp32; -inf if empty)."""
    inv_t = reference.inverse_temperature(temperature)
    req = row_request.long()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for r0 in range(0, logits.shape[0], chunk):
        r1 = min(r0 + chunk, logits.shape[0])
        z, masked = masked_z(logits[r0:r1], inv_t[req[r0:r1]],
                             None if threshold is None else threshold[r0:r1],
                             None if allowed is None else allowed[req[r0:r1]], softcap)
        out[r0:r1] = torch.logsumexp(z.double().masked_fill(masked, float("-inf")), dim=1).float()
    return out


def float64_soft_embedding(logits, row_request, temperature, lse, embed, normalizer, *, keep=None,
                           threshold=None, allowed=None, vocab_start=0, softcap=None, chunk=256):
    """``normalizer * exp(z - lse) @ E`` over columns [vocab_start, +V_local), float64."""
    v_local, hidden = embed.shape
    cols = slice(vocab_start, vocab_start + v_local)
    inv_t = reference.inverse_temperature(temperature)
    norm = float(torch.as_tensor(normalizer).float())
    req = row_request.long()
    e64 = embed.double()
    out = torch.empty(logits.shape[0], hidden, dtype=torch.float64, device=logits.device)
    for r0 in range(0, logits.shape[0], chunk):
        r1 = min(r0 + chunk, logits.shape[0])
        z, masked = masked_z(logits[r0:r1, cols], inv_t[req[r0:r1]],
                             None if threshold is None else threshold[r0:r1],
                             None if allowed is None else allowed[req[r0:r1]][:, cols], softcap)
        rows_lse = lse[r0:r1].double()
        p = torch.exp(z.double() - rows_lse.unsqueeze(1))
        p = p.masked_fill(masked | ~torch.isfinite(rows_lse).unsqueeze(1), 0.0)
        out[r0:r1] = (p @ e64) * norm
    if keep is not None:
        out[~keep] = 0.0
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-300)).item()


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    logits: torch.Tensor
    row_request: torch.Tensor
    temperature: torch.Tensor
    lse: torch.Tensor
    embed: torch.Tensor
    normalizer: float | torch.Tensor
    threshold: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    softcap: float | None = None
    vocab_start: int = 0

    def kwargs(self) -> dict:
        return dict(threshold=self.threshold, allowed=self.allowed, softcap=self.softcap,
                    vocab_start=self.vocab_start)

    def args(self) -> tuple:
        return (self.logits, self.row_request, self.temperature, self.lse, self.embed, self.normalizer)


def make_case(*, requests=2, width=37, vocab=1500, hidden=72, logits_dtype=torch.float32,
              embed_dtype=torch.bfloat16, v_local=None, vocab_start=0, masks=False, softcap=None,
              greedy=False, row_pad=0, seed=0, device=DEVICE, scale=2.5) -> Case:
    """Fresh random inputs (never zeros). ``row_pad`` > 0 makes the logits rows strided."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = requests * width
    v_local = vocab - vocab_start if v_local is None else v_local
    base = torch.randn(n, vocab + row_pad, generator=g) * scale + 0.3
    logits = base.to(device=device, dtype=logits_dtype)[:, :vocab]
    row_request = torch.arange(requests, dtype=torch.int32).repeat_interleave(width).to(device)
    temperature = (0.4 + torch.rand(requests, generator=g)).to(device)
    if greedy:
        temperature[0] = 0.0
    threshold = allowed = None
    if masks:
        flat = logits.view(-1) if row_pad == 0 else None
        assert flat is not None, "masks are sprinkled on unpadded logits"
        u = torch.rand(n, vocab, generator=g).to(device)
        logits[u < 0.03] = float("-inf")
        logits[(u > 0.03) & (u < 0.035)] = float("nan")
        x = reference.softcapped(logits, softcap)
        masked = torch.isnan(x) | (x == float("-inf"))
        top_k = torch.tensor([vocab // 3] + [0] * (requests - 1), device=device)
        top_p = torch.tensor([1.0] + [0.9] * (requests - 1), device=device)
        threshold = reference.top_k_top_p_threshold(x, masked, top_k[row_request.long()],
                                                    top_p[row_request.long()])
        if softcap is not None:
            # The threshold is a softcapped logit; the kernel's tanh may differ from torch's by an
            # ulp, which would flip the boundary token. Put the threshold between data values.
            threshold = threshold - 1e-3
        allowed = (torch.rand(requests, vocab, generator=g) < 0.8).to(device)
    lse = float64_lse(logits, row_request, temperature, threshold=threshold, allowed=allowed,
                      softcap=softcap)
    embed = (torch.randn(v_local, hidden, generator=g) * 0.5).to(device=device, dtype=embed_dtype)
    return Case(logits, row_request, temperature, lse, embed, 0.75, threshold, allowed, softcap,
                vocab_start)


def run_kernel(case: Case, *, out=None, keep=None, **overrides) -> torch.Tensor:
    """Launch with a poisoned ``out`` (unless given) and return it."""
    if out is None:
        out = torch.full((case.logits.shape[0], case.embed.shape[1]), POISON, device=case.logits.device)
    res = se.soft_embedding_rows(*case.args(), keep=keep, out=out, **case.kwargs(), **overrides)
    assert res.data_ptr() == out.data_ptr()
    return res


def check(case: Case, got: torch.Tensor, *, keep=None, against_torch=True) -> None:
    """Every element written, dropped rows exactly 0, close to float64 and to the torch backend."""
    assert not torch.isnan(got).any(), "an output element was not written (NaN poison left)"
    want = float64_soft_embedding(*case.args(), keep=keep, **case.kwargs())
    if keep is not None:
        assert (got[~keep] == 0).all()
    tol = TOLERANCE[case.embed.dtype]
    assert rel_err(got, want) <= tol, (rel_err(got, want), tol)
    if against_torch:
        torch_out = reference.soft_embedding_rows(*case.args(), keep=keep, **case.kwargs())
        assert rel_err(got, torch_out.double()) <= tol + rel_err(torch_out, want)


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ---------------------------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("logits_dtype,embed_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float16, torch.float32), (torch.float32, torch.float32),
])
def test_matches_float64_and_torch(logits_dtype, embed_dtype):
    case = make_case(logits_dtype=logits_dtype, embed_dtype=embed_dtype, seed=1)
    check(case, run_kernel(case))


@cpu_only
@pytest.mark.parametrize("softcap,greedy", [(None, True), (4.0, False)])
def test_masks_greedy_and_softcap(softcap, greedy):
    """-inf, NaN, top-k/top-p threshold, allowed set; one greedy request (T = 0); softcap turns
    -inf logits into -cap (unmasked), as the spec says. Not greedy with softcap: at T = 0,
    z = softcap(x) * 1e10 turns a 1-ulp tanh difference between this kernel and torch into
    thousands of nats, so that pair is only consistent when lse comes from the same softcap code
    (the row-statistics kernel), not from torch."""
    case = make_case(masks=True, greedy=greedy, softcap=softcap, scale=4.0, seed=2)
    check(case, run_kernel(case))


@cpu_only
def test_consistent_with_row_stats_kernel_greedy_softcap():
    """lse and threshold from the Triton row-statistics kernel: since both kernels share
    ``logit_row.softcapped``, greedy rows (T = 0) with a softcap give exactly normalizer *
    E[argmax], which a torch-computed lse cannot promise (see test_masks_greedy_and_softcap)."""
    row_stats = pytest.importorskip("dgemma_sampler.kernels.row_stats")
    case = make_case(requests=2, width=5, vocab=260, hidden=40, greedy=True, softcap=4.0, scale=6.0,
                     seed=21)
    position = torch.arange(5, dtype=torch.int32).repeat(2)
    stats = row_stats.row_stats_rows(case.logits, case.row_request, position, case.temperature,
                                     torch.tensor([1, 2]), torch.tensor([0, 0]), softcap=4.0,
                                     top_k=torch.tensor([20, 0]))
    case = replace(case, lse=stats.lse, threshold=stats.threshold)
    got = run_kernel(case)
    greedy = case.row_request == 0
    assert torch.equal(got[greedy], case.embed.float()[stats.argmax[greedy]] * 0.75)
    want = float64_soft_embedding(*case.args(), **case.kwargs())
    assert rel_err(got[~greedy], want[~greedy]) <= TOLERANCE[case.embed.dtype]


@cpu_only
def test_rows_without_finite_lse_are_zero():
    case = make_case(seed=3)
    case.logits[5] = float("-inf")  # a fully masked row: lse = -inf
    case.lse = float64_lse(case.logits, case.row_request, case.temperature)
    case.lse[9] = float("nan")
    case.lse[11] = float("inf")
    got = run_kernel(case)
    assert (got[[5, 9, 11]] == 0).all()
    check(case, got)


@cpu_only
@pytest.mark.parametrize("vocab_start,v_local", [(300, 1024), (113, 777)])
def test_vocab_slice(vocab_start, v_local):
    """A tensor-parallel rank's slice; 1024 = 8 blocks exercises the unmasked-K fast path."""
    case = make_case(vocab_start=vocab_start, v_local=v_local, masks=True, seed=4)
    check(case, run_kernel(case))


@cpu_only
@pytest.mark.parametrize("pattern", ["none", "alternate", "all", "random", "tail"])
def test_keep_patterns(pattern):
    case = make_case(seed=5)
    n = case.logits.shape[0]
    keep = {
        "none": torch.zeros(n, dtype=torch.bool),
        "alternate": torch.arange(n) % 2 == 0,
        "all": torch.ones(n, dtype=torch.bool),
        "random": torch.rand(n, generator=torch.Generator().manual_seed(6)) < 0.4,
        "tail": torch.arange(n) >= n - 5,
    }[pattern]
    got = run_kernel(case, keep=keep)
    if pattern == "none":
        assert (got == 0).all()
    else:
        check(case, got, keep=keep)


@cpu_only
@pytest.mark.parametrize("hint", ["exact", "low", "zero"])
def test_num_kept_hint(hint):
    """``num_kept`` only sizes the schedule: a count that is too low is still correct."""
    case = make_case(seed=7)
    n = case.logits.shape[0]
    keep = torch.arange(n) % 3 != 0
    count = int(keep.sum())
    num_kept = {"exact": count, "low": count // 3, "zero": 0}[hint]
    check(case, run_kernel(case, keep=keep, num_kept=num_kept), keep=keep, against_torch=False)


@pytest.mark.parametrize("kept", [0, 1, 9, 40, 74])
def test_schedule_by_the_device_count_is_the_plan_of_that_count(kept):
    """With ``keep`` and no host count the kernel reads its schedule from ``plans_by_count`` by
    the kept count on the device: the result is the one of the host plan for that count, bit
    for bit (the same tiles, the same split; the launch's extra programs change nothing), and
    the rows not kept are zero."""
    case = make_case(requests=2, width=37, seed=9)
    n = case.logits.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    keep[torch.randperm(n, generator=torch.Generator().manual_seed(kept))[:kept].to(DEVICE)] = True
    by_device = run_kernel(case, keep=keep, num_sms=3)
    by_host = run_kernel(case, keep=keep, num_sms=3, num_kept=kept)
    assert torch.equal(by_device, by_host)
    assert (by_device[~keep] == 0).all()


@cpu_only
def test_strided_logits_and_out():
    """Rows of logits and of ``out`` strided (out a column window of a wider state buffer)."""
    case = make_case(row_pad=40, seed=8)
    n, hidden = case.logits.shape[0], case.embed.shape[1]
    state = torch.full((n, hidden + 24), -7.0)
    out = state[:, 5:5 + hidden]
    out.fill_(POISON)
    got = run_kernel(case, out=out)
    assert got.stride(0) == hidden + 24
    assert (state[:, :5] == -7.0).all() and (state[:, 5 + hidden:] == -7.0).all()
    check(case, got)


@cpu_only
def test_out_view_of_slot_state_buffer():
    """``out`` as rows of a slot-indexed ``[max_reqs, CL, H]`` buffer (requests in slots 1..2)."""
    case = make_case(requests=2, width=37, seed=9)
    state = torch.full((4, 37, case.embed.shape[1]), -3.0)
    out = state[1:3].view(-1, case.embed.shape[1])
    out.fill_(POISON)
    check(case, run_kernel(case, out=out))
    assert (state[0] == -3.0).all() and (state[3] == -3.0).all()


@cpu_only
def test_tensor_normalizer_and_default_out():
    case = make_case(seed=10)
    case.normalizer = torch.tensor(1.5)
    got = se.soft_embedding_rows(*case.args(), **case.kwargs())
    assert got.shape == (case.logits.shape[0], case.embed.shape[1]) and got.dtype == torch.float32
    check(case, got)


@cpu_only
@pytest.mark.parametrize("num_sms", [1, 4, 64])
def test_schedules_agree_and_are_deterministic(num_sms):
    """1 SM: whole tiles only; 4: whole waves + a split tail; 64: every tile split (one wave)."""
    case = make_case(seed=11)
    cfg = se.INTERPRETER_CONFIG
    plan = se.plan_split(case.logits.shape[0], case.logits.shape[0], case.embed.shape[1],
                         case.embed.shape[0], cfg, num_sms, min_k_blocks=1)
    kind = {1: (False, True), 4: (True, True), 64: (True, False)}[num_sms]
    assert (plan.split > 1, plan.dp_head > 0) == kind, plan
    first = run_kernel(case, num_sms=num_sms)
    second = run_kernel(case, num_sms=num_sms)
    assert torch.equal(first, second)
    check(case, first, against_torch=False)


@cpu_only
@pytest.mark.parametrize("with_keep", [False, True])
def test_ragged_slice_with_and_without_keep(with_keep):
    """A vocabulary slice that is not a whole number of K blocks (masked last K block) and a
    ragged last N tile, rows in order or gathered by ``keep``."""
    case = make_case(vocab_start=32, v_local=1400, seed=16)
    keep = None
    if with_keep:
        keep = torch.rand(case.logits.shape[0], generator=torch.Generator().manual_seed(3)) < 0.6
    check(case, run_kernel(case, keep=keep), keep=keep)


@cpu_only
@pytest.mark.parametrize("num_sms", [1, 64])
def test_half_width_last_n_tile(num_sms):
    """H = 90 with BLOCK_N 64: the last N tile runs 32 wide (HALF_LAST_N), whole or split-K."""
    assert half_last_n(90, 64) and half_last_n(2816, 512) and not half_last_n(2816, 256)
    case = make_case(hidden=90, embed_dtype=torch.float16, seed=17)
    check(case, run_kernel(case, num_sms=num_sms), against_torch=False)


@cpu_only
def test_greedy_rows_exact_beside_sampled_rows():
    """Requests 0 and 1 greedy (T = 0, |lse| ~ 1e10), request 2 not, in one launch: greedy rows
    are exactly normalizer * E[argmax] (the prologue rounds z = x * inv_t to fp32 before forming
    the exponent; folding the two products into one FFMA would be off by thousands of nats)."""
    case = make_case(requests=3, width=48, greedy=True, seed=18)
    case.temperature[1] = 0.0
    case.lse = float64_lse(case.logits, case.row_request, case.temperature)
    got = run_kernel(case)
    greedy = case.row_request <= 1
    argmax = case.logits[greedy].argmax(dim=1)
    assert torch.equal(got[greedy], case.embed.float()[argmax] * 0.75)
    want = float64_soft_embedding(*case.args())
    assert rel_err(got[~greedy], want[~greedy]) <= TOLERANCE[case.embed.dtype]


@cpu_only
def test_plus_inf_logit_takes_all_the_mass():
    """A +inf logit: z = FLT_MAX, lse = FLT_MAX, p = 1 there and 0 elsewhere (the clamp p <= 1)."""
    case = make_case(requests=1, width=6, seed=19)
    case.logits[2, 77] = float("inf")
    case.lse = float64_lse(case.logits, case.row_request, case.temperature)
    got = run_kernel(case)
    assert torch.equal(got[2], case.embed.float()[77] * 0.75)
    others = torch.arange(6) != 2
    want = float64_soft_embedding(*case.args())
    assert rel_err(got[others], want[others]) <= TOLERANCE[case.embed.dtype]


@cpu_only
def test_candidates_respect_shared_memory_and_masks():
    """Every GPU candidate fits in shared memory; an ``allowed`` mask keeps BLOCK_K <= 32."""
    for cfg in se.gpu_candidates(torch.float32, torch.bfloat16, False):
        assert se.shared_memory_bytes(cfg, torch.float32, torch.bfloat16, False) <= se.SHARED_MEMORY_BYTES
    assert all(c.block_k <= 32 for c in se.gpu_candidates(torch.float32, torch.bfloat16, True))
    assert se.gpu_candidates(torch.float32, torch.bfloat16, True)
    assert se.gpu_candidates(torch.float32, torch.float32, False)  # tf32 E still has a tile


@cpu_only
def test_small_tiles_config():
    """Several N tiles per row block (BLOCK_N 32 < H) with the split tail."""
    case = make_case(hidden=90, seed=12)
    check(case, run_kernel(case, config=se.TileConfig(16, 32, 128, 4, 1)), against_torch=False)


@cpu_only
def test_ops_triton_backend_matches_torch_backend():
    """Through the public 3-D API: backend='triton' (interpreter) vs backend='torch'."""
    import dgemma_sampler as ds

    case = make_case(requests=3, width=20, seed=13)
    logits3 = case.logits.view(3, 20, -1)
    keep = torch.rand(3, 20, generator=torch.Generator().manual_seed(1)) < 0.7
    lse = case.lse.view(3, 20)
    results = {}
    for backend in ("triton", "torch"):
        out = torch.full((3, 20, case.embed.shape[1]), POISON)
        results[backend] = ds.soft_embedding(logits3, case.temperature, lse, case.embed, 0.75,
                                             keep=keep, out=out, backend=backend)
    assert (results["triton"][~keep] == 0).all()
    assert rel_err(results["triton"], results["torch"].double()) <= 1e-2


@cpu_only
@pytest.mark.parametrize("block_m,block_n,expected", [
    (128, 256, {1: (0, 22, 6), 4: (0, 88, 3), 16: (264, 88, 3), 32: (660, 44, 3)}),
    (64, 512, {1: (0, 24, 5), 4: (96, 0, 1), 16: (384, 0, 1), 32: (768, 0, 1)}),
])
def test_split_plan_at_production_shapes(block_m, block_n, expected):
    """The schedule the H200 gets: whole waves plus a split tail that fills (90% of) whole waves
    (64 x 512 at 4 requests: 96 tiles in one partial wave, S = 4 would pass the scratch cap),
    with the partial-sum scratch under the cap."""
    cfg = se.TileConfig(block_m, block_n, 64, 8, 3)
    for requests, (dp_head, tail, split) in expected.items():
        rows = 256 * requests
        plan = se.plan_split(rows, rows, 2816, 262144, cfg, 132)
        assert (plan.dp_head, plan.tail_tiles, plan.split) == (dp_head, tail, split), (requests, plan)
        pieces = plan.tail_tiles * plan.split
        assert plan.split == 1 or pieces / (math.ceil(pieces / 132) * 132) >= 0.9
        assert plan.scratch_elems * 4 <= se.MAX_SCRATCH_BYTES
        assert plan.programs == dp_head + tail * split


@triton.jit
def _schedule_kernel(out_ptr, n_tiles_n, dp_head, tail_tiles, split, GROUP: tl.constexpr):
    """Each program's (M-tile, N-tile, split piece) as the Gluon kernel takes them."""
    pid = tl.program_id(0)
    m_tile, n_tile, _, piece, _ = tile_schedule.tile_of_program(pid, n_tiles_n, dp_head, tail_tiles,
                                                                split)
    m_tile, n_tile = tile_schedule.grouped_tile(m_tile, n_tile, dp_head, n_tiles_n, GROUP)
    tl.store(out_ptr + 3 * pid, m_tile)
    tl.store(out_ptr + 3 * pid + 1, n_tile)
    tl.store(out_ptr + 3 * pid + 2, piece)


@cpu_only
@pytest.mark.parametrize("group", [1, 6, 12])
@pytest.mark.parametrize("rows,planned_rows,hidden,sms", [
    (256, 256, 2816, 132),          # 1 request: the split tail alone
    (4096, 4096, 2816, 132),        # whole waves in 4 groups of 6 M-tiles, a tail
    (8192 + 768, 8192, 2816, 132),  # rows past the planned ones, taken whole
    (5000, 5000, 2048, 114),        # waves that are not whole groups
    (3000, 3000, 1000, 7),          # a ragged last N-tile, many small waves
])
def test_grouped_order_takes_every_tile_once(rows, planned_rows, hidden, sms, group):
    """The Gluon kernel's program order (``tile_of_program``, then ``grouped_tile``) is a
    permutation: every whole tile taken by one program, every tail tile's pieces by one each."""
    cfg = se.TileConfig(128, 256, 64, 8, 3)
    plan = se.plan_split(rows, planned_rows, hidden, 262144, cfg, sms)
    out = torch.full((plan.programs, 3), -1, dtype=torch.int32)
    _schedule_kernel[(plan.programs,)](out, plan.n_tiles_n, plan.dp_head, plan.tail_tiles,
                                       plan.split, GROUP=group)
    want = []
    for tile in range(math.ceil(rows / 128) * plan.n_tiles_n):
        in_tail = plan.dp_head <= tile < plan.dp_head + plan.tail_tiles
        want += [(*divmod(tile, plan.n_tiles_n), piece) for piece in range(plan.split if in_tail else 1)]
    assert sorted(map(tuple, out.tolist())) == sorted(want)
    if group == 6 and plan.dp_head >= 6 * plan.n_tiles_n:
        # consecutive programs share an E tile (N-tile) in a whole group
        assert out[:6, 1].unique().numel() == 1 and out[:6, 0].tolist() == list(range(6))


def _bad(case: Case, **changes):
    kwargs = dict(zip(("logits", "row_request", "temperature", "lse", "embed_weight", "normalizer"),
                      case.args()))
    kwargs.update(case.kwargs())
    kwargs.update(changes)
    return kwargs


@cpu_only
@pytest.mark.parametrize("changes", [
    lambda c: dict(logits=c.logits.to(torch.int32)),
    lambda c: dict(logits=c.logits.t()),
    lambda c: dict(lse=c.lse[:-1]),
    lambda c: dict(embed_weight=c.embed.t().contiguous().t()),
    lambda c: dict(vocab_start=2000),
    lambda c: dict(keep=torch.ones(3, dtype=torch.bool)),
    lambda c: dict(out_index=torch.zeros(c.logits.shape[0], dtype=torch.int64)),
    lambda c: dict(num_kept=10_000),
])
def test_kernel_boundary_asserts(changes):
    """The launch wrapper only asserts its inputs (``dgemma_sampler.ops`` and the step validate
    what users pass, with clear errors: ``tests/test_bad_inputs.py``)."""
    case = make_case(seed=14)
    with pytest.raises(AssertionError):
        se.soft_embedding_rows(**_bad(case, **changes(case)))


@cpu_only
def test_cpu_without_interpreter_is_refused(monkeypatch):
    case = make_case(seed=15)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AssertionError, match="needs CUDA tensors"):
        se.soft_embedding_rows(*case.args())


# ---------------------------------------------------------------------------------------------
# GPU tests at the production shape (V = 262144, H = 2816, 256 rows per request)
# ---------------------------------------------------------------------------------------------

VOCAB, HIDDEN, CANVAS = 262144, 2816, 256
gpu_only = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device")


def production_case(requests, *, logits_dtype=torch.float32, masks=False, softcap=None,
                    greedy=False, seed=0) -> Case:
    """Gemma-like magnitudes: logits ~ N(0, 3^2), T in [0.4, 0.8], E ~ N(0, 0.03^2) in bf16,
    normalizer sqrt(H). ``masks``: -inf, NaN, top-k 50 threshold and an allowed set."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = requests * CANVAS
    logits = torch.randn(n, VOCAB, generator=g, device="cuda").mul_(3.0).to(logits_dtype)
    row_request = torch.arange(requests, dtype=torch.int32, device="cuda").repeat_interleave(CANVAS)
    temperature = 0.4 + 0.4 * torch.rand(requests, generator=g, device="cuda")
    threshold = allowed = None
    if greedy:
        temperature[0] = 0.0
    if masks:
        u = torch.rand(n, VOCAB, generator=g, device="cuda")
        logits[u < 0.01] = float("-inf")
        logits[u > 0.9999] = float("nan")
        allowed = torch.rand(requests, VOCAB, generator=g, device="cuda") < 0.9
        x = reference.softcapped(logits, softcap)
        top_k = torch.full((n,), 50, device="cuda")
        threshold = reference.top_k_top_p_threshold(x, torch.isnan(x) | (x == float("-inf")), top_k, None)
        if softcap is not None:  # between data values: see make_case
            threshold = threshold - 1e-3
        del x
    lse = float64_lse(logits, row_request, temperature, threshold=threshold, allowed=allowed,
                      softcap=softcap)
    embed = (torch.randn(VOCAB, HIDDEN, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    return Case(logits, row_request, temperature, lse, embed, math.sqrt(HIDDEN), threshold, allowed,
                softcap)


def check_gpu(case: Case, got: torch.Tensor, keep=None, tol=1e-2) -> None:
    assert not torch.isnan(got).any(), "an output element was not written (NaN poison left)"
    want = float64_soft_embedding(*case.args(), keep=keep, **case.kwargs(), chunk=128)
    if keep is not None:
        assert (got[~keep] == 0).all()
        got, want = got[keep], want[keep]
    err = rel_err(got, want)
    row_err = ((got.double() - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert err <= tol and row_err <= 3 * tol, (err, row_err)


@gpu
@gpu_only
@pytest.mark.parametrize("requests", [1, 32])
def test_gpu_production_shape(requests):
    case = production_case(requests, seed=requests)
    got = run_kernel(case)
    check_gpu(case, got)
    assert torch.equal(got, run_kernel(case)), "not deterministic run to run"


@gpu
@gpu_only
def test_gpu_every_candidate_config():
    """Each tuning candidate, split-K (1 request), with and without ``keep`` (rows in order /
    gathered). The benchmark's --sweep reports the error of the other tile shapes."""
    case = production_case(1, seed=11)
    want = float64_soft_embedding(*case.args(), chunk=128)
    keep = torch.ones(CANVAS, dtype=torch.bool, device="cuda")
    keep[::7] = False
    want_keep = want.clone()
    want_keep[~keep] = 0.0
    for cfg in se.gpu_candidates(torch.float32, torch.bfloat16, False):
        for k, w in ((None, want), (keep, want_keep)):
            got = run_kernel(case, keep=k, config=cfg)
            assert not torch.isnan(got).any(), cfg
            err = rel_err(got, w)
            assert err <= 1e-2, (str(cfg), k is not None, err)


@gpu
@gpu_only
def test_gpu_bf16_logits_keep_and_vocab_slice():
    """bf16 logits, every other request kept, the second half of the vocabulary (TP rank 1 of 2),
    out rows of a slot-indexed state buffer."""
    requests = 4
    case = production_case(requests, logits_dtype=torch.bfloat16, seed=7)
    case = replace(case, embed=case.embed[VOCAB // 2:].contiguous(), vocab_start=VOCAB // 2)
    keep = (case.row_request % 2 == 0)
    state = torch.full((8, CANVAS, HIDDEN), POISON, device="cuda")
    out = state[2:2 + requests].view(-1, HIDDEN)
    got = run_kernel(case, out=out, keep=keep, num_kept=int(keep.sum()))
    check_gpu(case, got, keep=keep)
    assert torch.isnan(state[:2]).all() and torch.isnan(state[2 + requests:]).all()


@gpu
@gpu_only
@pytest.mark.parametrize("softcap,greedy", [(30.0, False), (None, True)])
def test_gpu_masks_softcap_greedy(softcap, greedy):
    """Masks with softcap 30, or with request 0 greedy (not both: see the CPU test)."""
    case = production_case(2, masks=True, softcap=softcap, greedy=greedy, seed=3)
    check_gpu(case, run_kernel(case))


@gpu
@gpu_only
def test_gpu_memory_beyond_output_is_only_the_split_scratch():
    case = production_case(1, seed=5)
    out = torch.empty(CANVAS, HIDDEN, device="cuda")
    se.soft_embedding_rows(*case.args(), out=out)  # tune and compile first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    se.soft_embedding_rows(*case.args(), out=out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= se.MAX_SCRATCH_BYTES + 2**20, extra


@pytest.mark.parametrize("split", [False, True])
def test_out_index_scatters_rows_into_a_slot_buffer(split):
    """``out_index`` writes row n into ``out[out_index[n]]``: the slot-indexed state rows."""
    n, v, h = 11, 700 if INTERPRET else 4099, 40
    logits = torch.randn(n, v, device=DEVICE) * 3
    request = torch.zeros(n, dtype=torch.int32, device=DEVICE)
    temp = torch.tensor([0.7], device=DEVICE)
    lse = torch.logsumexp(logits * reference.inverse_temperature(temp), dim=-1)
    e = torch.randn(v, h, device=DEVICE).to(torch.bfloat16)
    keep = torch.rand(n, device=DEVICE) > 0.3
    index = torch.randperm(3 * n, device=DEVICE)[:n]
    want = torch.full((3 * n, h), 7.0, device=DEVICE)
    got = want.clone()
    reference.soft_embedding_rows(logits, request, temp, lse, e, 2.0, keep=keep, out=want, out_index=index)
    kw = dict(num_sms=1) if split else {}
    se.soft_embedding_rows(logits, request, temp, lse, e, 2.0, keep=keep, out=got, out_index=index, **kw)
    untouched = torch.ones(3 * n, dtype=torch.bool, device=DEVICE)
    untouched[index] = False
    assert (got[untouched] == 7.0).all()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2


@gpu
@gpu_only
@pytest.mark.parametrize("requests,logits_dtype", [(1, torch.float32), (3, torch.bfloat16),
                                                    (16, torch.bfloat16), (32, torch.float32)])
def test_gpu_wgmma_kernel_matches_the_triton_kernel(requests, logits_dtype):
    """The Gluon kernel (soft_embedding_wgmma.py) against the Triton one on the same inputs:
    split-K (1 request), a ragged vocabulary slice, dropped rows, a top-k threshold on some rows,
    out rows scattered into a slot buffer, a tensor normalizer; and against float64. At 16 and
    32 requests whole tiles run in the grouped order (``tile_schedule.grouped_tile``), the
    split tail in its own."""
    wg = pytest.importorskip("dgemma_sampler.kernels.soft_embedding_wgmma")
    case = production_case(requests, logits_dtype=logits_dtype, seed=40 + requests)
    v0 = 1000  # a slice that starts and ends off the 64-column K blocks
    case = replace(case, embed=case.embed[v0:v0 + 200_003].contiguous(), vocab_start=v0,
                   normalizer=torch.tensor(53.0, device="cuda"))
    n = case.logits.shape[0]
    g = torch.Generator(device="cuda").manual_seed(requests)
    keep = torch.rand(n, generator=g, device="cuda") > 0.2
    keep[:CANVAS // 2] = True
    threshold = torch.full((n,), float("-inf"), device="cuda")
    threshold[::3] = case.logits[::3].float().topk(50, dim=1).values[:, -1]
    case = replace(case, threshold=threshold, lse=float64_lse(case.logits, case.row_request,
                                                              case.temperature, threshold=threshold))
    assert wg.supported(case.logits, case.embed, case.vocab_start, None, None)
    index = torch.randperm(2 * n, device="cuda")[:n]
    outs = []
    for use_wgmma in (True, False):
        out = torch.full((2 * n, HIDDEN), POISON, device="cuda")
        se.soft_embedding_rows(*case.args(), keep=keep, out=out, out_index=index, wgmma=use_wgmma,
                               **case.kwargs())
        outs.append(out)
    got, want = outs
    assert not torch.isnan(got[index]).any() and torch.isnan(got).any(dim=1).sum() == n
    # Bit-identical without keep (bench_soft_embedding.py checks that); with keep both kernels
    # compact rows, but into tiles of their own sizes, so a row can land in a split-K tile in
    # one kernel and not in the other: fp32 sums in another order (1.6e-5 seen at 32 requests).
    assert rel_err(got[index], want[index].double()) <= 1e-4
    check_gpu(case, got[index], keep=keep)
    again = torch.full_like(got, POISON)
    se.soft_embedding_rows(*case.args(), keep=keep, out=again, out_index=index, wgmma=True, **case.kwargs())
    assert torch.equal(torch.nan_to_num(again, 7.0), torch.nan_to_num(got, 7.0)), "not deterministic"


@gpu
@gpu_only
@pytest.mark.parametrize("requests,logits_dtype", [(1, torch.float32), (32, torch.float32),
                                                    (8, torch.bfloat16)])
def test_gpu_wgmma_row_order_gathers_rows(requests, logits_dtype):
    """The Gluon kernel's row order (``keep``): every row kept gives the in-order result bit for
    bit (consecutive rows: the same tiles, by TMA); rows kept at random (a quarter, scattered
    over every tile: gathered by ``cp.async``) or by request (every other one: consecutive rows
    again, from another first row) give, on the kept rows, the result of those rows alone in
    order, and zeros elsewhere; nothing kept writes zeros."""
    pytest.importorskip("dgemma_sampler.kernels.soft_embedding_wgmma")
    case = production_case(requests, logits_dtype=logits_dtype, seed=70 + requests)
    n = case.logits.shape[0]

    def run(keep, **kw):
        out = torch.full((n, HIDDEN), POISON, device="cuda")
        return se.soft_embedding_rows(*case.args(), keep=keep, out=out, wgmma=True,
                                      **case.kwargs(), **kw)

    plain = run(None)
    assert torch.equal(run(torch.ones(n, dtype=torch.bool, device="cuda")), plain)
    assert (run(torch.zeros(n, dtype=torch.bool, device="cuda")) == 0).all()
    g = torch.Generator(device="cuda").manual_seed(requests)
    scattered = torch.rand(n, generator=g, device="cuda") < 0.25
    by_request = case.row_request % 2 == 1
    for keep in (scattered, by_request):
        if not keep.any():
            continue
        got = run(keep)
        assert (got[~keep] == 0).all()
        alone = replace(case, logits=case.logits[keep], row_request=case.row_request[keep],
                        lse=case.lse[keep],
                        threshold=None if case.threshold is None else case.threshold[keep])
        want = se.soft_embedding_rows(*alone.args(), wgmma=True, **alone.kwargs())
        # (the kept rows alone plan other tiles, some split along the vocabulary: the wgmma's
        # accumulation is not exact fp32, and 2e-5 to 1e-4 apart was seen on an H100)
        assert rel_err(got[keep], want.double()) <= 3e-4
        check_gpu(case, got, keep=keep)


def test_tall_tile_only_for_a_given_operand_of_one_canvas():
    """``soft_embedding_wgmma.tile_shape``: 256 x 128 for a given operand of at most one canvas,
    else 128 x 256; both tiles' pipelines hold 4 stages of 16-bit tiles (3 for fp32 logits,
    beside the p buffers, on the wide tile only)."""
    wg = pytest.importorskip("dgemma_sampler.kernels.soft_embedding_wgmma")
    assert wg.tile_shape(True, 1) == wg.tile_shape(True, 256) == wg.TALL == (256, 128)
    assert wg.tile_shape(True, 257) == wg.tile_shape(False, 256) == wg.WIDE == (128, 256)
    bf16 = torch.bfloat16
    assert wg.stages_for(bf16, bf16, tile=wg.TALL) == wg.stages_for(bf16, bf16) == 4
    assert wg.stages_for(torch.float32, bf16) == 3


def test_gluon_kernel_compiles_for_sm90_without_spills():
    """The Hopper kernel compiles for sm_90 with the Triton installed here (in CI the latest
    release; the device runs 3.6), each fp32 / bf16 specialization (rows in order or by a row
    order) without register spills
    (``tools/compile_sm90.py``: a stand-in driver, no GPU)."""
    pytest.importorskip("dgemma_sampler.kernels.soft_embedding_wgmma")
    tools = Path(__file__).resolve().parents[1] / "tools"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(tools / "compile_sm90.py"), "--dtypes", "float32,bfloat16"],
                         env=env, capture_output=True, text=True, timeout=600)
    report = [line for line in run.stdout.splitlines() if " shared " in line]
    assert run.returncode == 0 and len(report) == 11, run.stdout[-2000:] + run.stderr[-2000:]
    for line in report:
        assert "0 bytes spill stores" in line and "Used " in line, line
