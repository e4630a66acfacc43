"""The logits-free parts of a decode step, replayed from CUDA graphs while the batch keeps its shape.

Around the two kernels that read the logits a step does small work: before them the
per-request gathers (temperature and its inverse, seeds, draws), between them the state update
(padding, acceptance, renoise, ring, convergence, commit bookkeeping; see
``step.update_after_stats``). In PyTorch that is ~70 small operators; on a GPU it is two Triton
launches (``kernels/request_prologue.py``, ``kernels/canvas_update.py``) and a few operators.
Each launch costs the host 15-40 us and the GPU a few, so with few requests the eager step is
bound by the host, and the GEMM, which needs the update's ``keep``, waits behind that host work.

Neither part reads the logits: the gathers read the persistent state, the update the flat
statistics, the state and the batch's layout. So each is captured once per tile plan and
replayed, and the logits-reading kernels stay outside the graphs (their input moves from step
to step):

* ``prologue``: replayed; its outputs stay in the graph's memory, read by this step's kernels
  on the same stream before any later replay rewrites them.
* ``update``: the six statistics vectors are copied into the graph's input buffers (one
  ``_foreach_copy_`` per dtype) and the graph replayed. ``keep`` stays the graph's (the GEMM
  launched next reads it); the outputs that leave the step are copied out of the graph's
  memory by ``detach`` after the GEMM's launch, and statistics that are mere views of the
  inputs (full canvases) are returned as views of the step's own statistics instead.

A plan is captured on its second use (``CAPTURE_AFTER``): a batch shape that occurs once pays
nothing, and every kernel the parts launch has been compiled by then. Replays are
bit-identical to the eager parts (same kernels, same order). Launching a graph is not free
either (``cudaGraphLaunch`` costs host time too), but it is one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .reference import RowStats
from .step import StepOutput

# Eager uses of a tile plan before its parts are captured.
CAPTURE_AFTER = 1

T = TypeVar("T")


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, one ``_foreach_copy_`` launch per dtype."""
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def _escaping(out: StepOutput) -> list[torch.Tensor]:
    return [out.sampled, out.num_sampled, out.just_converged, *out.stats.as_tuple()]


def capture(fn: Callable[[], T], device: torch.device, pool: Any = None
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """``(graph, fn())`` with ``fn``'s kernels recorded, not run (run them by replaying); its
    memory from ``pool`` (``torch.cuda.graph_pool_handle()``) when given, else a pool of its own."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            result = fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph, result


class UpdateGraph:
    """``update_runner`` of ``step.decode_step``: each part eager for its first
    ``capture_after`` calls, then captured once and replayed.

    The parts must be the same every time they are asked for: the owner keeps one runner per
    tile plan (same slots, widths, valid lengths and state generation).
    """

    def __init__(self, capture_after: int = CAPTURE_AFTER):
        self.capture_after = capture_after
        self.prologue_calls = self.update_calls = 0
        self.prologue_graph: torch.cuda.CUDAGraph | None = None
        self.graph: torch.cuda.CUDAGraph | None = None  # the update's
        self._prologue_out: tuple = ()  # the prologue graph's outputs, once captured
        self._inputs: RowStats | None = None
        self._outputs: tuple[StepOutput, torch.Tensor | None] | None = None
        self._aliases: list[int | None] = []
        self._flat: RowStats | None = None  # the replayed step's own statistics (``detach``)

    def _eager(self, calls: int) -> bool:
        """Whether a part runs its operators directly: during its first ``capture_after``
        calls, and while the caller captures a graph of its own (the operators then go into
        that graph; replaying or capturing ours inside it is not what the caller recorded)."""
        return calls <= self.capture_after or torch.cuda.is_current_stream_capturing()

    def prologue(self, fn: Callable[[], tuple], device: torch.device) -> tuple:
        """``fn()`` (no inputs; reads the state), its outputs valid for this step only."""
        self.prologue_calls += 1
        if self._eager(self.prologue_calls):
            return fn()
        if self.prologue_graph is None:
            self.prologue_graph, self._prologue_out = capture(fn, device)
        self.prologue_graph.replay()
        return self._prologue_out

    def __call__(self, update: Callable[..., tuple[StepOutput, torch.Tensor | None]],
                 flat: RowStats) -> tuple[StepOutput, torch.Tensor | None]:
        """``update(flat)``; a replayed step's output is the graph's until ``detach``."""
        self.update_calls += 1
        self._flat = None
        if self._eager(self.update_calls):
            return update(flat)
        if self.graph is None:
            self._capture_update(update, flat)
        graph, inputs, outputs = self.graph, self._inputs, self._outputs
        assert graph is not None and inputs is not None and outputs is not None  # captured together
        copy_all(list(inputs.as_tuple()), list(flat.as_tuple()))
        graph.replay()
        self._flat = flat
        return outputs

    def detach(self, out: StepOutput) -> StepOutput:
        """The step's output in memory of its own (the next replay rewrites the graph's)."""
        if self._flat is None or self._outputs is None or out is not self._outputs[0]:
            return out  # an eager update's output is already the caller's
        flat_parts = self._flat.as_tuple()
        self._flat = None
        leaving, fresh, parts = [], [], []
        for t, source in zip(_escaping(out), self._aliases):
            if source is not None:
                parts.append(flat_parts[source].view(t.shape))
            else:
                copy = torch.empty_like(t)
                leaving.append(t)
                fresh.append(copy)
                parts.append(copy)
        copy_all(fresh, leaving)
        sampled, num_sampled, just_converged, *stats = parts
        return StepOutput(sampled=sampled, num_sampled=num_sampled, just_converged=just_converged,
                          stats=RowStats(*stats))

    def _capture_update(self, update: Callable[..., tuple[StepOutput, torch.Tensor | None]],
                        flat: RowStats) -> None:
        self._inputs = buffers = RowStats(*(torch.empty_like(t) for t in flat.as_tuple()))
        # ``gather``: the graph reads seeds and draws from the state itself.
        graph, outputs = capture(lambda: update(buffers, True), flat.argmax.device)
        self.graph, self._outputs = graph, outputs
        # Which escaping outputs are whole, contiguous views of an input buffer.
        inputs = buffers.as_tuple()
        self._aliases = [
            next((i for i, x in enumerate(inputs)
                  if t.data_ptr() == x.data_ptr() and t.numel() == x.numel()
                  and t.dtype == x.dtype and t.is_contiguous()), None)
            for t in _escaping(outputs[0])]
