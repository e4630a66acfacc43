"""A whole decode step of a small batch replayed from one CUDA graph: projection, statistics,
support pass, GEMMs and update.

With one or two requests a step's kernels take about a millisecond of GPU time, and dispatching
them eagerly (a few dozen kernels and operators, 15-25 us of host time each) costs about as much
again: the GPU waits for the host. ``update_graph.py`` replays the logits-free parts of a step;
here the whole step is one graph, so that it costs its kernels' time only.

A step's only input that moves between steps of one batch shape is its rows (hidden states or
logits): the graph reads them from a static buffer, which each step fills with one device copy
(hidden states: ``rows x H`` x 2 bytes, 1.4 MB at one request; logits: ``rows x V`` x 4 bytes, 256 MiB
at one request, a copy of ~0.1 ms). Everything else is the persistent state (slot-indexed
tensors the step reads and writes in place), the tile plan's layout, and memory of the graph's
own (the projected logits, the statistics, the outputs).

Memory: the graphs of a runner share one memory pool. One step runs at a time and the outputs of
a replay are copied out of the graph's memory before anything else runs, so graphs may reuse
each other's scratch: the pool holds about one step's intermediates (on the hidden-state path one
tile of model-dtype logits) however many batch shapes are captured. Only batches whose logits
take at most ``MAX_GRAPH_BYTES`` are graphed (1 request in fp32, 2 in bf16 at DiffusionGemma's
shape): beyond that the GPU time of a step hides the host's, and the pool would hold more.

A plan's graph is captured on its second use (``CAPTURE_AFTER``: a shape seen once costs nothing,
and every kernel is compiled and every cache filled by then), and replayed bit-identically to
the eager step (same kernels, same order). Steps that stash logprobs run eagerly: the stash reads
the step's logits after a host read of which requests converged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .kernels.contract import ROW_STATS
from .reference import RowStats
from .step import StepOutput
from .update_graph import CAPTURE_AFTER, capture, copy_all

if TYPE_CHECKING:
    from .head import Projection

MAX_GRAPH_BYTES = 1 << 28


def graphable_bytes() -> int:
    """Logits bytes of the largest step replayed whole."""
    return MAX_GRAPH_BYTES


def _tensors(out: StepOutput) -> list[torch.Tensor]:
    """The tensors of ``out``: ``sc_path_rows`` last, where it has one."""
    extra = [] if out.sc_path_rows is None else [out.sc_path_rows]
    return [out.sampled, out.num_sampled, out.just_converged, *out.stats.as_tuple(), *extra]


class StepGraph:
    """One tile plan's whole step: eager for its first ``CAPTURE_AFTER`` uses, then replayed.

    ``runner`` is the ``runner.StepRunner`` whose ``run_tile`` the graph records, ``plan`` its
    tile plan, ``projection`` the hidden-state projection of the steps (None: logits input).
    """

    def __init__(self, runner: Any, plan: Any, projection: Projection | None, *, pool: Any) -> None:
        self.runner = runner
        self.plan = plan
        self.projection = projection
        self.pool = pool
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: torch.Tensor | None = None
        self._out: StepOutput | None = None

    def use(self, projection: Projection | None) -> None:
        """Take the step's projection: one that makes other logits than the captured one's (another
        head, softcap or slice: another ``Projection.key``) drops the graph, and the plan runs
        eagerly once and is captured again."""
        old = None if self.projection is None else self.projection.key
        new = None if projection is None else projection.key
        if new != old:
            self.graph, self.static, self._out, self.calls = None, None, None, 0
        self.projection = projection

    def _step(self, rows: torch.Tensor) -> StepOutput:
        logits = rows
        if self.projection is not None:
            logits = self.projection.project(rows, self.plan.valid_np)
        return self.runner.run_tile(self.plan, logits, projection=self.projection)

    def run(self, rows: torch.Tensor) -> StepOutput:
        """The step over ``rows`` (same shape and dtype every time)."""
        self.calls += 1
        if self.calls <= CAPTURE_AFTER or torch.cuda.is_current_stream_capturing():
            return self._step(rows)
        graph, static = self.graph, self.static
        if graph is None or static is None or static.shape != rows.shape or static.dtype != rows.dtype:
            self.static = static = torch.empty_like(rows)
            graph, self._out = capture(lambda: self._step(static), rows.device, pool=self.pool)
            self.graph = graph
        static.copy_(rows)
        graph.replay()
        return self._detach()

    def _detach(self) -> StepOutput:
        """The replay's outputs in memory of their own (the next replay of any graph of the pool
        may rewrite the graph's)."""
        assert self._out is not None  # captured with the graph
        parts = _tensors(self._out)
        fresh = [torch.empty_like(t) for t in parts]
        copy_all(fresh, parts)
        sampled, num_sampled, just_converged, *rest = fresh
        stats, sc_path_rows = rest[:len(ROW_STATS)], rest[len(ROW_STATS):]
        return StepOutput(sampled=sampled, num_sampled=num_sampled, just_converged=just_converged,
                          stats=RowStats(*stats), sc_path_rows=sc_path_rows[0] if sc_path_rows else None)
