"""The vLLM adapters' device path (``dgemma_sampler.vllm.device.decode``), without vLLM.

``FusedDiffusionSampler`` (0.33 and 0.34) turns vLLM's input batch into host arrays and calls
``device.decode``, which runs the step through ``runner.StepRunner``. Here ``decode`` gets
stand-ins for vLLM's host objects: a ``DiffusionState`` as the diffusion request states (it
holds every tensor vLLM's does, plus the keyed noise's seeds and draws, as the adapter adds),
``SamplingStates``-like top-k / top-p arrays (vLLM's convention: "off" is the vocabulary size
and 1), vLLM's output buffers, and what the adapter passes: for 0.34 hidden states with either
the model's bf16 LM head and softcap (``head.LmHead``: the adapter's own projection) or a bf16
LM head plus fp32 softcap as ``compute_logits`` (its fallback), for 0.33 the logits. Checked
against ``DiffusionSampler`` over the same logits (one runner behind both):

- the 0.33 path equals it bit for bit; the 0.34 paths too, in tokens, statistics and state,
  whatever their tile size (soft embeddings within 1e-4: the GEMM's split may follow the tile;
  the LM head's bf16 logits with the softcap in the kernels give the statistics of the fp32
  softcapped logits bit for bit);
- vLLM's outputs (``sampled``, ``num_sampled``, ``draft_tokens``) are the step's;
- logprobs are stashed for the converging requests that want them;
- on the GPU: the update replayed from CUDA graphs, and a step's transient memory is one tile
  of projected logits (``bytes_per_request``): the head's bf16 output alone on the adapter's own
  path, no fp32 copy beside it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler.head import LmHead, Projection
from dgemma_sampler.runner import LogprobRequest, StepRunner, bytes_per_request
from dgemma_sampler.vllm.device import VllmRequestOptions, decode, projected_logit_bytes

SOFTCAP = 30.0


class Buffer(SimpleNamespace):
    """vLLM's staged per-slot arrays: ``np`` on the host, ``gpu`` on the device."""


def projection(weight: torch.Tensor, per_request: bool = True):
    """``compute_logits`` as DiffusionGemma's: the head in its dtype, then the softcap in
    fp32 in place (vLLM compiles it into one kernel: the head's output and its fp32 copy are
    all it holds). ``per_request``: one GEMM per request, so that a row's logits do not
    depend on the tile it lands in (the comparisons need that; vLLM's is one GEMM)."""

    calls: list[int] = []

    def project(hidden: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        calls.append(hidden.shape[0])
        if per_request:
            logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32,
                                 device=hidden.device)
            r = 0
            for k in lengths:
                part = hidden[r:r + int(k)].to(weight.dtype)
                logits[r:r + int(k)] = torch.nn.functional.linear(part, weight)
                r += int(k)
        else:
            logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()
        return logits.div_(SOFTCAP).tanh_().mul_(SOFTCAP)

    project.calls = calls
    return project


class Setup:
    """One vLLM-like sampler's objects around a ``StepRunner`` (the adapter's), and a
    ``DiffusionSampler`` over its own state with the same requests."""

    def __init__(self, device, *, n, canvas, vocab, hidden, widths, top_k, top_p, backend,
                 graph_update=False, budget=None):
        cfg = ds.SamplerConfig(t_min=0.4, t_max=0.8, entropy_bound=0.5, confidence_threshold=0.05,
                               stability_threshold=1, max_denoising_steps=4, canvas_length=canvas)
        self.slots = list(range(1, n + 1))
        gen = torch.Generator().manual_seed(3)
        self.weight = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(
            torch.bfloat16).to(device)
        self.states, self.ref_state = (ds.DiffusionState(n + 2, cfg, vocab, hidden, device)
                                       for _ in range(2))
        k_np = np.full(n + 2, vocab, dtype=np.int32)
        p_np = np.ones(n + 2, dtype=np.float32)
        for j, s in enumerate(self.slots):
            for st in (self.states, self.ref_state):
                st.add_request(s, seed=100 + j, canvas_width=widths[j], top_k=top_k[j],
                               top_p=top_p[j])
            k_np[s], p_np[s] = top_k[j], top_p[j]
        for st in (self.states, self.ref_state):
            st.finish_prefill(self.slots)
        sampling = SimpleNamespace(
            top_k=Buffer(np=k_np, gpu=torch.from_numpy(k_np).to(device)),
            top_p=Buffer(np=p_np, gpu=torch.from_numpy(p_np).to(device)))
        self.runner = StepRunner(
            cfg, self.states, VllmRequestOptions(sampling, self.states, vocab), self.weight, 2.0,
            backend=backend, vocab_size=vocab, budget_bytes=budget, graph_update=graph_update)
        self.ref = ds.DiffusionSampler(cfg, self.ref_state, self.weight, 2.0, backend=backend,
                                       graph_update=graph_update)
        self.sampled = torch.full((n, canvas), -1, dtype=torch.int32, device=device)
        self.num_sampled = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.draft_tokens = torch.zeros(n + 2, canvas, dtype=torch.int64, device=device)
        self.project = projection(self.weight)
        self.head = LmHead(self.weight, softcap=SOFTCAP, backend=backend)
        self.stash: dict = {}

    def projection(self, input: str) -> Projection | None:
        """What the adapter projects a tile with: the model's head (``lm_head``), vLLM's
        ``compute_logits`` (``compute_logits``), or nothing (``logits``: vLLM 0.33)."""
        if input == "lm_head":
            return self.head.projection()
        if input == "compute_logits":
            return Projection(project=self.project, itemsize=projected_logit_bytes(self.weight))
        return None

    def step(self, hidden: torch.Tensor, valid, *, input: str):
        """One step of the adapter's device path and of ``DiffusionSampler`` on the same
        logits; returns both outputs."""
        valid = np.asarray(valid, dtype=np.int64)
        logits = self.project(hidden.to(self.weight.dtype), valid)
        del self.project.calls[-1:]
        wanted = LogprobRequest(slots={self.slots[0]}, build=self._logprobs, stash=self.stash)
        rows = logits if input == "logits" else hidden.to(self.weight.dtype)
        out = decode(
            self.runner, rows,
            decode_slots=np.asarray(self.slots), decode_idx=np.arange(len(self.slots)),
            valid=valid, vocab=self.weight.shape[0], column_tokens=None, sampled=self.sampled,
            num_sampled=self.num_sampled, draft_tokens=self.draft_tokens,
            all_slots=torch.tensor(self.slots, device=hidden.device),
            projection=self.projection(input), logprobs=wanted)
        ref = self.ref.step(logits, self.slots, valid_len=list(valid),
                            logprobs={self.slots[0]: 2})
        return out, ref

    def _logprobs(self, slot, r):
        return self.runner.logprobs_fn(r.rows, r.inv_t, r.threshold, r.allowed, r.selected, 2,
                                       softcap=r.softcap)


def run_and_compare(device, *, n, canvas, vocab, hidden, widths, valid, top_k, top_p, backend,
                    tile, input, steps=5, graph_update=False):
    budget = None
    hidden_input = input != "logits"
    if hidden_input:
        itemsize = 2 if input == "lm_head" else 2 + 4
        budget = tile * bytes_per_request(max(widths), vocab, itemsize)
    su = Setup(device, n=n, canvas=canvas, vocab=vocab, hidden=hidden, widths=widths, top_k=top_k,
               top_p=top_p, backend=backend, graph_update=graph_update, budget=budget)
    gen = torch.Generator(device=device).manual_seed(11)
    targets = torch.randint(0, vocab, (sum(valid),), generator=gen, device=device)
    stashed = 0
    for t in range(steps):
        # Peaked at fixed targets after the first step, so requests converge and commit.
        hidden_states = torch.randn(sum(valid), hidden, generator=gen, device=device)
        if t:
            hidden_states += 6.0 * hidden ** 0.5 * su.weight[targets].float()
        out, ref = su.step(hidden_states, valid, input=input)
        if hidden_input:
            assert su.runner.last_tile_requests == min(tile, n)
        if input == "compute_logits":
            assert su.project.calls == [sum(valid[i:i + tile]) for i in range(0, n, tile)]
            su.project.calls.clear()
        assert torch.equal(out.sampled, ref.sampled)
        assert torch.equal(out.num_sampled, ref.num_sampled)
        assert torch.equal(out.just_converged, ref.just_converged)
        for a, b in zip(out.stats.as_tuple(), ref.stats.as_tuple()):
            assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True, rtol=0, atol=0)
        for name in ("canvas", "argmax_canvas", "step", "is_encoder_phase", "confident", "draws",
                     "accepted_canvas_history", "accepted_canvas_history_len"):
            assert torch.equal(getattr(su.states, name), getattr(su.ref_state, name)), name
        sc, sc_ref = su.states.self_conditioning_embeds, su.ref_state.self_conditioning_embeds
        if (tile >= n or not hidden_input) and input != "lm_head":
            assert torch.equal(sc, sc_ref)
        else:  # (the head's logits: p from bf16 logits on the GPU, one rounding more or less)
            torch.testing.assert_close(sc, sc_ref, rtol=1e-4 if device == "cpu" else 1e-2,
                                       atol=1e-4 if device == "cpu" else 1e-2)
        # vLLM's outputs: the step's, at each request's batch index; the canvases fed back.
        W = out.sampled.shape[1]
        assert torch.equal(su.sampled[:, :W].long(), out.sampled)
        assert torch.equal(su.num_sampled, out.num_sampled)
        assert torch.equal(su.draft_tokens[su.slots, :W], su.states.canvas[su.slots, :W])
        if bool(out.just_converged[0]):
            ids, vals, ranks = su.stash.pop(su.slots[0])
            assert ids.shape == (valid[0], 3) and (vals[:, 0] <= 0).all()
            stashed += 1
    assert stashed >= 1
    return su


CPU_CASE = dict(n=3, canvas=6, vocab=301, hidden=12, widths=(6, 4, 6), valid=(6, 3, 6),
                top_k=(301, 20, 301), top_p=(1.0, 1.0, 0.8))


@pytest.mark.parametrize("input,tile", [("logits", 3), ("compute_logits", 1),
                                        ("compute_logits", 2), ("compute_logits", 3),
                                        ("lm_head", 1), ("lm_head", 3)],
                         ids=["v0.33-logits", "v0.34-compute-logits-tile-1",
                              "v0.34-compute-logits-tile-2", "v0.34-compute-logits-one-tile",
                              "v0.34-lm-head-tile-1", "v0.34-lm-head-one-tile"])
def test_device_path_is_the_samplers_step_cpu(input, tile):
    run_and_compare("cpu", backend="torch", tile=tile, input=input, **CPU_CASE)


GPU_CASE = dict(n=4, canvas=256, vocab=262144, hidden=2816, widths=(256, 256, 200, 256),
                valid=(256, 256, 200, 131), top_k=(262144, 50, 262144, 262144),
                top_p=(1.0, 1.0, 0.9, 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("input,tile", [("logits", 4), ("compute_logits", 1),
                                        ("compute_logits", 4), ("lm_head", 1), ("lm_head", 4)],
                         ids=["v0.33-logits", "v0.34-compute-logits-tile-1",
                              "v0.34-compute-logits-one-tile", "v0.34-lm-head-tile-1",
                              "v0.34-lm-head-one-tile"])
def test_device_path_is_the_samplers_step_gpu(input, tile):
    """At DiffusionGemma's shape, Triton kernels, graph replay of the update on. The LM head's
    path gets its logits from ``kernels/head_gemm.py`` (fp32 sums in another order than cuBLAS's
    per-request GEMMs): only where a bf16 logit rounds differently can a statistic differ, so
    that path is compared in ``test_lm_head_path_close_to_compute_logits_gpu``."""
    if input == "lm_head":
        pytest.skip("compared statistically below")
    run_and_compare("cuda", backend="triton", tile=tile, input=input, graph_update=True,
                    **GPU_CASE)


@pytest.mark.gpu
def test_device_path_transient_memory_is_one_projected_tile_gpu():
    """0.34's path with a budget of one request per tile: a step's peak allocation beyond
    what existed before is one request's projected logits (bf16 head output and its fp32
    softcapped copy), within 10% plus 32 MiB, after the update's graphs are captured."""
    c = dict(GPU_CASE, top_k=(262144,) * 4, top_p=(1.0,) * 4)
    vocab, canvas, hidden = c["vocab"], c["canvas"], c["hidden"]
    one = bytes_per_request(canvas, vocab, 2 + 4)
    su = Setup("cuda", n=c["n"], canvas=canvas, vocab=vocab, hidden=hidden, widths=c["widths"],
               top_k=c["top_k"], top_p=c["top_p"], backend="triton", graph_update=True, budget=one)
    su.project = projection(su.weight, per_request=False)
    valid = np.asarray(c["valid"], dtype=np.int64)
    hidden_states = torch.randn(int(valid.sum()), hidden, device="cuda").to(torch.bfloat16)
    for input, itemsize in (("compute_logits", 2 + 4), ("lm_head", 2)):
        one = bytes_per_request(canvas, vocab, itemsize)
        su.runner.budget_bytes = one
        peaks = []
        for _ in range(4):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            decode(su.runner, hidden_states, decode_slots=np.asarray(su.slots),
                   decode_idx=np.arange(len(su.slots)), valid=valid, vocab=vocab,
                   column_tokens=None, sampled=su.sampled, num_sampled=su.num_sampled,
                   draft_tokens=su.draft_tokens, all_slots=torch.tensor(su.slots, device="cuda"),
                   projection=su.projection(input))
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        assert su.runner.last_tile_requests == 1
        assert peaks[-1] <= 1.1 * one + (32 << 20), (input, peaks, one)


@pytest.mark.gpu
def test_lm_head_path_close_to_compute_logits_gpu():
    """The adapter's own projection (``kernels/head_gemm.py``, bf16 logits, softcap in the
    kernels) against ``compute_logits`` (cuBLAS, fp32 softcapped copy), same requests, same
    seeds, one step from the same state: the head's bf16 logits differ from cuBLAS's only where
    an fp32 sum in another order rounds to the neighbouring bf16 value, so nearly every argmax
    and sample agree, and entropies and lse agree to that rounding."""
    c = dict(GPU_CASE, top_k=(262144,) * 4, top_p=(1.0,) * 4)
    runs = []
    for input in ("lm_head", "compute_logits"):
        su = Setup("cuda", n=c["n"], canvas=c["canvas"], vocab=c["vocab"], hidden=c["hidden"],
                   widths=c["widths"], top_k=c["top_k"], top_p=c["top_p"], backend="triton")
        su.project = projection(su.weight, per_request=False)
        valid = np.asarray(c["valid"], dtype=np.int64)
        gen = torch.Generator(device="cuda").manual_seed(5)
        hidden_states = torch.randn(int(valid.sum()), c["hidden"], generator=gen, device="cuda")
        out, _ = su.step(hidden_states, valid, input=input)
        runs.append((out, su.states.self_conditioning_embeds.clone()))
    (a, sc_a), (b, sc_b) = runs
    assert (a.stats.argmax == b.stats.argmax).float().mean() > 0.99
    assert (a.stats.sample == b.stats.sample).float().mean() > 0.99
    torch.testing.assert_close(a.stats.lse, b.stats.lse, rtol=1e-3, atol=1e-3, equal_nan=True)
    torch.testing.assert_close(a.stats.entropy, b.stats.entropy, rtol=1e-2, atol=1e-2)
    assert (sc_a - sc_b).norm() <= 2e-2 * sc_b.norm()
