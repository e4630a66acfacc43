"""The dispatcher: one whole decode step over a batch, with backend choice and request tiling.

``DiffusionSampler`` owns no per-request state (``DiffusionState`` does); it picks the
backend, cuts the decoding requests into tiles whose transient memory fits a budget read
from ``torch.cuda.mem_get_info`` every step, and runs ``step.decode_step`` per tile. The
keyed noise makes every tile size give the same result.

Transient bytes per request (the budget formula, ``bytes_per_request``):

* Triton backend, logits input: per canvas position a handful of O(1) statistics
  (``STAT_BYTES`` = 64 bytes with padding and the row layout); the kernels materialise
  nothing of size V. 32 requests x 256 positions cost about 0.5 MiB.
* PyTorch backend: the oracle works on fp32 chunks of rows; per row it holds about
  ``TORCH_BYTES_PER_ENTRY`` = 48 bytes per vocabulary entry (logits, z, exp, Gumbel bits as
  int64 intermediates, masks), so its chunk of rows is sized from the budget instead.
* Hidden-state input: the logits of a tile, ``W x V x itemsize`` bytes per request (the
  projection stays in the model dtype; the kernels upcast and softcap in registers), plus
  the above. Tiles of projected logits are further capped at ``hidden_tile_bytes`` (1 GiB):
  larger tiles buy no speed once a tile fills the GPU.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import reference
from .config import SamplerConfig
from .ops import FLOAT_DTYPES, check_tensor, resolve_backend
from .state import DiffusionState, to_device_int64
from .step import StepLayout, StepOutput, decode_step, step_layout
from .update_graph import UpdateGraph

STAT_BYTES = 64
TORCH_BYTES_PER_ENTRY = 48
DEFAULT_CPU_BUDGET = 1 << 30
# Tile plans kept for reuse: a decoding batch keeps its shape for many steps, and a plan
# (device index tensors, row layout, masks) costs a host->device copy and ~20 small ops.
PLAN_CACHE_SIZE = 8
TEMPERATURE_TABLE_MAX = 1 << 20  # entries (4 MiB)


def memory_budget(device: torch.device, fraction: float) -> int:
    """Bytes the step may use for temporaries: a fraction of what the device has free."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return DEFAULT_CPU_BUDGET


def bytes_per_request(width: int, vocab: int, logits_itemsize: int = 0) -> int:
    """Transient bytes one request adds to a tile (``logits_itemsize`` > 0: projected logits)."""
    return width * (STAT_BYTES + vocab * logits_itemsize)


def backend_functions(backend: str):
    """The flat-row (stats, soft embedding, logprobs) functions of a resolved backend."""
    if backend == "triton":
        from .kernels.logprobs import token_logprobs_rows
        from .kernels.row_stats import row_stats_rows
        from .kernels.soft_embedding import soft_embedding_rows

        return row_stats_rows, soft_embedding_rows, token_logprobs_rows
    return reference.row_stats_rows, reference.soft_embedding_rows, reference.token_logprobs_rows


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
    memory_fraction : share of the free device memory the step's temporaries may use.
    budget_bytes : fixed budget instead of ``memory_fraction`` of the free memory.
    graph_update : replay the logits-free parts of a step (per-request gathers, state update)
        from CUDA graphs once a batch shape repeats (``update_graph.py``); default: on CUDA,
        unless ``DGEMMA_GRAPH_UPDATE=0``.
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
        memory_fraction: float = 0.5,
        budget_bytes: int | None = None,
        hidden_tile_bytes: int = 1 << 30,
        graph_update: bool | None = None,
    ) -> None:
        if not isinstance(cfg, SamplerConfig):
            raise TypeError(f"cfg must be a SamplerConfig, got {type(cfg).__name__}")
        check_tensor("embed_weight", embed_weight, dim=2, dtypes=FLOAT_DTYPES, device=state.device)
        if embed_weight.shape[1] != state.hidden_size:
            raise ValueError(
                f"embed_weight must have hidden size {state.hidden_size} (the state's), "
                f"got shape {tuple(embed_weight.shape)}"
            )
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        self.cfg = cfg
        self.state = state
        self.embed_weight = embed_weight.contiguous()
        self.normalizer = normalizer
        self.backend = resolve_backend(backend, state.device)
        self.vocab_start = vocab_start
        self.sc_reduce = sc_reduce
        self.memory_fraction = memory_fraction
        self.budget_bytes = budget_bytes
        self.hidden_tile_bytes = hidden_tile_bytes
        if graph_update is None:
            graph_update = state.device.type == "cuda" and os.environ.get("DGEMMA_GRAPH_UPDATE") != "0"
        elif graph_update and state.device.type != "cuda":
            raise ValueError("graph_update needs a CUDA device")
        self.graph_update = bool(graph_update)
        self.stats_fn, self.soft_fn, self.logprobs_fn = backend_functions(self.backend)
        self.pending_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.last_tile_requests = 0
        self._plans: OrderedDict[tuple, _TilePlan] = OrderedDict()
        # The schedule temperature of every step count 0..N, computed once by the config's own
        # formula on the device (so entries are bit-identical to computing it per step): one
        # gather per step instead of six elementwise ops.
        self._temperature_table = None
        if cfg.max_denoising_steps <= TEMPERATURE_TABLE_MAX:
            done = torch.arange(cfg.max_denoising_steps + 1, dtype=state.step.dtype, device=state.device)
            self._temperature_table = cfg.temperature(done).to(torch.float32)

    # ---------------------------------------------------------------- plumbing
    def temperature_of(self, slots: torch.Tensor) -> torch.Tensor:
        steps = self.state.step[slots]
        if self._temperature_table is None:
            return self.cfg.temperature(steps).to(torch.float32)
        # max(N - n, 1) is constant past n = N - 1, so the table's last entry covers n >= N.
        return self._temperature_table[steps.clamp(max=self.cfg.max_denoising_steps)]

    def prefill(self, slots: Sequence[int]) -> None:
        """Requests whose prompt is done: draw their first canvas and start denoising."""
        for s in slots:
            self.state.check_slot(s)
        self.state.finish_prefill(list(slots))

    def tile_requests(self, width: int, vocab: int, logits_itemsize: int) -> int:
        """Requests per tile: ``budget // bytes_per_request``, the budget re-read now."""
        budget = self.budget_bytes
        if budget is None:
            budget = memory_budget(self.state.device, self.memory_fraction)
        if logits_itemsize:
            budget = min(budget, self.hidden_tile_bytes)
        return max(1, budget // bytes_per_request(width, vocab, logits_itemsize))

    def _torch_chunk_rows(self, vocab: int) -> int:
        budget = self.budget_bytes or memory_budget(self.state.device, self.memory_fraction)
        return int(max(1, min(4096, budget // (vocab * TORCH_BYTES_PER_ENTRY))))

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
        ``[sum(valid_len), H]`` and the (tied) ``output_weight`` ``[V, H]``: logits are
        projected one tile at a time (softcap from the config, fused into the kernels) and
        the full-batch logits never exist. ``logprobs`` maps a slot to its top-n (>= 0) and
        ``logprob_token_ids`` a slot to the ids it wants; those requests get their
        logprobs on the step they emit (``StepOutput.logprobs``), as vLLM stashes them.
        """
        state = self.state
        slots = [int(s) for s in slots]
        slot_set = set(slots)
        if not slot_set <= state.active:  # (active slots are valid slots)
            for s in slots:
                state.check_slot(s)
                if s not in state.active:
                    raise ValueError(f"slot {s} holds no request (add_request first)")
        if len(slot_set) != len(slots):
            raise ValueError("slots must not repeat")
        n = len(slots)
        widths = state.canvas_width_np[slots].astype(np.int64)
        if valid_len is None:
            valid = widths.copy()
        else:
            valid = np.asarray(valid_len, dtype=np.int64)
            if valid.shape != (n,) or (valid < 1).any() or (valid > widths).any():
                raise ValueError(
                    "valid_len must hold one length per slot, each in [1, that slot's canvas width]"
                )
        hidden_input = hidden_states is not None
        if hidden_input:
            if logits is not None:
                raise ValueError("give either logits or hidden_states, not both")
            check_tensor("hidden_states", hidden_states, dim=2, dtypes=FLOAT_DTYPES, device=state.device)
            check_tensor("output_weight", output_weight, dim=2, dtypes=FLOAT_DTYPES, device=state.device)
            if hidden_states.shape[1] != output_weight.shape[1]:
                raise ValueError("hidden_states and output_weight must share the hidden size")
            n_rows, vocab = hidden_states.shape[0], output_weight.shape[0]
        else:
            check_tensor("logits", logits, dtypes=FLOAT_DTYPES, device=state.device)
            if logits.dim() == 3:
                if logits.shape[0] != n or (valid != logits.shape[1]).any():
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
            return StepOutput(empty.view(0, 0), empty.int(), empty.bool(), None)

        W = int(widths.max())
        starts = np.concatenate(([0], np.cumsum(valid)[:-1])).astype(np.int64)
        if hidden_input:
            tile = self.tile_requests(W, vocab, hidden_states.element_size())
        else:
            # Logits input: the kernels need O(1) bytes per row, and the oracle bounds its
            # memory per chunk of rows (``_torch_chunk_rows``): one tile.
            tile = n
        self.last_tile_requests = min(tile, n)
        stats_fn = self.stats_fn
        if self.backend == "torch":
            chunk = self._torch_chunk_rows(vocab)
            stats_fn = lambda *a, **k: reference.row_stats_rows(*a, chunk_rows=chunk, **k)  # noqa: E731
        if column_tokens is not None and self.backend == "triton":
            # Constrained reads hold only K << V columns: the oracle is cheap there and keys
            # the noise by token id through ``column_tokens``.
            stats_fn = reference.row_stats_rows

        outputs: list[StepOutput] = []
        for t0 in range(0, n, tile):
            t1 = min(t0 + tile, n)
            r0, r1 = int(starts[t0]), int(starts[t1 - 1] + valid[t1 - 1])
            plan = self._plan_tile(slots[t0:t1], starts[t0:t1] - r0, valid[t0:t1], widths[t0:t1],
                                   W, vocab, column_tokens)
            if hidden_input:
                tile_logits = self._project(hidden_states[r0:r1], output_weight, valid[t0:t1])
            else:
                tile_logits = logits[r0:r1]
            out = self._run_tile(plan, tile_logits, stats_fn, hidden_input, column_tokens)
            if logprobs or logprob_token_ids:
                self._stash_logprobs(out, plan.slots, tile_logits, starts[t0:t1] - r0,
                                     valid[t0:t1], plan.top_k, plan.top_p, plan.allowed,
                                     logprobs or {}, logprob_token_ids or {}, hidden_input,
                                     column_tokens)
            outputs.append(out)
        result = _concat(outputs)
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
        slots = [int(s) for s in slots]
        widths = state.canvas_width_np[slots].astype(np.int64)
        valid = widths.copy() if valid_len is None else np.asarray(valid_len, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(valid)[:-1])).astype(np.int64)
        plan = self._plan_tile(slots, starts, valid, widths, int(widths.max()), state.vocab_size, None,
                               cache=False)
        stats_fn = self.stats_fn

        def run(logits: torch.Tensor) -> StepOutput:
            return self._run_tile(plan, logits, stats_fn, False, None)

        return run

    def _plan_tile(self, tile_slots, starts, valid, widths, W, vocab, column_tokens,
                   cache: bool = True) -> "_TilePlan":
        """The device side of a tile's host decisions; reused while the batch keeps its
        shape and no request was added or removed (``state.generation``)."""
        state = self.state
        key = (state.generation, tuple(tile_slots), starts.tobytes(), valid.tobytes(),
               widths.tobytes(), W, vocab, column_tokens is None)
        plan = self._plans.get(key) if cache else None
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        # One pinned host buffer, one copy that does not wait for the GPU.
        slots_t, row_starts, valid_t, width_t = to_device_int64(
            state.device, tile_slots, starts, valid, widths)
        top_k, top_p = self._top_k_top_p(tile_slots, slots_t)
        layout = step_layout(
            state, slots_t, row_starts, valid_t, width_t, W, int(valid.sum()),
            full_width=bool((widths == W).all()),
            any_pins=any(s in state.pinned_slots for s in tile_slots))
        plan = _TilePlan(
            slots=list(tile_slots), slots_t=slots_t, row_starts=row_starts, valid=valid_t,
            width=width_t, W=W, top_k=top_k, top_p=top_p,
            allowed=None if column_tokens is not None else state.allowed_mask(tile_slots, vocab),
            layout=layout,
            # Only a cached plan is seen again; constrained reads bring new columns every step.
            update_graph=UpdateGraph() if cache and self.graph_update and column_tokens is None else None,
        )
        if cache and plan.allowed is None:  # ([n, V] masks are not worth holding on to)
            self._plans[key] = plan
            while len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    def _run_tile(self, plan: "_TilePlan", tile_logits, stats_fn, hidden_input, column_tokens):
        return decode_step(
            self.state, tile_logits, plan.slots_t, plan.row_starts, plan.valid, plan.width, plan.W,
            confidence_threshold=self.cfg.confidence_threshold,
            entropy_bound=self.cfg.entropy_bound,
            temperature_of=self.temperature_of,
            stats_fn=stats_fn, soft_fn=self.soft_fn,
            embed_weight=self._embed_for(column_tokens), normalizer=self.normalizer,
            vocab_size=self.state.vocab_size,
            softcap=self.cfg.softcap if hidden_input else None,
            top_k=plan.top_k, top_p=plan.top_p, allowed=plan.allowed,
            column_tokens=column_tokens,
            vocab_start=self.vocab_start if column_tokens is None else 0,
            sc_reduce=self.sc_reduce,
            layout=plan.layout, noise_backend=self.backend,
            update_runner=plan.update_graph, tail_eps=self.cfg.tail_eps,
        )

    def _project(self, hidden: torch.Tensor, weight: torch.Tensor, lengths) -> torch.Tensor:
        """Logits of one tile, ``hidden @ weight.T`` in the model dtype (as vLLM's lm_head);
        the kernels upcast to fp32 and apply the softcap in registers.

        One GEMM per request: a BLAS may round a row differently depending on how many rows
        share the GEMM, and a request's results must not depend on the tile it lands in.
        """
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.result_type(hidden, weight),
                          device=hidden.device)
        r = 0
        for k in lengths:
            k = int(k)
            torch.matmul(hidden[r:r + k], weight.t(), out=out[r:r + k])
            r += k
        return out

    def _embed_for(self, column_tokens: torch.Tensor | None) -> torch.Tensor:
        if column_tokens is None:
            return self.embed_weight
        # A constrained step's logits cover only the allowed ids: their K embedding rows.
        return self.embed_weight[column_tokens - self.vocab_start].contiguous()

    def _top_k_top_p(self, tile_slots: list[int], slots_t: torch.Tensor):
        s = self.state
        k_on = bool((s.top_k_np[tile_slots] > 0).any())
        p_on = bool((s.top_p_np[tile_slots] < 1.0).any())
        return (s.top_k[slots_t] if k_on else None, s.top_p[slots_t] if p_on else None)

    def _stash_logprobs(self, out, tile_slots, tile_logits, starts, valid, top_k, top_p,
                        allowed, logprobs, token_ids, hidden_input, column_tokens):
        want = [s in logprobs or s in token_ids for s in tile_slots]
        if not any(want):
            return
        converged = out.just_converged.cpu().tolist()  # the one host sync, as in vLLM
        for j, s in enumerate(tile_slots):
            if not (want[j] and converged[j]):
                continue
            k = int(valid[j])
            rows = tile_logits[int(starts[j]): int(starts[j]) + k]
            read_only = s in self.state.read_only_slots
            # vLLM reports read-only requests at temperature 1, the others at the step's.
            step_before = self.state.step[s] - 1
            t = torch.ones((), device=rows.device) if read_only else \
                self.cfg.temperature(step_before.unsqueeze(0)).to(torch.float32)[0]
            inv_t = reference.inverse_temperature(t).expand(k).contiguous()  # one per row
            thr = out.stats.threshold[j, :k]
            allow = None if allowed is None else allowed[j].unsqueeze(0).expand(k, -1)
            ids = token_ids.get(s)
            ids_t = None
            if ids is not None:
                ids_t = to_device_int64(rows.device, list(ids))[0].expand(k, -1)
            selected = out.stats.argmax[j, :k]
            if column_tokens is not None:
                selected = torch.searchsorted(column_tokens, selected)
            res = self.logprobs_fn(rows, inv_t, thr, allow, selected, int(logprobs.get(s, 0)),
                                   token_ids=ids_t,
                                   softcap=self.cfg.softcap if hidden_input else None)
            if column_tokens is not None:
                res = (column_tokens[res[0]],) + tuple(res[1:])
            self.pending_logprobs[s] = res


@dataclass
class _TilePlan:
    """Host decisions and device index tensors of one tile of decoding requests."""

    slots: list[int]
    slots_t: torch.Tensor
    row_starts: torch.Tensor
    valid: torch.Tensor
    width: torch.Tensor
    W: int
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    allowed: torch.Tensor | None
    layout: StepLayout
    update_graph: UpdateGraph | None = None


def _concat(outputs: list[StepOutput]) -> StepOutput:
    if len(outputs) == 1:
        return outputs[0]
    from .reference import RowStats

    stats = RowStats(*(torch.cat(parts) for parts in zip(*(o.stats.as_tuple() for o in outputs))))
    paths = [o.sc_path_rows for o in outputs if o.sc_path_rows is not None]
    return StepOutput(
        sampled=torch.cat([o.sampled for o in outputs]),
        num_sampled=torch.cat([o.num_sampled for o in outputs]),
        just_converged=torch.cat([o.just_converged for o in outputs]),
        stats=stats,
        sc_path_rows=torch.stack(paths).sum(0) if paths else None,
    )
