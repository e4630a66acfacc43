"""The dispatcher: one whole decode step over a batch, with backend choice and request tiling.

``DiffusionSampler`` owns no per-request state (``DiffusionState`` does) and does no device
work of its own: it validates a step's inputs, turns them into host arrays and hands them to
``runner.StepRunner``, the same runner the vLLM adapters call. The runner cuts the decoding
requests into tiles whose transient memory fits a budget read from ``torch.cuda.mem_get_info``
every step (hidden-state input) and runs ``step.decode_step`` per tile; the keyed noise makes
every tile size give the same result. ``runner.py`` states the budget formula.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .checks import id_list, int_range, is_int, need_flag, need_int, need_real
from .config import SamplerConfig
from .head import LmHead
from .ops import FLOAT_DTYPES, check_normalizer, check_tensor, check_values, resolve_backend
from .reference import RowStats
from .runner import LogprobRequest, LogprobRows, StepRunner
from .state import DiffusionState, to_device_int64
from .step import StepOutput


class _StateOptions:
    """``runner.RequestOptions`` read from a ``DiffusionState``'s host mirrors."""

    def __init__(self, state: DiffusionState) -> None:
        self.state = state

    @property
    def generation(self) -> int:
        return self.state.generation

    def top_k_top_p(self, slots: list[int], slots_t: torch.Tensor):
        s = self.state
        k_on = bool((s.top_k_np[slots] > 0).any())
        p_on = bool((s.top_p_np[slots] < 1.0).any())
        return (s.top_k[slots_t] if k_on else None, s.top_p[slots_t] if p_on else None)

    def allowed_rows(self, slots: list[int], vocab: int) -> torch.Tensor | None:
        return self.state.allowed_mask(slots, vocab)

    def any_pins(self, slots: list[int]) -> bool:
        return any(s in self.state.pinned_slots for s in slots)


def _check_construction(cfg, state, embed_weight, normalizer, vocab_start, sc_reduce,
                        memory_fraction, budget_bytes, graph_update) -> None:
    """``DiffusionSampler``'s arguments, each checked against the others (``checks.py``). A
    tensor normalizer's value is read here, once (a host synchronisation at construction)."""
    if not isinstance(cfg, SamplerConfig):
        raise TypeError(f"cfg must be a SamplerConfig, got {type(cfg).__name__}")
    if not isinstance(state, DiffusionState):
        raise TypeError(f"state must be a DiffusionState, got {type(state).__name__}")
    if cfg != state.cfg:
        raise ValueError(f"cfg must be the state's configuration (state.cfg), got {cfg} for a state "
                         f"built with {state.cfg}")
    check_tensor("embed_weight", embed_weight, dim=2, dtypes=FLOAT_DTYPES, device=state.device)
    if embed_weight.shape[1] != state.hidden_size:
        raise ValueError(
            f"embed_weight must have hidden size {state.hidden_size} (the state's), "
            f"got shape {tuple(embed_weight.shape)}"
        )
    vocab_start = need_int("vocab_start", vocab_start)
    if not (0 <= vocab_start and vocab_start + embed_weight.shape[0] <= state.vocab_size):
        raise ValueError(
            f"embed_weight rows [vocab_start={vocab_start}, +{embed_weight.shape[0]}) must lie inside "
            f"the state's vocabulary of {state.vocab_size}"
        )
    normalizer_ok = check_normalizer(normalizer, state.device)
    if normalizer_ok is not None:
        check_values(normalizer_ok)
    if sc_reduce is not None and not callable(sc_reduce):
        raise TypeError(f"sc_reduce must be None or callable, got {type(sc_reduce).__name__}")
    if not 0.0 < need_real("memory_fraction", memory_fraction) <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if budget_bytes is not None:
        int_range("budget_bytes", budget_bytes, 1)
    if graph_update is not None:
        need_flag("graph_update", graph_update)


def _check_step(state: DiffusionState, slots, valid_len, logits, hidden_states, output_weight,
                logprobs, logprob_token_ids, column_tokens) -> list[int]:
    """The host-side checks of a step's arguments (no device reads): the slots as Python ints,
    each holding a prefilled request; ``valid_len`` ints in [1, the slot's canvas width]; the
    logprob requests naming slots of this step; the optional tensors' types and devices."""
    slots = state.check_slots(slots, prefilled=True)
    if valid_len is not None:
        valid = id_list("valid_len", valid_len)
        widths = state.canvas_width_np[slots]
        if len(valid) != len(slots) or any(not 1 <= v <= w for v, w in zip(valid, widths)):
            raise ValueError(
                "valid_len must hold one length per slot, each in [1, that slot's canvas width]")
    if output_weight is not None and hidden_states is None:
        raise ValueError("output_weight goes with hidden_states (logits are not projected)")
    in_step = set(slots)
    for name, requests in (("logprobs", logprobs), ("logprob_token_ids", logprob_token_ids)):
        if requests is None:
            continue
        if not isinstance(requests, dict):
            raise TypeError(f"{name} must be a dict from slot to request, got {type(requests).__name__}")
        for slot, want in requests.items():
            if not is_int(slot) or slot not in in_step:
                raise ValueError(f"{name} names slot {slot!r}, which is not among this step's slots")
            if name == "logprobs":
                int_range(f"logprobs[{slot}]", want, 0, state.vocab_size + 1)
            elif any(not 0 <= t < state.vocab_size for t in id_list(f"logprob_token_ids[{slot}]", want)):
                raise ValueError(f"logprob_token_ids[{slot}] must be ids in [0, {state.vocab_size})")
    if column_tokens is not None:
        check_tensor("column_tokens", column_tokens, dim=1, dtypes=(torch.int64,), device=state.device)
        if isinstance(logits, torch.Tensor) and logits.shape[-1] != column_tokens.shape[0]:
            raise ValueError(
                f"logits must have one column per entry of column_tokens ({column_tokens.shape[0]}), "
                f"got shape {tuple(logits.shape)}")
    return slots


class DiffusionSampler:
    """One whole decode step of DiffusionGemma's entropy-bound sampler.

    Parameters
    ----------
    cfg : the sampler configuration.
    state : the slot-indexed ``DiffusionState`` the step reads and writes.
    embed_weight : ``[V_local, H]`` (tied) embedding rows of this rank's vocabulary slice.
    normalizer : the embedding normalizer (scalar tensor or float).
    backend : "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
    vocab_start : first vocabulary id of ``embed_weight`` (tensor parallelism).
    sc_reduce : in-place all-reduce of soft-embedding partial sums across ranks.
    tp_group : the tensor-parallel process group (None: one rank). Its ranks merge per-row
        partials of the statistics: from full logits each rank reads its share of the columns,
        and from hidden states with this rank's slice of the head as ``output_weight`` (the
        rows of ``embed_weight``) the logits are never gathered at all.
    memory_fraction : share of the free device memory the step's temporaries may use.
    budget_bytes : fixed budget instead of ``memory_fraction`` of the free memory.
    graph_update : replay the logits-free parts of a step (per-request gathers, state update)
        from CUDA graphs once a batch shape repeats (``update_graph.py``), and the whole step of
        a batch of one or two requests (``step_graph.py``); default: on CUDA, unless
        ``DGEMMA_GRAPH_UPDATE=0``.

    Every argument is checked on construction and every method's arguments on each call, on
    the host (``checks.py``: TypeError / ValueError naming the argument, nothing converted):
    ``cfg`` must be ``state.cfg``, ``embed_weight`` must fit the state's vocabulary and hidden
    size, a tensor ``normalizer`` is a finite 1-element floating tensor on the state's device
    (read once, here). A step takes only prefilled requests.
    """

    def __init__(
        self,
        cfg: SamplerConfig,
        state: DiffusionState,
        embed_weight: torch.Tensor,
        normalizer: torch.Tensor | float,
        *,
        backend: str = "auto",
        vocab_start: int = 0,
        sc_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_group: Any = None,
        memory_fraction: float = 0.5,
        budget_bytes: int | None = None,
        graph_update: bool | None = None,
    ) -> None:
        _check_construction(cfg, state, embed_weight, normalizer, vocab_start, sc_reduce,
                            memory_fraction, budget_bytes, graph_update)
        vocab_start = int(vocab_start)
        self.cfg = cfg
        self.state = state
        self.embed_weight = embed_weight.contiguous()
        self.normalizer = normalizer
        self.backend = resolve_backend(backend, state.device)
        self.vocab_start = vocab_start
        self.runner = StepRunner(
            cfg, state, _StateOptions(state), self.embed_weight, normalizer,
            backend=self.backend, vocab_size=state.vocab_size, vocab_start=vocab_start,
            sc_reduce=sc_reduce, tp_group=tp_group, memory_fraction=memory_fraction,
            budget_bytes=budget_bytes, graph_update=graph_update)
        self.logprobs_fn = self.runner.logprobs_fn
        self.pending_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- plumbing
    @property
    def graph_update(self) -> bool:
        """Whether the logits-free parts of a step are replayed from CUDA graphs."""
        return self.runner.graph_update

    @property
    def last_tile_requests(self) -> int:
        """Requests per tile of the last step."""
        return self.runner.last_tile_requests

    def temperature_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The schedule temperature of ``slots`` (an int tensor on the state's device)."""
        check_tensor("slots", slots, dim=1, dtypes=(torch.int32, torch.int64), device=self.state.device)
        return self.runner.temperature_of(slots)

    def tile_requests(self, width: int, vocab: int, logits_itemsize: int) -> int:
        """Requests per tile: ``budget // bytes_per_request``, the budget re-read now."""
        width, vocab = int_range("width", width, 1), int_range("vocab", vocab, 1)
        return self.runner.tile_requests(width, vocab, int_range("logits_itemsize", logits_itemsize, 0))

    def prefill(self, slots: Sequence[int]) -> None:
        """Requests whose prompt is done: draw their first canvas and start denoising. Each
        slot must hold a request that was not prefilled yet (``DiffusionState.check_slots``)."""
        self.state.finish_prefill(slots)

    # ---------------------------------------------------------------- the step
    def step(
        self,
        logits: torch.Tensor | None,
        slots: Sequence[int],
        valid_len: Sequence[int] | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        output_weight: torch.Tensor | None = None,
        logprobs: dict[int, int] | None = None,
        logprob_token_ids: dict[int, Sequence[int]] | None = None,
        column_tokens: torch.Tensor | None = None,
    ) -> StepOutput:
        """One decode step for the decoding requests in ``slots`` (host list of slot ids).

        ``logits`` are ``[sum(valid_len), V]`` (request j's rows follow request j-1's), or
        ``[n, W, V]`` with every canvas full. Alternatively give ``hidden_states``
        ``[sum(valid_len), H]`` and the (tied) ``output_weight`` of the same dtype, ``[V, H]``
        or under tensor parallelism this rank's slice (the rows of ``embed_weight``): logits are
        projected one tile at a time in that dtype, batch-invariantly (``head.LmHead``; the
        softcap from the config is applied in the kernels that read them), and the full-batch
        logits never exist. ``logprobs`` maps a slot to its top-n (>= 0) and
        ``logprob_token_ids`` a slot to the ids it wants; those requests get their
        logprobs on the step they emit (``StepOutput.logprobs``), as vLLM stashes them.
        """
        state = self.state
        slots = _check_step(state, slots, valid_len, logits, hidden_states, output_weight,
                            logprobs, logprob_token_ids, column_tokens)
        n = len(slots)
        widths = state.canvas_width_np[slots].astype(np.int64)
        if valid_len is None:
            valid = widths.copy()
        else:  # (checked by ``_check_step``)
            valid = np.asarray(valid_len, dtype=np.int64)
        hidden_input = hidden_states is not None
        head_weight = None  # ``output_weight``, checked, with hidden-state input
        if hidden_states is not None:
            if logits is not None:
                raise ValueError("give either logits or hidden_states, not both")
            check_tensor("hidden_states", hidden_states, dim=2, dtypes=FLOAT_DTYPES, device=state.device)
            output_weight = head_weight = check_tensor("output_weight", output_weight, dim=2,
                                                       dtypes=FLOAT_DTYPES, device=state.device)
            head_rows = (state.vocab_size, self.embed_weight.shape[0])
            if output_weight.shape[0] not in head_rows or output_weight.shape[1] != hidden_states.shape[1]:
                raise ValueError(
                    f"output_weight must be [{state.vocab_size}, {hidden_states.shape[1]}] (the "
                    f"head) or [{self.embed_weight.shape[0]}, {hidden_states.shape[1]}] (this "
                    f"rank's slice, as embed_weight), got {tuple(output_weight.shape)}")
            if hidden_states.dtype != output_weight.dtype:
                raise TypeError(f"hidden_states ({hidden_states.dtype}) and output_weight "
                                f"({output_weight.dtype}) must have one dtype, the model's")
            if hidden_states.stride(1) != 1:
                raise ValueError("hidden_states must be contiguous in the hidden dimension")
            if column_tokens is not None:
                raise ValueError("column_tokens go with logits input (a shared allowed set's K "
                                 "columns), not with hidden_states")
            n_rows, vocab = hidden_states.shape[0], output_weight.shape[0]
        else:
            logits = check_tensor("logits", logits, dtypes=FLOAT_DTYPES, device=state.device)
            if logits.dim() == 3:
                if logits.shape[0] != n or np.any(valid != logits.shape[1]):
                    raise ValueError("3-D logits must be [len(slots), W, V] with full canvases of width W")
                logits = logits.reshape(-1, logits.shape[-1])
            if logits.dim() != 2:
                raise ValueError(f"logits must be [rows, V] or [n, W, V], got shape {tuple(logits.shape)}")
            if logits.stride(-1) != 1:
                raise ValueError("logits must be contiguous in the vocabulary dimension")
            n_rows, vocab = logits.shape
        if n_rows != int(valid.sum()):
            raise ValueError(f"expected {int(valid.sum())} rows (sum of valid lengths), got {n_rows}")
        if column_tokens is None and vocab != state.vocab_size and not hidden_input:
            if self.vocab_start == 0 and self.embed_weight.shape[0] == state.vocab_size:
                raise ValueError(f"logits vocabulary {vocab} != the state's {state.vocab_size}")
        if n == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=state.device)
            return StepOutput(empty.view(0, 0), empty.int(), empty.bool(),
                              RowStats.empty(0, state.device).view(0, 0))

        stash = None
        if logprobs or logprob_token_ids:
            stash = self._logprob_request(logprobs or {}, logprob_token_ids or {}, column_tokens)
        projection = None
        if head_weight is not None:
            whole = head_weight.shape[0] == state.vocab_size
            projection = LmHead(head_weight, softcap=self.cfg.softcap,
                                vocab_start=0 if whole else self.vocab_start,
                                vocab_size=state.vocab_size, backend=self.backend).projection()
        result = self.runner.step(
            slots, valid, widths, vocab=vocab, logits=logits, hidden_states=hidden_states,
            projection=projection, column_tokens=column_tokens, logprobs=stash)
        if self.pending_logprobs:
            emitted = (result.num_sampled > 0).cpu().tolist()
            for s, e in zip(slots, emitted):
                if e and s in self.pending_logprobs:
                    result.logprobs[s] = self.pending_logprobs.pop(s)
        return result

    # ---------------------------------------------------------------- helpers
    def graphable(self, slots: Sequence[int], valid_len: Sequence[int] | None = None):
        """A step over fixed ``slots`` and logits shape with every host decision taken now.

        Returns ``run(logits) -> StepOutput``. Calling it does no host work and no host
        synchronisation (device index tensors, top-k/top-p and allowed masks are prepared
        here), so it can be captured in a CUDA graph and replayed every step while the
        batch keeps its shape. Logprobs are not part of the captured step.
        """
        state = self.state
        slots = _check_step(state, slots, valid_len, None, None, None, None, None, None)
        widths = state.canvas_width_np[slots].astype(np.int64)
        valid = widths.copy() if valid_len is None else np.asarray(valid_len, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(valid)[:-1])).astype(np.int64)
        plan = self.runner.plan(slots, starts, valid, widths, state.vocab_size, cache=False)

        def run(logits: torch.Tensor) -> StepOutput:
            return self.runner.run_tile(plan, logits)

        return run

    def _logprob_request(self, logprobs: dict[int, int], token_ids: dict[int, Sequence[int]],
                         column_tokens: torch.Tensor | None) -> LogprobRequest:
        """The stash of this step: top-n and / or named ids of the requests that ask."""

        def build(slot: int, r: LogprobRows):
            k = r.rows.shape[0]
            ids = token_ids.get(slot)
            ids_t = None
            if ids is not None:
                ids_t = to_device_int64(r.rows.device, list(ids))[0].expand(k, -1)
            selected = r.selected
            if column_tokens is not None:
                selected = torch.searchsorted(column_tokens, selected)
            res = self.logprobs_fn(r.rows, r.inv_t, r.threshold, r.allowed, selected,
                                   int(logprobs.get(slot, 0)), token_ids=ids_t, softcap=r.softcap)
            if column_tokens is not None:
                res = (column_tokens[res[0]],) + tuple(res[1:])
            return res

        return LogprobRequest(slots=set(logprobs) | set(token_ids), build=build,
                              stash=self.pending_logprobs)
