"""vLLM 0.33's own DiffusionGemma sampler, driven on the CPU through tests/vllm_harness.py.

These tests prove the harness runs vLLM's sampler end to end (prefill, denoise, converge, commit)
and pin the runner-facing behaviour our sampler must reproduce: what ``draft_tokens`` holds after
each step, ``num_sampled`` / ``num_rejected``, the logprobs stash, per-slot canvas widths and
truncated canvases. Logits are peaked (one token 30 nats above the rest) so every position is
near-deterministic: sample == argmax, entropy ~ 0, and the trajectory does not depend on noise.
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

pytestmark = pytest.mark.vllm

V, CL, H = 64, 8, 16
ST = 2  # vLLM's history depth: generation config stability_threshold 1, plus one


@pytest.fixture(autouse=True)
def _plenty_of_memory():
    vh.set_free_memory(64 << 30)
    yield
    vh.set_free_memory(64 << 30)


def make(**kw):
    args = dict(max_num_reqs=4, canvas_length=CL, vocab_size=V, hidden=H,
                max_denoising_steps=12, stability_threshold=ST, t_min=0.0, t_max=1.0,
                entropy_bound=1.0, confidence_threshold=0.5)
    args.update(kw)
    return vh.make_vllm_sampler(**args)


def random_targets(slots, gen):
    return {s: torch.randint(0, V, (CL,), generator=gen) for s in slots}


def run(h, entries, targets, gen):
    """One step with logits peaked at ``targets[slot][:valid_len]`` for every Decode entry."""
    batch = vh.make_input_batch(entries)
    rows = [targets[e.slot][: e.valid_len] for e in entries if isinstance(e, Decode)]
    if rows:
        logits = vh.peaked_logits(torch.cat(rows), V, generator=gen)
    else:
        logits = torch.zeros(0, V)
    before = h.snapshot()
    out = h.step(logits.clone(), batch)
    return out, before, h.snapshot(), logits


def test_prefill_step_finishes_whole_prompts_only():
    h = make()
    assert type(h.sampler).__module__ == "vllm.model_executor.models.diffusion_gemma"
    for s in range(3):
        h.add_request(s)
    assert h.states.is_encoder_phase[:3].all()
    batch = vh.make_input_batch([Prefill(0, 5), Prefill(1, 9, chunk=4), Prefill(2, 3)])
    assert batch.num_draft_tokens == 0
    out = h.step(torch.zeros(0, V), batch)

    # Prefill-only path: one zero column per request, nothing sampled or rejected.
    assert out.sampled_token_ids.shape == (3, 1) and (out.sampled_token_ids == 0).all()
    assert out.num_sampled.tolist() == [0, 0, 0]
    assert out.num_rejected.tolist() == [0, 0, 0]
    assert out.logprobs_tensors is None
    # Finished prompts start denoising from a fresh canvas copied to the drafts; the chunked one
    # stays in the encoder phase with its drafts untouched.
    assert h.states.is_encoder_phase[:3].tolist() == [False, True, False]
    for s in (0, 2):
        assert torch.equal(h.draft_tokens[s], h.states.canvas[s])
        assert int(h.draft_tokens[s].min()) >= 0 and int(h.draft_tokens[s].max()) < V
    assert (h.draft_tokens[1] == 0).all()

    out = h.step(torch.zeros(0, V), vh.make_input_batch([Prefill(1, 9, chunk=5, computed=4)]))
    assert not h.states.is_encoder_phase[1]
    assert torch.equal(h.draft_tokens[1], h.states.canvas[1])


def test_trajectory_denoise_converge_commit():
    """3 requests, one still prefilling during the first decode step: each denoises ST steps,
    converges, commits its argmax canvas, and starts the next block."""
    gen = torch.Generator().manual_seed(11)
    h = make()
    for s in range(3):
        h.add_request(s)
    run(h, [Prefill(0, 5), Prefill(1, 6), Prefill(2, 9, chunk=4)], {}, gen)
    targets = random_targets(range(3), gen)

    # Step 1: mixed batch. Slot 2 finishes its prompt here (no logit rows for it).
    out, before, after, _ = run(h, [Decode(0, CL), Decode(1, CL), Prefill(2, 9, chunk=5, computed=4)],
                                targets, gen)
    assert out.sampled_token_ids.shape == (3, CL)
    assert out.num_sampled.tolist() == [0, 0, 0]
    # A denoise step rejects its whole query (the canvas KV is not kept); a prefill rejects none.
    assert out.num_rejected.tolist() == [CL, CL, 0]
    assert after["is_encoder_phase"][:3].tolist() == [False, False, False]
    assert after["step"][:3].tolist() == [1, 1, 0]
    for s in (0, 1):
        assert torch.equal(after["argmax_canvas"][s], targets[s])
        # Peaked rows are all accepted, so the next input canvas is the sample == argmax.
        assert torch.equal(after["canvas"][s], targets[s])
        assert torch.equal(after["draft_tokens"][s], after["canvas"][s])
    assert torch.equal(after["draft_tokens"][2], after["canvas"][2])

    phases = {s: [] for s in range(3)}
    emitted = {s: [] for s in range(3)}
    for _ in range(6):
        entries = [Decode(s, CL) for s in range(3)]
        out, before, after, _ = run(h, entries, targets, gen)
        for i, s in enumerate(range(3)):
            committing = bool(before["is_encoder_phase"][s])
            n = int(out.num_sampled[i])
            if committing:
                phases[s].append("commit")
                emitted[s].append(out.sampled_token_ids[i].tolist())
                assert n == CL
                assert torch.equal(out.sampled_token_ids[i].long(), before["argmax_canvas"][s])
                assert int(out.num_rejected[i]) == 0
                assert not after["is_encoder_phase"][s]
                assert int(after["step"][s]) == 0 and int(after["history_len"][s]) == 0
                # The next block starts from a fresh canvas, and the drafts carry it.
                assert torch.equal(after["draft_tokens"][s], after["canvas"][s])
                assert (after["sc_embeds"][s] == 0).all()
            else:
                converged = bool(after["is_encoder_phase"][s])
                phases[s].append("converge" if converged else "denoise")
                assert n == 0 and (out.sampled_token_ids[i] == 0).all()
                assert int(out.num_rejected[i]) == CL
                assert int(after["step"][s]) == int(before["step"][s]) + 1
                if converged:
                    # The converging step overwrites the canvas with the argmax canvas: the commit
                    # forward reads exactly the tokens that will be emitted.
                    assert torch.equal(after["canvas"][s], after["argmax_canvas"][s])
                    assert torch.equal(after["draft_tokens"][s], targets[s])
                    assert (after["sc_embeds"][s] == 0).all()
    # Slots 0/1 had one denoise step already, slot 2 none: with ST=2 each converges on its
    # second denoise step, commits on the next, and starts over.
    assert phases[0] == ["converge", "commit", "denoise", "converge", "commit", "denoise"]
    assert phases[1] == phases[0]
    assert phases[2] == ["denoise", "converge", "commit", "denoise", "converge", "commit"]
    for s in range(3):
        assert emitted[s] == [targets[s].tolist()] * 2


def test_per_request_width_and_truncated_canvas():
    """A request asking for a narrower canvas (extra_args) runs in its own tile at that width; a
    canvas truncated below its width (near max_model_len) pads phantom uniform rows, whose entropy
    keeps the mean above the confidence threshold, so it only converges at its step cap."""
    gen = torch.Generator().manual_seed(5)
    h = make()
    h.add_request(0)
    h.add_request(1, extra_args={"diffusion_canvas_length": 5})
    h.add_request(2, extra_args={"diffusion_max_steps": 4})
    assert h.states.canvas_width_np[:3].tolist() == [CL, 5, CL]
    assert h.states.max_steps[:3].tolist() == [12, 12, 4]
    run(h, [Prefill(s, 4) for s in range(3)], {}, gen)
    targets = random_targets(range(3), gen)
    valid = {0: CL, 1: 5, 2: 6}

    commits = {s: None for s in range(3)}
    for step in range(1, 7):
        out, before, after, _ = run(h, [Decode(s, valid[s]) for s in range(3)], targets, gen)
        for i in range(3):
            if before["is_encoder_phase"][i] and commits[i] is None:
                commits[i] = step
                k = valid[i]
                assert int(out.num_sampled[i]) == k
                assert out.sampled_token_ids[i, :k].tolist() == targets[i][:k].tolist()
                assert (out.sampled_token_ids[i, k:] == 0).all()
                assert int(out.num_rejected[i]) == 0
            elif not before["is_encoder_phase"][i]:
                assert int(out.num_rejected[i]) == valid[i]
        if step == 1:
            # Phantom rows 6, 7 of slot 2: zero logits, so uniform: argmax 0, entropy log V, and
            # the mean entropy over the full width stays above the threshold.
            assert after["argmax_canvas"][2, 6:].tolist() == [0, 0]
            assert not after["confident"][2]
            assert after["confident"][0] and after["confident"][1]
    # Width 5 and width 8 converge at ST=2 and commit at step 3; the truncated canvas waits for
    # its cap of 4 denoise steps and commits at step 5.
    assert commits == {0: 3, 1: 3, 2: 5}


def test_logprobs_stashed_at_convergence_and_emitted_on_commit():
    gen = torch.Generator().manual_seed(3)
    h = make()
    h.add_request(0)
    h.add_request(1, logprobs=2)
    run(h, [Prefill(0, 4), Prefill(1, 4)], {}, gen)
    targets = random_targets(range(2), gen)
    entries = [Decode(0, CL), Decode(1, CL)]

    out, *_ = run(h, entries, targets, gen)
    assert out.logprobs_tensors is None
    out, before, after, logits = run(h, entries, targets, gen)  # converges (ST=2)
    assert after["is_encoder_phase"][:2].all()
    assert out.logprobs_tensors is None  # stashed, not emitted
    # Logprobs are of the temperature-scaled logits of the converging step.
    n = int(before["step"][0])
    temp = max(12 - n, 1) / 12
    expected = torch.log_softmax(logits.double() / temp, dim=-1)

    out, *_ = run(h, entries, targets, gen)  # commit (the logits of this step are not used)
    lp = out.logprobs_tensors
    assert lp is not None
    # Every converging request in a batch that wants logprobs gets a stash, also slot 0 that did
    # not ask; the output processor drops it. Start offsets per request, num_reqs long.
    assert lp.logprob_token_ids.shape == (2 * CL, 1 + 2)
    assert lp.cu_num_generated_tokens == [0, CL]
    # Column 0 is the emitted (argmax) token, then the top-2.
    assert torch.equal(lp.logprob_token_ids[:, 0], torch.cat([targets[0], targets[1]]))
    assert torch.equal(lp.logprob_token_ids[:, 1], lp.logprob_token_ids[:, 0])
    assert lp.selected_token_ranks.tolist() == [1] * (2 * CL)
    ref = expected.gather(1, lp.logprob_token_ids.long()).float()
    torch.testing.assert_close(lp.logprobs, ref, rtol=1e-4, atol=1e-4)
    assert h.sampler._pending_logprobs == {}


def test_tiling_does_not_change_outputs():
    """With no free memory the sampler runs one request per tile; deterministic outputs match."""
    results = []
    for free in (64 << 30, 0):
        vh.set_free_memory(free)
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(8)
        h = make()
        h.add_request(0)
        h.add_request(1, extra_args={"diffusion_canvas_length": 6})
        h.add_request(2)
        run(h, [Prefill(s, 3) for s in range(3)], {}, gen)
        targets = random_targets(range(3), gen)
        trace = []
        for _ in range(4):
            out, _, after, _ = run(h, [Decode(0, CL), Decode(1, 6), Decode(2, 7)], targets, gen)
            trace.append((out.sampled_token_ids.tolist(), out.num_sampled.tolist(),
                          out.num_rejected.tolist(), after["is_encoder_phase"].tolist(),
                          after["step"].tolist(), after["argmax_canvas"].tolist()))
        results.append(trace)
    assert results[0] == results[1]


def test_self_conditioning_embedding():
    """After a denoise step that does not converge, the slot holds
    normalizer * softmax(logits / T) @ E over its canvas (probs and matmul in E's dtype)."""
    gen = torch.Generator().manual_seed(21)
    E = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    h = make(embed_weight=E, normalizer=math.sqrt(H))
    h.add_request(0)
    run(h, [Prefill(0, 4)], {}, gen)
    batch = vh.make_input_batch([Decode(0, CL)])
    logits = torch.randn(CL, V, generator=gen) * 2.0  # flat enough not to converge
    h.step(logits.clone(), batch)
    assert not h.states.is_encoder_phase[0]
    probs = torch.softmax(logits.double() / 1.0, dim=-1)
    expected = math.sqrt(H) * probs @ E.double()
    got = h.states.self_conditioning_embeds[0].double()
    assert h.states.self_conditioning_embeds.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)


def test_single_step_cap_converges_immediately():
    """diffusion_max_steps=1: the first denoise step converges whatever the entropy, and the
    self-conditioning matmul is skipped (every slot of the tile ends)."""
    gen = torch.Generator().manual_seed(2)
    h = make()
    h.add_request(0, extra_args={"diffusion_max_steps": 1})
    run(h, [Prefill(0, 4)], {}, gen)
    batch = vh.make_input_batch([Decode(0, CL)])
    logits = torch.randn(CL, V, generator=gen)  # high entropy
    out = h.step(logits.clone(), batch)
    assert h.states.is_encoder_phase[0] and not h.states.confident[0]
    argmax = logits.argmax(dim=-1)
    assert torch.equal(h.states.argmax_canvas[0], argmax)
    assert torch.equal(h.draft_tokens[0], argmax)
    assert (h.states.self_conditioning_embeds[0] == 0).all()
    out = h.step(torch.randn(CL, V, generator=gen), batch)
    assert out.num_sampled.tolist() == [CL]
    assert torch.equal(out.sampled_token_ids[0].long(), argmax)
    np.testing.assert_array_equal(out.num_rejected.numpy(), [0])
