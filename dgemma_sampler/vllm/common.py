"""What the vLLM adapters of every release share: vLLM's host bookkeeping around ``StepRunner``.

A release's adapter (``v0_33.py``, ``v0_34.py``) is ``FusedSampler`` mixed into that
release's own ``diffusion_gemma.DiffusionSampler``: it inherits vLLM's request setup
(``SamplingParams.extra_args``, staged writes, the prefill-only step, ``num_rejected``,
``profile_run``) and replaces the device work of a decode step with ``runner.StepRunner``:

* no ``[rows, V]`` fp32 copies: top-k / top-p and per-row allowed sets are thresholds and
  masks the kernels apply in registers, logprobs are read from the step's own logits;
* every random number (first canvas, renoise, Gumbel noise, canvas after a commit) is keyed by
  the request's ``SamplingParams.seed`` (vLLM draws a random one when unset) and a per-request
  draw counter, so a seed reproduces a generation and batching does not change it;
* the caller's logits are only read (vLLM masks fp32 logits in place for top-k/top-p).

Only what differs between releases (the step's input: logits or hidden states; the tile
budget) stays in the release's file. ``tests/test_vllm_parity.py`` runs each adapter beside
its release's own sampler step by step; the README lists where they deliberately differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.model_executor.models import diffusion_gemma as _dg
from vllm.v1.outputs import LogprobsTensors

from .. import reference
from ..config import SamplerConfig
from ..head import Projection
from ..keyed_noise import Stream, random_tokens
from ..ops import resolve_backend
from ..runner import LogprobRequest, LogprobRows, StepRunner
from .device import VllmRequestOptions, decode
from .seeds import check_seed

# A child of vLLM's "vllm" logger, whose handler shows it (and whose level gates it).
logger = init_logger("vllm.dgemma_sampler")


def _log_soft_embedding_paths(out: Any) -> None:
    """At DEBUG, the step's soft-embedding rows per path (``StepOutput.sc_path_rows``). Reading
    them is a host sync, so only when the logger would print them."""
    if out.sc_path_rows is None or not logger.isEnabledFor(logging.DEBUG):
        return
    rows = out.sc_path_rows.tolist()
    logger.debug("soft embedding rows: %d not kept, %d top token, %d support, %d dense by the "
                 "statistics, %d dense by the support size", *rows)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


if TYPE_CHECKING:
    class _VllmDiffusionSampler:
        """What ``FusedSampler`` uses of the vLLM ``DiffusionSampler`` it is mixed into, for type
        checkers: at run time the mixin's base is ``object`` and these come from the adapter's
        other base, vLLM's class (``v0_33.py``, ``v0_34.py``)."""

        # Per-slot state: vLLM's diffusion state (the adapter adds ``seeds`` and ``draws``), its
        # sampling parameters, its request drafts and logprob token ids.
        diffusion_states: Any
        sampling_states: Any
        req_states: Any
        logprob_token_ids_state: Any
        # The generation config and the model.
        t_min: float
        t_max: float
        entropy_bound: float
        confidence_threshold: float
        canvas_length: int
        vocab_size: int
        embed_weight: torch.Tensor
        normalizer: torch.Tensor | float
        sc_vocab_start: int  # this rank's self-conditioning slice of the vocabulary
        sc_vocab_end: int
        tp_size: int
        tp_group_name: str
        logits_mode: bool  # logprobs_mode reports logits (raw or processed), not logprobs
        # Step outputs and the logprob stash.
        _sampled: torch.Tensor
        _num_sampled: torch.Tensor
        _pending_logprobs: dict[int, LogprobsTensors]

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def add_request(self, req_idx: int, sampling_params: Any) -> None: ...

        def _handle_prefill(self, input_batch: Any, device: torch.device, /) -> Any: ...

        def _build_output(self, input_batch: Any, sampled: torch.Tensor, num_sampled: torch.Tensor,
                          nlogits_np: np.ndarray, device: torch.device, /, *,
                          logprobs_tensors: Any) -> Any: ...
else:
    _VllmDiffusionSampler = object


class FusedSampler(_VllmDiffusionSampler):
    """The release-independent part of ``FusedDiffusionSampler`` (mixed in before vLLM's
    ``DiffusionSampler``, whose constructor arguments it passes through)."""

    def __init__(self, *args: Any, backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        states = self.diffusion_states
        # The keys of the keyed noise, beside vLLM's own per-slot tensors.
        states.seeds = torch.zeros(states.max_num_reqs, dtype=torch.int64, device=states.device)
        states.draws = torch.zeros(states.max_num_reqs, dtype=torch.int64, device=states.device)
        self.cfg = SamplerConfig(
            t_min=self.t_min, t_max=self.t_max, entropy_bound=self.entropy_bound,
            confidence_threshold=self.confidence_threshold,
            stability_threshold=states.stability_threshold - 1,
            max_denoising_steps=states.max_denoising_steps, canvas_length=self.canvas_length,
        )
        self.backend = resolve_backend(backend, states.device)
        self.options = VllmRequestOptions(self.sampling_states, states, self.vocab_size)
        self.runner = StepRunner(
            self.cfg, states, self.options,
            self.embed_weight[: self.sc_vocab_end - self.sc_vocab_start], self.normalizer,
            backend=self.backend, vocab_size=self.vocab_size, vocab_start=self.sc_vocab_start,
            sc_reduce=self._all_reduce if self.tp_size > 1 else None,
            tp_group=self._tp_device_group() if self.tp_size > 1 else None,
        )
        self.logprobs_fn = self.runner.logprobs_fn

    # ------------------------------------------------------------------ requests
    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        """vLLM's request setup, plus the keys of the keyed noise.

        The one parameter the adapter adds, ``SamplingParams.seed``, is checked here, before
        anything changes (``seeds.check_seed``; the plugin also refuses a bad seed at
        admission). The ``diffusion_*`` keys of ``extra_args`` are vLLM's and read by vLLM's
        own ``add_request``, unchanged: vLLM checks them at admission
        (``vllm.utils.diffusion.validate_diffusion_sampling_params``: types, canvas width,
        seed-canvas length and ids, pin positions, a positive step cap, read-only and
        constrained as a bool or 0/1) and then converts with ``int()`` and truthiness. What it
        still accepts silently we accept too: a ``diffusion_max_steps`` above the server's
        step count is lowered to it, ``diffusion_read_only`` / ``diffusion_constrained`` may be
        0 / 1, and a request object built without admission (``add_request`` called directly)
        is converted rather than refused.
        """
        check_seed(getattr(sampling_params, "seed", None))
        super().add_request(req_idx, sampling_params)
        states = self.diffusion_states
        states.seeds[req_idx] = int(self.sampling_states.seeds.np[req_idx])
        states.draws[req_idx] = 0
        self.options.generation += 1  # cached tile plans hold this slot's options

    def _finish_prefills(self, input_batch: Any, prefill_indices_np: np.ndarray) -> None:
        """Requests whose last prompt chunk runs now get a keyed first canvas and denoise next."""
        states = self.diffusion_states
        prompt_done = (
            input_batch.num_computed_prefill_tokens_np[prefill_indices_np]
            + input_batch.num_scheduled_tokens[prefill_indices_np]
            >= input_batch.prefill_len_np[prefill_indices_np]
        )
        done_np = input_batch.idx_mapping_np[prefill_indices_np[prompt_done]]
        if len(done_np) == 0:
            return
        done = _to_device(done_np.astype(np.int64), states.is_encoder_phase.device)
        pos = torch.arange(self.canvas_length, device=done.device)
        states.canvas[done] = random_tokens(
            states.seeds[done].unsqueeze(1), states.draws[done].unsqueeze(1), pos.unsqueeze(0),
            Stream.CANVAS, self.vocab_size)
        states.apply_seed_canvases(done_np, done)
        self.req_states.draft_tokens[done, : self.canvas_length] = states.canvas[done]
        states.is_encoder_phase.index_fill_(0, done, False)

    # ------------------------------------------------------------------ the step
    def _sample(self, rows: torch.Tensor, input_batch: Any, *,
                projection: Callable[[np.ndarray], tuple[Projection, int]] | None = None) -> Any:
        """A whole step of vLLM's sampler: ``rows`` are logits, or hidden states projected a tile
        at a time by the ``Projection`` that ``projection(decode_slots)`` picks for this step
        (with the number of columns it makes)."""
        if input_batch.num_draft_tokens == 0:
            return self._handle_prefill(input_batch, rows.device)
        num_reqs = input_batch.num_reqs
        slots_np = input_batch.idx_mapping_np[:num_reqs]
        nlogits_np = np.diff(input_batch.cu_num_logits_np[: num_reqs + 1])
        decode_idx_np = np.flatnonzero(nlogits_np > 0)
        prefill_idx_np = np.flatnonzero(nlogits_np == 0)
        if len(prefill_idx_np):
            self._finish_prefills(input_batch, prefill_idx_np)

        sampled = self._sampled[:num_reqs]
        num_sampled = self._num_sampled[:num_reqs]
        sampled.zero_()
        num_sampled.zero_()
        logprobs_tensors = None
        if len(decode_idx_np):
            self._decode(rows, input_batch, slots_np, nlogits_np, decode_idx_np, sampled,
                         num_sampled, projection)
            logprobs_tensors = self._emit_logprobs(slots_np, num_sampled, num_reqs)
        return self._build_output(input_batch, sampled, num_sampled, nlogits_np, rows.device,
                                  logprobs_tensors=logprobs_tensors)

    def _decode(self, rows, input_batch, slots_np, nlogits_np, decode_idx_np, sampled,
                num_sampled, projection) -> None:
        column_tokens = self.diffusion_states.step_allowed  # a shared set: [rows, K] logits
        decode_slots_np = slots_np[decode_idx_np].astype(np.int64)
        vocab = self.vocab_size if column_tokens is None else column_tokens.numel()
        tile_projection = None
        if projection is not None:
            tile_projection, vocab = projection(decode_slots_np)
        out = decode(
            self.runner, rows, decode_slots=decode_slots_np, decode_idx=decode_idx_np,
            valid=nlogits_np[decode_idx_np], column_tokens=column_tokens, vocab=vocab,
            sampled=sampled, num_sampled=num_sampled, draft_tokens=self.req_states.draft_tokens,
            all_slots=input_batch.idx_mapping[: input_batch.num_reqs],
            projection=tile_projection,
            logprobs=self._logprob_request(slots_np, decode_slots_np, column_tokens))
        _log_soft_embedding_paths(out)

    # ------------------------------------------------------------------ tensor parallelism
    @staticmethod
    def _tp_device_group() -> Any:
        """vLLM's tensor-parallel process group, over which the runner merges per-row partials
        of the statistics (``tensor_parallel``)."""
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().device_group

    def _all_reduce(self, t: torch.Tensor) -> None:
        t.copy_(torch.ops.vllm.all_reduce(t, group_name=self.tp_group_name))

    # ------------------------------------------------------------------ logprobs
    def _logprob_columns(self, slots_np: np.ndarray) -> tuple[int, int] | None:
        """``(top-n, most requested ids)`` over every request of the batch (prefilling ones
        too, as vLLM counts them), or None when no request of the batch wants logprobs."""
        max_num_logprobs = self.sampling_states.max_num_logprobs(slots_np)
        max_token_ids = self.logprob_token_ids_state.max_num_token_ids(slots_np)
        if max_num_logprobs < 0 and max_token_ids <= 0:
            return None
        return max(max_num_logprobs, 0), max_token_ids

    def _logprob_request(self, slots_np, decode_slots_np,
                         column_tokens: torch.Tensor | None) -> LogprobRequest | None:
        """Logprobs of the requests converging now, kept until they emit (vLLM's stash).

        Once the batch wants logprobs every converging request gets a stash, whether it asked
        or not (the output processor drops what was not asked for). Rows are the masked,
        temperature-scaled logits of this step; read-only requests report temperature 1.
        """
        columns = self._logprob_columns(slots_np)
        if columns is None:
            return None
        num_logprobs, max_token_ids = columns

        def build(slot: int, r: LogprobRows) -> LogprobsTensors:
            if column_tokens is not None:
                return self._shared_set_logprobs(r, column_tokens)
            return self._vocab_logprobs(r, slot, num_logprobs, max_token_ids)

        return LogprobRequest(slots=set(decode_slots_np.tolist()), build=build,
                              stash=self._pending_logprobs)

    def _shared_set_logprobs(self, r: LogprobRows, column_tokens: torch.Tensor) -> LogprobsTensors:
        """A step over one shared allowed set (logits ``[k, K]``): every allowed id,
        renormalised over the set, after the argmax column (vLLM's layout: ``1 + K`` wide,
        always logprobs, also in a logits mode)."""
        k = r.rows.shape[0]
        # Column of each argmax id: the set keeps the request's order (it is not sorted), and
        # the first matching column is the one the argmax picked.
        selected_col = (column_tokens.unsqueeze(0) == r.selected.unsqueeze(1)).int().argmax(1)
        every_column = torch.arange(column_tokens.numel(), device=r.rows.device).expand(k, -1)
        cols, vals, ranks = self.logprobs_fn(r.rows, r.inv_t, r.threshold, None, selected_col, 0,
                                             token_ids=every_column, softcap=r.softcap)
        return LogprobsTensors(logprob_token_ids=column_tokens[cols], logprobs=vals,
                               selected_token_ranks=ranks.to(torch.int64))

    def _vocab_logprobs(self, r: LogprobRows, slot: int, num_logprobs: int,
                        max_token_ids: int) -> LogprobsTensors:
        """Full-vocabulary rows: the argmax, then the request's own ids if it named any, else
        the batch's top-n; padded to the batch's width with id 0 at -inf."""
        token_ids = None
        if max_token_ids > 0:
            n_custom = int(self.logprob_token_ids_state.num_token_ids.np[slot])
            if n_custom > 0:
                token_ids = self.logprob_token_ids_state.token_ids.gpu[slot, :n_custom]
                token_ids = token_ids.to(torch.int64).expand(r.rows.shape[0], -1)
        ids, vals, ranks = self.logprobs_fn(r.rows, r.inv_t, r.threshold, r.allowed, r.selected,
                                            num_logprobs, token_ids=token_ids, softcap=r.softcap)
        pad = 1 + max(num_logprobs, max_token_ids) - ids.shape[1]
        if pad > 0:
            ids = torch.nn.functional.pad(ids, (0, pad), value=0)
            vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
        if self.logits_mode:
            # raw/processed logits modes report the scaled, masked logits instead: the
            # reported columns only, gathered before the upcast (no [k, V] copy).
            z = reference.softcapped(r.rows.gather(1, ids), r.softcap) * r.inv_t.unsqueeze(1)
            vals = torch.where(torch.isfinite(vals), z, vals)
        return LogprobsTensors(logprob_token_ids=ids, logprobs=vals,
                               selected_token_ranks=ranks.to(torch.int64))

    def _emit_logprobs(self, slots_np, num_sampled, num_reqs):
        """The stashes of the requests emitting now, in batch order. As in vLLM only a batch
        that wants logprobs emits; other stashes wait (or are dropped by ``add_request``)."""
        if not self._pending_logprobs or self._logprob_columns(slots_np) is None:
            return None
        emitting = set(slots_np[num_sampled.cpu().numpy() > 0].tolist())
        parts, cu = [], []
        offset = 0
        for i in range(num_reqs):
            cu.append(offset)
            slot = int(slots_np[i])
            if slot in emitting and slot in self._pending_logprobs:
                lp = self._pending_logprobs.pop(slot)
                parts.append(lp)
                offset += lp.logprobs.shape[0]
        return _dg._concat_logprob_stashes(parts, cu) if parts else None
