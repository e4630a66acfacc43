"""Which soft-embedding GEMM runs a call, on what schedule: the dispatch in front of the kernels.

``soft_embedding_rows`` (the Triton twin of ``reference.soft_embedding_rows``) chooses per call:

* the Hopper kernel (``soft_embedding_wgmma.py``) where it applies (``supported``), fed the
  operand that ``soft_embedding_operand.py`` wrote over logits the caller owns
  (``logits_scratch``), or making it in its prologue;
* else the portable Triton kernel (``soft_embedding.py``), the first tile configuration of
  ``GPU_CONFIGS`` that compiles without register spills, remembered per shape.

and plans the schedule both kernels run (``plan_split``: whole tiles in waves, the remaining
tiles split along the vocabulary into pieces that fill whole waves; with ``keep`` the kept rows
compacted first and the plan of every kept count tabulated, ``plans_by_count``, so that the
count stays on the device). ``gemm_name`` tells which GEMM a device runs (the plugin's log line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
from triton.runtime.errors import OutOfResources

from . import contract
from .kept_rows import kept_first
from .logit_row import interpreting
from .soft_embedding import TileConfig, launch_portable, merge_split

MAX_SCRATCH_BYTES = 32 * 2**20  # split-K partials beyond the output: at most 32 MiB
MIN_K_BLOCKS_PER_PIECE = 8  # a split-K piece shorter than this is all prologue and epilogue
MAX_SPLIT = 16
PIECE_OVERHEAD = 0.02  # cost of one extra split-K wave (fill, drain, stage 2), in whole-tile units


# Hopper candidates, the first that fits taken per shape key; one whose kernel spills
# registers loses to any that does not (checked for sm_90 with Triton 3.6 and 3.9 over logits
# fp32/bf16/fp16, E bf16/fp16/fp32, keep, threshold, allowed, softcap). The prologue costs 4-5
# instructions and one MUFU op per probability and feeds 2 * block_n MMA flops; L2 traffic is
# 2 / block_n + 1 / block_m bytes per flop (fp32 logits, bf16 E). Hence tiles whose accumulator
# is 128 registers per thread, 128 x 256 (2 warpgroups of 64 x 256, the least L2 traffic).
# BLOCK_K 64 splits each dot into 4 wgmma (3 in flight while the next prologue runs), 32 into 2.
# In order of preference (the first that fits and does not spill is used, the same on every
# run): 128 x 256 x 64 in 3 stages, then 128 x 256 x 32 in 4 stages where the deeper tiles do
# not fit (fp32 E, an ``allowed`` mask).
GPU_CONFIGS = (
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(128, 256, 32, 8, 4),
)
SHARED_MEMORY_BYTES = 227 * 1024  # Hopper's per-block limit
# The interpreter: small tiles so that tests cover several M/N tiles, split-K and masking, with
# a deep K block because the interpreter's cost is per operation, not per element.
INTERPRETER_CONFIG = TileConfig(32, 64, 128, 4, 1)


def shared_memory_bytes(cfg: TileConfig, logits_dtype: torch.dtype, embed_dtype: torch.dtype,
                        has_allowed: bool) -> int:
    """Pipeline buffers: num_stages x (logits tile + allowed tile + E tile). Within a few KiB of
    what Triton 3.6/3.9 allocate for sm_90 near the limit (fp32 E); launches that still do not fit
    raise OutOfResources and the tuner skips them."""
    a_bytes = cfg.block_m * cfg.block_k * (logits_dtype.itemsize + int(has_allowed))
    return cfg.num_stages * (a_bytes + cfg.block_k * cfg.block_n * embed_dtype.itemsize)


def gpu_candidates(logits_dtype, embed_dtype, has_allowed: bool,
                   configs: tuple[TileConfig, ...] = GPU_CONFIGS) -> list[TileConfig]:
    """The configs whose pipeline buffers fit in shared memory; with an ``allowed`` mask (one more
    load per entry) only BLOCK_K <= 32, the others spill registers."""
    return [cfg for cfg in configs
            if shared_memory_bytes(cfg, logits_dtype, embed_dtype, has_allowed) <= SHARED_MEMORY_BYTES
            and not (has_allowed and cfg.block_k > 32)]


@dataclass(frozen=True)
class SplitPlan:
    """Program layout: ``dp_head`` whole tiles, then ``tail_tiles`` tiles in ``split`` pieces each,
    then ``extra_tiles`` whole tiles of rows past ``num_kept`` (they only store zeros)."""

    n_tiles_n: int
    dp_head: int
    tail_tiles: int
    split: int
    extra_tiles: int
    block_m: int
    block_n: int

    @property
    def programs(self) -> int:
        return self.dp_head + self.tail_tiles * self.split + self.extra_tiles

    @property
    def scratch_elems(self) -> int:
        return self.tail_tiles * (self.split - 1) * self.block_m * self.block_n

    table = None  # the schedule is the launch's (``CountPlans``: read on the device)

    def flags(self) -> dict:
        return {}


def plan_split(rows: int, planned_rows: int, hidden: int, v_local: int, cfg: TileConfig,
               num_sms: int, max_scratch_bytes: int = MAX_SCRATCH_BYTES,
               min_k_blocks: int = MIN_K_BLOCKS_PER_PIECE) -> SplitPlan:
    """Whole tiles in full waves, the remainder split along the vocabulary to fill whole waves.

    Cost of a split S for the L tail tiles, in units of one whole tile's time:
    ceil(L * S / num_sms) / S (+ PIECE_OVERHEAD per extra wave); the smallest S among the cheapest
    wins. S is bounded by the scratch cap and by ``min_k_blocks`` per piece.
    """
    n_tiles_n = triton.cdiv(hidden, cfg.block_n)
    planned = triton.cdiv(planned_rows, cfg.block_m) * n_tiles_n
    total = triton.cdiv(rows, cfg.block_m) * n_tiles_n
    dp_head = planned // num_sms * num_sms
    tail = planned - dp_head
    k_blocks = triton.cdiv(v_local, cfg.block_k)
    tile_bytes = cfg.block_m * cfg.block_n * 4
    best_split, best_cost = 1, float(math.ceil(tail / num_sms))
    for split in range(2, MAX_SPLIT + 1):
        if k_blocks // split < min_k_blocks or (split - 1) * tail * tile_bytes > max_scratch_bytes:
            break
        waves = math.ceil(tail * split / num_sms)
        cost = waves / split + PIECE_OVERHEAD * waves
        if cost < best_cost - 1e-9:
            best_split, best_cost = split, cost
    if best_split == 1:
        dp_head, tail = planned, 0
    return SplitPlan(n_tiles_n, dp_head, tail, best_split, total - planned, cfg.block_m, cfg.block_n)


@dataclass(frozen=True)
class CountPlans:
    """``plan_split`` for every number of kept rows, for a launch whose count stays on the
    device: ``table`` ``[M-tiles + 1, 3]`` int32 holds ``(dp_head, tail_tiles, split)`` for
    ``ceil(count / block_m)`` tiles of rows; the launch takes the largest grid, scratch and merge
    of any count (the programs past a count's plan find no tile and do nothing)."""

    table: torch.Tensor
    n_tiles_n: int
    programs: int
    tail_tiles: int
    scratch_elems: int
    dp_head = 0  # (the launch's values, unused: the kernels read the table's)
    split = 1

    def flags(self) -> dict:
        """The kernels' arguments that make them read the table."""
        return dict(plan_ptr=self.table, PLAN_BY_COUNT=True)


_COUNT_PLANS: dict[tuple, CountPlans] = {}


def plans_by_count(rows: int, hidden: int, v_local: int, cfg: TileConfig, num_sms: int,
                   device: torch.device, min_k_blocks: int = MIN_K_BLOCKS_PER_PIECE) -> CountPlans:
    """``CountPlans`` of a shape, built once (its table is copied to the device then: a first
    call must not be inside a CUDA graph capture, as for the kernels' compilation)."""
    key = (rows, hidden, v_local, cfg, num_sms, str(device), min_k_blocks)
    if key not in _COUNT_PLANS:
        plans = [plan_split(rows, tiles * cfg.block_m, hidden, v_local, cfg, num_sms,
                            min_k_blocks=min_k_blocks)
                 for tiles in range(triton.cdiv(rows, cfg.block_m) + 1)]
        table = torch.tensor([(p.dp_head, p.tail_tiles, p.split) for p in plans],
                             dtype=torch.int32, device=device)
        _COUNT_PLANS[key] = CountPlans(table, plans[0].n_tiles_n, max(p.programs for p in plans),
                                       max(p.tail_tiles for p in plans),
                                       max(p.scratch_elems for p in plans))
    return _COUNT_PLANS[key]


_TUNED: dict[tuple, TileConfig] = {}


def _pick_config(key: tuple, candidates: list[TileConfig], launch, tune: bool = True) -> TileConfig:
    """The first candidate (``GPU_CONFIGS`` order) that launches and does not spill registers,
    remembered per shape key. No timing: a choice made by a stopwatch could differ between two
    processes, and with it the summation order, i.e. the bits of the result. A launch only
    rewrites ``out`` (the kernel is a pure function of its inputs). Under CUDA-graph capture, or
    with ``tune`` False, the first candidate is used (and not remembered)."""
    if key in _TUNED:
        return _TUNED[key]
    if torch.cuda.is_current_stream_capturing() or not tune:
        return candidates[0]
    spilling = []
    for cfg in candidates:
        try:
            kernel = launch(cfg)  # compiles
        except OutOfResources:
            continue  # not this tile on this device
        if not getattr(kernel, "n_spills", 0):
            _TUNED[key] = cfg
            return cfg
        spilling.append(cfg)
    if not spilling:
        raise RuntimeError(f"no soft-embedding tile config fits this device for {key}")
    _TUNED[key] = spilling[0]
    return spilling[0]


def tuning_key(planned_rows: int, hidden: int, v_local: int, logits_dtype, embed_dtype,
               masks: tuple) -> tuple:
    """Rows bucketed to a power of two (at least 256, one canvas) so a new batch size rarely retunes."""
    rows_bucket = max(256, triton.next_power_of_2(max(planned_rows, 1)))
    v_bucket = triton.next_power_of_2(max(v_local, 1))
    return (rows_bucket, hidden, v_bucket, logits_dtype, embed_dtype) + masks


def _wgmma_module():
    """``soft_embedding_wgmma`` where this Triton has the Gluon API it uses, else None."""
    global _WGMMA
    if _WGMMA is False:
        try:
            from . import soft_embedding_wgmma
            _WGMMA = soft_embedding_wgmma
        except (ImportError, AttributeError):
            _WGMMA = None
    return _WGMMA


_WGMMA: ModuleType | None | bool = False  # False: not looked up yet


def wgmma_config(module, tile: tuple[int, int], logits_dtype: torch.dtype,
                 embed_dtype: torch.dtype) -> TileConfig:
    """The Gluon kernel's ``TileConfig`` on output tile ``tile`` (``soft_embedding_wgmma``'s
    ``WIDE`` or ``TALL``): what its schedule and split-K merge are planned with."""
    return TileConfig(tile[0], tile[1], module.BLOCK_K, module.NUM_WARPS,
                      module.stages_for(logits_dtype, embed_dtype, tile=tile))


def _launch_wgmma(module, logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value,
                  out, keep, threshold, out_index, vocab_start, sms, planned_rows, *,
                  operand: dict | None = None):
    """The Gluon kernel on the same schedule as the Triton one (whole tiles in waves, a split-K
    tail), the same compaction of kept rows and the same split-K merge. ``operand``: the
    arguments of ``soft_embedding_operand.operand_in_place`` besides the rows (its masks and
    softcap): the operand is first written over the kept rows, then multiplied as it is."""
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    tile = module.tile_shape(operand is not None, n_rows)
    cfg = wgmma_config(module, tile, logits.dtype, embed_weight.dtype)
    plan = _plan(n_rows, planned_rows, keep, hidden, v_local, cfg, sms, logits.device,
                 MIN_K_BLOCKS_PER_PIECE)
    placeholder = inv_t
    scratch = (torch.empty(plan.scratch_elems, dtype=torch.float32, device=logits.device)
               if plan.scratch_elems else placeholder)
    row_order, kept_count = _kept_first(keep)
    if operand is not None:
        from .soft_embedding_operand import operand_in_place

        operand_in_place(logits, row_request, inv_t, lse, row_order=row_order,
                         kept_count=kept_count, threshold=threshold, vocab_start=vocab_start,
                         v_local=v_local, **operand)
        threshold = None  # applied
    module.launch(logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out,
                  row_order=row_order, kept_count=kept_count, threshold=threshold,
                  out_index=out_index, vocab_start=vocab_start, plan=plan, scratch=scratch,
                  placeholder=placeholder, tile=tile, p_given=operand is not None)
    merge_split(plan, cfg, out, out_index, scratch, row_order, kept_count, norm_tensor,
                 norm_value, n_rows, hidden, placeholder)


def _plan(n_rows: int, planned_rows: int | None, keep, hidden: int, v_local: int, cfg: TileConfig,
          sms: int, device: torch.device, min_k_blocks: int):
    """The schedule of a launch: ``plan_split`` for ``planned_rows`` (every row without
    ``keep``, or the caller's count of kept rows), or with ``keep`` and no count
    ``plans_by_count``, the plan of every count, read on the device by the kept count there."""
    if keep is not None and planned_rows is None:
        return plans_by_count(n_rows, hidden, v_local, cfg, sms, device, min_k_blocks)
    return plan_split(n_rows, n_rows if planned_rows is None else planned_rows, hidden, v_local,
                      cfg, sms, min_k_blocks=min_k_blocks)


def _kept_first(keep: torch.Tensor | None):
    """(row order, kept count): the kept rows first, in row order (``kept_rows.kept_first``),
    and their number as a ``[1]`` int32 tensor that stays on the device (no sync); (None, None)
    without ``keep``."""
    if keep is None:
        return None, None
    return kept_first(keep)


def gemm_name(capability: tuple[int, int] | None) -> str:
    """The soft-embedding GEMM a call with 16-bit E and no allowed mask runs on a CUDA device of
    ``capability`` (None: unknown): the Gluon wgmma kernel on Hopper where this Triton has the
    Gluon API, else the portable Triton kernel."""
    if capability is not None and capability[0] == 9 and _wgmma_module() is not None:
        return "Gluon wgmma soft-embedding GEMM"
    return "Triton soft-embedding GEMM"


def _check_inputs(logits, row_request, temperature, lse, embed_weight, keep, threshold, allowed,
                  vocab_start, out, out_index, num_kept) -> None:
    """Cheap asserts at the kernel's boundary; the caller (``dgemma_sampler.ops``, the step)
    validates what a user passes, with clear errors."""
    assert logits.dim() == 2 and logits.dtype in contract.FLOAT_DTYPES, (logits.dtype, logits.shape)
    dev = logits.device
    assert dev.type == "cuda" or interpreting(), \
        f"the Triton soft embedding needs CUDA tensors (or TRITON_INTERPRET=1), got {dev}"
    n_rows, vocab = logits.shape
    assert not (n_rows and vocab) or logits.stride(1) == 1, "logits rows must be contiguous"
    v_local, hidden = embed_weight.shape
    assert embed_weight.dtype in contract.FLOAT_DTYPES, embed_weight.dtype
    assert not (v_local and hidden) or embed_weight.stride(1) == 1, "embed_weight rows must be contiguous"
    assert 0 <= vocab_start and vocab_start + v_local <= vocab, (vocab_start, v_local, vocab)
    for name, t, dtypes, shape in (
        ("row_request", row_request, (torch.int32, torch.int64), (n_rows,)),
        ("temperature", temperature, contract.FLOAT_DTYPES, (temperature.shape[0],)),
        ("lse", lse, (torch.float32,), (n_rows,)),
        ("keep", keep, (torch.bool,), (n_rows,)),
        ("threshold", threshold, (torch.float32,), (n_rows,)),
        ("allowed", allowed, (torch.bool,), (temperature.shape[0], vocab)),
        ("out_index", out_index, (torch.int64,), (n_rows,)),
    ):
        if t is None:
            continue
        assert t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}"
        assert tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}"
        assert t.device == dev, f"{name} must be on {dev}, got {t.device}"
    assert allowed is None or not allowed.numel() or allowed.stride(1) == 1, "allowed rows must be contiguous"
    if out is not None:
        assert out.dtype == torch.float32 and out.dim() == 2 and out.shape[1] == hidden, \
            f"out must be [M, {hidden}] fp32, got {out.dtype} {tuple(out.shape)}"
        assert out_index is not None or out.shape[0] == n_rows, "out must have a row per logits row"
        assert not out.numel() or out.stride(1) == 1, "out rows must be contiguous"
    assert out_index is None or out is not None, "out_index needs out, the buffer it indexes"
    assert num_kept is None or 0 <= num_kept <= n_rows, num_kept


def soft_embedding_rows(
    logits: torch.Tensor,
    row_request: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    *,
    keep: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    out_index: torch.Tensor | None = None,
    num_kept: int | None = None,
    config: TileConfig | None = None,
    num_sms: int | None = None,
    wgmma: bool | None = None,
    tune: bool = True,
    inv_t: torch.Tensor | None = None,
    logits_scratch: bool = False,
) -> torch.Tensor:
    """Triton twin of ``reference.soft_embedding_rows`` (same arguments, same result; inputs are
    validated by the caller, ``dgemma_sampler.ops``, and only asserted here). The kernel tiles
    rows itself, so unlike the oracle it takes no ``chunk_rows``.

    logits ``[N, V]`` fp32/bf16/fp16 (rows may be strided); row_request ``[N]`` int; temperature
    ``[R]``; lse ``[N]`` fp32; embed_weight ``[V_local, H]`` bf16/fp16/fp32 (fp32 multiplies in
    tf32 on the GPU); keep ``[N]`` bool; threshold ``[N]`` fp32; allowed ``[R, V]`` bool; out
    ``[N, H]`` fp32, rows may be strided (e.g. a view of a slot-indexed state buffer).

    With ``out_index`` ``[N]`` int64, row n is written to ``out[out_index[n]]`` (``out`` is then
    any ``[M, H]`` fp32 buffer, e.g. the flattened slot-indexed soft-embedding state).

    ``num_kept``: optional host-side count of True in ``keep``; it only sizes the schedule (a wrong
    count is still correct, just slower). ``config`` / ``num_sms`` override tuning (tests, bench).
    ``wgmma``: the Gluon kernel of ``soft_embedding_wgmma.py`` (Hopper, the common case); None:
    where it applies and no ``config`` is given, False: never, True: always (an error where it
    does not apply). ``tune`` False: the first tile config that fits, unchecked for register
    spills (``_pick_config``). ``dgemma_sampler.ops`` sets both from the environment (``envs``).
    ``inv_t``: ``contract.inverse_temperature(temperature)`` where the caller has it (a step
    computes it once for its soft-embedding kernels).
    ``logits_scratch``: the caller owns ``logits`` and reads no kept row's columns
    ``[vocab_start, vocab_start + V_local)`` afterwards. On Hopper, with logits in E's dtype,
    the operand is then written over them (``soft_embedding_operand``) and the Gluon kernel
    multiplies it without a prologue, masks and softcap included: the same result, faster.
    """
    _check_inputs(logits, row_request, temperature, lse, embed_weight, keep, threshold, allowed,
                  vocab_start, out, out_index, num_kept)
    assert softcap is None or 0 < softcap < float("inf"), softcap
    norm_tensor, norm_value = contract.split_normalizer(normalizer, logits.device)
    n_rows = logits.shape[0]
    v_local, hidden = embed_weight.shape
    dev = logits.device
    if out is None:
        out = torch.empty(n_rows, hidden, dtype=torch.float32, device=dev)
    if n_rows == 0 or hidden == 0:
        return out

    if inv_t is None:
        inv_t = contract.inverse_temperature(temperature)
    contract.check_inverse_temperature(inv_t, temperature)
    sms = num_sms if num_sms is not None else contract.sm_count(dev)
    module = _wgmma_module() if wgmma or (wgmma is None and dev.type == "cuda") else None
    # A given operand where the caller allows it (it takes the masks and the softcap too).
    given = logits_scratch and module is not None and module.supported(
        logits, embed_weight, vocab_start, allowed, softcap, p_given=True)
    fits = given or (module is not None
                     and module.supported(logits, embed_weight, vocab_start, allowed, softcap))
    if wgmma is None:
        wgmma = fits and config is None
    elif wgmma and not fits:
        raise ValueError("the wgmma soft embedding does not support this call (see "
                         "soft_embedding_wgmma.supported)")
    planned_rows = None if keep is None else num_kept  # None: every row, or the device's count
    if wgmma:
        _launch_wgmma(module, logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value,
                      out, keep, threshold, out_index, vocab_start, sms, planned_rows,
                      operand=dict(allowed=allowed, softcap=softcap) if given else None)
        return out

    row_order, kept_count = _kept_first(keep)
    interpret = interpreting()

    def launch(cfg: TileConfig):
        plan = _plan(n_rows, planned_rows, keep, hidden, v_local, cfg, sms, dev,
                     1 if interpret else MIN_K_BLOCKS_PER_PIECE)
        return launch_portable(
            logits, row_request, inv_t, lse, embed_weight, norm_tensor, norm_value, out, cfg=cfg,
            plan=plan, row_order=row_order, kept_count=kept_count, threshold=threshold,
            allowed=allowed, out_index=out_index, vocab_start=vocab_start, softcap=softcap,
            keep=keep)

    if config is None:
        if dev.type != "cuda":
            config = INTERPRETER_CONFIG
        else:
            masks = (keep is not None, threshold is not None, allowed is not None, softcap is not None)
            key = tuning_key(n_rows if planned_rows is None else planned_rows, hidden, v_local,
                             logits.dtype, embed_weight.dtype, masks)
            candidates = gpu_candidates(logits.dtype, embed_weight.dtype, allowed is not None)
            config = _pick_config(key, candidates, launch, tune)
    launch(config)
    return out
