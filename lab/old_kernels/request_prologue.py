"""The per-request inputs of a decode step in one launch: temperature, its inverse, seed, draw.

For the ``n`` requests in slots ``s_j`` of the slot-indexed state, with ``table`` the
schedule's temperature at every step count ``0 .. N`` (``table[N]`` stands for every later
count, where the schedule is flat)::

    T_j     = table[clamp(step[s_j], 0, N)]
    inv_t_j = 1 / max(T_j, GREEDY_CLAMP)        (a correctly rounded fp32 division)
    seed_j  = seeds[s_j],  draw_j = draws[s_j]

Bit for bit the result of the PyTorch twin (``StepRunner.request_inputs`` without a kernel:
four gathers, two clamps and a reciprocal, ``contract.inverse_temperature``): gathers copy, both
sides divide with IEEE rounding, and a NaN temperature stays NaN through the clamp as in
``torch.clamp``. One launch instead of seven matters to a small step replayed from a CUDA
graph, where every node costs the GPU a few microseconds whatever it does.

Traffic: ~56 bytes per request (32 read, 24 written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import GREEDY_CLAMP

BLOCK_REQUESTS = 128


@triton.jit
def _request_prologue_kernel(
    slots_ptr,                                   # [n] int64 slot of each request
    step_ptr, seeds_ptr, draws_ptr,              # [S] int32, int64, int64 slot-indexed state
    table_ptr,                                   # [N + 1] fp32 temperature per step count
    temperature_ptr, inv_t_ptr,                  # [n] fp32 outputs
    seeds_out_ptr, draws_out_ptr,                # [n] int64 outputs
    n, last_step,
    CLAMP: tl.constexpr, BLOCK: tl.constexpr,
):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    slot = tl.load(slots_ptr + j, mask=live, other=0)
    steps = tl.load(step_ptr + slot, mask=live, other=0)
    steps = tl.minimum(tl.maximum(steps, 0), last_step)
    t = tl.load(table_ptr + steps, mask=live, other=1.0)
    tl.store(temperature_ptr + j, t, mask=live)
    # tl.div_rn: Triton's own ``/`` on fp32 is an approximate division.
    clamped = tl.maximum(t, CLAMP, propagate_nan=tl.PropagateNan.ALL)
    tl.store(inv_t_ptr + j, tl.div_rn(tl.full(t.shape, 1.0, tl.float32), clamped), mask=live)
    tl.store(seeds_out_ptr + j, tl.load(seeds_ptr + slot, mask=live, other=0), mask=live)
    tl.store(draws_out_ptr + j, tl.load(draws_ptr + slot, mask=live, other=0), mask=live)


def request_prologue(
    slots: torch.Tensor, step: torch.Tensor, seeds: torch.Tensor, draws: torch.Tensor,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, inv_t, seeds, draws)`` of the requests in ``slots`` (``[n]`` int64,
    each a valid index of the ``[S]`` state vectors ``step`` (int32), ``seeds`` and ``draws``
    (int64)), with ``table`` the ``[N + 1]`` fp32 temperature of every step count."""
    n = slots.numel()
    dev = slots.device
    assert slots.dim() == 1 and slots.dtype == torch.int64 and slots.is_contiguous(), \
        "slots must be a contiguous [n] int64 tensor"
    for name, t, dtype in (("step", step, torch.int32), ("seeds", seeds, torch.int64),
                           ("draws", draws, torch.int64), ("table", table, torch.float32)):
        assert t.dim() == 1 and t.dtype == dtype and t.is_contiguous() and t.device == dev, \
            f"{name} must be a contiguous 1-D {dtype} tensor on {dev}"
    assert step.shape == seeds.shape == draws.shape, \
        "step, seeds and draws must be state vectors of the same length"
    assert table.numel() >= 1, "the temperature table must hold at least step count 0"
    temperature = torch.empty(n, dtype=torch.float32, device=dev)
    inv_t = torch.empty(n, dtype=torch.float32, device=dev)
    seeds_out = torch.empty(n, dtype=torch.int64, device=dev)
    draws_out = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _request_prologue_kernel[(triton.cdiv(n, BLOCK_REQUESTS),)](
            slots, step, seeds, draws, table, temperature, inv_t, seeds_out, draws_out,
            n, table.numel() - 1, CLAMP=GREEDY_CLAMP, BLOCK=BLOCK_REQUESTS, num_warps=4)
    return temperature, inv_t, seeds_out, draws_out
