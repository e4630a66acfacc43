"""Tensor parallelism: row statistics and soft embedding over a vocabulary-sharded logits tensor.

Under tensor parallelism rank ``r`` holds the logits of the vocabulary slice
``[vocab_start_r, vocab_end_r)`` only (slices may be uneven, empty, and need not follow
rank order; together they partition ``[0, vocab_size)``). Upstream gathers the full
``[rows, V]`` logits on every rank before sampling. Here the logits stay local: each rank
computes the statistics of its slice and the ranks exchange O(1) numbers per row in ONE
``all_gather`` per step, from which every rank derives the single-GPU answer.

Merging the partials of one row (``r`` over the ranks whose slice kept an entry, i.e.
whose local ``lse_r > -inf``)::

    lse      = logsumexp_r(lse_r)
    w_r      = exp(lse_r - lse)                 # share of the probability on rank r
    entropy  = sum_r w_r * (H_r - (lse_r - lse))

The entropy identity is the chain rule ``H = sum_r w_r H_r + H(w)``; written with
``log w_r = lse_r - lse`` (never ``log(exp(...))``) every term is non-negative, so nothing
cancels. It is evaluated in float64 from the fp32 partials, with ``lse_r`` split into the
slice maximum ``m_r`` and log-partition ``L_r = lse_r - m_r``. When ``|m_r|`` is huge (T = 0
multiplies by 1e10) the fp32 ``lse_r`` no longer resolves ``L_r``: a 3-way tie at the top has
``L_r = log 3`` but ``lse_r == m_r``. In that regime every entry but the tied maxima
underflows, so ``H_r = L_r`` exactly; the merge takes ``L_r = H_r`` whenever ``m_r + H_r``
agrees with ``lse_r`` to about two fp32 ulps (then ``H_r`` is within a few ulps of the true
``L_r`` in any case), else ``lse_r - m_r``. The remaining error is about ``2^-24 |max z|``
nats (< 5e-6 at softcap 30, T >= 0.4); it exceeds 1e-5 only for 0 < T << 1 rows whose
non-maximal entries do not all underflow. Exporting ``m`` and ``log Z`` from the
row-statistics pass would remove it.

``argmax`` is the lowest global id among the ranks' local argmaxes whose ``z`` is the
largest, which is exactly "lowest id of the largest z" over the whole row. ``sample`` is
the same with the key of the local winner's sampling block, ``lse_b + G_b`` (reference
step 5): the two-stage draw of the row is the winner of the ranks' draws, because every
slice starts on a sampling-block boundary (``vocab_start`` a multiple of ``sample_block``,
checked), so each block lies on one rank, whose local pass (``vocab_offset =
vocab_start``) computes the same block key and the same in-block Gumbel-max as one GPU.
Greedy rows (T == 0) take the merged argmax. The ``z`` of a local argmax is recomputed here
from one gathered logit per row with the fp32 operations of ``reference.py``, and the block
key comes from the local pass; a backend whose ``tanh`` / ``log`` differ by an ulp can
resolve a cross-rank near-tie within an ulp differently than one GPU (the only documented
difference; exact ties always go to the lowest global id).

A row that no rank kept (every entry masked) gives argmax = sample = 0, entropy = 0,
lse = -inf, as on one GPU; ``has_nan`` is OR-ed over the ranks.

The soft embedding needs no new math: ``normalizer * sum_v p_v E[v]`` is a sum over the
vocabulary, so each rank computes its slice's term with the *global* lse (already scaled by
the normalizer, which is linear) and one fp32 ``all_reduce`` sums them.

top-k / top-p / allowed-token sets are not supported under tensor parallelism (their
thresholds would need a distributed selection); vLLM itself refuses constrained reads
with tensor parallelism. They raise ``NotImplementedError``.

The public functions check their arguments as ``ops`` does (``checks.py``: TypeError /
ValueError naming the argument, before any work or collective), except
``row_stats_rows_sharded``: it is the decode step's statistics function, called with
arguments the step built, and stays unchecked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops, reference, support
from .backend import kernels
from .checks import int_range, need_int
from .kernels.contract import ROW_STATS
from .reference import FLT_MAX, RowStats

# Columns of the packed per-row partials (int32; fp32 values travel as their bit patterns,
# so the exchange is exact and one tensor of one dtype carries everything): the keys the
# "winner" rules compare, then every statistic that ``contract.ROW_STATS`` merges across ranks.
KEYS = ("z_max", "sample_key")
PACKED = tuple(f for f in ROW_STATS if not f.merge.startswith("none:"))
COLUMN = {name: i for i, name in enumerate(KEYS + tuple(f.name for f in PACKED))}
NUM_FIELDS = len(COLUMN)

_TP_UNSUPPORTED = (
    "{name} is not supported with a vocabulary-sharded (tensor-parallel) sampler: its "
    "threshold would need a distributed selection over the whole vocabulary. vLLM refuses "
    "constrained reads under tensor parallelism as well; run these requests with "
    "tensor_parallel_size=1 or gather the logits first."
)


def vocab_slice(vocab_size: int, rank: int, world_size: int,
                sample_block: int = reference.SAMPLE_BLOCK) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s share: whole sampling blocks, split as evenly as possible.

    Slices start on sampling-block boundaries (what the sharded statistics require); the
    first ranks hold one block more, the last slice ends at ``vocab_size``, and a rank can
    get nothing when there are fewer blocks than ranks. (vLLM pads each partition to a
    multiple of 64 instead, which is a block boundary only for some vocabulary sizes; any
    block-aligned partition works with this module.)
    """
    vocab_size = int_range("vocab_size", vocab_size, 1)
    world_size = int_range("world_size", world_size, 1)
    rank = int_range("rank", rank, 0, world_size)
    reference.check_sample_block(sample_block)
    sample_block = int(sample_block)
    blocks = -(-vocab_size // sample_block)
    base, extra = divmod(blocks, world_size)
    first = rank * base + min(rank, extra)
    last = first + base + (1 if rank < extra else 0)
    return min(first * sample_block, vocab_size), min(last * sample_block, vocab_size)


def world_size_of(group=None) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialized (no group at all)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(group)


def _check_slice(v_local: int, vocab_start: int, vocab_size: int, world: int) -> None:
    need_int("vocab_start", vocab_start)
    need_int("vocab_size", vocab_size)
    if not (0 < vocab_size < 2**31):
        raise ValueError(f"vocab_size must be in [1, 2^31), got {vocab_size}")
    if not (0 <= vocab_start and vocab_start + v_local <= vocab_size):
        raise ValueError(
            f"local logits hold vocabulary [{vocab_start}, {vocab_start + v_local}), which is not "
            f"inside [0, vocab_size={vocab_size}); cut padding columns off the local logits"
        )
    if world == 1 and (vocab_start != 0 or v_local != vocab_size):
        raise ValueError(
            f"with one rank the local logits must hold the whole vocabulary [0, {vocab_size}), "
            f"got [{vocab_start}, {vocab_start + v_local})"
        )


def _f32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().view(torch.int32)


def _bits_f32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.float32)


def _pack(t: torch.Tensor) -> torch.Tensor:
    """A statistic as an int32 column: fp32 by its bits, integers and flags by value (token
    ids fit int32: ``row_stats`` refuses vocabularies past it)."""
    return _f32_bits(t) if t.dtype.is_floating_point else t.to(torch.int32)


def _unpack(column: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _bits_f32(column) if dtype.is_floating_point else column.to(dtype)


def local_row_partials(
    local_logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    *,
    vocab_start: int,
    softcap: float | None = None,
    backend: str = "auto",
    sample_block: int = reference.SAMPLE_BLOCK,
) -> tuple[torch.Tensor, RowStats | None]:
    """Statistics of this rank's vocabulary slice, packed as ``[R * W, NUM_FIELDS]`` int32.

    Returns the packed partials and the local ``RowStats`` (flat rows, global ids; None for
    an empty slice). An empty slice packs as an all-masked one (lse = -inf).
    """
    _check_local(local_logits, temperature, seeds, draws, softcap)
    vocab_start = int_range("vocab_start", vocab_start, 0)
    ops.resolve_backend(backend, local_logits.device)
    reference.check_sample_block(sample_block)
    flat, request, position = ops._flat_rows(local_logits)
    return _local_partials_rows(flat, request, position, temperature, seeds, draws,
                                vocab_start=vocab_start, softcap=softcap, backend=backend,
                                sample_block=int(sample_block))


def _check_local(local_logits, temperature, seeds, draws, softcap) -> None:
    """A rank's ``[R, W, V_local]`` logits slice (``V_local`` may be 0) and its request
    parameters, as ``ops.row_stats`` checks the whole logits."""
    ops.check_tensor("local_logits", local_logits, dim=3, dtypes=ops.FLOAT_DTYPES)
    if local_logits.numel() and local_logits.stride(2) != 1:
        raise ValueError("local_logits must be contiguous in the vocabulary dimension")
    ops._check_request_params(local_logits, temperature, seeds, draws, None, None, None)
    ops._check_softcap(softcap)


def _local_partials_rows(flat, request, position, temperature, seeds, draws, *, vocab_start,
                         softcap, backend, sample_block=reference.SAMPLE_BLOCK, inv_t=None):
    """``local_row_partials`` on flat rows ``[N, V_local]`` with their request / position
    (``inv_t``: the requests' inverse temperature, None: computed here)."""
    n, v_local = flat.shape
    device = flat.device
    reference.check_sample_block(sample_block)
    if vocab_start % sample_block:
        raise ValueError(
            f"a vocabulary slice must start on a sampling-block boundary: vocab_start "
            f"{vocab_start} is not a multiple of sample_block {sample_block} (the sample would "
            f"differ from one GPU's)"
        )
    if v_local == 0:
        packed = torch.zeros(n, NUM_FIELDS, dtype=torch.int32, device=device)
        neg_inf = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        for col in (COLUMN["z_max"], COLUMN["sample_key"], COLUMN["lse"]):
            packed[:, col] = _f32_bits(neg_inf)
        return packed, None
    run = kernels(ops.resolve_backend(backend, device)).row_stats_rows
    sample_key = torch.empty(n, dtype=torch.float32, device=device)
    if inv_t is None:
        inv_t = reference.inverse_temperature(temperature)
    stats = run(flat, request, position, temperature, seeds, draws, softcap=softcap,
                vocab_offset=vocab_start, sample_block=sample_block, sample_key=sample_key,
                inv_t=inv_t)

    # z of the local argmax, recomputed from one logit per row with the fp32 operations of
    # reference.py: the kernel does not export it, and one gathered logit per row costs
    # nothing next to the pass over the slice.
    row_inv_t = inv_t[request.to(torch.int64)]

    def z_of(token: torch.Tensor) -> torch.Tensor:
        local = (token - vocab_start).clamp(0, v_local - 1)  # all-masked rows: ignored later
        x = flat.gather(1, local.unsqueeze(1)).squeeze(1)
        return torch.clamp(reference.softcapped(x, softcap) * row_inv_t, max=FLT_MAX)

    keys = {"z_max": z_of(stats.argmax), "sample_key": sample_key}
    columns = [_f32_bits(keys[k]) for k in KEYS]
    columns += [_pack(getattr(stats, f.name)) for f in PACKED]
    return torch.stack(columns, dim=1), stats


def row_stats_rows_sharded(logits: torch.Tensor, *rows: torch.Tensor, vocab_start: int,
                           vocab_end: int, **kwargs) -> RowStats:
    """Flat-row statistics (the decode step's row statistics) computed from one vocabulary slice.

    ``logits`` are the full-vocabulary rows ``[N, V]`` that vLLM hands every rank after its
    logits gather; this rank reads only columns ``[vocab_start, vocab_end)`` and the ranks
    merge their partials with one all_gather, so each rank streams ``1 / world`` of the
    logits. ``rows`` (row request, row position, temperature, seeds, draws) and ``kwargs`` are
    ``row_stats_rows_local``'s. Returns the single-GPU ``RowStats`` (global ids), identical on
    every rank.
    """
    return row_stats_rows_local(logits[:, vocab_start:vocab_end], *rows, vocab_start=vocab_start,
                                **kwargs)


def row_stats_rows_local(
    local_logits: torch.Tensor,
    row_request: torch.Tensor,
    row_position: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    *,
    vocab_start: int,
    group=None,
    softcap: float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    backend: str = "auto",
    sample_block: int = reference.SAMPLE_BLOCK,
    inv_t: torch.Tensor | None = None,
) -> RowStats:
    """Flat-row statistics of the full vocabulary from this rank's logits alone: ``local_logits``
    ``[N, V_local]`` are vocabulary ids ``[vocab_start, vocab_start + V_local)`` (a multiple of
    ``sample_block``), e.g. this rank's slice of the LM head applied to hidden states, never
    gathered. The ranks merge their packed partials with one all_gather. Returns the single-GPU
    ``RowStats`` (global ids), identical on every rank. ``inv_t``: the requests'
    ``inverse_temperature`` where the caller has it already."""
    _reject_constraints(top_k=top_k, top_p=top_p, allowed=allowed)
    packed, stats = _local_partials_rows(local_logits, row_request, row_position, temperature,
                                         seeds, draws, vocab_start=vocab_start, softcap=softcap,
                                         backend=backend, sample_block=sample_block, inv_t=inv_t)
    return _merge_ranks(packed, stats, temperature, row_request, world_size_of(group), group)


def _merge_ranks(packed, local, temperature, row_request, world, group) -> RowStats:
    """The single-GPU flat-row statistics from this rank's packed partials.

    One rank: its own statistics. Otherwise one all_gather and the merge; with no rows every
    rank skips the collective together (they all have the same rows).
    """
    if world == 1:
        return local  # the slice is the whole vocabulary
    if packed.shape[0] == 0:
        return merge_row_partials(packed.unsqueeze(0), packed.new_zeros(0, dtype=torch.bool))
    gathered = _all_gather_rows(packed, world, group)
    greedy = (temperature.to(torch.float32) == 0)[row_request.to(torch.int64)]
    return merge_row_partials(gathered, greedy)


def merge_row_partials(gathered: torch.Tensor, greedy: torch.Tensor) -> RowStats:
    """Single-GPU row statistics from every rank's packed partials.

    ``gathered`` ``[world, N, NUM_FIELDS]`` int32 (any rank order), ``greedy`` ``[N]`` bool
    (T == 0). Returns flat ``[N]`` RowStats (threshold -inf: no top-k / top-p under TP).
    """
    ops.check_tensor("gathered", gathered, dim=3, dtypes=(torch.int32,))
    world, n, fields = gathered.shape
    if fields != NUM_FIELDS:
        raise ValueError(f"gathered partials must have {NUM_FIELDS} fields, got {fields}")
    if world < 1:
        raise ValueError("gathered must hold the partials of at least one rank, got shape "
                         f"{tuple(gathered.shape)}")
    ops.check_tensor("greedy", greedy, dtypes=(torch.bool,), device=gathered.device, shape=(n,))
    neg_inf = float("-inf")
    column = {name: gathered[..., i] for name, i in COLUMN.items()}
    lse_r = _bits_f32(column["lse"])
    # NaN lse (degenerate input) stays "kept" so it propagates as it would on one GPU.
    kept = lse_r != neg_inf
    any_kept = kept.any(dim=0)
    lse, entropy = _merge_lse_entropy(lse_r, _bits_f32(column["z_max"]),
                                      _bits_f32(column["entropy"]), kept, any_kept)

    def winner(key: str, name: str) -> torch.Tensor:
        # Largest key, ties to the lowest global id; ranks that kept nothing never win.
        score = torch.where(kept, _bits_f32(column[key]), neg_inf)
        best = score.max(dim=0).values
        ids = column[name].to(torch.int64)
        candidate = kept & (score == best)
        picked = torch.where(candidate, ids, torch.iinfo(torch.int64).max).min(dim=0).values
        return torch.where(any_kept, picked, 0)

    merged = {}
    for stat in ROW_STATS:
        rule, _, arg = stat.merge.partition(":")
        if rule == "lse":
            value = lse
        elif rule == "entropy":
            value = entropy
        elif rule == "winner":
            value = winner(arg, stat.name)
        elif rule == "none":
            value = torch.full((n,), float(arg), device=gathered.device)
        else:
            parts = _unpack(column[stat.name], stat.dtype)
            value = {"any": lambda t: t.any(dim=0), "max": lambda t: t.amax(dim=0),
                     "min": lambda t: t.amin(dim=0)}[rule](parts)
        merged[stat.name] = value.to(stat.dtype)
    # A greedy row (T == 0) samples its argmax, as on one GPU.
    merged["sample"] = torch.where(greedy, merged["argmax"], merged["sample"])
    return RowStats(**merged)


def _merge_lse_entropy(lse_r, m_r, h_r, kept, any_kept):
    """The rows' lse and entropy from every rank's lse, slice maximum and entropy (module
    docstring), in float64."""
    neg_inf = float("-inf")
    # lse and entropy in float64 from each slice's max m_r and log-partition L_r = log Z_r,
    # relative to M = max_r m_r so that nothing large is added to something small (near
    # FLT_MAX, where +inf logits clamp, log(total) would vanish next to lse even in fp64).
    m_r = torch.where(kept, m_r.double(), neg_inf)
    lse64 = lse_r.double()
    h_r = h_r.double()
    big_m = torch.where(any_kept, m_r.max(dim=0).values, 0.0)
    # L_r = lse_r - m_r loses everything below half an ulp of the fp32 lse_r: at T = 0
    # (z = x * 1e10) a 3-way tie has L_r = log 3 and lse_r = m_r exactly. Then H_r is the
    # exact L_r (H = L - E[z - m], and every entry but the tied maxima underflows). H_r is
    # used whenever it is consistent with lse_r, where it is within a few ulps of L_r.
    slack = (lse64.abs() + m_r.abs() + h_r.abs()) * 2.0**-23
    from_entropy = ((m_r + h_r) - lse64).abs() <= slack
    log_z = torch.where(from_entropy, h_r, lse64 - m_r)
    d_r = torch.where(kept, (m_r - big_m) + log_z, neg_inf)
    top = torch.where(any_kept, d_r.max(dim=0).values, 0.0)
    log_total = torch.log(torch.exp(d_r - top).sum(dim=0))  # total >= 1 where any_kept
    lse = torch.where(any_kept, big_m + (top + log_total), neg_inf)
    log_w = torch.where(kept, (d_r - top) - log_total, 0.0)  # log of rank r's probability share
    entropy = torch.where(kept, torch.exp(log_w) * (h_r - log_w), 0.0).sum(dim=0)
    return lse, torch.where(any_kept, entropy, 0.0)


def _all_gather_rows(packed: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[N, F]`` on every rank -> ``[world, N, F]`` (group rank order), one collective."""
    n, fields = packed.shape
    # The concatenated output form is the one every backend accepts (gloo rejects the
    # stacked form). Newer torch renamed the call all_gather_single and deprecates the
    # old name, which older releases (the GPU machine's) still need.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = packed.new_empty((world * n, fields))
    gather(out, packed.contiguous(), group=group)
    return out.view(world, n, fields)


def _reject_constraints(**constraints) -> None:
    for name, value in constraints.items():
        if value is not None:
            raise NotImplementedError(_TP_UNSUPPORTED.format(name=name))


def row_stats_sharded(
    local_logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draws: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    softcap: float | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    backend: str = "auto",
    sample_block: int = reference.SAMPLE_BLOCK,
) -> RowStats:
    """``ds.row_stats`` of the full-vocabulary logits, from this rank's slice and one all_gather.

    Parameters
    ----------
    local_logits : ``[R, W, V_local]`` fp32 / bf16 / fp16, this rank's columns
        ``[vocab_start, vocab_start + V_local)`` of the ``[R, W, vocab_size]`` logits
        (contiguous in V; ``V_local`` may be 0). Every rank passes the same ``R, W``.
    temperature, seeds, draws : ``[R]``, identical on every rank (see ``ds.row_stats``).
    vocab_start, vocab_size : this rank's offset (a multiple of ``sample_block``) and the
        full vocabulary size.
    group : the tensor-parallel process group (None: the default group, or a single
        process when torch.distributed is not initialized).

    Returns ``[R, W]`` RowStats with global token ids, identical on every rank, equal to
    ``ds.row_stats(full_logits, ...)`` (module docstring: exact up to fp32 rounding of lse /
    entropy and ulp-level near-ties between ranks).
    """
    _reject_constraints(top_k=top_k, top_p=top_p, allowed=allowed)
    _check_local(local_logits, temperature, seeds, draws, softcap)
    r, w, v_local = local_logits.shape
    world = world_size_of(group)
    _check_slice(v_local, vocab_start, vocab_size, world)
    vocab_start = int(vocab_start)
    ops.resolve_backend(backend, local_logits.device)
    reference.check_sample_block(sample_block)

    flat, request, position = ops._flat_rows(local_logits)
    packed, local = _local_partials_rows(flat, request, position, temperature, seeds, draws,
                                         vocab_start=vocab_start, softcap=softcap, backend=backend,
                                         sample_block=int(sample_block))
    return _merge_ranks(packed, local, temperature, request, world, group).view(r, w)


def soft_embedding_sharded(
    local_logits: torch.Tensor,
    temperature: torch.Tensor,
    global_lse: torch.Tensor,
    local_embed_weight: torch.Tensor,
    normalizer: torch.Tensor | float,
    *,
    keep: torch.Tensor | None = None,
    group=None,
    softcap: float | None = None,
    threshold: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    tail_eps: float = 0.0,
) -> torch.Tensor:
    """``normalizer * softmax(z) @ E`` over the full vocabulary, from this rank's slice.

    ``local_embed_weight`` ``[V_local, H]`` holds the embedding rows of the same slice as
    ``local_logits`` ``[R, W, V_local]``; ``global_lse`` ``[R, W]`` fp32 is
    ``row_stats_sharded(...).lse``. Each rank computes its slice's share (already scaled by
    the normalizer) and one fp32 all_reduce(sum) adds them. Returns ``[R, W, H]`` fp32,
    identical on every rank, zero where ``keep`` is False.

    ``tail_eps`` (``support.py``): each rank leaves out at most ``tail_eps / world`` of a row's
    mass from its slice, so the reduced sum leaves out at most ``tail_eps``.
    """
    _reject_constraints(threshold=threshold, allowed=allowed)
    ops.check_tensor("local_logits", local_logits, dim=3, dtypes=ops.FLOAT_DTYPES)
    ops.check_tensor("local_embed_weight", local_embed_weight, dim=2, dtypes=ops.FLOAT_DTYPES,
                     device=local_logits.device)
    r, w, v_local = local_logits.shape
    if local_embed_weight.shape[0] != v_local:
        raise ValueError(
            f"local_embed_weight has {local_embed_weight.shape[0]} rows but local_logits hold "
            f"{v_local} vocabulary columns; both must be this rank's slice"
        )
    hidden = local_embed_weight.shape[1]
    ops.check_tensor("global_lse", global_lse, dtypes=(torch.float32,), device=local_logits.device,
                     shape=(r, w))
    ops.check_tail_eps(tail_eps)
    world = world_size_of(group)
    if v_local == 0:
        # ops.soft_embedding checks the other branch's arguments; an empty slice checks its own
        # here, so that every rank refuses the same call before the collective.
        dev = local_logits.device
        ops.check_tensor("temperature", temperature, dim=1, dtypes=ops.FLOAT_DTYPES, device=dev,
                         shape=(r,))
        if keep is not None:
            ops.check_tensor("keep", keep, dtypes=(torch.bool,), device=dev, shape=(r, w))
        ops._check_softcap(softcap)
        normalizer_ok = ops.check_normalizer(normalizer, dev)
        ops.resolve_backend(backend, dev)
        if r:
            ops.check_values(ops.temperature_ok(temperature), *([normalizer_ok] if normalizer_ok else []))
        elif normalizer_ok:
            ops.check_values(normalizer_ok)
        if out is None:
            out = torch.zeros(r, w, hidden, dtype=torch.float32, device=local_logits.device)
        else:
            ops.check_tensor("out", out, dtypes=(torch.float32,), device=local_logits.device,
                             shape=(r, w, hidden))
            out.zero_()
    else:
        # The normalizer is applied once here, to each rank's share; the sum below is linear,
        # so the reduced result carries it exactly once.
        out = ops.soft_embedding(local_logits, temperature, global_lse, local_embed_weight,
                                 normalizer, keep=keep, vocab_start=0, softcap=softcap,
                                 out=out, backend=backend,
                                 tail_eps=support.slice_tail_eps(tail_eps, 1 / world))
    if world > 1 and out.numel():
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
