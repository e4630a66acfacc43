"""Drive vLLM's own DiffusionGemma sampler (0.33 or 0.34) on the CPU, without a model or an engine.

vLLM's ``DiffusionSampler`` (``vllm.model_executor.models.diffusion_gemma``) is the behaviour our
sampler must reproduce. It is normally built by ``DiffusionGemmaModelState.custom_sampler`` inside
the GPU model runner. This module builds the same objects directly:

- the real ``DiffusionGemmaRequestStates`` and ``DiffusionSampler``;
- for the runner's ``sampler`` argument, a namespace holding vLLM's real ``SamplingStates``,
  ``LogprobTokenIdsState`` and ``RequestState`` (the full ``Sampler`` needs a whole ``VllmConfig``);
- real ``SamplingParams`` per request and real ``InputBatch`` dataclasses per step, filled the way
  ``GPUModelRunner.prepare_inputs`` fills them for a model with ``num_new_sampled_tokens_per_step
  == 0`` (a decoding request schedules exactly its canvas as draft tokens and gets one logit row per
  draft token; a prefilling request gets none).

On a machine without CUDA a few things are swapped before/after import (``install_cpu_stubs``):

- environment, before vLLM's submodules load: ``VLLM_TARGET_DEVICE=cpu`` (vLLM's CPU platform),
  ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""``. The last makes
  ``vllm.triton_utils`` keep real Triton with no active driver (its "distributed env" leniency),
  so vLLM's Triton kernels (logprob gather, ranks, per-request logprob ids, staged writes) run in
  the interpreter instead of being replaced by placeholders that cannot launch;
- ``buffer_utils.is_uva_available`` -> False: the CPU platform claims UVA but pinned memory and
  the accelerator view need a GPU; the fallback keeps a plain "device" copy on the CPU;
- ``apply_top_k_top_p`` (as imported by diffusion_gemma) -> vLLM's PyTorch implementation, the
  one it uses without Triton: its Triton top-k/top-p kernel does not run in the interpreter;
- ``torch.accelerator.get_memory_info`` -> a configurable free-memory figure (``set_free_memory``),
  which drives the sampler's tile size, so tests can force one request per tile;
- the three ``torch.compile``d functions run eagerly (their original Python), unless
  ``install_cpu_stubs(compiled=True)`` is called: Inductor on the CPU then works and gives the
  same trajectories, but builds for minutes on 2 cores.

The two releases differ in what the sampler is called with (``RELEASE``): 0.33 takes the
logits, 0.34 the hidden states and projects them itself through the ``compute_logits`` callable
of its constructor. For 0.34 the harness builds a ``compute_logits`` (``make_compute_logits``)
and turns a step's logits into hidden states it projects back exactly
(``IdentityProjection``), so one test drives both releases with the same logits; a test may
give a real projection instead (``make_vllm_sampler(compute_logits=...)``).

The decode step then runs vLLM's CPU branch, ``sample_row_stats_reference`` (torch global RNG),
instead of its Triton row-stats kernel. Everything else is vLLM's own code. With CUDA no stub
is installed and everything runs on the GPU (untested: vLLM 0.33 wants torch 2.14).

Import this module before anything imports vLLM or Triton (``import vllm`` alone imports Triton,
though not the platform), or run with ``TRITON_INTERPRET=1`` in the environment as the project's
CPU tests do; test files check for vLLM with ``importlib.util.find_spec`` rather than
``pytest.importorskip("vllm")`` for that reason.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

ON_CPU = not torch.cuda.is_available()
DEVICE = torch.device("cpu" if ON_CPU else "cuda")


def _prepare_environment() -> None:
    """Environment vLLM reads while its submodules import (see the module docstring)."""
    if not ON_CPU:
        return
    if "vllm.triton_utils" in sys.modules:
        # Too late to change what vLLM decided; only fine if it kept real Triton.
        if not sys.modules["vllm.triton_utils"].HAS_TRITON:
            raise RuntimeError(
                "vllm.triton_utils was imported before vllm_harness and replaced Triton with "
                "placeholders; import vllm_harness first (or set VLLM_TARGET_DEVICE=cpu "
                'TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" in the environment)'
            )
        return
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # triton.language's own @jit helpers (tl.max, ...) were built for compilation and fail
        # inside interpreted kernels. `import vllm` alone imports Triton.
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 "
            "or import vllm_harness before vllm/triton"
        )
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


_prepare_environment()

import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.model_executor.models import diffusion_gemma as dg  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402
from vllm.v1.worker.gpu import buffer_utils  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.sample.logprob import LogprobTokenIdsState  # noqa: E402
from vllm.v1.worker.gpu.sample.states import SamplingStates  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

# Captured now: our vllm.general_plugins entry point (dgemma_sampler.vllm.plugin.register) points
# dg.DiffusionSampler at FusedDiffusionSampler, and this harness must keep driving vLLM's own.
DiffusionSampler = dg.DiffusionSampler
if DiffusionSampler.__module__ != dg.__name__:
    raise RuntimeError(
        f"diffusion_gemma.DiffusionSampler is {DiffusionSampler.__module__}."
        f"{DiffusionSampler.__qualname__}, not vLLM's: a plugin replaced it before vllm_harness was "
        "imported (import vllm_harness first, or set DGEMMA_SAMPLER_DISABLE=1)"
    )
DiffusionGemmaRequestStates = dg.DiffusionGemmaRequestStates

# The installed release's sampler contract: "0.33" (logits in) or "0.34" (hidden states in).
RELEASE = ".".join(vllm.__version__.split(".")[:2])
if RELEASE not in ("0.33", "0.34"):
    raise RuntimeError(f"vllm_harness drives vLLM 0.33 and 0.34, not {vllm.__version__}")
HIDDEN_INPUT = RELEASE == "0.34"

# The free memory the fake get_memory_info reports; the sampler tiles by half of it.
_FREE_MEMORY = [64 << 30]
_COMPILED_NAMES = ("_compute_num_rejected", "_denoise_temperature", "_compiled_sample_step",
                   "_softcap_logits")  # (the last: 0.34's compute_logits)
_ORIGINALS: dict[str, Any] = {}


def set_free_memory(num_bytes: int) -> None:
    """What ``torch.accelerator.get_memory_info()[0]`` reports on the CPU. The sampler puts
    ``max(1, free // 2 // (W * vocab * 12))`` requests in a tile; 0 forces one per tile."""
    _FREE_MEMORY[0] = int(num_bytes)


def _fake_memory_info(device_index: Any = None) -> tuple[int, int]:
    return _FREE_MEMORY[0], max(_FREE_MEMORY[0], 1 << 40)


def _top_k_top_p_on_cpu(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
    has_topp_only_rows: bool = True,
) -> torch.Tensor:
    # vLLM's own non-Triton path: its Triton top-k/top-p kernel does not run in the interpreter.
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def install_cpu_stubs(compiled: bool = False) -> None:
    """Swap what needs a GPU (idempotent; no-op with CUDA). ``compiled=False`` runs the
    sampler's ``torch.compile``d step functions eagerly: same Python, no Inductor build."""
    if not ON_CPU:
        return
    buffer_utils.is_uva_available = lambda: False
    torch.accelerator.get_memory_info = _fake_memory_info
    dg.apply_top_k_top_p = _top_k_top_p_on_cpu
    for name in _COMPILED_NAMES:
        if not hasattr(dg, name):
            continue
        compiled_fn = _ORIGINALS.setdefault(name, getattr(dg, name))
        setattr(dg, name, compiled_fn if compiled else compiled_fn._torchdynamo_orig_callable)


install_cpu_stubs()


# --------------------------------------------------------------------------------------------
# Sampler construction
# --------------------------------------------------------------------------------------------


@dataclass
class VllmDiffusionHarness:
    """vLLM's sampler plus every object around it that the model runner would own."""

    sampler: Any  # DiffusionSampler (or a drop-in with the same constructor)
    states: Any  # DiffusionGemmaRequestStates
    runner_sampler: SimpleNamespace  # what custom_sampler() receives as ``sampler``
    canvas_length: int
    vocab_size: int
    device: torch.device
    projection: Any = None  # 0.34: the compute_logits the sampler was built with
    prompt_lens: dict[int, int] = field(default_factory=dict)

    @property
    def req_states(self) -> RequestState:
        return self.runner_sampler.req_states

    @property
    def draft_tokens(self) -> torch.Tensor:
        """``[max_num_reqs, canvas_length]`` int64: the runner feeds row ``slot[:k]`` back as the
        next step's input ids."""
        return self.runner_sampler.req_states.draft_tokens

    def add_request(
        self,
        slot: int,
        *,
        prompt_len: int = 5,
        top_k: int = 0,
        top_p: float = 1.0,
        logprobs: int | None = None,
        logprob_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        extra_args: dict | None = None,
        temperature: float = 1.0,
    ) -> SamplingParams:
        """Register a request at ``slot`` in the runner's order: model state (resets the
        diffusion slot), then the sampler (reads ``extra_args``), then staged writes."""
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            logprobs=logprobs,
            logprob_token_ids=list(logprob_token_ids) if logprob_token_ids else None,
            seed=seed,
            extra_args=dict(extra_args) if extra_args else None,
            max_tokens=1 << 20,
        )
        self.states.add_request(slot)
        self.states.prompt_len[slot].fill_(prompt_len)
        self.prompt_lens[slot] = prompt_len
        self.sampler.add_request(slot, params)
        self.sampler.apply_staged_writes()
        return params

    def remove_request(self, slot: int) -> None:
        self.states.remove_request(slot)
        self.prompt_lens.pop(slot, None)

    def decode_slots(self, input_batch: InputBatch) -> np.ndarray:
        """Slots with logit rows this step, in batch order."""
        n = input_batch.num_reqs
        num_logits = np.diff(input_batch.cu_num_logits_np[: n + 1])
        return input_batch.idx_mapping_np[:n][num_logits > 0]

    def begin_step(self, input_batch: InputBatch) -> torch.Tensor | None:
        """The part of ``DiffusionGemmaModelState.prepare_inputs`` the sampler depends on: the
        step's shared constrained set (``states.step_allowed``). When it is not None every decode
        slot reads the same allowed ids and ``compute_logits`` returns ``[rows, K]`` logits whose
        column j is token ``allowed[j]``; pass such logits to ``step``."""
        self.states.step_allowed = None
        if input_batch.num_draft_tokens > 0 and self.prompt_lens:
            self.states.step_allowed = self.states.batch_allowed(
                self.decode_slots(input_batch).tolist()
            )
        return self.states.step_allowed

    def step(self, logits: torch.Tensor, input_batch: InputBatch):
        """One step as the runner makes it: ``begin_step`` (model state) then the sampler call.
        Note vLLM may mask fp32 ``logits`` in place (top-k/top-p): pass a clone to compare.
        0.34 with the default projection: the sampler gets hidden states whose projection
        is ``logits``; with a projection of the test's own, ``logits`` are the hidden states."""
        allowed = self.begin_step(input_batch)
        rows = int(input_batch.cu_num_logits_np[input_batch.num_reqs])
        if HIDDEN_INPUT and not isinstance(self.projection, IdentityProjection):
            assert logits.shape[0] == rows, (tuple(logits.shape), rows)
            return self.sampler(logits.to(self.device), input_batch)
        width = self.vocab_size if allowed is None else allowed.numel()
        assert logits.shape == (rows, width), (tuple(logits.shape), (rows, width))
        if HIDDEN_INPUT:
            return self.sampler(self.projection.hidden_of(logits.to(self.device)), input_batch)
        return self.sampler(logits.to(self.device), input_batch)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Clones of every per-slot state tensor, for before/after comparisons."""
        s = self.states
        return {
            "canvas": s.canvas.clone(),
            "argmax_canvas": s.argmax_canvas.clone(),
            "step": s.step.clone(),
            "is_encoder_phase": s.is_encoder_phase.clone(),
            "confident": s.confident.clone(),
            "history": s.accepted_canvas_history.clone(),
            "history_len": s.accepted_canvas_history_len.clone(),
            "sc_embeds": s.self_conditioning_embeds.clone(),
            "max_steps": s.max_steps.clone(),
            "draft_tokens": self.draft_tokens.clone(),
        }


class IdentityProjection:
    """A 0.34 ``compute_logits`` whose "hidden states" are vocabulary-wide logits: it returns
    them (in their own dtype), or their ``step_allowed`` columns on a shared-set step, as the
    model's ``compute_logits`` projects onto the allowed rows of the LM head. ``hidden_of``
    builds the hidden states whose projection is given logits, so the projection is exact
    and the two releases can be driven with the same logits. Counts calls and rows, so a
    test can see how the sampler tiles its projection."""

    def __init__(self, states: Any) -> None:
        self.states = states
        self.calls: list[int] = []  # rows of each call

    def hidden_of(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.states.step_allowed
        if allowed is None:
            return logits
        hidden = torch.zeros(logits.shape[0], self.states.vocab_size, dtype=logits.dtype,
                             device=logits.device)
        hidden[:, allowed] = logits
        return hidden

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        allowed = self.states.step_allowed
        # A fresh tensor, as a projection returns (vLLM masks what it gets in place).
        return hidden.clone() if allowed is None else hidden[:, allowed]


class LmHeadProjection:
    """A 0.34 ``compute_logits`` as DiffusionGemma's: hidden states ``[rows, H]`` times the
    tied LM head in its dtype, then the final softcap in fp32; on a shared-set step only the
    allowed rows of the head. Counts calls and rows (``calls``)."""

    def __init__(self, states: Any, weight: torch.Tensor, softcap: float | None = 30.0) -> None:
        self.states = states
        self.weight = weight
        self.softcap = softcap
        self.calls: list[int] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        allowed = self.states.step_allowed
        weight = self.weight if allowed is None else self.weight[allowed]
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ModelComputeLogits:
    """DiffusionGemma's own ``compute_logits`` (0.34), as the model state passes it: the bound
    method of a ``DiffusionGemmaForConditionalGeneration`` whose LM head is ``weight`` (tied,
    bf16, unquantized), with vLLM's real ``LogitsProcessor`` and the model's final softcap.
    The model is built without its layers (only what ``compute_logits`` reads); the head GEMM
    is vLLM's CPU dispatch (``layer.cpu_linear``), here ``F.linear``, counted in ``calls``
    (rows per call). Call it with the sampler's request states to get the bound method."""

    def __init__(self, weight: torch.Tensor, softcap: float | None = 30.0) -> None:
        self.weight = weight
        self.softcap = softcap
        self.calls: list[int] = []
        self.model: Any = None

    def __call__(self, states: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        cls = dg.DiffusionGemmaForConditionalGeneration
        model = cls.__new__(cls)
        torch.nn.Module.__init__(model)
        head = torch.nn.Module()
        head.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        head.quant_method = UnquantizedEmbeddingMethod()
        head.tp_size = 1
        vocab = self.weight.shape[0]
        head.shard_indices = SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=vocab,
                                             num_org_vocab_padding=0)

        def cpu_linear(x, w, b):
            self.calls.append(x.shape[0])
            return torch.nn.functional.linear(x, w, b)

        head.cpu_linear = cpu_linear
        model.lm_head = head
        with set_current_vllm_config(VllmConfig()):
            model.logits_processor = LogitsProcessor(vocab, soft_cap=None)
        model.final_logit_softcapping = self.softcap
        model.diffusion_states = states
        self.model = model
        return model.compute_logits


def make_runner_sampler(
    max_num_reqs: int,
    canvas_length: int,
    vocab_size: int,
    device: torch.device = DEVICE,
    logprobs_mode: str = "raw_logprobs",
    max_model_len: int = 4096,
) -> SimpleNamespace:
    """The ``sampler`` argument of ``DiffusionSampler``: the four attributes it reads, from
    vLLM's own classes. ``draft_tokens`` is ``[max_num_reqs, canvas_length]`` because the runner
    sizes it by ``num_speculative_tokens``, which is the canvas length for diffusion models."""
    req_states = RequestState(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_reqs * canvas_length,
        num_speculative_steps=canvas_length,
        vocab_size=vocab_size,
        device=device,
    )
    return SimpleNamespace(
        sampling_states=SamplingStates(max_num_reqs, vocab_size),
        logprob_token_ids_state=LogprobTokenIdsState(max_num_reqs, device),
        req_states=req_states,
        logprobs_mode=logprobs_mode,
    )


def make_vllm_sampler(
    max_num_reqs: int = 4,
    canvas_length: int = 8,
    vocab_size: int = 64,
    hidden: int = 16,
    max_denoising_steps: int = 12,
    stability_threshold: int = 2,
    t_min: float = 0.0,
    t_max: float = 1.0,
    entropy_bound: float = 1.0,
    confidence_threshold: float = 0.5,
    embed_weight: torch.Tensor | None = None,
    normalizer: torch.Tensor | float | None = None,
    *,
    device: torch.device = DEVICE,
    logprobs_mode: str = "raw_logprobs",
    sampler_cls: type | None = None,
    compute_logits: Callable[[Any], Callable[[torch.Tensor], torch.Tensor]] | None = None,
    **sampler_kwargs: Any,
) -> VllmDiffusionHarness:
    """Build vLLM's ``DiffusionSampler`` the way ``custom_sampler`` does.

    ``stability_threshold`` is vLLM's buffer depth ST (the model state passes the generation
    config's value + 1): a request is stable once its last ST argmax canvases agree.
    ``sampler_cls`` swaps in another sampler with the same constructor (for side-by-side runs);
    extra keyword arguments go to it (``sc_vocab_start`` and friends). For 0.34,
    ``compute_logits(states)`` returns the projection the sampler is built with (default:
    ``IdentityProjection``, which ``VllmDiffusionHarness.step`` feeds with logits)."""
    if embed_weight is None:
        g = torch.Generator().manual_seed(7)
        embed_weight = torch.randn(vocab_size, hidden, generator=g).to(torch.bfloat16)
    if normalizer is None:
        normalizer = float(hidden) ** 0.5
    if not isinstance(normalizer, torch.Tensor):
        normalizer = torch.tensor(normalizer, dtype=embed_weight.dtype)
    embed_weight = embed_weight.to(device)
    normalizer = normalizer.to(device)
    # [vocab, hidden], or under tensor parallelism a rank's (padded) shard of it.
    assert embed_weight.dim() == 2 and embed_weight.shape[1] == hidden, (embed_weight.shape, hidden)

    states = DiffusionGemmaRequestStates(
        max_num_reqs=max_num_reqs,
        canvas_length=canvas_length,
        vocab_size=vocab_size,
        max_denoising_steps=max_denoising_steps,
        device=device,
        hidden_size=hidden,
        stability_threshold=stability_threshold,
    )
    runner_sampler = make_runner_sampler(
        max_num_reqs, canvas_length, vocab_size, device, logprobs_mode
    )
    cls = sampler_cls or DiffusionSampler
    projection = None
    if HIDDEN_INPUT:
        projection = (compute_logits or IdentityProjection)(states)
        sampler_kwargs["compute_logits"] = projection
    sampler = cls(
        sampler=runner_sampler,
        diffusion_config=SimpleNamespace(
            canvas_length=canvas_length, max_denoising_steps=max_denoising_steps
        ),
        vocab_size=vocab_size,
        diffusion_states=states,
        t_min=t_min,
        t_max=t_max,
        entropy_bound=entropy_bound,
        confidence_threshold=confidence_threshold,
        embed_weight=embed_weight,
        normalizer=normalizer,
        **sampler_kwargs,
    )
    return VllmDiffusionHarness(
        sampler=sampler,
        states=states,
        runner_sampler=runner_sampler,
        canvas_length=canvas_length,
        vocab_size=vocab_size,
        device=device,
        projection=projection,
    )


# --------------------------------------------------------------------------------------------
# Input batches
# --------------------------------------------------------------------------------------------


@dataclass
class Prefill:
    """A request still feeding its prompt: ``chunk`` prompt tokens this step, after ``computed``
    of ``prefill_len``. No logit rows. The step that reaches ``prefill_len`` finishes it."""

    slot: int
    prefill_len: int
    chunk: int | None = None  # default: the whole remaining prompt
    computed: int = 0


@dataclass
class Decode:
    """A decoding request (denoise or commit step): ``valid_len`` draft tokens and as many
    logit rows (``valid_len`` < the slot's canvas width when truncated near max_model_len).
    ``query_len`` is the scheduled token count (default ``valid_len``)."""

    slot: int
    valid_len: int
    context_len: int = 0
    prefill_len: int = 0
    query_len: int | None = None


def make_input_batch(
    entries: Sequence[Prefill | Decode], device: torch.device = DEVICE
) -> InputBatch:
    """A real ``InputBatch`` for one step, in the given batch order (the runner puts requests
    with drafts first, then by query length; the sampler must not depend on the order).

    ``num_draft_tokens == 0`` (the prefill-only path) exactly when no entry is a ``Decode``."""
    num_reqs = len(entries)
    assert num_reqs > 0
    slots = np.array([e.slot for e in entries], dtype=np.intp)
    assert len(set(slots.tolist())) == num_reqs, "a slot appears twice in the batch"

    query = np.zeros(num_reqs, dtype=np.int32)
    drafts = np.zeros(num_reqs, dtype=np.int32)
    computed_prefill = np.zeros(num_reqs, dtype=np.int32)
    prefill_len = np.zeros(num_reqs, dtype=np.int32)
    computed = np.zeros(num_reqs, dtype=np.int32)
    for i, e in enumerate(entries):
        if isinstance(e, Prefill):
            chunk = e.prefill_len - e.computed if e.chunk is None else e.chunk
            assert 0 < chunk and e.computed + chunk <= e.prefill_len, e
            query[i] = chunk
            computed_prefill[i] = e.computed
            prefill_len[i] = e.prefill_len
            computed[i] = e.computed
        else:
            assert e.valid_len > 0, e
            q = e.valid_len if e.query_len is None else e.query_len
            assert q >= e.valid_len, "the runner asserts num_scheduled_tokens >= num_logits"
            query[i] = q
            drafts[i] = e.valid_len
            pl = e.prefill_len or max(e.context_len, 1)
            prefill_len[i] = pl
            computed_prefill[i] = pl
            computed[i] = max(e.context_len, pl)

    num_logits = drafts  # num_new_sampled_tokens_per_step == 0: no bonus row
    cu_num_logits_np = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_logits, out=cu_num_logits_np[1:])
    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    num_draft_tokens = int(drafts.sum())

    idx_mapping = torch.as_tensor(slots, dtype=torch.int64, device=device)
    num_logits_t = torch.as_tensor(num_logits, dtype=torch.int64)
    expanded_idx_mapping = torch.repeat_interleave(idx_mapping.cpu(), num_logits_t).to(device)
    expanded_local_pos = torch.cat(
        [torch.arange(int(n), dtype=torch.int32) for n in num_logits]
    ).to(device)
    # The logit rows are the last num_logits tokens of each request's query.
    logits_indices = torch.cat(
        [
            torch.arange(int(end) - int(n), int(end), dtype=torch.int64)
            for end, n in zip(query_start_loc_np[1:], num_logits)
        ]
    ).to(device)
    seq_lens_np = computed + query
    is_prefilling = computed_prefill < prefill_len

    return InputBatch(
        req_ids=[f"req-{int(s)}" for s in slots],
        num_reqs=num_reqs,
        num_reqs_after_padding=num_reqs,
        idx_mapping=idx_mapping,
        idx_mapping_np=slots,
        expanded_idx_mapping=expanded_idx_mapping,
        expanded_local_pos=expanded_local_pos,
        num_scheduled_tokens=query,
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens,
        num_draft_tokens=num_draft_tokens,
        num_draft_tokens_per_req=drafts,
        query_start_loc=torch.as_tensor(query_start_loc_np, device=device),
        query_start_loc_np=query_start_loc_np,
        seq_lens=torch.as_tensor(seq_lens_np, device=device),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens_np.copy()),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=computed,
        prefill_len_np=prefill_len,
        num_computed_prefill_tokens_np=computed_prefill,
        is_prefilling_np=is_prefilling,
        has_prefill=bool(is_prefilling.any()),
        decode_graph_eligible=not bool(is_prefilling.any()),
        input_ids=torch.zeros(num_tokens, dtype=torch.int32, device=device),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        is_padding=torch.zeros(num_tokens, dtype=torch.bool, device=device),
        logits_indices=logits_indices,
        cu_num_logits=torch.as_tensor(cu_num_logits_np, device=device),
        cu_num_logits_np=cu_num_logits_np,
        has_structured_output_reqs=False,
        prompt_lens=None,
    )


def peaked_logits(
    targets: torch.Tensor, vocab_size: int, *, peak: float = 30.0, noise: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[rows, vocab]`` fp32 logits with standard-normal noise and ``targets[r]`` raised by
    ``peak`` on each row: near-zero entropy, argmax == targets."""
    rows = targets.shape[0]
    logits = noise * torch.randn(rows, vocab_size, generator=generator)
    logits[torch.arange(rows), targets.cpu()] += peak
    return logits
