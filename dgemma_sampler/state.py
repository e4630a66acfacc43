"""Slot-indexed per-request state of the denoising sampler.

The tensor names match vLLM 0.33's ``DiffusionGemmaRequestStates`` so that the decode step
(``step.py``) runs over either object; the vLLM adapter hands it vLLM's own states plus the
two tensors vLLM does not have: ``seeds`` and ``draws`` (request seed and that request's
draw counter, the keys of every random number).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .checks import id_list, int_range, is_int, is_real, need_flag, need_int
from .config import SamplerConfig
from .keyed_noise import Stream


def to_device_int64(device: torch.device, *arrays) -> list[torch.Tensor]:
    """Small host int64 arrays on ``device`` with one copy that does not wait for the GPU.

    A host->device ``cudaMemcpyAsync`` from pageable memory first waits until the stream has
    drained, so the host could never run ahead of the GPU. Here the arrays are packed into
    one pinned buffer and copied once (non-blocking); the device tensors are slices of that
    one copy. The pinned buffer comes from PyTorch's caching host allocator, which records
    an event on the copy and hands the block out again only once the copy has finished, so
    a buffer is never rewritten while a copy from it may still be in flight.
    """
    parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    sizes = [p.size for p in parts]
    if device.type == "cuda":
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
        np.concatenate(parts, out=host.numpy())
    else:
        host = torch.from_numpy(np.concatenate(parts))
    return list(host.to(device, non_blocking=True).split(sizes))


def _as_device(device: object) -> torch.device:
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must name a device, got {device!r} ({exc})") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class DiffusionState:
    """Pre-allocated per-slot tensors for up to ``max_num_reqs`` concurrent requests.

    Phases: a request enters in prefill (``is_encoder_phase`` True). ``finish_prefill``
    draws its first canvas and flips it to denoising. Each decode step either denoises
    (step counter +1) or, once converged, commits (``is_encoder_phase`` True means "the
    next step commits"; it emits the argmax canvas and starts a fresh canvas). The host
    keeps which slots hold a request (``active``) and which of those still wait for
    ``finish_prefill`` (``awaiting_prefill``), so that a call out of that order is refused
    without reading the device.

    Arguments follow ``checks.py``: ints are Python or numpy integers, never bools; flags are
    bools; nothing is converted, and a refused call changes nothing.
    """

    def __init__(
        self,
        max_num_reqs: int,
        cfg: SamplerConfig,
        vocab_size: int,
        hidden_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        max_num_reqs = int_range("max_num_reqs", max_num_reqs, 1)
        if not isinstance(cfg, SamplerConfig):
            raise TypeError(f"cfg must be a SamplerConfig, got {type(cfg).__name__}")
        vocab_size = int_range("vocab_size", vocab_size, 1)
        hidden_size = int_range("hidden_size", hidden_size, 1)
        device = _as_device(device)
        self.cfg = cfg
        self.max_num_reqs = max_num_reqs
        self.canvas_length = cl = cfg.canvas_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_denoising_steps = cfg.max_denoising_steps
        self.stability_threshold = st = cfg.ring_size  # vLLM's name for the ring size
        self.device = device

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.is_encoder_phase = zeros(max_num_reqs, dtype=torch.bool)
        self.canvas = zeros(max_num_reqs, cl, dtype=torch.int64)
        self.argmax_canvas = zeros(max_num_reqs, cl, dtype=torch.int64)
        self.step = zeros(max_num_reqs, dtype=torch.int32)
        self.accepted_canvas_history = zeros(max_num_reqs, st, cl, dtype=torch.int64)
        self.accepted_canvas_history_len = zeros(max_num_reqs, dtype=torch.int32)
        self.confident = zeros(max_num_reqs, dtype=torch.bool)
        self.max_steps = torch.full((max_num_reqs,), cfg.max_denoising_steps, dtype=torch.int32,
                                    device=device)
        self.seed_canvas = zeros(max_num_reqs, cl, dtype=torch.int64)
        self.has_seed = zeros(max_num_reqs, dtype=torch.bool)
        self.pin_mask = zeros(max_num_reqs, cl, dtype=torch.bool)
        self.read_only = zeros(max_num_reqs, dtype=torch.bool)
        self.self_conditioning_embeds = zeros(max_num_reqs, cl, hidden_size, dtype=torch.float32)
        self.seeds = zeros(max_num_reqs, dtype=torch.int64)
        self.draws = zeros(max_num_reqs, dtype=torch.int64)
        self.top_k = zeros(max_num_reqs, dtype=torch.int64)
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32, device=device)
        # Host-side mirrors: which slots need the optional work, without reading the GPU.
        self.canvas_width_np = np.full(max_num_reqs, cl, dtype=np.int32)
        self.seeded_slots: set[int] = set()
        self.read_only_slots: set[int] = set()
        self.single_step_slots: set[int] = set()
        self.constrained: dict[int, tuple[int, ...]] = {}
        self.top_k_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p_np = np.ones(max_num_reqs, dtype=np.float32)
        self.pinned_slots: set[int] = set()
        self.active: set[int] = set()
        self.awaiting_prefill: set[int] = set()  # active slots finish_prefill has not seen
        # Bumped by every add/remove: host-side plans built from the mirrors above stay
        # valid while it is unchanged.
        self.generation = 0
        self._seed_source = torch.Generator().manual_seed(0x5EED)

    # ------------------------------------------------------------------ requests
    def check_slot(self, slot: int, name: str = "slot") -> int:
        """``slot`` as a Python int: TypeError unless an int (not a bool), ValueError outside
        ``[0, max_num_reqs)``."""
        if not is_int(slot):
            raise TypeError(f"{name} must be an int, got {type(slot).__name__} {slot!r}")
        if not 0 <= slot < self.max_num_reqs:
            raise ValueError(f"{name} must be an int in [0, {self.max_num_reqs}), got {slot!r}")
        return int(slot)

    def check_slots(self, slots: object, *, prefilled: bool) -> list[int]:
        """Distinct slots, each holding a request: ``prefilled`` True (a step) wants requests
        ``finish_prefill`` has seen, False (a prefill) ones it has not. Returns them as Python
        ints; refuses anything else with the slot named. ``slots`` is a sequence of ints or a
        1-D integer array or tensor (whose values are read on the host: a synchronisation
        for a device tensor)."""
        if isinstance(slots, (torch.Tensor, np.ndarray)):
            slots = id_list("slots", slots)
        elif isinstance(slots, (str, bytes)) or not isinstance(slots, Iterable):
            raise TypeError(f"slots must be a sequence of ints, got {type(slots).__name__}")
        # Plain ints cost one type test each (this runs on every step).
        out = [s if type(s) is int else self.check_slot(s, f"slots[{i}]") for i, s in enumerate(slots)]
        chosen = set(out)
        if not chosen <= self.active:  # (active slots are valid slots)
            for i, s in enumerate(out):
                self.check_slot(s, f"slots[{i}]")
                if s not in self.active:
                    raise ValueError(f"slot {s} holds no request (add_request first)")
        if len(chosen) != len(out):
            raise ValueError("slots must not repeat")
        waiting = chosen & self.awaiting_prefill
        if prefilled and waiting:
            raise ValueError(f"slot {min(waiting)} has not been prefilled (prefill it before its first step)")
        if not prefilled and waiting != chosen:
            raise ValueError(f"slot {min(chosen - waiting)} was already prefilled")
        return out

    def add_request(
        self,
        slot: int,
        *,
        seed: int | None = None,
        max_steps: int | None = None,
        canvas_width: int | None = None,
        seed_canvas: Sequence[int] | None = None,
        pinned: Sequence[int] | None = None,
        read_only: bool = False,
        allowed_ids: Sequence[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        """Start a request in ``slot`` (prefill phase), replacing whatever the slot held.

        ``seed`` (an int in ``[-2^63, 2^64)``; an unsigned 64-bit seed keeps its bits) makes
        the generation reproducible; without one a seed is drawn from the state's own
        generator. ``max_steps`` (an int >= 1) caps the request's denoising steps; like vLLM's
        per-request cap it only lowers the config's ``max_denoising_steps``. ``canvas_width``
        is an int in ``[1, canvas_length]`` (None: the whole canvas). ``seed_canvas`` holds
        exactly ``canvas_width`` ids in ``[0, vocab_size)``; ``pinned`` positions (in
        ``[0, canvas_width)``) need a seed canvas. ``read_only`` is a bool. ``allowed_ids`` is
        a non-empty list of ids in ``[0, vocab_size)``. ``top_k`` is an int >= 0 (0
        disables), ``top_p`` a real in ``(0, 1]``.

        Ints may be Python or numpy integers, never bools; id lists are lists, tuples, 1-D
        integer arrays or tensors. A wrong type is a TypeError, a wrong value a ValueError,
        both raised before the slot changes (``checks.py``).
        """
        slot = self.check_slot(slot)
        cl, vocab = self.canvas_length, self.vocab_size
        if seed is not None:
            if not is_int(seed):
                raise TypeError(f"seed must be a 64-bit integer, got {type(seed).__name__} {seed!r}")
            if not -(2**63) <= seed < 2**64:
                raise ValueError(f"seed must be a 64-bit integer, got {seed!r}")
            seed = int(seed)
            if seed >= 2**63:  # an unsigned 64-bit seed keeps its bits
                seed -= 2**64
        cap = None
        if max_steps is not None:
            cap = min(int_range("max_steps", max_steps, 1), self.max_denoising_steps)
        width = cl if canvas_width is None else int_range("canvas_width", canvas_width, 1, cl + 1)
        canvas_ids = None
        if seed_canvas is not None:
            canvas_ids = id_list("seed_canvas", seed_canvas)
            if len(canvas_ids) != width:
                raise ValueError(f"seed_canvas must hold exactly {width} ids, got {len(canvas_ids)}")
            if any(not 0 <= t < vocab for t in canvas_ids):
                raise ValueError(f"seed_canvas ids must be in [0, {vocab})")
        pos = []
        if pinned is not None:
            pos = id_list("pinned", pinned)
            if pos and seed_canvas is None:
                raise ValueError("pinned positions need a seed_canvas to hold")
            if any(not 0 <= q < width for q in pos):
                raise ValueError(f"pinned positions must be in [0, {width})")
        read_only = need_flag("read_only", read_only)
        allowed = None
        if allowed_ids is not None:
            allowed = tuple(sorted(set(id_list("allowed_ids", allowed_ids))))
            if not allowed or allowed[0] < 0 or allowed[-1] >= vocab:
                raise ValueError(f"allowed_ids must be a non-empty set of ids in [0, {vocab})")
        top_k = need_int("top_k", top_k)
        if top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {top_k!r}")
        if not is_real(top_p):
            raise TypeError(f"top_p must be a real number in (0, 1], got {type(top_p).__name__} {top_p!r}")
        if not 0.0 < top_p <= 1.0:  # (NaN fails too)
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        top_p = float(top_p)
        if seed is None:
            seed = int(torch.randint(-(2**63), 2**63 - 1, (1,), generator=self._seed_source))

        self.remove_request(slot)
        self.generation += 1
        self.active.add(slot)
        self.awaiting_prefill.add(slot)
        self.is_encoder_phase[slot] = True
        self.step[slot] = 0
        self.draws[slot] = 0
        self.seeds[slot] = seed
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
        self.top_k_np[slot] = top_k
        self.top_p_np[slot] = top_p
        if cap is not None:
            self.max_steps[slot] = cap
            if cap == 1:
                self.single_step_slots.add(slot)
        self.canvas_width_np[slot] = width
        if canvas_ids is not None:
            self.seed_canvas[slot, :width] = torch.tensor(canvas_ids, dtype=torch.int64)
            self.has_seed[slot] = True
            self.seeded_slots.add(slot)
        if pos:
            self.pin_mask[slot, pos] = True
            self.pinned_slots.add(slot)
        if read_only:
            self.read_only[slot] = True
            self.read_only_slots.add(slot)
        if allowed is not None:
            self.constrained[slot] = allowed

    def remove_request(self, slot: int) -> None:
        """Free ``slot`` (a free slot stays free); every per-slot field returns to its default."""
        slot = self.check_slot(slot)
        self.generation += 1
        self.active.discard(slot)
        self.awaiting_prefill.discard(slot)
        self.is_encoder_phase[slot] = False
        self.step[slot] = 0
        self.accepted_canvas_history_len[slot] = 0
        self.self_conditioning_embeds[slot] = 0
        self.max_steps[slot] = self.max_denoising_steps
        self.has_seed[slot] = False
        self.pin_mask[slot] = False
        self.read_only[slot] = False
        self.top_k[slot] = 0
        self.top_p[slot] = 1.0
        self.top_k_np[slot] = 0
        self.top_p_np[slot] = 1.0
        self.canvas_width_np[slot] = self.canvas_length
        self.seeded_slots.discard(slot)
        self.read_only_slots.discard(slot)
        self.single_step_slots.discard(slot)
        self.pinned_slots.discard(slot)
        self.constrained.pop(slot, None)

    # ------------------------------------------------------------------ canvases
    def fresh_canvas(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Uniform random canvases ``[n, width]`` keyed on (seed, draw, position)."""
        from .step import noise_canvases, use_triton_update

        return noise_canvases(self.seeds[slots], self.draws[slots], width, self.vocab_size,
                              (Stream.CANVAS,), triton=use_triton_update(slots.device))[0]

    def finish_prefill(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Draw the first canvas of ``slots`` (seed canvases replace it) and start denoising.

        ``slots`` (``check_slots``) are distinct requests added and not yet prefilled;
        anything else is refused before any slot changes."""
        slots = self.check_slots(slots, prefilled=False)
        if not slots:
            return
        self.awaiting_prefill.difference_update(slots)
        idx = to_device_int64(self.device, slots)[0]
        self.canvas[idx] = self.fresh_canvas(idx, self.canvas_length)
        self.canvas[idx] = torch.where(self.has_seed[idx].unsqueeze(1), self.seed_canvas[idx],
                                       self.canvas[idx])
        self.is_encoder_phase[idx] = False

    def allowed_mask(self, slots: Sequence[int], vocab: int) -> torch.Tensor | None:
        """``[len(slots), vocab]`` bool masks of the constrained slots (all True elsewhere).

        Built on the device from one small staged copy of (row, flat index) pairs: the
        ``[n, vocab]`` mask never crosses the bus.
        """
        if not self.constrained or not any(s in self.constrained for s in slots):
            return None
        rows, flat = [], []
        for i, s in enumerate(slots):
            ids = self.constrained.get(int(s))
            if ids is not None:
                if ids[-1] >= vocab:
                    raise IndexError(f"allowed id {ids[-1]} of slot {s} is outside a vocabulary of {vocab}")
                rows.append(i)
                flat.append(i * vocab + np.asarray(ids, dtype=np.int64))
        rows_t, flat_t = to_device_int64(self.device, rows, np.concatenate(flat))
        mask = torch.ones(len(slots), vocab, dtype=torch.bool, device=self.device)
        mask.index_fill_(0, rows_t, False)
        mask.view(-1).index_fill_(0, flat_t, True)
        return mask
