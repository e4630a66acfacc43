"""Step-by-step parity of ``FusedDiffusionSampler`` with the installed vLLM's own
``DiffusionSampler``.

The same tests run against vLLM 0.33 (``dgemma_sampler.vllm.v0_33``: logits in) and 0.34
(``v0_34``: hidden states in, projected by ``compute_logits`` a tile at a time; the harness
feeds the tests' logits through an exact projection), whichever is installed; the tests of
0.34's projection, tile sizes and ``profile_run`` run against 0.34 only. Both samplers run side
by side through ``tests/vllm_harness.py``: the same constructor arguments, the same requests
(real ``SamplingParams``), the same ``InputBatch`` per step and the same logits (a clone each:
vLLM masks fp32 logits in place for top-k/top-p). After every step
``assert_same_step`` compares what the model runner and the next step read:

- exactly: ``sampled_token_ids``, ``num_sampled``, ``num_rejected``, phases
  (``is_encoder_phase``), step counters, confidence, argmax canvases, the argmax history and its
  length, step caps; logprob ids and ranks and the stash layout (``cu_num_generated_tokens``);
- logprob values within 1e-4, soft embeddings within bf16 tolerance (relative Frobenius 1e-2
  per request over the positions the next forward reads);
- the canvas and ``draft_tokens`` exactly wherever randomness cannot matter: after a converging
  step (the argmax canvas), a seed canvas after prefill, pinned positions, and every denoise
  step of the ``exact`` scenarios (temperature 0 and an entropy bound that accepts every
  position, so every position takes its argmax).

Randomness differs by design (vLLM draws from torch's global generator, we from noise keyed by
request seed and draw counter), so fresh canvases and renoised positions are compared
distributionally instead, and our own reproducibility is tested separately.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

# Not pytest.importorskip("vllm"): importing vllm imports Triton, and on the CPU the harness must
# set TRITON_INTERPRET (and vLLM's platform) first.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vllm extra", allow_module_level=True)

import vllm_harness as vh  # noqa: E402  (sets the CPU environment before vLLM loads)
from vllm_harness import Decode, Prefill  # noqa: E402

if vh.RELEASE == "0.34":
    from dgemma_sampler.vllm.v0_34 import FusedDiffusionSampler  # noqa: E402
else:
    from dgemma_sampler.vllm.v0_33 import FusedDiffusionSampler  # noqa: E402

pytestmark = pytest.mark.vllm

V, CL, H = 64, 8, 16
ST = 2  # vLLM's ring depth: generation config stability_threshold 1, plus one
N_STEPS = 12
BIG_BOUND = 1e9  # accepts every position


@pytest.fixture(autouse=True)
def _plenty_of_memory():
    vh.set_free_memory(64 << 30)
    yield
    vh.set_free_memory(64 << 30)


# ------------------------------------------------------------------------------------------
# Two samplers, one trajectory
# ------------------------------------------------------------------------------------------


class Pair:
    """vLLM's sampler (``ref``) and ours (``ours``), each with its own states and runner
    objects, built from the same arguments."""

    def __init__(self, *, backend: str = "torch", logprobs_mode: str = "raw_logprobs",
                 logits_dtype: torch.dtype = torch.float32, **kw):
        args = dict(max_num_reqs=6, canvas_length=CL, vocab_size=V, hidden=H,
                    max_denoising_steps=N_STEPS, stability_threshold=ST, t_min=0.4, t_max=1.0,
                    entropy_bound=1.0, confidence_threshold=0.5)
        args.update(kw)
        self.vocab = args["vocab_size"]
        self.logits_dtype = logits_dtype
        self.ref = vh.make_vllm_sampler(logprobs_mode=logprobs_mode, **args)
        self.ours = vh.make_vllm_sampler(logprobs_mode=logprobs_mode,
                                         sampler_cls=FusedDiffusionSampler, backend=backend, **args)
        assert type(self.ref.sampler) is vh.DiffusionSampler
        assert type(self.ours.sampler) is FusedDiffusionSampler
        self.seeds: dict[int, list[int]] = {}  # slot -> seed canvas
        self.pins: dict[int, list[int]] = {}

    def add(self, slot: int, *, prompt_len: int = 5, **kw) -> None:
        extra = kw.get("extra_args") or {}
        for h in (self.ref, self.ours):
            h.add_request(slot, prompt_len=prompt_len, **kw)
        self.seeds.pop(slot, None)
        self.pins.pop(slot, None)
        if extra.get("diffusion_seed_canvas") is not None:
            self.seeds[slot] = list(extra["diffusion_seed_canvas"])
            self.pins[slot] = list(extra.get("diffusion_pinned") or [])

    def remove(self, slot: int) -> None:
        for h in (self.ref, self.ours):
            h.remove_request(slot)

    def allowed(self, entries) -> torch.Tensor | None:
        """The shared constrained set of the step (what ``compute_logits`` would read)."""
        return self.ref.begin_step(vh.make_input_batch(entries))

    def step(self, entries, logits: torch.Tensor, *, exact: bool = False):
        """One step of both samplers from clones of ``logits``; compares everything."""
        logits = logits.to(self.logits_dtype)
        before = (self.ref.snapshot(), self.ours.snapshot())
        given = logits.clone()
        out_ref = self.ref.step(logits.clone(), vh.make_input_batch(entries))
        out_ours = self.ours.step(given, vh.make_input_batch(entries))
        assert torch.equal(given, logits), "FusedDiffusionSampler wrote the caller's logits"
        assert_same_step(self, entries, out_ref, out_ours, before, exact)
        return out_ref, out_ours


def rel_frobenius(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_same_logprobs(ref, ours) -> None:
    if ref is None:
        assert ours is None
        return
    assert ours is not None
    assert ours.cu_num_generated_tokens == ref.cu_num_generated_tokens
    assert ours.logprob_token_ids.dtype == ref.logprob_token_ids.dtype
    assert ours.logprob_token_ids.shape == ref.logprob_token_ids.shape
    assert torch.equal(ours.selected_token_ranks, ref.selected_token_ranks)
    assert ours.logprobs.shape == ref.logprobs.shape
    finite = torch.isfinite(ref.logprobs)
    assert torch.equal(torch.isfinite(ours.logprobs), finite)
    assert torch.equal(ours.logprobs[~finite], ref.logprobs[~finite])
    # Ids exactly wherever there is a probability. A -inf column is padding or a top-n pick
    # past what top-k/top-p kept, whose id vLLM leaves to torch.topk's order among -inf ties.
    assert torch.equal(ours.logprob_token_ids[finite], ref.logprob_token_ids[finite])
    assert torch.equal(ours.logprob_token_ids[:, 0], ref.logprob_token_ids[:, 0])
    torch.testing.assert_close(ours.logprobs[finite], ref.logprobs[finite], rtol=1e-4, atol=1e-4)


def assert_same_step(pair: Pair, entries, out_ref, out_ours, before, exact: bool) -> None:
    r, o = pair.ref, pair.ours
    before_ref, before_ours = before
    # What the runner reads.
    for name in ("sampled_token_ids", "num_sampled", "num_rejected"):
        a, b = getattr(out_ref, name), getattr(out_ours, name)
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert torch.equal(b, a), (name, a, b)
    assert out_ours.num_nans is None
    assert_same_logprobs(out_ref.logprobs_tensors, out_ours.logprobs_tensors)
    assert r.sampler._pending_logprobs.keys() == o.sampler._pending_logprobs.keys()

    # Deterministic state: phases, counters, confidence, argmax canvases and their history.
    sr, so = r.states, o.states
    for name in ("is_encoder_phase", "step", "confident", "accepted_canvas_history_len",
                 "max_steps", "argmax_canvas", "accepted_canvas_history", "read_only",
                 "pin_mask", "has_seed"):
        assert torch.equal(getattr(so, name), getattr(sr, name)), name
    np.testing.assert_array_equal(so.canvas_width_np, sr.canvas_width_np)

    width = sr.canvas_width_np
    batch = {e.slot for e in entries}
    decode_width = max((int(width[e.slot]) for e in entries if isinstance(e, Decode)), default=0)
    for h, snap in ((r, before_ref), (o, before_ours)):
        for s in range(h.states.max_num_reqs):
            if s not in batch:  # requests outside the batch are left alone
                assert torch.equal(h.states.canvas[s], snap["canvas"][s])
                assert torch.equal(h.draft_tokens[s], snap["draft_tokens"][s])
            elif decode_width:  # the runner feeds these back as the next input ids
                assert torch.equal(h.draft_tokens[s, :decode_width],
                                   h.states.canvas[s, :decode_width])
    for i, e in enumerate(entries):
        s = e.slot
        w = int(width[s])
        if isinstance(e, Prefill):
            done = e.computed + (e.prefill_len - e.computed if e.chunk is None else e.chunk) \
                >= e.prefill_len
            if done and s in pair.seeds:
                seed = torch.tensor(pair.seeds[s], device=sr.canvas.device)
                for h in (r, o):
                    assert torch.equal(h.states.canvas[s, :w], seed)
                    assert torch.equal(h.draft_tokens[s, :w], seed)
            for h in (r, o):
                if done:  # the first canvas is the next input
                    assert torch.equal(h.draft_tokens[s, :w], h.states.canvas[s, :w])
            continue
        k = e.valid_len
        committed = bool(before_ref["is_encoder_phase"][s])
        # Converged now: commits next, or a read-only request that emitted already.
        converged = not committed and (
            bool(sr.is_encoder_phase[s]) or int(out_ref.num_sampled[i]) > 0)
        # Soft embeddings over the rows the next forward reads: zero exactly where vLLM's are.
        sc_ref = sr.self_conditioning_embeds[s, :k]
        sc_ours = so.self_conditioning_embeds[s, :k]
        zero_rows = (sc_ref == 0).all(dim=-1)
        assert (sc_ours[zero_rows] == 0).all(), f"slot {s}: soft embedding where vLLM has none"
        if (~zero_rows).any():
            err = rel_frobenius(sc_ours[~zero_rows], sc_ref[~zero_rows])
            assert err <= 1e-2, f"slot {s}: soft embedding off by {err:.2e}"
        # The canvas the next forward reads.
        for h in (r, o):
            assert torch.equal(h.draft_tokens[s, :k], h.states.canvas[s, :k])
            tokens = h.states.canvas[s, :k]
            assert int(tokens.min()) >= 0 and int(tokens.max()) < pair.vocab
        if converged:
            # The commit forward reads exactly the argmax canvas it will emit.
            for h in (r, o):
                assert torch.equal(h.states.canvas[s, :w], h.states.argmax_canvas[s, :w])
            assert torch.equal(so.canvas[s, :k], sr.canvas[s, :k])
        elif committed:
            # The commit emitted the argmax canvas and drew a fresh canvas for the next block.
            for h in (r, o):
                assert not torch.equal(h.states.canvas[s, :k], h.states.argmax_canvas[s, :k])
        else:
            pins = pair.pins.get(s, [])
            for h in (r, o):
                for p in pins:
                    if p < k:
                        assert int(h.states.canvas[s, p]) == pair.seeds[s][p]
            if exact:
                assert torch.equal(so.canvas[s, :k], sr.canvas[s, :k]), (s, so.canvas, sr.canvas)


# ------------------------------------------------------------------------------------------
# Logits
# ------------------------------------------------------------------------------------------


class Logits:
    """Per-slot logits rows for a step: ``flat`` (random, scale ``scale``: high entropy) or
    ``peaked`` at per-slot targets (near-zero entropy, argmax == target)."""

    def __init__(self, gen: torch.Generator, vocab: int = V):
        self.gen = gen
        self.vocab = vocab

    def targets(self, n: int = CL, cols: int | None = None) -> torch.Tensor:
        return torch.randint(0, cols or self.vocab, (n,), generator=self.gen)

    def rows(self, entries, spec: dict, cols: int | None = None) -> torch.Tensor:
        """``spec[slot]`` is a target tensor (peaked rows) or a float scale (random rows)."""
        cols = cols or self.vocab
        parts = []
        for e in entries:
            if not isinstance(e, Decode):
                continue
            how = spec[e.slot]
            if isinstance(how, torch.Tensor):
                parts.append(vh.peaked_logits(how[: e.valid_len], cols, generator=self.gen))
            else:
                parts.append(float(how) * torch.randn(e.valid_len, cols, generator=self.gen))
        return torch.cat(parts) if parts else torch.zeros(0, cols)


# ------------------------------------------------------------------------------------------
# Trajectories
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_mixed_trajectory(dtype):
    """Temperature 0 and an entropy bound that accepts everything: every canvas position takes
    its argmax, so canvases match exactly on every denoise step. Five requests with prefill
    chunks, a narrow canvas, a truncated canvas with a step cap, a seeded + pinned canvas that
    joins mid-flight, and a read-only request; batches mix prefilling, denoising and
    committing requests, in a different order every step. Logits in fp32 and in bf16."""
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    pair = Pair(t_min=0.0, t_max=0.0, entropy_bound=BIG_BOUND, logits_dtype=dtype)
    lg = Logits(gen)
    pair.add(0, seed=10)
    pair.add(1, seed=11, extra_args={"diffusion_canvas_length": 5})
    pair.add(2, seed=12, extra_args={"diffusion_max_steps": 4})
    pair.add(4, seed=14, extra_args={"diffusion_read_only": True, "diffusion_max_steps": 6})
    pair.step([Prefill(0, 5), Prefill(1, 4), Prefill(2, 9, chunk=4), Prefill(4, 3)],
              torch.zeros(0, V), exact=True)
    valid = {0: CL, 1: 5, 2: 6, 3: CL, 4: CL}
    # Targets change for a while, then hold: stability (ST=2) decides when a request converges.
    plan = {s: [lg.targets() for _ in range(3)] for s in range(5)}
    seen = {s: 0 for s in range(5)}

    def spec(slots):
        out = {}
        for s in slots:
            seq = plan[s]
            out[s] = seq[min(seen[s], len(seq) - 1)]
            seen[s] += 1
        return out

    active = [0, 1, 4]
    for step in range(10):
        entries = [Decode(s, valid[s]) for s in active]
        if step == 0:
            entries.append(Prefill(2, 9, chunk=5, computed=4))
        if step == 1:
            entries.append(Decode(2, valid[2]))
            pair.add(3, seed=13, prompt_len=4, extra_args={
                "diffusion_seed_canvas": lg.targets().tolist(), "diffusion_pinned": [1, 6]})
            entries.append(Prefill(3, 4))
        if step >= 2:
            entries.append(Decode(2, valid[2]))
            entries.append(Decode(3, valid[3]))
        order = np.random.default_rng(step).permutation(len(entries))
        entries = [entries[j] for j in order]
        logits = lg.rows(entries, spec([e.slot for e in entries if isinstance(e, Decode)]))
        out_ref, _ = pair.step(entries, logits, exact=True)
        if 4 in active and int(out_ref.num_sampled[[e.slot for e in entries].index(4)]) > 0:
            active.remove(4)  # a read-only request finishes on the step it emits
            pair.remove(4)


def test_sampling_options_and_logprobs_trajectory():
    """Temperature schedule 1.0 -> 0.4, entropy bound 1: everything but the renoised canvas is
    deterministic and compared every step. Requests with top-k, top-p, both, logprobs (top-n,
    token ids, both), a narrow and a truncated canvas, a read-only request with logprobs (at
    temperature 1), and an abort between converging and committing whose slot is reused at
    once. vLLM runs one request per tile (no free memory), our sampler the whole batch."""
    vh.set_free_memory(0)
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    pair = Pair()
    lg = Logits(gen)
    pair.add(0, top_k=5, logprobs=3)
    pair.add(1, top_p=0.8, logprob_token_ids=[1, 2, 3, 60])
    pair.add(2, top_k=10, top_p=0.9, logprobs=2, logprob_token_ids=[7, 8],
             extra_args={"diffusion_canvas_length": 6})
    pair.add(3)
    pair.add(4, logprobs=2, extra_args={"diffusion_read_only": True})
    pair.step([Prefill(s, 4) for s in range(5)], torch.zeros(0, V))
    valid = {0: CL, 1: CL, 2: 6, 3: 7, 4: CL}
    targets = {s: lg.targets() for s in range(5)}
    flat_steps = {0: 1, 1: 2, 2: 0, 3: 3, 4: 1}  # denoise steps on flat logits first
    seen = {s: 0 for s in range(5)}
    active = [0, 1, 2, 3, 4]
    prefilling: list[int] = []
    trace = []
    aborted = None
    for step in range(10):
        entries = [Decode(s, valid[s]) for s in active] + [Prefill(s, 3) for s in prefilling]
        active += prefilling
        prefilling = []
        spec = {}
        for e in entries:
            if isinstance(e, Decode):
                spec[e.slot] = 3.0 if seen[e.slot] < flat_steps[e.slot] else targets[e.slot]
                seen[e.slot] += 1
        out_ref, _ = pair.step(entries, lg.rows(entries, spec))
        slots = [e.slot for e in entries]
        trace.append((slots, out_ref.num_sampled.tolist(), out_ref.logprobs_tensors is not None))
        if 4 in active and int(out_ref.num_sampled[slots.index(4)]) > 0:
            active.remove(4)  # a read-only request finishes on the step it emits
            pair.remove(4)
        if 1 in active and bool(pair.ref.states.is_encoder_phase[1]) and step < 6:
            # Aborted between converging and committing: its stash must not reach the
            # request that reuses the slot (which prefills in the next, mixed, batch).
            assert 1 in pair.ours.sampler._pending_logprobs
            active.remove(1)
            pair.remove(1)
            pair.add(1, logprobs=1, top_k=3, prompt_len=3)
            assert 1 not in pair.ours.sampler._pending_logprobs
            seen[1], flat_steps[1], targets[1] = 0, 1, lg.targets()
            prefilling.append(1)
            aborted = step
    assert aborted is not None
    assert sum(lp for *_, lp in trace) >= 3, trace


@pytest.mark.parametrize("exact", [False, True], ids=["sampled", "exact"])
def test_constrained_reads(exact):
    """Constrained requests (``diffusion_constrained``; the allowed set is the request's
    ``logprob_token_ids``, in the request's order). While every decode slot shares one set, the
    logits are ``[rows, K]`` (column j is token ``allowed[j]``) and logprobs report every allowed
    id; once an unconstrained or differently constrained request decodes alongside, the step
    runs over the full vocabulary with per-row masks."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    kw = dict(t_min=0.0, t_max=0.0, entropy_bound=BIG_BOUND) if exact else {}
    pair = Pair(**kw)
    lg = Logits(gen)
    allowed_a = [40, 5, 9, 2, 33, 17]  # not sorted: column order is the request's order
    allowed_b = [3, 60, 7]
    pair.add(0, logprob_token_ids=allowed_a, extra_args={
        "diffusion_constrained": True, "diffusion_read_only": True, "diffusion_max_steps": 3})
    pair.add(1, logprob_token_ids=allowed_a, extra_args={"diffusion_constrained": True})
    pair.add(2, top_k=4, logprobs=2)
    pair.add(3, logprob_token_ids=allowed_b, logprobs=1, extra_args={"diffusion_constrained": True})
    pair.step([Prefill(0, 4), Prefill(1, 4)], torch.zeros(0, V), exact=exact)

    # Fixed targets, as column indices into each set: argmax canvases settle and requests
    # converge, on either path.
    sets = {0: allowed_a, 1: allowed_a, 3: allowed_b}
    cols = {s: torch.randint(0, len(ids), (CL,), generator=gen) for s, ids in sets.items()}
    schedule = [
        [Decode(0, CL), Decode(1, CL)],
        [Decode(1, CL), Decode(0, CL), Prefill(2, 3), Prefill(3, 6)],
        [Decode(1, CL), Decode(0, CL)],  # 0 reaches its cap and emits; 1 commits
        [Decode(1, CL), Decode(2, CL), Decode(3, 5)],
        [Decode(3, 5), Decode(1, CL), Decode(2, CL)],
        [Decode(1, CL), Decode(2, CL)],
        [Decode(2, CL), Decode(1, CL), Decode(3, 5)],
        [Decode(1, CL)],
        [Decode(1, CL)],
    ]
    shared_logprobs = per_row_logprobs = 0
    flat = {2: 2}  # steps of flat logits for the unconstrained request
    for entries in schedule:
        allowed = pair.allowed(entries)
        decode = [e.slot for e in entries if isinstance(e, Decode)]
        if allowed is not None:
            assert allowed.tolist() == allowed_a
            logits = lg.rows(entries, {s: cols[s] for s in decode}, cols=len(allowed_a))
        else:
            spec = {}
            for s in decode:
                if s in sets:
                    spec[s] = torch.tensor(sets[s])[cols[s]]
                elif flat[s] > 0:
                    spec[s], flat[s] = 2.0, flat[s] - 1
                else:
                    spec[s] = lg.targets() if s not in cols else cols[s]
                    cols.setdefault(s, spec[s])
            logits = lg.rows(entries, spec)
        out, _ = pair.step(entries, logits, exact=exact)
        if out.logprobs_tensors is not None:
            if allowed is not None:
                shared_logprobs += 1
                assert out.logprobs_tensors.logprob_token_ids.shape[1] == 1 + len(allowed_a)
            else:
                per_row_logprobs += 1
        for s, ids in sets.items():
            w = int(pair.ours.states.canvas_width_np[s])
            assert set(pair.ours.states.argmax_canvas[s, :w].tolist()) <= set(ids) | {0}
    assert shared_logprobs >= 2 and per_row_logprobs >= 1, (shared_logprobs, per_row_logprobs)


def test_logits_mode_and_stash_waiting():
    """``logprobs_mode="raw_logits"``: full-vocabulary stashes report the scaled, masked logits,
    a shared-set stash still reports logprobs (as vLLM does). A request that did not ask for
    logprobs but converged beside one that did keeps its stash until a batch that wants
    logprobs emits it: the commit step alone emits none."""
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    pair = Pair(logprobs_mode="raw_logits")
    lg = Logits(gen)
    allowed = [11, 3, 50, 7]
    pair.add(0, top_k=6, logprobs=3)
    pair.add(1, logprob_token_ids=[4, 5, 6])
    pair.add(2)
    pair.add(3, logprob_token_ids=allowed, extra_args={"diffusion_constrained": True})
    pair.add(4, logprob_token_ids=allowed, extra_args={"diffusion_constrained": True})
    pair.step([Prefill(s, 4) for s in range(5)], torch.zeros(0, V))
    targets = {s: lg.targets() for s in range(3)}
    targets.update({s: lg.targets(cols=len(allowed)) for s in (3, 4)})

    # Full vocabulary: 0, 1 and 2 converge together on the second step, 2 without logprobs.
    entries = [Decode(0, CL), Decode(1, CL), Decode(2, CL)]
    for _ in range(2):
        pair.step(entries, lg.rows(entries, targets))
    assert pair.ref.states.is_encoder_phase[:3].all()
    assert set(pair.ours.sampler._pending_logprobs) == {0, 1, 2}
    out, _ = pair.step(entries[:2], lg.rows(entries[:2], targets))  # 0 and 1 commit
    lp = out.logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (2 * CL, 1 + 3)
    # Logits mode: column 0 is the argmax's scaled logit, not a logprob.
    assert (lp.logprobs[:, 0] > 0).all()
    pair.remove(0)
    pair.remove(1)
    out, _ = pair.step(entries[2:], lg.rows(entries[2:], targets))  # 2 commits alone
    assert int(out.num_sampled[0]) == CL and out.logprobs_tensors is None
    assert set(pair.ours.sampler._pending_logprobs) == {2}

    # One shared allowed set: K-space logits; the stash is logprobs over the set.
    entries = [Decode(4, CL), Decode(3, CL)]
    for _ in range(3):
        assert pair.allowed(entries).tolist() == allowed
        out, _ = pair.step(entries, lg.rows(entries, targets, cols=len(allowed)))
    lp = out.logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (2 * CL, 1 + len(allowed))
    assert (lp.logprobs <= 0).all()


@pytest.mark.parametrize("free_memory", [64 << 30, 0], ids=["one-tile", "tile-per-request"])
def test_single_step_caps(free_memory):
    """``diffusion_max_steps`` 1 converges on the first denoise step whatever the entropy; vLLM
    then skips the self-conditioning matmul for a tile of such requests only. Either way the
    soft embeddings that are read match (none for a request about to commit)."""
    vh.set_free_memory(free_memory)
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    pair = Pair()
    lg = Logits(gen)
    pair.add(0, extra_args={"diffusion_max_steps": 1})
    pair.add(1, logprobs=1, extra_args={"diffusion_max_steps": 1, "diffusion_canvas_length": 5})
    pair.add(2, extra_args={"diffusion_max_steps": 99})  # clamped to the schedule length
    pair.step([Prefill(s, 4) for s in range(3)], torch.zeros(0, V))
    entries = [Decode(0, CL), Decode(1, 5), Decode(2, CL)]
    for _ in range(4):
        out, _ = pair.step(entries, lg.rows(entries, {0: 2.0, 1: 2.0, 2: 2.0}))
    assert pair.ours.states.max_steps[:3].tolist() == [1, 1, N_STEPS]


def test_top_k_top_p_samples_stay_in_the_kept_set():
    """Temperature 1 and every position accepted: the canvas is the sample. Both samplers draw
    only tokens that top-k / top-p keep (ties do not occur in these random logits)."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    pair = Pair(t_min=1.0, t_max=1.0, entropy_bound=BIG_BOUND)
    lg = Logits(gen)
    options = {0: dict(top_k=3), 1: dict(top_p=0.5), 2: dict(top_k=6, top_p=0.7), 3: {}}
    for s, kw in options.items():
        pair.add(s, **kw)
    pair.step([Prefill(s, 4) for s in options], torch.zeros(0, V))
    entries = [Decode(s, CL) for s in options]
    for _ in range(3):
        logits = lg.rows(entries, dict.fromkeys(options, 2.0))
        pair.step(entries, logits)
        for i, s in enumerate(options):
            rows = logits[i * CL: (i + 1) * CL].double()
            order = rows.argsort(dim=-1, descending=True)
            probs = torch.softmax(rows, dim=-1).gather(1, order)
            keep_sorted = torch.ones_like(probs, dtype=torch.bool)
            k = options[s].get("top_k")
            if k:
                keep_sorted[:, k:] = False
                probs = torch.where(keep_sorted, probs, 0.0)
                probs = probs / probs.sum(dim=-1, keepdim=True)
            p = options[s].get("top_p")
            if p:
                keep_sorted &= (probs.cumsum(dim=-1) - probs) < p
            kept = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
            for h in (pair.ref, pair.ours):
                canvas = h.states.canvas[s, :CL].cpu()
                assert kept.gather(1, canvas.unsqueeze(1)).all(), (s, canvas)
            if not options[s]:
                # Unfiltered rows sample more than the top token now and then.
                assert not torch.equal(pair.ours.states.canvas[s], rows.argmax(dim=-1))


def test_sample_distribution_matches_softmax():
    """One logits row repeated over 4 requests x 128 positions, temperature 1, every position
    accepted: the canvas tokens of both samplers follow softmax(row) (chi-square over two
    steps, 1024 draws each)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    vocab, width = 16, 128
    pair = Pair(vocab_size=vocab, canvas_length=width, t_min=1.0, t_max=1.0,
                entropy_bound=BIG_BOUND, confidence_threshold=0.01)
    row = torch.randn(vocab, generator=gen)
    probs = torch.softmax(row.double(), dim=-1)
    assert float(probs.min()) * 1024 > 5  # every bin expects enough draws
    for s in range(4):
        pair.add(s, seed=1000 + s)
    pair.step([Prefill(s, 4) for s in range(4)], torch.zeros(0, vocab))
    entries = [Decode(s, width) for s in range(4)]
    counts = {"ref": torch.zeros(vocab), "ours": torch.zeros(vocab)}
    for _ in range(2):
        pair.step(entries, row.expand(4 * width, vocab).clone())
        for name, h in (("ref", pair.ref), ("ours", pair.ours)):
            counts[name] += torch.bincount(h.states.canvas[:4].reshape(-1).cpu(), minlength=vocab)
    for name, c in counts.items():
        p_value = scipy_stats.chisquare(c.numpy(), (probs * c.sum()).numpy()).pvalue
        assert p_value > 1e-4, (name, p_value, c)


def test_our_sampler_is_reproducible_across_batches():
    """Our canvases are a function of the request's seed and its own steps: the same requests
    in other slots, in another batch order, scheduled at other times and beside another
    request give identical canvases (first canvas, renoised canvases, commits) every step."""
    def logits_of(req: int, j: int, k: int) -> torch.Tensor:
        """The logits of request ``req``'s ``j``-th decode step, whatever batch it is in."""
        rows = 2.0 * torch.randn(k, V, generator=torch.Generator().manual_seed(100 * req + j))
        if j % 4 in (2, 3):  # peaked twice in a row: converges, then commits
            target = torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(req))
            rows[torch.arange(k), target] += 30.0
        return rows

    seeds = {"a": 7, "b": 8, "c": -5}
    width = {"a": CL, "b": 5, "c": CL}

    def run(slot_of: dict, schedule: list[list[str]], with_other: bool = False):
        h = vh.make_vllm_sampler(max_num_reqs=6, canvas_length=CL, vocab_size=V, hidden=H,
                                 max_denoising_steps=N_STEPS, stability_threshold=ST,
                                 t_min=0.4, t_max=1.0, entropy_bound=1.0,
                                 confidence_threshold=0.5, sampler_cls=FusedDiffusionSampler)
        for name, slot in slot_of.items():
            h.add_request(slot, seed=seeds[name],
                          extra_args={"diffusion_canvas_length": width[name]})
        if with_other:  # an unseeded request in slot 5 decodes in every batch
            h.add_request(5, seed=None)
        h.step(torch.zeros(0, V), vh.make_input_batch(
            [Prefill(slot, 4) for slot in slot_of.values()]
            + ([Prefill(5, 4)] if with_other else [])))
        canvases = {name: [h.states.canvas[slot, :width[name]].clone()]
                    for name, slot in slot_of.items()}
        steps = dict.fromkeys(slot_of, 0)
        emitted = dict.fromkeys(slot_of, 0)
        for names in schedule:
            entries = [Decode(slot_of[n], width[n]) for n in names]
            rows = [logits_of(ord(n), steps[n], width[n]) for n in names]
            if with_other:
                entries.append(Decode(5, CL))
                rows.append(torch.randn(CL, V))
            out = h.step(torch.cat(rows), vh.make_input_batch(entries))
            for i, n in enumerate(names):
                steps[n] += 1
                canvases[n].append(h.states.canvas[slot_of[n], :width[n]].clone())
                emitted[n] += int(out.num_sampled[i])
        assert emitted == {n: width[n] for n in slot_of}  # one commit each
        return canvases

    together = run({"a": 0, "b": 1, "c": 2}, [["a", "b", "c"]] * 6)
    apart = run({"c": 0, "a": 3, "b": 4},
                [["c"], ["b", "c"], ["c", "b", "a"], ["a"], ["b", "a", "c"], ["a", "c", "b"],
                 ["a", "b"], ["b", "a"], ["c"]], with_other=True)
    for name in seeds:
        assert len(together[name]) == len(apart[name]) == 7
        for j, (x, y) in enumerate(zip(together[name], apart[name])):
            assert torch.equal(x, y), (name, j, x, y)
    assert not torch.equal(together["a"][1], together["c"][1])


def test_triton_backend_trajectory():
    """``backend="triton"`` (the fused kernels, through the interpreter on the CPU): a short
    trajectory with logprobs (top-n and ids), a per-row constrained request, a narrow and a
    truncated canvas, compared every step. (top-k / top-p are left out: their threshold
    search takes tens of seconds per call in the interpreter.)"""
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    pair = Pair(backend="triton")
    assert pair.ours.sampler.backend == "triton"
    lg = Logits(gen)
    allowed = [3, 40, 9]
    pair.add(0, logprobs=2)
    pair.add(1, logprob_token_ids=[9, 4], extra_args={"diffusion_max_steps": 3})
    pair.add(2, logprob_token_ids=allowed, extra_args={
        "diffusion_canvas_length": 5, "diffusion_constrained": True})
    pair.step([Prefill(0, 4), Prefill(1, 4), Prefill(2, 4)], torch.zeros(0, V))
    targets = {0: lg.targets(), 2: torch.tensor(allowed)[lg.targets(cols=3)]}
    entries = [Decode(0, CL), Decode(1, 6), Decode(2, 5)]
    emitted = 0
    for j in range(4):
        assert pair.allowed(entries) is None  # per-row masks
        spec = {0: targets[0] if j else 2.0, 1: 2.0, 2: targets[2]}
        out, _ = pair.step(entries, lg.rows(entries, spec))
        emitted += out.logprobs_tensors is not None
    assert emitted >= 2


def test_triton_backend_shared_allowed_set():
    """The shared-set path with ``backend="triton"``: K-wide logits, the soft embedding over
    the set's K embedding rows, and logprobs over every allowed id."""
    gen = torch.Generator().manual_seed(9)
    torch.manual_seed(9)
    pair = Pair(backend="triton")
    lg = Logits(gen)
    allowed = [30, 2, 17, 61, 8]
    for s in (0, 1):
        pair.add(s, logprob_token_ids=allowed, extra_args={"diffusion_constrained": True})
    pair.step([Prefill(0, 4), Prefill(1, 4)], torch.zeros(0, V))
    entries = [Decode(1, CL), Decode(0, 7)]
    targets = {s: lg.targets(cols=len(allowed)) for s in (0, 1)}
    emitted = 0
    for j in range(4):
        assert pair.allowed(entries).tolist() == allowed
        spec = targets if j else dict.fromkeys(targets, 1.0)
        out, _ = pair.step(entries, lg.rows(entries, spec, cols=len(allowed)))
        emitted += out.logprobs_tensors is not None
    assert emitted == 1


def test_constrained_top_k_reads_alike_on_both_paths():
    """Deliberate difference: with top-k (or top-p) a constrained request keeps the top-k *of
    its allowed set*, on the shared K-space path and on the per-row path alike, so it reads
    the same whoever shares its batch. vLLM's per-row path applies top-k over the whole
    vocabulary before masking to the set: when the top-k tokens lie outside the set, every
    allowed token is masked and it commits a token outside the set."""
    gen = torch.Generator().manual_seed(10)
    allowed = [12, 40, 3, 25, 7]
    logits_k = 2.0 * torch.randn(CL, len(allowed), generator=gen)
    full = 2.0 * torch.randn(CL, V, generator=gen)
    full[:, allowed] = logits_k
    full[:, [50, 51]] += 20.0  # the vocabulary's top 2, outside the set

    def read(h, shared: bool):
        h.add_request(0, top_k=2, logprob_token_ids=allowed,
                      extra_args={"diffusion_constrained": True, "diffusion_read_only": True,
                                  "diffusion_max_steps": 1})
        h.add_request(1, logprob_token_ids=allowed if shared else None,
                      extra_args={"diffusion_constrained": True} if shared else None)
        h.step(torch.zeros(0, V), vh.make_input_batch([Prefill(0, 4), Prefill(1, 4)]))
        batch = vh.make_input_batch([Decode(0, CL), Decode(1, CL)])
        assert (h.begin_step(batch) is not None) == shared
        logits = torch.cat([logits_k, logits_k]) if shared else torch.cat([full, full])
        out = h.step(logits.clone(), batch)
        lp = out.logprobs_tensors
        return out.sampled_token_ids[0].long().cpu(), lp.logprobs.cpu(), lp.logprob_token_ids.cpu()

    ours = {}
    for shared in (True, False):
        h = vh.make_vllm_sampler(max_num_reqs=2, canvas_length=CL, vocab_size=V, hidden=H,
                                 sampler_cls=FusedDiffusionSampler)
        ours[shared] = read(h, shared)
    top2 = torch.tensor(allowed)[logits_k.topk(2, dim=-1).indices]
    for tokens, logprobs, ids in ours.values():
        assert torch.equal(tokens, torch.tensor(allowed)[logits_k.argmax(dim=-1)])
        # The emitted read's logprobs: the set's top 2 share the mass, the rest is masked.
        finite = torch.isfinite(logprobs[:CL, 1:])
        for i in range(CL):
            assert set(ids[i, 1:][finite[i]].tolist()) == set(top2[i].tolist())
        torch.testing.assert_close(logprobs[:CL, 1:].exp().sum(-1), torch.ones(CL))

    h = vh.make_vllm_sampler(max_num_reqs=2, canvas_length=CL, vocab_size=V, hidden=H)
    vllm_tokens, *_ = read(h, shared=False)
    assert not set(vllm_tokens.tolist()) <= set(allowed)  # vLLM 0.33 leaves the set


def test_entropy_bound_acceptance_matches():
    """Acceptance itself: positions whose logits tie k tokens at the top (entropy about log k)
    against an entropy bound between two partial sums. An accepted position takes its sample,
    one of its k tokens; a rejected one a uniform token from 512. Both samplers accept exactly
    the positions a float64 oracle accepts."""
    vocab = 512
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    entries = [Decode(0, CL), Decode(1, CL), Decode(2, 6)]
    k_of = torch.randint(1, 6, (3, CL), generator=gen)
    tops = torch.stack([torch.randperm(vocab, generator=gen)[:5] for _ in range(3 * CL)])
    logits = 0.3 * torch.randn(3 * CL, vocab, generator=gen)
    for row in range(3 * CL):
        logits[row, tops[row, : k_of.view(-1)[row]]] += 30.0
    rows = torch.cat([logits[i * CL: i * CL + e.valid_len] for i, e in enumerate(entries)])
    entropy = -(torch.softmax(rows.double(), -1) * torch.log_softmax(rows.double(), -1)).sum(-1)
    per_request, before = [], []
    start = 0
    for e in entries:
        ent = torch.cat([entropy[start: start + e.valid_len],
                         torch.full((CL - e.valid_len,), math.log(vocab), dtype=torch.float64)])
        start += e.valid_len
        srt = ent.sort().values
        per_request.append(ent)
        before.append(srt.cumsum(0) - srt)
    # A bound well away from every partial sum.
    sums = torch.cat(before).sort().values
    gaps = sums[1:] - sums[:-1]
    j = int(torch.argmax(torch.where(sums[1:] < 4.0, gaps, 0.0)))
    bound = float(sums[j] + sums[j + 1]) / 2
    assert float(gaps[j]) > 0.1

    pair = Pair(vocab_size=vocab, t_min=1.0, t_max=1.0, entropy_bound=bound,
                confidence_threshold=0.01)
    for s in range(3):
        pair.add(s)
    pair.step([Prefill(s, 4) for s in range(3)], torch.zeros(0, vocab))
    pair.step(entries, rows)
    coincidences = 0
    for i, e in enumerate(entries):
        ent = per_request[i]
        order = ent.argsort(stable=True)
        accepted = torch.zeros(CL, dtype=torch.bool)
        accepted[order] = before[i] <= bound
        assert 0 < int(accepted.sum()) < CL
        for h in (pair.ref, pair.ours):
            canvas = h.states.canvas[e.slot]
            for p in range(e.valid_len):
                in_top = int(canvas[p]) in tops[i * CL + p, : k_of[i, p]].tolist()
                if accepted[p]:
                    assert in_top, (h.sampler.__class__.__name__, e.slot, p)
                else:
                    coincidences += in_top
    assert coincidences <= 2  # a renoised token lands in a 1..5-token set 1% of the time


# ------------------------------------------------------------------------------------------
# Tensor parallelism: a rank's vocabulary slice of the soft embedding
# ------------------------------------------------------------------------------------------


def test_tensor_parallel_slices_of_the_soft_embedding():
    """Each tensor-parallel rank multiplies its own vocabulary slice ``[sc_vocab_start,
    sc_vocab_end)`` of the probabilities by its (padded) shard of the embedding; the ranks'
    partial sums add up to the whole. Two ranks are run one after the other with one rank's
    constructor arguments each (``tp_size`` 1: no all-reduce), beside vLLM's sampler built
    alike: each rank's partial soft embedding matches vLLM's, the padding rows of the shard
    are never read, and the two partials add up to the unsliced soft embedding. Exact
    scenario (every position takes its argmax), so the three runs share one trajectory."""
    gen = torch.Generator().manual_seed(12)
    embed = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    cut = 37  # not a multiple of any block size
    pad = torch.full((5, H), 1e4, dtype=torch.bfloat16)  # padding rows: never read
    shards = {"full": (0, V, embed), "rank0": (0, cut, torch.cat([embed[:cut], pad])),
              "rank1": (cut, V, torch.cat([embed[cut:], pad]))}
    entries = [Decode(0, CL), Decode(1, 5), Decode(2, 6)]
    rows = [2.0 * torch.randn(sum(e.valid_len for e in entries), V, generator=gen)
            for _ in range(4)]
    soft = {}
    for name, (start, end, weight) in shards.items():
        torch.manual_seed(12)
        pair = Pair(t_min=0.0, t_max=0.0, entropy_bound=BIG_BOUND, embed_weight=weight,
                    sc_vocab_start=start, sc_vocab_end=end)
        pair.add(0)
        pair.add(1, extra_args={"diffusion_canvas_length": 5})
        pair.add(2)
        pair.step([Prefill(s, 4) for s in range(3)], torch.zeros(0, V), exact=True)
        soft[name] = []
        for logits in rows:
            pair.step(entries, logits, exact=True)
            soft[name].append(pair.ours.states.self_conditioning_embeds[:3].clone())
    for full, a, b in zip(soft["full"], soft["rank0"], soft["rank1"]):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        kept = (full != 0).any(-1)
        assert kept.any()
        assert rel_frobenius((a + b)[kept], full[kept]) <= 1e-2


# ------------------------------------------------------------------------------------------
# vLLM 0.34: hidden states in, logits projected a tile at a time
# ------------------------------------------------------------------------------------------

needs_034 = pytest.mark.skipif(vh.RELEASE != "0.34", reason="vLLM 0.34's hidden-state input")
HID = 24  # the model's hidden size in the projection tests


def lm_head(seed: int = 13) -> torch.Tensor:
    return torch.randn(V, HID, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def add_mixed_requests(pair: Pair) -> list:
    """Five requests through prefill: top-k with top-n logprobs, top-p with logprobs of named
    ids and a narrow canvas, a step cap, a read-only request, a plain one; their decode entries
    (two truncated canvases)."""
    pair.add(0, top_k=5, logprobs=2, extra_args={"diffusion_max_steps": 3})
    pair.add(1, top_p=0.7, logprob_token_ids=[4, 9], extra_args={"diffusion_canvas_length": 5})
    pair.add(2, extra_args={"diffusion_max_steps": 4})
    pair.add(3, logprobs=1, extra_args={"diffusion_read_only": True, "diffusion_max_steps": 2})
    pair.add(4)
    pair.step([Prefill(s, 4) for s in range(5)], torch.zeros(0, HID))
    return [Decode(0, CL), Decode(1, 5), Decode(2, 6), Decode(3, CL), Decode(4, 7)]


def projected_pair(weight: torch.Tensor, **kw) -> Pair:
    """Both samplers built with DiffusionGemma's projection (bf16 tied head, softcap 30)."""
    return Pair(hidden=HID, embed_weight=weight,
                compute_logits=lambda states: vh.LmHeadProjection(states, weight), **kw)


@needs_034
@pytest.mark.parametrize("tile", [1, 2, 5], ids=["tile-1", "tile-2", "one-tile"])
def test_hidden_states_projected_per_tile(tile):
    """Hidden states through a bf16 LM head and the softcap, top-k / top-p, logprobs (top-n
    and ids), a narrow and a truncated canvas, a read-only request. vLLM pads each request
    to its tile's width and projects the tile; ours projects the valid rows of ``tile``
    requests at a time (budget from ``bytes_per_request`` with the projection's bytes),
    and the steps agree."""
    from dgemma_sampler.runner import bytes_per_request

    vh.set_free_memory(0)  # vLLM: one request per tile
    gen = torch.Generator().manual_seed(14)
    torch.manual_seed(14)
    weight = lm_head()
    pair = projected_pair(weight)
    runner = pair.ours.sampler.runner
    itemsize = weight.element_size() + 4  # the head's output and the fp32 softcapped copy
    runner.budget_bytes = tile * bytes_per_request(CL, V, itemsize)
    entries = add_mixed_requests(pair)
    targets = {e.slot: torch.randint(0, V, (e.valid_len,), generator=gen) for e in entries}
    projection = pair.ours.projection
    emitted = 0
    for j in range(5):
        hidden = torch.cat([
            (3.0 * weight[targets[e.slot]].float() if j else 0.0)
            + torch.randn(e.valid_len, HID, generator=gen) for e in entries])
        projection.calls.clear()
        out, _ = pair.step(entries, hidden)
        emitted += out.logprobs_tensors is not None
        n = len(entries)
        assert runner.last_tile_requests == min(tile, n)
        valid = [e.valid_len for e in entries]
        assert projection.calls == [sum(valid[t:t + tile]) for t in range(0, n, tile)]
        if 3 in [e.slot for e in entries] and int(out.num_sampled[3]) > 0:
            entries = [e for e in entries if e.slot != 3]  # a read-only request ends
            pair.remove(3)
    assert emitted >= 2


@needs_034
def test_hidden_states_shared_allowed_set():
    """A shared constrained set under 0.34: ``compute_logits`` projects onto the set's K rows
    of the head; both samplers read and report over the set alike."""
    torch.manual_seed(15)
    weight = lm_head(15)
    pair = projected_pair(weight)
    allowed = [30, 2, 17, 61, 8]
    for s in (0, 1):
        pair.add(s, logprob_token_ids=allowed, extra_args={"diffusion_constrained": True})
    pair.step([Prefill(0, 4), Prefill(1, 4)], torch.zeros(0, HID))
    entries = [Decode(1, CL), Decode(0, 7)]
    gen = torch.Generator().manual_seed(15)
    target = torch.tensor(allowed)[torch.randint(0, 5, (CL + 7,), generator=gen)]
    emitted = 0
    for j in range(4):
        assert pair.allowed(entries).tolist() == allowed
        hidden = (4.0 * weight[target].float() if j else 0.0) \
            + torch.randn(CL + 7, HID, generator=gen)
        out, _ = pair.step(entries, hidden)
        emitted += out.logprobs_tensors is not None
    assert emitted == 1


def model_pair(weight: torch.Tensor, **kw) -> tuple[Pair, vh.ModelComputeLogits,
                                                  vh.ModelComputeLogits]:
    """Both samplers built with DiffusionGemma's own ``compute_logits`` (a model each, one
    head): vLLM's calls it, ours projects through the model's ``lm_head.weight`` itself."""
    ref_head, our_head = vh.ModelComputeLogits(weight), vh.ModelComputeLogits(weight)
    heads = iter((ref_head, our_head))  # Pair builds vLLM's sampler first
    pair = Pair(hidden=HID, embed_weight=weight, logits_dtype=weight.dtype,
                compute_logits=lambda states: next(heads)(states), **kw)
    return pair, ref_head, our_head


@needs_034
def test_models_own_head_projected_by_the_adapter():
    """DiffusionGemma's ``compute_logits`` over a real (small) tied head: vLLM's sampler calls it
    (bf16 GEMM, fp32 softcapped copy); ours never does, and projects the head itself in bf16
    with the softcap in the kernels. Step by step the two agree as everywhere else (top-k /
    top-p, logprobs by top-n and by ids, a narrow and a truncated canvas, a read-only request),
    in tiles of one request and of all."""
    from dgemma_sampler.runner import bytes_per_request

    for tile in (1, 5):
        vh.set_free_memory(0)
        gen = torch.Generator().manual_seed(21)
        torch.manual_seed(21)
        weight = lm_head(21)
        pair, ref_head, our_head = model_pair(weight)
        assert pair.ours.sampler._model_head is not None  # recognised as DiffusionGemma's own
        runner = pair.ours.sampler.runner
        runner.budget_bytes = tile * bytes_per_request(CL, V, weight.element_size())
        entries = add_mixed_requests(pair)
        targets = {e.slot: torch.randint(0, V, (e.valid_len,), generator=gen) for e in entries}
        emitted = 0
        for j in range(5):
            hidden = torch.cat([
                (3.0 * weight[targets[e.slot]].float() if j else 0.0)
                + torch.randn(e.valid_len, HID, generator=gen) for e in entries]).to(torch.bfloat16)
            out, _ = pair.step(entries, hidden)
            emitted += out.logprobs_tensors is not None
            assert runner.last_tile_requests == min(tile, len(entries))
            if 3 in [e.slot for e in entries] and int(out.num_sampled[3]) > 0:
                entries = [e for e in entries if e.slot != 3]
                pair.remove(3)
        assert emitted >= 2
        assert ref_head.calls and not our_head.calls


@needs_034
def test_models_own_head_leaves_a_shared_set_to_compute_logits():
    """A shared constrained set: only ``compute_logits`` knows its K columns (it projects onto
    those rows of the head), so ours calls it there, and both samplers agree."""
    torch.manual_seed(22)
    weight = lm_head(22)
    pair, _, _ = model_pair(weight)
    allowed = [30, 2, 17, 61, 8]
    for s in (0, 1):
        pair.add(s, logprob_token_ids=allowed, extra_args={"diffusion_constrained": True})
    pair.step([Prefill(0, 4), Prefill(1, 4)], torch.zeros(0, HID))
    entries = [Decode(1, CL), Decode(0, 7)]
    gen = torch.Generator().manual_seed(22)
    target = torch.tensor(allowed)[torch.randint(0, 5, (CL + 7,), generator=gen)]
    for j in range(3):
        assert pair.allowed(entries).tolist() == allowed
        hidden = ((4.0 * weight[target].float() if j else 0.0)
                  + torch.randn(CL + 7, HID, generator=gen)).to(torch.bfloat16)
        pair.step(entries, hidden)
        # (the step's set is still on our states: compute_logits projected it)
        assert pair.ours.states.step_allowed is not None
        assert pair.ours.sampler._lm_head(np.array([0, 1])) is None
    pair.ours.states.step_allowed = None
    assert pair.ours.sampler._lm_head(np.array([0, 1])) is not None


@needs_034
def test_profile_run_goes_through_our_path():
    """0.34's ``profile_run`` (one dummy full-canvas request, then slot 0 reset): on ours it
    projects one request's canvas through the runner, and leaves the states as vLLM's does."""
    weight = lm_head(16)
    pair = projected_pair(weight)
    for h in (pair.ref, pair.ours):
        h.sampler.profile_run(torch.randn(3, HID))
    assert pair.ours.projection.calls == [CL]
    assert pair.ours.sampler.runner.last_tile_requests == 1
    for name in ("is_encoder_phase", "step", "accepted_canvas_history_len", "max_steps"):
        assert torch.equal(getattr(pair.ours.states, name), getattr(pair.ref.states, name)), name
    assert bool(pair.ours.states.is_encoder_phase[0])
    assert not pair.ours.states.self_conditioning_embeds.any()
