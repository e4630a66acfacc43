"""``FusedDiffusionSampler``: vLLM's DiffusionGemma sampler with the fused kernels inside.

It is constructed with exactly the arguments of vLLM 0.33's ``DiffusionSampler`` and called
the same way, and it returns the same ``SamplerOutput`` / ``LogprobsTensors``. It inherits
vLLM's host-side bookkeeping (request setup from ``SamplingParams.extra_args``, staged writes,
the prefill-only step, ``num_rejected``) and replaces the device work of a decode step:

* no tiling by free memory, no ``[rows, V]`` fp32 copies: one row-statistics pass, the state
  update of ``dgemma_sampler.step`` over vLLM's own state tensors, and the soft embedding
  written straight into ``self_conditioning_embeds``;
* every random number (first canvas, renoise, Gumbel noise, canvas after a commit) is keyed by
  the request's ``SamplingParams.seed`` (vLLM draws a random one when unset) and a per-request
  draw counter, so a seed reproduces a generation and batching does not change it;
* the caller's logits are only read (vLLM masks fp32 logits in place for top-k/top-p).

``tests/test_vllm_parity.py`` runs it beside vLLM's sampler step by step; the README lists
where it deliberately differs.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from vllm.model_executor.models import diffusion_gemma as _dg
from vllm.v1.outputs import LogprobsTensors

from .. import reference
from ..config import SamplerConfig
from ..keyed_noise import Stream, random_tokens
from ..ops import resolve_backend
from ..sampler import backend_functions
from ..state import to_device_int64
from ..step import decode_step
from ..tensor_parallel import row_stats_rows_sharded, vocab_slice


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


class FusedDiffusionSampler(_dg.DiffusionSampler):
    """Drop-in replacement for ``vllm.model_executor.models.diffusion_gemma.DiffusionSampler``."""

    def __init__(self, sampler: Any, diffusion_config: Any, vocab_size: int, diffusion_states: Any,
                 *, backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(sampler, diffusion_config, vocab_size, diffusion_states, **kwargs)
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
        self.stats_fn, self.soft_fn, self.logprobs_fn = backend_functions(self.backend)

    # ------------------------------------------------------------------ requests
    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        super().add_request(req_idx, sampling_params)
        states = self.diffusion_states
        states.seeds[req_idx] = int(self.sampling_states.seeds.np[req_idx])
        states.draws[req_idx] = 0

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
    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> Any:
        if input_batch.num_draft_tokens == 0:
            return self._handle_prefill(input_batch, logits.device)
        states = self.diffusion_states
        device = logits.device
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
            self._decode(logits, input_batch, slots_np, nlogits_np, decode_idx_np, sampled,
                         num_sampled)
            logprobs_tensors = self._emit_logprobs(slots_np, num_sampled, num_reqs)
        return self._build_output(input_batch, sampled, num_sampled, nlogits_np, device,
                                  logprobs_tensors=logprobs_tensors)

    def _decode(self, logits, input_batch, slots_np, nlogits_np, decode_idx_np, sampled,
                num_sampled) -> None:
        states = self.diffusion_states
        device = logits.device
        decode_slots_np = slots_np[decode_idx_np]
        valid_np = nlogits_np[decode_idx_np].astype(np.int64)
        widths_np = states.canvas_width_np[decode_slots_np].astype(np.int64)
        W = int(widths_np.max())
        starts_np = np.concatenate(([0], np.cumsum(valid_np)[:-1])).astype(np.int64)
        # One pinned, non-blocking copy for the step's index arrays (a pageable copy would
        # wait for the GPU to drain).
        slots, decode_idx, starts_t, valid_t, widths_t = to_device_int64(
            device, decode_slots_np, decode_idx_np, starts_np, valid_np, widths_np)

        top_k, top_p = self._top_k_top_p(decode_slots_np, slots)
        column_tokens = states.step_allowed  # a shared allowed set: logits are [rows, K]
        embed = self.embed_weight[: self.sc_vocab_end - self.sc_vocab_start]
        vocab_start = self.sc_vocab_start
        allowed = None
        if column_tokens is not None:
            embed = self.embed_weight[column_tokens]
            vocab_start = 0
        elif states.constrained:
            allowed = self._allowed_rows(decode_slots_np, logits.shape[-1], device)

        stats_fn = self.stats_fn
        if column_tokens is not None:
            # K << V columns: the oracle is cheap there and keys the noise by token id.
            stats_fn = reference.row_stats_rows
        elif self.tp_size > 1 and top_k is None and top_p is None and allowed is None:
            # Every rank holds the gathered logits: each streams only its own vocabulary
            # slice and the ranks merge per-row partials with one all_gather. The slices are
            # whole sampling blocks (vLLM's partition need not be), so the draw is one GPU's.
            group = self._tp_device_group()
            stats_start, stats_end = vocab_slice(self.vocab_size, dist.get_rank(group),
                                                 self.tp_size)
            stats_fn = functools.partial(
                row_stats_rows_sharded, vocab_start=stats_start, vocab_end=stats_end,
                group=group, backend=self.backend)

        out = decode_step(
            states, logits, slots, starts_t, valid_t, widths_t, W,
            confidence_threshold=self.confidence_threshold, entropy_bound=self.entropy_bound,
            temperature_of=lambda s: self.cfg.temperature(states.step[s]).to(torch.float32),
            stats_fn=stats_fn, soft_fn=self.soft_fn, embed_weight=embed, normalizer=self.normalizer,
            vocab_size=self.vocab_size, top_k=top_k, top_p=top_p, allowed=allowed,
            column_tokens=column_tokens, vocab_start=vocab_start,
            sc_reduce=self._all_reduce if self.tp_size > 1 else None, tail_eps=self.cfg.tail_eps,
        )
        sampled[decode_idx, :W] = out.sampled.to(sampled.dtype)
        num_sampled[decode_idx] = out.num_sampled.to(num_sampled.dtype)
        self._stash_logprobs(out, logits, decode_slots_np, starts_np, valid_np, slots_np,
                             allowed, column_tokens)
        all_slots = input_batch.idx_mapping[: input_batch.num_reqs]
        self.req_states.draft_tokens[all_slots, :W] = states.canvas[all_slots, :W]

    # ------------------------------------------------------------------ helpers
    def _tp_device_group(self):
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().device_group

    def _all_reduce(self, t: torch.Tensor) -> None:
        t.copy_(torch.ops.vllm.all_reduce(t, group_name=self.tp_group_name))

    def _top_k_top_p(self, decode_slots_np: np.ndarray, slots: torch.Tensor):
        ss = self.sampling_states
        k_np = ss.top_k.np[decode_slots_np]
        p_np = ss.top_p.np[decode_slots_np]
        top_k = ss.top_k.gpu[slots].to(torch.int64) if (k_np < self.vocab_size).any() else None
        top_p = ss.top_p.gpu[slots] if (p_np < 1.0).any() else None
        return top_k, top_p

    def _allowed_rows(self, decode_slots_np: np.ndarray, vocab: int, device) -> torch.Tensor | None:
        states = self.diffusion_states
        if not any(int(s) in states.constrained for s in decode_slots_np):
            return None
        mask = torch.ones(len(decode_slots_np), vocab, dtype=torch.bool, device=device)
        for i, s in enumerate(decode_slots_np.tolist()):
            ids = states.constrained.get(s)
            if ids is not None:
                mask[i] = False
                mask[i, states.allowed_tensor(ids)] = True
        return mask

    def _logprob_columns(self, slots_np: np.ndarray) -> tuple[int, int] | None:
        """``(top-n, most requested ids)`` over every request of the batch (prefilling ones
        too, as vLLM counts them), or None when no request of the batch wants logprobs."""
        max_num_logprobs = self.sampling_states.max_num_logprobs(slots_np)
        max_token_ids = self.logprob_token_ids_state.max_num_token_ids(slots_np)
        if max_num_logprobs < 0 and max_token_ids <= 0:
            return None
        return max(max_num_logprobs, 0), max_token_ids

    def _stash_logprobs(self, out, logits, decode_slots_np, starts_np, valid_np, slots_np,
                        allowed, column_tokens) -> None:
        """Logprobs of the requests converging now, kept until they emit (vLLM's stash).

        Once the batch wants logprobs every converging request gets a stash, whether it asked
        or not (the output processor drops what was not asked for). Rows are the masked,
        temperature-scaled logits of this step; read-only requests report temperature 1.
        """
        columns = self._logprob_columns(slots_np)
        if columns is None:
            return
        num_logprobs, max_token_ids = columns
        states = self.diffusion_states
        converged = out.just_converged.cpu().numpy()  # one host sync, only with logprobs
        for j in np.flatnonzero(converged).tolist():
            slot = int(decode_slots_np[j])
            k = int(valid_np[j])
            rows = logits[int(starts_np[j]): int(starts_np[j]) + k]
            if slot in states.read_only_slots:
                t = torch.ones((), device=rows.device)
            else:  # the temperature of the step that just ran (its counter moved on)
                t = self.cfg.temperature(states.step[slot:slot + 1] - 1).to(torch.float32)[0]
            # Materialised: the Triton logprobs kernel reads one value per row (no stride).
            inv_t = reference.inverse_temperature(t).expand(k).contiguous()
            thr = out.stats.threshold[j, :k]
            selected = out.stats.argmax[j, :k]
            if column_tokens is not None:
                lp = self._shared_set_logprobs(rows, inv_t, thr, selected, column_tokens)
            else:
                allow = None if allowed is None else allowed[j].unsqueeze(0).expand(k, -1)
                lp = self._vocab_logprobs(rows, inv_t, thr, allow, selected, slot,
                                          num_logprobs, max_token_ids)
            self._pending_logprobs[slot] = lp

    def _shared_set_logprobs(self, rows, inv_t, thr, selected, column_tokens) -> LogprobsTensors:
        """A step over one shared allowed set (logits ``[k, K]``): every allowed id,
        renormalised over the set, after the argmax column (vLLM's layout: ``1 + K`` wide,
        always logprobs, also in a logits mode)."""
        k = rows.shape[0]
        # Column of each argmax id: the set keeps the request's order (it is not sorted), and
        # the first matching column is the one the argmax picked.
        selected_col = (column_tokens.unsqueeze(0) == selected.unsqueeze(1)).int().argmax(1)
        every_column = torch.arange(column_tokens.numel(), device=rows.device).expand(k, -1)
        cols, vals, ranks = self.logprobs_fn(rows, inv_t, thr, None, selected_col, 0,
                                             token_ids=every_column)
        return LogprobsTensors(logprob_token_ids=column_tokens[cols], logprobs=vals,
                               selected_token_ranks=ranks.to(torch.int64))

    def _vocab_logprobs(self, rows, inv_t, thr, allow, selected, slot, num_logprobs,
                        max_token_ids) -> LogprobsTensors:
        """Full-vocabulary rows: the argmax, then the request's own ids if it named any, else
        the batch's top-n; padded to the batch's width with id 0 at -inf."""
        token_ids = None
        if max_token_ids > 0:
            n_custom = int(self.logprob_token_ids_state.num_token_ids.np[slot])
            if n_custom > 0:
                token_ids = self.logprob_token_ids_state.token_ids.gpu[slot, :n_custom]
                token_ids = token_ids.to(torch.int64).expand(rows.shape[0], -1)
        ids, vals, ranks = self.logprobs_fn(rows, inv_t, thr, allow, selected, num_logprobs,
                                            token_ids=token_ids)
        pad = 1 + max(num_logprobs, max_token_ids) - ids.shape[1]
        if pad > 0:
            ids = torch.nn.functional.pad(ids, (0, pad), value=0)
            vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
        if self.logits_mode:
            # raw/processed logits modes report the scaled, masked logits instead.
            z = reference.softcapped(rows, None) * inv_t.unsqueeze(1)
            vals = torch.where(torch.isfinite(vals), z.gather(1, ids), vals)
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
