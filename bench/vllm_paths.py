"""vLLM's own DiffusionGemma sampler device paths, re-expressed without vLLM, to time in the
same run as ours.

The GPU machines have no vLLM, yet the figure a user wants is our step against what vLLM would
otherwise run. vLLM's row-statistics kernel is vLLM's own Triton code (``sample_row_stats`` in
``vllm/model_executor/models/diffusion_gemma_sampler.py``, identical in 0.31-0.34);
``tools/fetch_vllm_kernels.sh`` takes it out of a release at run time and ``load_kernels`` loads
it. Everything around the kernel is re-expressed here from what vLLM 0.33.0 and 0.34.0 run on
the device per decode step (``DiffusionSampler.__call__``, ``_compiled_sample_step``,
``_denoise_temperature``, ``compute_logits`` and ``_softcap_logits`` in
``vllm/model_executor/models/diffusion_gemma.py``), for a batch of ``n`` decoding requests
with no top-k / top-p, allowed sets, pins, read-only requests or logprobs:

* ``v034_step``: hidden states in. Tiles of ``max(1, 0.5 * free // (W * V * 4 * 5))``
  requests, ``free`` read from the device at every step. Per tile: the tile's hidden rows (a
  slice, or a gather padded with zero rows where a canvas is truncated), ``compute_logits``
  (``F.linear`` in the model dtype, then ``.float()`` and ``tanh(x / 30) * 30`` compiled into one
  kernel), the top-k / top-p row mapping vLLM builds even when both are off, the compiled
  schedule temperature, a seed drawn on the host, ``sample_row_stats`` writing bf16
  probabilities, and the compiled state update with ``probs @ E * normalizer`` stored in fp32.
* ``v033_step``: fp32 softcapped logits in, tiles of ``0.5 * free // (W * V * 4 * 3)``
  requests, the same per tile minus the projection (the row mapping once per step).
* ``two_gemm_floor``: the two cuBLAS GEMMs a step from hidden states cannot avoid (the head
  ``hidden @ W^T`` and the soft embedding ``p @ E``), each timed alone. The floor from logits
  (one read of the logits plus ``p @ E``) is ``bench_step.measure_floor``.

Reproduced as vLLM runs them: every device operation over ``[rows, V]`` or ``[rows, H]``
(projection, softcap, row statistics with its probabilities, the soft-embedding GEMM, its
scaling and fp32 store), the compiled pieces compiled (``torch.compile(dynamic=True)``, on a
GPU only), the tile budgets, the per-step ``mem_get_info`` and pinned host-to-device staging,
the host-drawn seed per tile, the small per-request operations of the update (confidence,
entropy-ranked acceptance, renoise from ``torch.randint``, the argmax history ring, stability,
convergence, the emitted tokens, the draft copy) and ``num_rejected``. Simplified: the state
holds exactly the ``n`` requests in slots ``0..n-1``; vLLM's UVA views of its host slot arrays
are host-to-device copies here; host bookkeeping that issues no device work (the output
object, logprob stashes, prefill handling) is left out; no tensor parallelism. vLLM 0.33 and
0.34 run no device-to-host synchronisation in such a step (the seed's ``.item()`` reads a CPU
tensor), and neither does this.

Usage (``bench/`` on ``sys.path``)::

    import vllm_paths
    kernels = vllm_paths.load_kernels(".vllm_kernels/diffusion_gemma_sampler.py")
    step = vllm_paths.v034_step(hidden, weight, kernels, canvas=256)   # hidden [n * 256, H] bf16
    step()                                  # one decode step; time it
    step.tiles                              # requests per tile in the last step
    head, soft = vllm_paths.two_gemm_floor(hidden, weight, weight)

On a CPU the paths run at small shapes with eager PyTorch (``compile=False``), with the real
kernel module under ``TRITON_INTERPRET=1`` or a stand-in with the same signature.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

FETCH_HINT = "bash tools/fetch_vllm_kernels.sh --from-venv DIR (or VERSION)"

# fp32 [W, V] copies per request that vLLM's tile budget counts against half the free memory:
# three in 0.33, five in 0.34 (its projection's output and fp32 copy).
BUDGET_COPIES = {"0.33": 3, "0.34": 5}


def load_kernels(path: str | os.PathLike) -> ModuleType:
    """vLLM's row-statistics module from a file (``tools/fetch_vllm_kernels.sh`` writes it).

    Raises ``FileNotFoundError`` for a missing file, ``ImportError`` for one that does not import
    or has no callable ``sample_row_stats``, each naming the file and how to make it. The module
    gets ``origin`` (the release, from the fetch script's header: ``vllm==0.34.0 (wheel ...)``)
    and ``sha256``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no vLLM kernel module at {path}: make it with {FETCH_HINT}")
    source = path.read_bytes()
    name = f"_vllm_kernels_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Triton reads a jitted function's source through its module: register it while it loads.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ImportError(f"{path} does not import ({type(e).__name__}: {e}); was it made by "
                          f"{FETCH_HINT}?") from e
    if not callable(getattr(module, "sample_row_stats", None)):
        sys.modules.pop(name, None)
        raise ImportError(f"{path} has no sample_row_stats: it is not vLLM's "
                          f"diffusion_gemma_sampler.py (make it with {FETCH_HINT})")
    head = re.match(r"# Taken from (.+) by tools/fetch_vllm_kernels\.sh", source.decode(errors="replace"))
    module.origin = head.group(1) if head else "unknown origin"
    module.sha256 = hashlib.sha256(source).hexdigest()
    return module


def free_device_memory(device: torch.device) -> int:
    """Free bytes as vLLM reads them each step (``torch.accelerator.get_memory_info``, the same
    ``cudaMemGetInfo``); on a CPU, the available physical memory. Tests replace this."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tile_requests(version: str, free: int, width: int, vocab: int) -> int:
    """Requests per tile in vLLM ``version`` ("0.33" or "0.34") for canvases ``width`` wide."""
    return max(1, int(free * 0.5) // max(width * vocab * 4 * BUDGET_COPIES[version], 1))


@dataclass(frozen=True)
class Schedule:
    """The sampler's configuration as vLLM holds it. The defaults never converge
    (``confidence_threshold`` 0, a step cap out of reach), so that every timed step is a denoise
    step with its soft embedding, as ``bench_step.make_sampler``'s; temperatures stay near
    ``t_max``. ``ring`` is vLLM's ``stability_threshold``: DiffusionGemma's setting plus one."""

    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    confidence_threshold: float = 0.0
    max_denoising_steps: int = 1_000_000
    ring: int = 2


class VllmState:
    """The per-request device state vLLM's sampler reads and writes in a decode step, for ``n``
    requests in slots ``0..n-1``, already denoising (past prefill) from random canvases."""

    def __init__(self, n: int, canvas: int, vocab: int, hidden: int, schedule: Schedule,
                 device: torch.device):
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.canvas = torch.randint(0, vocab, (n, canvas), device=device)
        self.argmax_canvas = zeros(n, canvas, dtype=torch.int64)
        self.step = zeros(n, dtype=torch.int32)
        self.committing = zeros(n, dtype=torch.bool)  # vLLM's is_encoder_phase
        self.confident = zeros(n, dtype=torch.bool)
        self.sc_embeds = zeros(n, canvas, hidden, dtype=torch.float32)
        self.history = zeros(n, schedule.ring, canvas, dtype=torch.int64)
        self.history_len = zeros(n, dtype=torch.int32)
        self.max_steps = torch.full((n,), schedule.max_denoising_steps, dtype=torch.int32,
                                    device=device)
        self.pins = zeros(n, canvas, dtype=torch.bool)
        self.seed_canvas = zeros(n, canvas, dtype=torch.int64)
        self.read_only = zeros(n, dtype=torch.bool)
        # The runner's outputs and its draft-token buffer.
        self.sampled = zeros(n, canvas, dtype=torch.int32)
        self.num_sampled = zeros(n, dtype=torch.int32)
        self.draft_tokens = zeros(n, canvas, dtype=torch.int64)


def _softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    # fp32 before the tanh; compiled, the cast, divide, tanh and multiply are one pass.
    return torch.tanh(logits.float() / cap) * cap


def _temperature(steps, slots, max_denoising_steps: float, t_min: float, t_max: float):
    remaining = (max_denoising_steps - steps[slots].float()).clamp(min=1.0)
    return t_min + (t_max - t_min) * (remaining / max_denoising_steps)


def _num_rejected(num_logits, num_sampled, query_start):
    query_lens = query_start[1:] - query_start[:-1]
    denoising = (num_logits > 0) & (num_sampled == 0)
    return torch.where(denoising, query_lens, num_logits - num_sampled)


def _state_update(sample, argmax, entropy, probs, slots, out_rows, all_slots, valid,
                  canvas, argmax_canvas, steps, committing, confident, sc_embeds, embed,
                  normalizer, history, history_len, max_steps, pins, seed_canvas, read_only,
                  sampled, num_sampled, draft_tokens, confidence_threshold: float, vocab: int,
                  width: int, ring: int, entropy_bound: float):
    """One tile's update after the row statistics ([n, W] each; ``probs`` [n, W, V]), in the
    order vLLM's compiled step runs it (DESIGN.md section 2, steps 3-7)."""
    n = slots.shape[0]
    # Confidence over the whole canvas width, truncated positions included (vLLM's choice).
    confident[slots] = entropy.mean(dim=-1) < confidence_threshold
    # A position is accepted when the entropies ranked below it sum to at most the bound. On an
    # ascending row the running max is the entry itself; vLLM subtracts it through cummax.
    ranked, order = torch.sort(entropy, dim=-1)
    below = torch.cumsum(ranked, dim=-1) - torch.cummax(ranked, dim=-1).values
    accepted = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, order, below <= entropy_bound)

    commit = committing[slots]
    denoise = ~commit
    steps[slots] = torch.where(denoise, steps[slots] + 1, torch.zeros_like(steps[slots]))
    noise = torch.randint(0, vocab, (n, width), device=slots.device, dtype=canvas.dtype)
    proposal = torch.where(accepted, sample, noise)
    proposal = torch.where(pins[slots], seed_canvas[slots], proposal)
    canvas[slots] = torch.where(commit.unsqueeze(1), noise, proposal)

    # The argmax canvas enters a ring of the last ``ring`` steps; stable when all agree.
    length = history_len[slots]
    at = length % ring
    for i in range(ring):
        here = ((at == i) & denoise).unsqueeze(1)
        history[slots, i] = torch.where(here, argmax, history[slots, i])
    argmax_canvas[slots] = torch.where(denoise.unsqueeze(1), argmax, argmax_canvas[slots])
    length = torch.where(denoise, length + 1, torch.zeros_like(length))
    history_len[slots] = length
    first = history[slots, 0]
    differing = torch.zeros(n, device=slots.device, dtype=torch.int32)
    for i in range(1, ring):
        differing = differing + (first != history[slots, i]).sum(dim=-1).int()
    converged = ((differing == 0) & confident[slots] & (length >= ring)) | (
        steps[slots] >= max_steps[slots])
    committing[slots] = torch.where(commit, torch.zeros_like(commit), converged)

    emit = commit | (denoise & converged & read_only[slots])
    sampled[out_rows] = argmax_canvas[slots].to(sampled.dtype) * emit.unsqueeze(1)
    num_sampled[out_rows] = (emit * valid).to(num_sampled.dtype)

    # Self-conditioning: bf16 probabilities times E in the model dtype, scaled, kept only where
    # the request denoises next, stored in fp32.
    keep = (denoise & ~committing[slots]).view(n, 1, 1)
    soft = torch.matmul(probs.to(embed.dtype), embed) * normalizer
    sc_embeds[slots] = (soft * keep * (~pins[slots]).unsqueeze(-1)).to(sc_embeds.dtype)

    fresh = (converged & denoise).unsqueeze(1)
    canvas[slots] = torch.where(fresh, argmax_canvas[slots], canvas[slots])
    committing[slots] = committing[slots] & ~read_only[slots]
    draft_tokens[all_slots, :width] = canvas[all_slots]


_COMPILED: dict[str, Callable] = {}


def _compiled(name: str, fn: Callable, compile: bool) -> Callable:
    """``fn`` under ``torch.compile(dynamic=True)`` as vLLM compiles it (one build per
    process), or ``fn`` itself."""
    if not compile:
        return fn
    if name not in _COMPILED:
        compiled = torch.compile(fn, dynamic=True)
        # Batch size 1 and sizes equal to the state's specialise the graph; vLLM raises the
        # limit so that the step never falls back to eager.
        _COMPILED[name] = torch._dynamo.config.patch(recompile_limit=64)(compiled)
    return _COMPILED[name]


def compute_logits(weight: torch.Tensor, softcap: float | None = 30.0, compile: bool | None = None):
    """DiffusionGemma's ``compute_logits`` over hidden rows: the head ``F.linear`` in the
    model dtype (cuBLAS), then, with a softcap, ``.float()`` and ``tanh(x / c) * c`` in one
    compiled kernel. Returns ``project(hidden [rows, H]) -> logits [rows, V]`` (fp32 with a
    softcap, else the model dtype)."""
    compile = weight.is_cuda if compile is None else compile
    cap = _compiled("softcap", _softcap, compile)

    def project(hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight)
        return logits if softcap is None else cap(logits, softcap)

    return project


class VllmStep:
    """One decode step of vLLM's ``DiffusionSampler`` on preallocated inputs: call it to run
    one (``step()``). Built by ``v034_step`` / ``v033_step``; after a call, ``tiles`` lists the
    requests per tile, ``num_rejected`` holds the runner's count and ``state`` the requests'
    state (``state.sc_embeds`` [n, CL, H] fp32: the soft embeddings)."""

    def __init__(self, version: str, rows: torch.Tensor, embed: torch.Tensor, kernels: ModuleType,
                 *, canvas: int, vocab: int, normalizer, valid, project, schedule: Schedule,
                 compile: bool | None, free_bytes: int | None):
        if version not in BUDGET_COPIES:
            raise ValueError(f"version {version!r}: one of {sorted(BUDGET_COPIES)}")
        self.version = version
        self.rows = rows
        self.device = rows.device
        n = len(valid)
        self.valid_np = np.asarray(valid, dtype=np.int64)
        if (self.valid_np < 1).any() or (self.valid_np > canvas).any():
            raise ValueError(f"valid canvas lengths must lie in [1, {canvas}]")
        if rows.shape[0] != int(self.valid_np.sum()):
            raise ValueError(f"{rows.shape[0]} input rows for valid canvas lengths summing to "
                             f"{int(self.valid_np.sum())}")
        self.embed = embed
        self.kernels = kernels
        self.canvas, self.vocab, self.n = canvas, vocab, n
        self.project = project
        self.schedule = schedule
        self.free_bytes = free_bytes
        # vLLM holds the normalizer as a 0-d tensor in the model dtype.
        self.normalizer = torch.as_tensor(normalizer, dtype=embed.dtype, device=self.device)
        self.state = VllmState(n, canvas, vocab, embed.shape[1], schedule, self.device)
        compile = self.device.type == "cuda" if compile is None else compile
        self._temperature = _compiled("temperature", _temperature, compile)
        self._update = _compiled("update", _state_update, compile)
        self._num_rejected = _compiled("num_rejected", _num_rejected, compile)
        self._pin = self.device.type == "cuda"
        # Buffers vLLM fills once per request (its input batch): the slot of each request, where
        # its query starts, how many logits it has.
        self.all_slots = torch.arange(n, device=self.device)
        self.query_start = torch.as_tensor(np.concatenate(([0], np.cumsum(self.valid_np))),
                                           dtype=torch.int32, device=self.device)
        self.num_logits = torch.as_tensor(self.valid_np, dtype=torch.int32, device=self.device)
        self.widths_np = np.full(n, canvas, dtype=np.int64)
        self.tiles: list[int] = []
        self.num_rejected: torch.Tensor | None = None

    def _h2d(self, array: np.ndarray) -> torch.Tensor:
        """A host array staged through pinned memory and copied without waiting (vLLM's
        ``async_tensor_h2d``)."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self._pin:
            t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.to(self.device, non_blocking=True)

    def __call__(self) -> None:
        st, n, device, width = self.state, self.n, self.device, self.canvas
        slots_np = np.arange(n, dtype=np.int64)
        valid_np = self.valid_np
        # vLLM reads its slot arrays through UVA views; copies stand in for them.
        slots = self._h2d(slots_np)
        out_rows = self._h2d(slots_np)
        valid = self._h2d(valid_np)
        if self.version == "0.33":
            # The top-k / top-p row mapping, built before the check that both are off.
            slots.repeat_interleave(valid, output_size=int(valid_np.sum()))
        starts_np = np.concatenate(([0], np.cumsum(valid_np)[:-1])).astype(np.int64)
        starts = self._h2d(starts_np)
        st.sampled.zero_()
        st.num_sampled.zero_()
        st.committing[slots].clone()  # vLLM's snapshot for the logprob stash
        free = self.free_bytes if self.free_bytes is not None else free_device_memory(device)
        per_tile = tile_requests(self.version, free, width, self.vocab)
        order = np.argsort(self.widths_np, kind="stable")
        self.tiles = []
        for t0 in range(0, n, per_tile):
            sel_np = order[t0:t0 + per_tile]
            k = len(sel_np)
            self.tiles.append(k)
            sel = self._h2d(sel_np)
            tile_slots = slots[sel]
            tile_valid = valid[sel]
            if (sel_np == np.arange(sel_np[0], sel_np[0] + k)).all() and valid_np[sel_np].min() == width:
                r0 = int(starts_np[sel_np[0]])
                tile_rows = self.rows[r0:r0 + k * width]
            else:
                # Each request padded to the tile's width; its phantom rows zeroed.
                ar = torch.arange(width, device=device)
                src = (starts[sel].unsqueeze(1) + ar.unsqueeze(0)).clamp_max(self.rows.shape[0] - 1)
                phantom = (ar.unsqueeze(0) >= tile_valid.unsqueeze(1)).reshape(-1, 1)
                tile_rows = self.rows[src.reshape(-1)].masked_fill_(phantom, 0)
            logits = self.project(tile_rows) if self.project is not None else tile_rows
            if self.version == "0.34":
                tile_slots.repeat_interleave(width, output_size=k * width)
            temp = self._temperature(st.step, tile_slots, float(self.schedule.max_denoising_steps),
                                     self.schedule.t_min, self.schedule.t_max)
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
            argmax, sample, entropy, probs = self.kernels.sample_row_stats(
                logits, temp, width, seed, self.embed.dtype)
            self._update(sample.view(k, width), argmax.view(k, width), entropy.view(k, width),
                         probs.view(k, width, -1), tile_slots, out_rows[sel], self.all_slots,
                         tile_valid, st.canvas, st.argmax_canvas, st.step, st.committing,
                         st.confident, st.sc_embeds, self.embed, self.normalizer, st.history,
                         st.history_len, st.max_steps, st.pins, st.seed_canvas, st.read_only,
                         st.sampled, st.num_sampled, st.draft_tokens,
                         confidence_threshold=self.schedule.confidence_threshold, vocab=self.vocab,
                         width=width, ring=self.schedule.ring,
                         entropy_bound=self.schedule.entropy_bound)
        self.num_rejected = self._num_rejected(self.num_logits, st.num_sampled, self.query_start)


def _valid(valid: Sequence[int] | None, canvas: int, rows: int) -> list[int]:
    """Each request's valid canvas length: ``valid``, or full canvases over ``rows``."""
    if valid is not None:
        return [int(v) for v in valid]
    if rows % canvas:
        raise ValueError(f"{rows} input rows are not whole canvases of {canvas}: pass valid=")
    return [canvas] * (rows // canvas)


def v034_step(hidden: torch.Tensor, weight: torch.Tensor, kernels: ModuleType, *, canvas: int,
              embed: torch.Tensor | None = None, normalizer: float | torch.Tensor | None = None,
              softcap: float | None = 30.0, valid: Sequence[int] | None = None,
              schedule: Schedule | None = None, compile: bool | None = None,
              free_bytes: int | None = None) -> VllmStep:
    """vLLM 0.34's decode step from hidden states, as ``step()``.

    ``hidden`` [sum(valid), H] in the model dtype (bf16): the canvases' rows, request after
    request. ``weight`` [V, H]: the LM head; ``embed`` [V, H] the embedding the soft embedding
    multiplies (default ``weight``: DiffusionGemma ties them). ``kernels``: ``load_kernels(...)``
    (or a stand-in with vLLM's ``sample_row_stats(logits, temps, canvas_len, seed, probs_dtype)
    -> (argmax, sample, entropy, probs)``). ``canvas``: CL, each request's canvas width;
    ``valid``: each request's valid length (default: full canvases, ``len(hidden) // canvas``
    requests). ``normalizer``: default ``sqrt(H)``. ``compile``: default on CUDA tensors only.
    ``free_bytes``: the free memory the tile budget reads (default: read from the device at each
    step, as vLLM does; on a serving GPU the KV cache leaves much less free than a benchmark's).
    """
    embed = weight if embed is None else embed
    norm = embed.shape[1] ** 0.5 if normalizer is None else normalizer
    return VllmStep("0.34", hidden, embed, kernels, canvas=canvas, vocab=weight.shape[0],
                    normalizer=norm, valid=_valid(valid, canvas, hidden.shape[0]),
                    project=compute_logits(weight, softcap, compile),
                    schedule=schedule or Schedule(), compile=compile, free_bytes=free_bytes)


def v033_step(logits: torch.Tensor, embed: torch.Tensor, kernels: ModuleType, *, canvas: int,
              normalizer: float | torch.Tensor | None = None, valid: Sequence[int] | None = None,
              schedule: Schedule | None = None, compile: bool | None = None,
              free_bytes: int | None = None) -> VllmStep:
    """vLLM 0.33's decode step from logits, as ``step()``.

    ``logits`` [sum(valid), V]: what 0.33's model runner hands the sampler (fp32, softcapped by
    ``compute_logits`` beforehand; any dtype the kernel reads). ``embed`` [V, H] in the model
    dtype. The other arguments as ``v034_step``'s. At DiffusionGemma's shape on an 80 GB card a
    batch of up to ~40 requests is one tile.
    """
    norm = embed.shape[1] ** 0.5 if normalizer is None else normalizer
    return VllmStep("0.33", logits, embed, kernels, canvas=canvas, vocab=logits.shape[1],
                    normalizer=norm, valid=_valid(valid, canvas, logits.shape[0]),
                    project=None, schedule=schedule or Schedule(), compile=compile,
                    free_bytes=free_bytes)


class TwoGemms(NamedTuple):
    """Closures over preallocated operands and outputs, each one cuBLAS GEMM."""

    head: Callable[[], torch.Tensor]  # hidden [rows, H] @ W^T -> [rows, V] in the model dtype
    soft_embedding: Callable[[], torch.Tensor]  # p [rows, V] @ E -> [rows, H]


def two_gemm_floor(hidden: torch.Tensor, weight: torch.Tensor, embed: torch.Tensor,
                   probs: torch.Tensor | None = None, temperature: float = 0.8,
                   softcap: float | None = 30.0) -> TwoGemms:
    """The floor of a step from hidden states (DESIGN.md section 9): the head GEMM and the
    soft-embedding GEMM, to time separately (``floor = t(head) + t(soft_embedding)``).

    ``hidden`` [rows, H], ``weight`` (head) and ``embed`` [V, H], all in the model dtype.
    ``probs`` [rows, V] in ``embed``'s dtype: the probabilities ``p @ E`` reads (default:
    ``softmax(softcap(hidden @ W^T) / temperature)``, computed here once, a block of rows at a
    time, so that the GEMM sees a step's values rather than noise). The floor from logits (one
    read of the logits plus ``p @ E``) is ``bench_step.measure_floor(rows, vocab, hidden,
    logits, embed, warmup, reps)``.
    """
    rows, vocab = hidden.shape[0], weight.shape[0]
    logits = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    soft = torch.empty(rows, embed.shape[1], dtype=embed.dtype, device=hidden.device)
    if probs is None:
        probs = torch.empty(rows, vocab, dtype=embed.dtype, device=hidden.device)
        block = max(1, (256 << 20) // (vocab * 4))
        for r in range(0, rows, block):
            z = F.linear(hidden[r:r + block], weight).float()
            z = z if softcap is None else torch.tanh(z / softcap) * softcap
            probs[r:r + block] = torch.softmax(z / temperature, dim=-1)
    weight_t = weight.t()
    return TwoGemms(head=lambda: torch.mm(hidden, weight_t, out=logits),
                    soft_embedding=lambda: torch.mm(probs, embed, out=soft))
