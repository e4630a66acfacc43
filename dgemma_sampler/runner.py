"""The device work of a decode step, shared by every front end.

``DiffusionSampler`` (``sampler.py``) and the vLLM adapters (``vllm/v0_33.py``,
``vllm/v0_34.py``) keep only their host bookkeeping: which requests decode, where their rows
are, what each request asked for, and the output layout their caller reads. They hand
``StepRunner.step`` host arrays (slots, valid lengths, canvas widths) and either the logits or
hidden states with a projection; the runner does everything that touches the device:

* tiling: all requests in one tile for logits input (the kernels hold O(1) bytes per row);
  for hidden-state input, requests per tile from a memory budget re-read every step, so that
  only one tile's projected logits exist at a time (``head.Projection``: our LM head in the
  model dtype, or a caller's projection);
* tile plans: the device index tensors, row layout, top-k/top-p gates and allowed masks of a
  tile, kept while the batch keeps its shape and no request changed (``PLAN_CACHE_SIZE``);
* the step itself (``step.decode_step``) with the schedule's temperature table, the backend's
  kernels (the oracle for a constrained read's K columns; under tensor parallelism statistics
  from this rank's vocabulary slice, merged across the ranks of ``tp_group``), and the
  logits-free parts replayed from CUDA graphs (``update_graph.py``), or for small batches the
  whole step, projection included (``step_graph.py``);
* the logprob stash: for the requests that converge now, the rows, temperature, threshold,
  allowed mask and selected tokens their logprobs need, handed to the front end's formatter
  while the tile's logits still exist.

What a front end knows about its requests comes in through a ``RequestOptions`` object (top-k
/ top-p tensors, allowed masks, pins, a generation counter that moves when a slot gets a new
request); vLLM keeps these in its own sampling states, ``DiffusionState`` in its own arrays.

Transient bytes per request (``bytes_per_request``):

* logits input, Triton backend: per canvas position a handful of O(1) statistics
  (``STAT_BYTES`` = 64 bytes with padding and the row layout); the kernels materialise
  nothing of size V. 32 requests x 256 positions cost about 0.5 MiB.
* PyTorch backend: the oracle works on fp32 chunks of rows; per row it holds about
  ``TORCH_BYTES_PER_ENTRY`` = 48 bytes per vocabulary entry (logits, z, exp, Gumbel bits as
  int64 intermediates, masks), so its chunk of rows is sized from the budget instead.
* hidden-state input: the projected logits of a tile, ``W x V x itemsize`` bytes per request
  (``Projection.itemsize``: 2 for our LM head's bf16 logits, 6 for vLLM's ``compute_logits``,
  whose fp32 softcapped copy lives beside its bf16 output), plus the above. Tiles are as large
  as the budget allows: every tile reads the whole ``[V, H]`` head (and the embedding) again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from . import envs, reference, support, tensor_parallel
from .backend import Kernels, kernels
from .config import SamplerConfig
from .head import Projection
from .reference import RowStats
from .state import to_device_int64
from .step import (
    RowMasks,
    SelfConditioning,
    StepBatch,
    StepLayout,
    StepOutput,
    decode_step,
    step_layout,
    use_triton_update,
)
from .step_graph import StepGraph, graphable_bytes
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


class RequestOptions(Protocol):
    """What the runner asks a front end about the requests of a tile (host slot arrays)."""

    @property
    def generation(self) -> int:
        """Moves whenever a slot gets a new request (invalidates cached plans); the runner only
        reads it (a plain attribute or a property)."""

    def top_k_top_p(self, slots: list[int], slots_t: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``([n] int64 top-k, [n] fp32 top-p)`` of the tile, None where no request uses it."""

    def allowed_rows(self, slots: list[int], vocab: int) -> torch.Tensor | None:
        """``[n, vocab]`` bool allowed-token masks (constrained requests), or None."""

    def any_pins(self, slots: list[int]) -> bool:
        """Whether a request of the tile pins canvas positions."""


@dataclass
class LogprobRows:
    """What the logprobs of one converging request are computed from (its ``k`` rows)."""

    rows: torch.Tensor  # [k, C] the step's logits (C = V, or K for a shared allowed set)
    inv_t: torch.Tensor  # [k] fp32: 1 / the temperature of the step that ran (1 if read-only)
    threshold: torch.Tensor  # [k] fp32: the top-k / top-p cut (-inf: none)
    allowed: torch.Tensor | None  # [k, C] bool or None
    selected: torch.Tensor  # [k] int64: the argmax token ids
    softcap: float | None  # applied to ``rows`` in registers (None: already applied)


@dataclass
class LogprobRequest:
    """The logprob stash of a step: which requests stash when they converge, how a stash is
    built from its ``LogprobRows`` (the front end's layout), and where it is kept."""

    slots: Container[int]
    build: Callable[[int, LogprobRows], Any]
    stash: dict[int, Any]


@dataclass
class TilePlan:
    """Host decisions and device index tensors of one tile of decoding requests."""

    slots: list[int]
    slots_t: torch.Tensor
    row_starts: torch.Tensor
    valid: torch.Tensor
    valid_np: np.ndarray
    width: torch.Tensor
    W: int
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    allowed: torch.Tensor | None
    layout: StepLayout
    update_graph: UpdateGraph | None = None
    step_graph: StepGraph | None = None

    @property
    def batch(self) -> StepBatch:
        return StepBatch(self.slots_t, self.row_starts, self.valid, self.width, self.W, self.layout)


class StepRunner:
    """One decode step's device work over a slot-indexed state.

    Parameters
    ----------
    cfg : the sampler configuration (temperature schedule, acceptance, convergence).
    state : the slot-indexed state (``DiffusionState``, or vLLM's request states with the
        keyed noise's ``seeds`` / ``draws`` beside them).
    options : the front end's ``RequestOptions``.
    embed_weight : ``[V_local, H]`` embedding rows of this rank's vocabulary slice.
    normalizer : the embedding normalizer (scalar tensor or float).
    backend : a resolved backend, "triton" or "torch".
    vocab_size : the full vocabulary (random tokens are drawn from it).
    vocab_start : first vocabulary id of ``embed_weight`` (tensor parallelism).
    sc_reduce : in-place all-reduce of soft-embedding partial sums across ranks.
    tp_group : the tensor-parallel process group (None: one rank). With several ranks, tiles
        without masks compute their statistics from this rank's vocabulary slice and merge
        O(1) partials per row across the group (``tensor_parallel``): from gathered logits each
        rank reads its share of the columns; logits a ``Projection`` made for this rank's
        slice alone are never gathered.
    memory_fraction, budget_bytes : the tile budget of hidden-state input.
    graph_update : replay the logits-free parts of a step from CUDA graphs (needs CUDA), and
        whole steps of small batches (``step_graph.py``).
    """

    def __init__(
        self,
        cfg: SamplerConfig,
        state: Any,
        options: RequestOptions,
        embed_weight: torch.Tensor,
        normalizer: torch.Tensor | float,
        *,
        backend: str,
        vocab_size: int,
        vocab_start: int = 0,
        sc_reduce: Callable[[torch.Tensor], None] | None = None,
        tp_group: Any = None,
        memory_fraction: float = 0.5,
        budget_bytes: int | None = None,
        graph_update: bool | None = None,
    ) -> None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be resolved to 'triton' or 'torch', got {backend!r}")
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        device = state.canvas.device
        if graph_update is None:
            graph_update = device.type == "cuda" and envs.graph_update()
        elif graph_update and device.type != "cuda":
            raise ValueError("graph_update needs a CUDA device")
        self.cfg = cfg
        self.state = state
        self.options = options
        self.device = device
        self.embed_weight = embed_weight
        self.normalizer = normalizer
        self.backend = backend
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start
        self.sc_reduce = sc_reduce
        self.tp_group = tp_group
        # (None is one rank here, not torch.distributed's default group)
        self.tp_world = 1 if tp_group is None else tensor_parallel.world_size_of(tp_group)
        self.memory_fraction = memory_fraction
        self.budget_bytes = budget_bytes
        self.graph_update = bool(graph_update)
        # Whole-step graphs share one memory pool: one step runs at a time, and a replay's
        # outputs are copied out before anything else runs (``step_graph.py``).
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graph_update else None
        self.kernels = kernels(backend)
        self.logprobs_fn = self.kernels.token_logprobs_rows
        if cfg.tail_eps > 0 and embed_weight is not None:
            # The support pass's bin weights, built here: the first step may run inside a CUDA
            # graph capture, where a host-to-device copy is not allowed.
            support.weights_on(embed_weight.device)
        self.plans: OrderedDict[tuple, TilePlan] = OrderedDict()
        self.last_tile_requests = 0
        # The schedule temperature of every step count 0..N, computed once by the config's own
        # formula on the device (so entries are bit-identical to computing it per step): one
        # gather per step instead of six elementwise ops.
        self._temperature_table = None
        if cfg.max_denoising_steps <= TEMPERATURE_TABLE_MAX:
            done = torch.arange(cfg.max_denoising_steps + 1, dtype=state.step.dtype, device=device)
            self._temperature_table = cfg.temperature(done).to(torch.float32)

    # ---------------------------------------------------------------- schedule and budget
    def temperature_of(self, slots: torch.Tensor, steps_back: int = 0) -> torch.Tensor:
        """The schedule temperature of ``slots`` at their step counter minus ``steps_back``."""
        steps = self.state.step[slots]
        if steps_back:
            steps = steps - steps_back
        if self._temperature_table is None:
            return self.cfg.temperature(steps).to(torch.float32)
        # max(N - n, 1) is constant past n = N - 1, so the table's last entry covers n >= N.
        return self._temperature_table[steps.clamp(min=0, max=self.cfg.max_denoising_steps)]

    def request_inputs(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(temperature, inv_t, seeds, draws)`` of the requests in ``slots`` (int64, on the
        device): the schedule temperature now, its inverse (``reference.inverse_temperature``,
        computed once for every kernel of the step) and the keyed-noise seed and draw. Where the
        step's update runs its Triton kernels and the schedule has a table, one launch
        (``kernels/request_prologue.py``, bit for bit these operators)."""
        state = self.state
        if self._temperature_table is not None and use_triton_update(slots.device, self.backend):
            from .kernels.request_prologue import request_prologue

            return request_prologue(slots, state.step, state.seeds, state.draws,
                                    self._temperature_table)
        temperature = self.temperature_of(slots)
        return (temperature, reference.inverse_temperature(temperature), state.seeds[slots],
                state.draws[slots])

    def tile_requests(self, width: int, vocab: int, logits_itemsize: int) -> int:
        """Requests per tile: ``budget // bytes_per_request``, the budget re-read now."""
        budget = self.budget_bytes
        if budget is None:
            budget = memory_budget(self.device, self.memory_fraction)
        return max(1, budget // bytes_per_request(width, vocab, logits_itemsize))

    def _torch_chunk_rows(self, vocab: int) -> int:
        budget = self.budget_bytes or memory_budget(self.device, self.memory_fraction)
        return int(max(1, min(4096, budget // (vocab * TORCH_BYTES_PER_ENTRY))))

    # ---------------------------------------------------------------- the step
    def step(
        self,
        slots: Sequence[int],
        valid: np.ndarray,
        widths: np.ndarray,
        *,
        vocab: int,
        logits: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        projection: Projection | None = None,
        column_tokens: torch.Tensor | None = None,
        logprobs: LogprobRequest | None = None,
    ) -> StepOutput:
        """One decode step for the requests in ``slots`` (host ints; ``valid`` / ``widths``
        int64 arrays of their valid lengths and canvas widths; request j's rows follow
        request j-1's).

        Give ``logits`` ``[sum(valid), vocab]`` (read only), or ``hidden_states`` ``[sum(valid),
        H]`` with the ``projection`` that makes a tile's logits (``vocab`` of its columns; the
        step owns them and overwrites what it no longer reads): logits then exist one tile at
        a time. ``column_tokens`` names the token of each column when the logits cover one
        allowed set only. Returns the step's output for all requests, in order.
        """
        n = len(slots)
        W = int(widths.max())
        starts = np.concatenate(([0], np.cumsum(valid)[:-1])).astype(np.int64)
        # ``head``: the projection that makes each tile's logits (hidden-state input), else None.
        head: Projection | None = None
        if hidden_states is not None:
            if projection is None:
                raise ValueError("hidden_states need a projection")
            source, head = hidden_states, projection
            tile = self.tile_requests(W, vocab, projection.itemsize)
        else:
            assert logits is not None, "StepRunner.step takes logits or hidden_states"
            source = logits
            # Logits input: the kernels need O(1) bytes per row, and the oracle bounds its
            # memory per chunk of rows (``_torch_chunk_rows``): one tile.
            tile = n
        self.last_tile_requests = min(tile, n)
        step_kernels = self.kernels
        if self.backend == "torch":
            step_kernels = step_kernels.with_row_stats(reference.row_stats_rows,
                                                       chunk_rows=self._torch_chunk_rows(vocab))
        if column_tokens is not None:
            # Constrained reads hold only K << V columns: the oracle is cheap there and keys
            # the noise by token id through ``column_tokens``.
            step_kernels = step_kernels.with_row_stats(reference.row_stats_rows)

        outputs: list[StepOutput] = []
        for t0 in range(0, n, tile):
            t1 = min(t0 + tile, n)
            r0, r1 = int(starts[t0]), int(starts[t1 - 1] + valid[t1 - 1])
            plan = self.plan(slots[t0:t1], starts[t0:t1] - r0, valid[t0:t1], widths[t0:t1],
                             vocab, column_tokens, W=W)
            rows = source[r0:r1]
            graph = self._step_graph(plan, rows, vocab, projection, logprobs, column_tokens,
                                     whole=t0 == 0 and t1 == n)
            if graph is not None:
                outputs.append(graph.run(rows))
                continue
            tile_logits = head.project(rows, valid[t0:t1]) if head is not None else rows
            out = self.run_tile(plan, tile_logits, step_kernels=step_kernels,
                                projection=projection, column_tokens=column_tokens)
            if logprobs is not None:
                self._stash_logprobs(out, plan, tile_logits, starts[t0:t1] - r0, valid[t0:t1],
                                     None if projection is None else projection.softcap, logprobs)
            outputs.append(out)
            # Drop this tile's logits before the next projection: otherwise two tiles are
            # alive at its peak.
            del tile_logits
        return _concat(outputs)

    def _step_graph(self, plan: TilePlan, rows: torch.Tensor, vocab: int,
                    projection: Projection | None, logprobs: LogprobRequest | None,
                    column_tokens: torch.Tensor | None, *, whole: bool) -> StepGraph | None:
        """The plan's whole-step graph where the step can be one (``step_graph.py``): a batch in
        one tile whose logits are small, no logprobs to stash (they read the logits on the host's
        word), every column of the vocabulary; else None (the step runs eagerly)."""
        if not (self.graph_update and whole and plan.update_graph is not None
                and logprobs is None and column_tokens is None):
            return None
        if projection is not None and projection.key is None:
            return None  # a caller's projection (vLLM's compute_logits): never captured
        itemsize = rows.element_size() if projection is None else projection.itemsize
        if rows.shape[0] * vocab * itemsize > graphable_bytes():
            return None
        if plan.step_graph is None:
            plan.step_graph = StepGraph(self, plan, projection, pool=self.graph_pool)
        plan.step_graph.use(projection)
        return plan.step_graph

    def plan(self, tile_slots: Sequence[int], starts: np.ndarray, valid: np.ndarray,
             widths: np.ndarray, vocab: int, column_tokens: torch.Tensor | None = None, *,
             W: int | None = None, cache: bool = True) -> TilePlan:
        """The device side of a tile's host decisions; reused while the batch keeps its
        shape and no request was added or removed (``options.generation``). ``W``: the
        width of the step's outputs (default: the tile's widest canvas); every tile of a
        step shares the step's, so that their outputs concatenate."""
        tile_slots = [int(s) for s in tile_slots]
        if W is None:
            W = int(widths.max())
        key = (self.options.generation, tuple(tile_slots), starts.tobytes(), valid.tobytes(),
               widths.tobytes(), W, vocab, column_tokens is None)
        plan = self.plans.get(key) if cache else None
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        # One pinned host buffer, one copy that does not wait for the GPU.
        slots_t, row_starts, valid_t, width_t = to_device_int64(
            self.device, tile_slots, starts, valid, widths)
        top_k, top_p = self.options.top_k_top_p(tile_slots, slots_t)
        layout = step_layout(
            self.state, slots_t, row_starts, valid_t, width_t, W, int(valid.sum()),
            full_width=bool((widths == W).all()),
            any_pins=self.options.any_pins(tile_slots))
        plan = TilePlan(
            slots=tile_slots, slots_t=slots_t, row_starts=row_starts, valid=valid_t,
            valid_np=valid.copy(),
            width=width_t, W=W, top_k=top_k, top_p=top_p,
            allowed=None if column_tokens is not None else self.options.allowed_rows(tile_slots, vocab),
            layout=layout,
            # Only a cached plan is seen again; constrained reads bring new columns every step.
            update_graph=UpdateGraph() if cache and self.graph_update and column_tokens is None else None,
        )
        if cache and plan.allowed is None:  # ([n, V] masks are not worth holding on to)
            self.plans[key] = plan
            while len(self.plans) > PLAN_CACHE_SIZE:
                self.plans.popitem(last=False)
        return plan

    def run_tile(self, plan: TilePlan, tile_logits: torch.Tensor, *,
                 step_kernels: Kernels | None = None,
                 projection: Projection | None = None,
                 column_tokens: torch.Tensor | None = None) -> StepOutput:
        """``decode_step`` over one planned tile (no host work, no host synchronisation).
        ``step_kernels``: the step's kernels (default the backend's); ``projection``: the
        tile's logits are a projection's, the step's own (None: a caller's logits, read only)."""
        step_kernels = step_kernels or self.kernels
        # The first vocabulary id of this rank's slice of the head, where the logits are one.
        slice_start = None if projection is None else projection.vocab_start
        local = slice_start is not None
        vocab_start = self.vocab_start if column_tokens is None else 0
        unmasked = (column_tokens is None and plan.allowed is None and plan.top_k is None
                    and plan.top_p is None)
        if slice_start is not None:
            # This rank's slice of the head: statistics from its own columns, merged across the
            # ranks; the soft embedding multiplies the same slice (vocab_start 0 in the tile).
            if slice_start != self.vocab_start or (
                    tile_logits.shape[1] != self.embed_weight.shape[0]):
                raise ValueError(
                    f"the head slice [{slice_start}, +{tile_logits.shape[1]}) must be "
                    f"the embedding's [{self.vocab_start}, +{self.embed_weight.shape[0]})")
            step_kernels = step_kernels.with_row_stats(
                tensor_parallel.row_stats_rows_local, vocab_start=slice_start,
                group=self.tp_group, backend=self.backend)
            vocab_start = 0
        elif self.tp_world > 1 and unmasked:
            # Every rank holds the gathered logits: each streams only its own vocabulary
            # slice and the ranks merge per-row partials.
            import torch.distributed as dist

            start, end = tensor_parallel.vocab_slice(
                self.vocab_size, dist.get_rank(self.tp_group), self.tp_world)
            step_kernels = step_kernels.with_row_stats(
                tensor_parallel.row_stats_rows_sharded, vocab_start=start, vocab_end=end,
                group=self.tp_group, backend=self.backend)
        soft = None
        if self.embed_weight is not None:
            soft = SelfConditioning(
                embed_weight=self._embed_for(column_tokens), normalizer=self.normalizer,
                vocab_start=vocab_start, reduce=self.sc_reduce,
                row_vocab=self.vocab_size if local else None,
                logits_scratch=projection is not None)
        masks = RowMasks(softcap=None if projection is None else projection.softcap,
                         top_k=plan.top_k, top_p=plan.top_p, allowed=plan.allowed,
                         column_tokens=column_tokens)
        return decode_step(self.state, tile_logits, plan.batch, cfg=self.cfg,
                           vocab_size=self.vocab_size, kernels=step_kernels,
                           request_inputs=self.request_inputs, masks=masks, soft=soft,
                           update_runner=plan.update_graph)

    def _embed_for(self, column_tokens: torch.Tensor | None) -> torch.Tensor:
        if column_tokens is None:
            return self.embed_weight
        # A constrained step's logits cover only the allowed ids: their K embedding rows.
        return self.embed_weight[column_tokens - self.vocab_start].contiguous()

    def _stash_logprobs(self, out: StepOutput, plan: TilePlan, tile_logits: torch.Tensor,
                        starts: np.ndarray, valid: np.ndarray, softcap: float | None,
                        request: LogprobRequest) -> None:
        """Stash the logprobs of this tile's requests that converged now (vLLM's rule: they
        are emitted with the commit that follows)."""
        want = [s in request.slots for s in plan.slots]
        if not any(want):
            return
        converged = out.just_converged.cpu().tolist()  # the one host sync, as in vLLM
        read_only = self.state.read_only_slots
        for j, s in enumerate(plan.slots):
            if not (want[j] and converged[j]):
                continue
            k = int(valid[j])
            rows = tile_logits[int(starts[j]): int(starts[j]) + k]
            if s in read_only:  # vLLM reports read-only requests at temperature 1
                t = torch.ones((), device=rows.device)
            else:  # the temperature of the step that just ran (its counter moved on)
                t = self.temperature_of(plan.slots_t[j:j + 1], steps_back=1)[0]
            # Materialised: the Triton logprobs kernel reads one value per row (no stride).
            inv_t = reference.inverse_temperature(t).expand(k).contiguous()
            allowed = None if plan.allowed is None else plan.allowed[j].unsqueeze(0).expand(k, -1)
            request.stash[s] = request.build(s, LogprobRows(
                rows=rows, inv_t=inv_t, threshold=out.stats.threshold[j, :k], allowed=allowed,
                selected=out.stats.argmax[j, :k], softcap=softcap))


def _concat(outputs: list[StepOutput]) -> StepOutput:
    if len(outputs) == 1:
        return outputs[0]
    stats = RowStats(*(torch.cat(parts) for parts in zip(*(o.stats.as_tuple() for o in outputs))))
    paths = [o.sc_path_rows for o in outputs if o.sc_path_rows is not None]
    return StepOutput(
        sampled=torch.cat([o.sampled for o in outputs]),
        num_sampled=torch.cat([o.num_sampled for o in outputs]),
        just_converged=torch.cat([o.just_converged for o in outputs]),
        stats=stats,
        sc_path_rows=torch.stack(paths).sum(0) if paths else None,
    )
