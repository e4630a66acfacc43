"""Every public entry point refuses bad input with an error naming the argument (issue #38).

The rule (``dgemma_sampler/checks.py``): a wrong type is a TypeError; a wrong value, shape,
device, a NaN or an out-of-order call a ValueError; nothing is converted (a bool is not an int,
an int is not a bool, a float is not a width) and a refused call changes nothing. One table per
entry point; the entry points that take a backend run their table on both. No kernel runs: every
call is refused first, so the Triton cases cost nothing through the interpreter.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dgemma_sampler as ds
from dgemma_sampler import tensor_parallel as tp

R, W, V, H = 2, 3, 50, 8
NAN, INF = float("nan"), float("inf")
META = "meta"  # a device no argument is ever on: the wrong-device cases


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """``(backend, device)``: Triton on CUDA, or through the interpreter on the CPU."""
    if request.param == "triton":
        return "triton", request.getfixturevalue("interpret")
    return "torch", "cpu"


def on(device, value):
    """A table value on the test's device: a callable is built there (strided views), a CPU
    tensor moved there; meta tensors (the wrong-device cases) and other values stay as they are."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return value(device)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return value.to(device)
    return value


def build(device, base: dict, over: dict) -> dict:
    return {k: on(device, v) for k, v in {**base, **over}.items()}


def snapshot(state: ds.DiffusionState) -> dict:
    """Every tensor, host mirror and counter of a state (and its seed generator)."""
    out = {"_seed_source": state._seed_source.get_state()}
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            out[name] = value.clone()
        elif isinstance(value, (np.ndarray, set, dict, int)):
            out[name] = copy.deepcopy(value)
    return out


def assert_unchanged(before: dict, state: ds.DiffusionState) -> None:
    after = snapshot(state)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[name]), name
        elif isinstance(value, np.ndarray):
            assert np.array_equal(value, after[name]), name
        else:
            assert value == after[name], name


# --------------------------------------------------------------------------- SamplerConfig


@pytest.mark.parametrize("over, exc, match", [
    (dict(t_min=0.9, t_max=0.4), ValueError, "SamplerConfig.t_min must be <= t_max"),
    (dict(t_min=-0.1), ValueError, "SamplerConfig.t_min must be a finite float >= 0"),
    (dict(t_min=NAN), ValueError, "SamplerConfig.t_min"),
    (dict(t_max=INF), ValueError, "SamplerConfig.t_max"),
    (dict(t_min="0.4"), TypeError, "SamplerConfig.t_min must be a real number"),
    (dict(t_max=True), TypeError, "SamplerConfig.t_max must be a real number"),
    (dict(entropy_bound=0.0), ValueError, "SamplerConfig.entropy_bound"),
    (dict(entropy_bound=-1.0), ValueError, "SamplerConfig.entropy_bound"),
    (dict(entropy_bound=None), TypeError, "SamplerConfig.entropy_bound"),
    (dict(confidence_threshold=NAN), ValueError, "SamplerConfig.confidence_threshold"),
    (dict(confidence_threshold=-0.1), ValueError, "SamplerConfig.confidence_threshold"),
    (dict(stability_threshold=-1), ValueError, "SamplerConfig.stability_threshold"),
    (dict(stability_threshold=True), TypeError, "SamplerConfig.stability_threshold must be an int"),
    (dict(max_denoising_steps=0), ValueError, "SamplerConfig.max_denoising_steps"),
    (dict(max_denoising_steps=48.0), TypeError, "SamplerConfig.max_denoising_steps must be an int"),
    (dict(canvas_length=0), ValueError, "SamplerConfig.canvas_length"),
    (dict(canvas_length=3.0), TypeError, "SamplerConfig.canvas_length must be an int"),
    (dict(canvas_length="256"), TypeError, "SamplerConfig.canvas_length must be an int"),
    (dict(softcap=0.0), ValueError, "SamplerConfig.softcap"),
    (dict(softcap=INF), ValueError, "SamplerConfig.softcap"),
    (dict(softcap=True), TypeError, "SamplerConfig.softcap"),
    (dict(tail_eps=1.0), ValueError, "SamplerConfig.tail_eps"),
    (dict(tail_eps=NAN), ValueError, "SamplerConfig.tail_eps"),
    (dict(tail_eps="0"), TypeError, "SamplerConfig.tail_eps"),
])
def test_sampler_config_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        ds.SamplerConfig(**over)


@pytest.mark.parametrize("steps_done, exc, match", [
    (True, TypeError, "steps_done must be a number or a tensor"),
    ("3", TypeError, "steps_done must be a number or a tensor"),
    (None, TypeError, "steps_done must be a number or a tensor"),
    (-1, ValueError, "steps_done must be a finite number >= 0"),
    (NAN, ValueError, "steps_done must be a finite number >= 0"),
])
def test_sampler_config_temperature_rejects(steps_done, exc, match):
    with pytest.raises(exc, match=match):
        ds.SamplerConfig().temperature(steps_done)


def test_sampler_config_takes_numpy_scalars_as_their_value():
    cfg = ds.SamplerConfig(t_min=np.float32(0.25), canvas_length=np.int64(8),
                           stability_threshold=np.int32(2))
    assert cfg == ds.SamplerConfig(t_min=0.25, canvas_length=8, stability_threshold=2)
    assert type(cfg.canvas_length) is int and type(cfg.t_min) is float


# --------------------------------------------------------------------------- row_stats


def row_stats_base():
    return dict(logits=torch.randn(R, W, V), temperature=torch.tensor([0.5, 1.0]),
                seeds=torch.tensor([1, 2]), draws=torch.tensor([0, 0]))


@pytest.mark.parametrize("over, exc, match", [
    (dict(logits=torch.randn(R, V)), ValueError, "logits must be 3-D"),
    (dict(logits=torch.randint(0, 5, (R, W, V))), TypeError, "logits must have dtype"),
    (dict(logits=lambda d: torch.randn(R, W, 2 * V, device=d)[..., ::2]), ValueError,
     "contiguous in the vocabulary"),
    (dict(logits=torch.randn(R, W, 0)), ValueError, "non-empty vocabulary"),
    (dict(logits=[[0.0]]), TypeError, "logits must be a torch.Tensor"),
    (dict(temperature=torch.tensor([0.5])), ValueError, "temperature must have shape"),
    (dict(temperature=torch.tensor([0.5, -1.0])), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([0.5, NAN])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([0.5, INF])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([0.5, 1.0], dtype=torch.float64)), TypeError,
     "temperature must have dtype"),
    (dict(temperature=torch.tensor([0.5, 1.0], device=META)), ValueError, "temperature must be on"),
    (dict(temperature=0.5), TypeError, "temperature must be a torch.Tensor"),
    (dict(seeds=torch.tensor([1.0, 2.0])), TypeError, "seeds must have dtype"),
    (dict(seeds=[1, 2]), TypeError, "seeds must be a torch.Tensor"),
    (dict(draws=torch.tensor([0])), ValueError, "draws must have shape"),
    (dict(draws=torch.tensor([0, 0], dtype=torch.int32)), TypeError, "draws must have dtype"),
    (dict(top_k=torch.tensor([-1, 3])), ValueError, "top_k must be >= 0"),
    (dict(top_k=torch.tensor([1.0, 3.0])), TypeError, "top_k must have dtype"),
    (dict(top_p=torch.tensor([0.0, 0.5])), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([0.5, 1.5])), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([0.5, NAN])), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(allowed=torch.ones(R, V + 1, dtype=torch.bool)), ValueError, "allowed must have shape"),
    (dict(allowed=torch.ones(R, V)), TypeError, "allowed must have dtype"),
    (dict(softcap=-1.0), ValueError, "softcap must be"),
    (dict(softcap=INF), ValueError, "softcap must be"),
    (dict(softcap=NAN), ValueError, "softcap must be"),
    (dict(softcap="30"), TypeError, "softcap must be"),
    (dict(softcap=True), TypeError, "softcap must be"),
    (dict(sample_block=100), ValueError, "sample_block must be a power of two"),
    (dict(sample_block=8), ValueError, "sample_block must be a power of two"),
    (dict(sample_block=4096.0), TypeError, "sample_block must be an int"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend=1), TypeError, "backend must be a str"),
])
def test_row_stats_rejects(over, exc, match, backend):
    name, device = backend
    with pytest.raises(exc, match=match):
        ds.row_stats(**build(device, {**row_stats_base(), "backend": name}, over))


def test_triton_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ds.row_stats(**row_stats_base(), backend="triton")


# --------------------------------------------------------------------------- soft_embedding


def soft_base():
    return dict(logits=torch.randn(R, W, V), temperature=torch.tensor([0.5, 1.0]),
                lse=torch.zeros(R, W), embed_weight=torch.randn(V, H), normalizer=2.0)


@pytest.mark.parametrize("over, exc, match", [
    (dict(logits=torch.randn(R, W, V).to(torch.int32)), TypeError, "logits must have dtype"),
    (dict(logits=torch.randn(R, W)), ValueError, "logits must be 3-D"),
    (dict(temperature=torch.tensor([0.5, NAN])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([0.5, -0.1])), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([0.5, INF])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([0.5])), ValueError, "temperature must have shape"),
    (dict(lse=torch.zeros(1, W)), ValueError, "lse must have shape"),
    (dict(lse=torch.zeros(R, W, dtype=torch.float64)), TypeError, "lse must have dtype"),
    (dict(lse=torch.zeros(R, W, device=META)), ValueError, "lse must be on"),
    (dict(embed_weight=torch.randn(V + 1, H)), ValueError, "must lie inside the logits vocabulary"),
    (dict(embed_weight=torch.randn(V, H).to(torch.int8)), TypeError, "embed_weight must have dtype"),
    (dict(embed_weight=lambda d: torch.randn(H, V, device=d).t()), ValueError,
     "embed_weight must be contiguous"),
    (dict(vocab_start=1), ValueError, "must lie inside"),
    (dict(vocab_start=-1), ValueError, "must lie inside"),
    (dict(vocab_start=1.0), TypeError, "vocab_start must be an int"),
    (dict(vocab_start=True), TypeError, "vocab_start must be an int"),
    (dict(normalizer=NAN), ValueError, "normalizer must be finite"),
    (dict(normalizer=-INF), ValueError, "normalizer must be finite"),
    (dict(normalizer="1"), TypeError, "normalizer must be a float"),
    (dict(normalizer=True), TypeError, "normalizer must be a float"),
    (dict(normalizer=torch.ones(2)), ValueError, "normalizer must be a scalar"),
    (dict(normalizer=torch.tensor(NAN)), ValueError, "normalizer must be finite"),
    (dict(normalizer=torch.tensor([INF])), ValueError, "normalizer must be finite"),
    (dict(normalizer=torch.tensor(2)), TypeError, "normalizer must be a float or a 1-element floating"),
    (dict(normalizer=torch.tensor(2.0, device=META)), ValueError, "normalizer must be on"),
    (dict(keep=torch.ones(R, W)), TypeError, "keep must have dtype"),
    (dict(keep=torch.ones(R, W + 1, dtype=torch.bool)), ValueError, "keep must have shape"),
    (dict(threshold=torch.zeros(R, W, dtype=torch.float64)), TypeError, "threshold must have dtype"),
    (dict(allowed=torch.ones(R + 1, V, dtype=torch.bool)), ValueError, "allowed must have shape"),
    (dict(softcap=-1.0), ValueError, "softcap must be None"),
    (dict(softcap=INF), ValueError, "softcap must be None"),
    (dict(softcap="1"), TypeError, "softcap must be None"),
    (dict(tail_eps=1.0), ValueError, "tail_eps must be"),
    (dict(tail_eps=NAN), ValueError, "tail_eps must be"),
    (dict(tail_eps="0"), ValueError, "tail_eps must be"),
    (dict(argmax=torch.zeros(R, W)), TypeError, "argmax must have dtype"),
    (dict(entropy=torch.zeros(R)), ValueError, "entropy must have shape"),
    (dict(out=torch.empty(R, W, H, dtype=torch.float64)), TypeError, "out must have dtype"),
    (dict(out=torch.empty(R, W, H + 1)), ValueError, "out must have shape"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
])
def test_soft_embedding_rejects(over, exc, match, backend):
    """Refused before the backend runs (the Triton kernels only assert): ``out`` is untouched."""
    name, device = backend
    out = torch.full((R, W, H), 7.0, device=device)
    call = build(device, {**soft_base(), "out": out, "backend": name}, over)
    with pytest.raises(exc, match=match):
        ds.soft_embedding(**call)
    assert (out == 7.0).all()


# --------------------------------------------------------------------------- DiffusionState


@pytest.mark.parametrize("over, exc, match", [
    (dict(max_num_reqs=0), ValueError, "max_num_reqs must be an int >= 1"),
    (dict(max_num_reqs=True), TypeError, "max_num_reqs must be an int"),
    (dict(max_num_reqs=2.0), TypeError, "max_num_reqs must be an int"),
    (dict(cfg={}), TypeError, "cfg must be a SamplerConfig"),
    (dict(cfg=None), TypeError, "cfg must be a SamplerConfig"),
    (dict(vocab_size=0), ValueError, "vocab_size must be an int >= 1"),
    (dict(vocab_size="50"), TypeError, "vocab_size must be an int"),
    (dict(hidden_size=-8), ValueError, "hidden_size must be an int >= 1"),
    (dict(hidden_size=8.0), TypeError, "hidden_size must be an int"),
    (dict(device=0), TypeError, "device must be a torch.device or a str"),
    (dict(device="no-such-device"), ValueError, "device must name a device"),
])
def test_diffusion_state_rejects(over, exc, match):
    call = {"max_num_reqs": 3, "cfg": ds.SamplerConfig(canvas_length=W), "vocab_size": V,
            "hidden_size": H, "device": "cpu", **over}
    with pytest.raises(exc, match=match):
        ds.DiffusionState(**call)


def make_state(device="cpu", max_num_reqs=4):
    """Slot 0 prefilled, slot 1 added (waiting for its prefill), the others free."""
    cfg = ds.SamplerConfig(canvas_length=W, max_denoising_steps=5)
    state = ds.DiffusionState(max_num_reqs, cfg, V, H, device)
    state.add_request(0, seed=1)
    state.add_request(1, seed=2)
    state.finish_prefill([0])
    return state


@pytest.mark.parametrize("args, over, exc, match", [
    ((4,), {}, ValueError, r"slot must be an int in \[0, 4\)"),
    ((-1,), {}, ValueError, r"slot must be an int in \[0, 4\)"),
    ((True,), {}, TypeError, "slot must be an int"),
    ((1.0,), {}, TypeError, "slot must be an int"),
    ((2,), dict(seed=True), TypeError, "seed must be a 64-bit integer"),
    ((2,), dict(seed=1.5), TypeError, "seed must be a 64-bit integer"),
    ((2,), dict(seed="7"), TypeError, "seed must be a 64-bit integer"),
    ((2,), dict(seed=2**64), ValueError, "seed must be a 64-bit integer"),
    ((2,), dict(seed=-(2**63) - 1), ValueError, "seed must be a 64-bit integer"),
    ((2,), dict(max_steps=0), ValueError, "max_steps must be an int >= 1"),
    ((2,), dict(max_steps=-3), ValueError, "max_steps must be an int >= 1"),
    ((2,), dict(max_steps=True), TypeError, "max_steps must be an int"),
    ((2,), dict(max_steps=2.0), TypeError, "max_steps must be an int"),
    ((2,), dict(canvas_width=0), ValueError, r"canvas_width must be an int in \[1, 4\)"),
    ((2,), dict(canvas_width=W + 1), ValueError, r"canvas_width must be an int in \[1, 4\)"),
    ((2,), dict(canvas_width=3.0), TypeError, "canvas_width must be an int"),
    ((2,), dict(canvas_width=True), TypeError, "canvas_width must be an int"),
    ((2,), dict(seed_canvas=[1, 2]), ValueError, "seed_canvas must hold exactly 3"),
    ((2,), dict(seed_canvas=[1, 2], canvas_width=3), ValueError, "seed_canvas must hold exactly 3"),
    ((2,), dict(seed_canvas=[1, 2, V]), ValueError, r"seed_canvas ids must be in \[0, 50\)"),
    ((2,), dict(seed_canvas=[1, 2, -1]), ValueError, r"seed_canvas ids must be in \[0, 50\)"),
    ((2,), dict(seed_canvas=[1.0, 2, 3]), TypeError, r"seed_canvas\[0\] must be an int"),
    ((2,), dict(seed_canvas=[1, True, 3]), TypeError, r"seed_canvas\[1\] must be an int"),
    ((2,), dict(seed_canvas="123"), TypeError, "seed_canvas must be a sequence of ints"),
    ((2,), dict(seed_canvas=7), TypeError, "seed_canvas must be a sequence of ints"),
    ((2,), dict(seed_canvas=torch.tensor([1.0, 2.0, 3.0])), TypeError, "seed_canvas must be a 1-D integer"),
    ((2,), dict(seed_canvas=np.array([[1, 2, 3]])), TypeError, "seed_canvas must be a 1-D integer"),
    ((2,), dict(pinned=[0]), ValueError, "pinned positions need a seed_canvas"),
    ((2,), dict(seed_canvas=[1, 2, 3], pinned=[3]), ValueError, r"pinned positions must be in \[0, 3\)"),
    ((2,), dict(seed_canvas=[1, 2], canvas_width=2, pinned=[2]), ValueError,
     r"pinned positions must be in \[0, 2\)"),
    ((2,), dict(seed_canvas=[1, 2, 3], pinned=[-1]), ValueError, "pinned positions must be in"),
    ((2,), dict(seed_canvas=[1, 2, 3], pinned=[0.0]), TypeError, r"pinned\[0\] must be an int"),
    ((2,), dict(read_only="yes"), TypeError, "read_only must be a bool"),
    ((2,), dict(read_only=1), TypeError, "read_only must be a bool"),
    ((2,), dict(read_only=None), TypeError, "read_only must be a bool"),
    ((2,), dict(allowed_ids=[V]), ValueError, "allowed_ids must be a non-empty set"),
    ((2,), dict(allowed_ids=[]), ValueError, "allowed_ids must be a non-empty set"),
    ((2,), dict(allowed_ids=[1.5]), TypeError, r"allowed_ids\[0\] must be an int"),
    ((2,), dict(allowed_ids="12"), TypeError, "allowed_ids must be a sequence of ints"),
    ((2,), dict(top_k=-2), ValueError, "top_k must be an int >= 0"),
    ((2,), dict(top_k=True), TypeError, "top_k must be an int"),
    ((2,), dict(top_k=2.5), TypeError, "top_k must be an int"),
    ((2,), dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    ((2,), dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    ((2,), dict(top_p=NAN), ValueError, r"top_p must be in \(0, 1\]"),
    ((2,), dict(top_p=True), TypeError, "top_p must be a real number"),
    ((2,), dict(top_p="0.5"), TypeError, "top_p must be a real number"),
    # A request already in the slot is untouched when its replacement is refused.
    ((0,), dict(top_p=2.0), ValueError, r"top_p must be in \(0, 1\]"),
    ((1,), dict(seed_canvas=[V, 0, 0]), ValueError, "seed_canvas ids"),
])
def test_add_request_rejects(args, over, exc, match):
    state = make_state()
    before = snapshot(state)
    with pytest.raises(exc, match=match):
        state.add_request(*args, **over)
    assert_unchanged(before, state)


def test_add_request_takes_numpy_integers_and_flags_as_their_value():
    state = make_state()
    state.add_request(np.int64(2), seed=np.uint64(2**64 - 1), max_steps=np.int32(100),
                      canvas_width=np.int64(2), seed_canvas=np.array([4, 5]), pinned=(np.int16(1),),
                      read_only=np.bool_(True), allowed_ids=torch.tensor([9, 3, 9]),
                      top_k=np.int64(3), top_p=np.float32(0.5))
    assert state.seeds[2].item() == -1  # the unsigned seed keeps its bits
    assert state.max_steps[2].item() == 5  # a request's cap only lowers the config's
    assert state.canvas_width_np[2] == 2 and state.seed_canvas[2, :2].tolist() == [4, 5]
    assert state.pin_mask[2].tolist() == [False, True, False] and 2 in state.read_only_slots
    assert state.constrained[2] == (3, 9) and state.top_k_np[2] == 3 and state.top_p_np[2] == 0.5


@pytest.mark.parametrize("method, args, exc, match", [
    ("finish_prefill", ([4],), ValueError, r"slots\[0\] must be an int in \[0, 4\)"),
    ("finish_prefill", ([True],), TypeError, r"slots\[0\] must be an int"),
    ("finish_prefill", ([1.0],), TypeError, r"slots\[0\] must be an int"),
    ("finish_prefill", ("1",), TypeError, "slots must be a sequence of ints"),
    ("finish_prefill", (1,), TypeError, "slots must be a sequence of ints"),
    ("finish_prefill", (torch.tensor([1.0]),), TypeError, "slots must be a 1-D integer tensor"),
    ("finish_prefill", ([2],), ValueError, "slot 2 holds no request"),
    ("finish_prefill", ([1, 1],), ValueError, "slots must not repeat"),
    ("finish_prefill", ([1, 0],), ValueError, "slot 0 was already prefilled"),
    ("remove_request", (4,), ValueError, r"slot must be an int in \[0, 4\)"),
    ("remove_request", (True,), TypeError, "slot must be an int"),
    ("check_slot", (np.float64(1.0),), TypeError, "slot must be an int"),
])
def test_state_methods_reject(method, args, exc, match):
    state = make_state()
    before = snapshot(state)
    with pytest.raises(exc, match=match):
        getattr(state, method)(*args)
    assert_unchanged(before, state)


# --------------------------------------------------------------------------- DiffusionSampler


def sampler_base(device):
    state = make_state(device)
    return dict(cfg=state.cfg, state=state, embed_weight=torch.randn(V, H, device=device),
                normalizer=2.0)


@pytest.mark.parametrize("over, exc, match", [
    (dict(cfg={}), TypeError, "cfg must be a SamplerConfig"),
    (dict(cfg=ds.SamplerConfig(canvas_length=W, max_denoising_steps=6)), ValueError,
     r"cfg must be the state's configuration \(state.cfg\)"),
    (dict(state=object()), TypeError, "state must be a DiffusionState"),
    (dict(embed_weight=torch.randn(V, H + 1)), ValueError, "embed_weight must have hidden size 8"),
    (dict(embed_weight=torch.randn(V + 1, H)), ValueError, "must lie inside the state's vocabulary of 50"),
    (dict(embed_weight=torch.randn(V, H), vocab_start=1), ValueError,
     "must lie inside the state's vocabulary"),
    (dict(embed_weight=torch.randn(V - 1, H), vocab_start=-1), ValueError, "must lie inside"),
    (dict(vocab_start=0.0), TypeError, "vocab_start must be an int"),
    (dict(embed_weight=torch.randn(V, H).to(torch.int8)), TypeError, "embed_weight must have dtype"),
    (dict(embed_weight=torch.randn(V, H, device=META)), ValueError, "embed_weight must be on"),
    (dict(embed_weight=np.zeros((V, H))), TypeError, "embed_weight must be a torch.Tensor"),
    (dict(normalizer=NAN), ValueError, "normalizer must be finite"),
    (dict(normalizer=INF), ValueError, "normalizer must be finite"),
    (dict(normalizer="2"), TypeError, "normalizer must be a float"),
    (dict(normalizer=torch.ones(2)), ValueError, "normalizer must be a scalar"),
    (dict(normalizer=torch.tensor(NAN)), ValueError, "normalizer must be finite"),
    (dict(normalizer=torch.tensor(2)), TypeError, "normalizer must be a float or a 1-element floating"),
    (dict(normalizer=torch.tensor(2.0, device=META)), ValueError, "normalizer must be on"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend=None), TypeError, "backend must be a str"),
    (dict(sc_reduce=3), TypeError, "sc_reduce must be None or callable"),
    (dict(memory_fraction=0.0), ValueError, r"memory_fraction must be in \(0, 1\]"),
    (dict(memory_fraction=1.5), ValueError, r"memory_fraction must be in \(0, 1\]"),
    (dict(memory_fraction=NAN), ValueError, "memory_fraction must be finite"),
    (dict(memory_fraction="0.5"), TypeError, "memory_fraction must be a real number"),
    (dict(budget_bytes=0), ValueError, "budget_bytes must be an int >= 1"),
    (dict(budget_bytes=1.5), TypeError, "budget_bytes must be an int"),
    (dict(graph_update="no"), TypeError, "graph_update must be a bool"),
])
def test_diffusion_sampler_rejects(over, exc, match, backend):
    name, device = backend
    call = build(device, {**sampler_base(device), "backend": name}, over)
    with pytest.raises(exc, match=match):
        ds.DiffusionSampler(**call)


def make_sampler(name="torch", device="cpu"):
    """``make_state``'s requests (0 prefilled, 1 waiting for its prefill) and a sampler."""
    base = sampler_base(device)
    return base["state"], ds.DiffusionSampler(**base, backend=name)


@pytest.mark.parametrize("args, exc, match", [
    (([4],), ValueError, r"slots\[0\] must be an int in \[0, 4\)"),
    (([True],), TypeError, r"slots\[0\] must be an int"),
    (([1.0],), TypeError, r"slots\[0\] must be an int"),
    (("1",), TypeError, "slots must be a sequence of ints"),
    (([2],), ValueError, "slot 2 holds no request"),
    (([1, 1],), ValueError, "slots must not repeat"),
    (([0],), ValueError, "slot 0 was already prefilled"),
])
def test_prefill_rejects(args, exc, match):
    state, sampler = make_sampler()
    before = snapshot(state)
    with pytest.raises(exc, match=match):
        sampler.prefill(*args)
    assert_unchanged(before, state)


STEP_CASES = [
    # slots: out of order, unknown, wrong type, repeated
    (dict(slots=[1]), ValueError, "slot 1 has not been prefilled"),
    (dict(slots=[0, 1], logits=torch.randn(2 * W, V)), ValueError, "slot 1 has not been prefilled"),
    (dict(slots=[2]), ValueError, r"slot 2 holds no request \(add_request first\)"),
    (dict(slots=[4]), ValueError, r"slots\[0\] must be an int in \[0, 4\)"),
    (dict(slots=[True]), TypeError, r"slots\[0\] must be an int"),
    (dict(slots=[0.0]), TypeError, r"slots\[0\] must be an int"),
    (dict(slots="0"), TypeError, "slots must be a sequence of ints"),
    (dict(slots=[0, 0], logits=torch.randn(2 * W, V)), ValueError, "slots must not repeat"),
    # logits
    (dict(logits=torch.randn(W - 1, V)), ValueError, "expected 3 rows"),
    (dict(logits=torch.randn(W, V + 1)), ValueError, "logits vocabulary 51"),
    (dict(logits=torch.randint(0, 3, (W, V))), TypeError, "logits must have dtype"),
    (dict(logits=torch.randn(W, V, device=META)), ValueError, "logits must be on"),
    (dict(logits=[[0.0] * V] * W), TypeError, "logits must be a torch.Tensor"),
    (dict(logits=torch.randn(2, W, V)), ValueError, r"3-D logits must be \[len\(slots\), W, V\]"),
    (dict(logits=torch.randn(W)), ValueError, r"logits must be \[rows, V\]"),
    (dict(logits=lambda d: torch.randn(W, 2 * V, device=d)[:, ::2]), ValueError,
     "contiguous in the vocabulary"),
    # valid_len
    (dict(valid_len=[W + 1]), ValueError, "valid_len must hold one length per slot"),
    (dict(valid_len=[0]), ValueError, "valid_len must hold one length per slot"),
    (dict(valid_len=[W, W]), ValueError, "valid_len must hold one length per slot"),
    (dict(valid_len=[3.0]), TypeError, r"valid_len\[0\] must be an int"),
    (dict(valid_len=[True]), TypeError, r"valid_len\[0\] must be an int"),
    (dict(valid_len=np.array([3.0])), TypeError, "valid_len must be a 1-D integer array"),
    # logprob requests
    (dict(logprobs={0: -1}), ValueError, r"logprobs\[0\] must be an int in \[0, 51\)"),
    (dict(logprobs={0: V + 1}), ValueError, r"logprobs\[0\] must be an int in \[0, 51\)"),
    (dict(logprobs={0: 1.5}), TypeError, r"logprobs\[0\] must be an int"),
    (dict(logprobs={0: True}), TypeError, r"logprobs\[0\] must be an int"),
    (dict(logprobs={1: 2}), ValueError, "logprobs names slot 1, which is not among this step's slots"),
    (dict(logprobs={0.0: 2}), ValueError, "logprobs names slot 0.0"),
    (dict(logprobs=[0]), TypeError, "logprobs must be a dict"),
    (dict(logprob_token_ids={0: [V]}), ValueError, r"logprob_token_ids\[0\] must be ids in \[0, 50\)"),
    (dict(logprob_token_ids={0: [1.0]}), TypeError, r"logprob_token_ids\[0\]\[0\] must be an int"),
    (dict(logprob_token_ids={3: [1]}), ValueError, "logprob_token_ids names slot 3"),
    # hidden-state input and constrained columns
    (dict(output_weight=torch.randn(V, H)), ValueError, "output_weight goes with hidden_states"),
    (dict(hidden_states=torch.randn(W, H)), ValueError, "give either logits or hidden_states"),
    (dict(logits=None, hidden_states=torch.randn(W, H)), TypeError, "output_weight must be a torch.Tensor"),
    (dict(logits=None, hidden_states=torch.randn(W, H), output_weight=torch.randn(V, H + 1)),
     ValueError, r"output_weight must be \[\d+, \d+\] \(the head\)"),
    (dict(logits=None, hidden_states=torch.randn(W, H), output_weight=torch.randn(V - 1, H)),
     ValueError, r"output_weight must be \[\d+, \d+\] \(the head\)"),
    (dict(logits=None, hidden_states=torch.randn(W, H),
          output_weight=torch.randn(V, H).to(torch.bfloat16)),
     TypeError, "must have one dtype, the model's"),
    (dict(logits=None, hidden_states=torch.randn(H, W).t(), output_weight=torch.randn(V, H)),
     ValueError, "hidden_states must be contiguous in the hidden dimension"),
    (dict(logits=None, hidden_states=torch.randn(W, H), output_weight=torch.randn(V, H),
          column_tokens=torch.arange(4)),
     ValueError, "column_tokens go with logits input"),
    (dict(column_tokens=torch.arange(V, dtype=torch.int32)), TypeError, "column_tokens must have dtype"),
    (dict(column_tokens=torch.arange(4)), ValueError, r"one column per entry of column_tokens \(4\)"),
]


@pytest.mark.parametrize("over, exc, match", STEP_CASES)
def test_step_rejects(over, exc, match, backend):
    """Refused on the host before any device work: the state is exactly as before."""
    name, device = backend
    state, sampler = make_sampler(name, device)
    before = snapshot(state)
    call = build(device, dict(logits=torch.randn(W, V), slots=[0]), over)
    with pytest.raises(exc, match=match):
        sampler.step(**call)
    assert_unchanged(before, state)
    assert not sampler.pending_logprobs


def test_step_checks_read_no_tensor():
    """A step's argument checks are host work only: no tensor operator runs, so none reads a
    device value (the step stays free of host synchronisations)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dgemma_sampler import sampler as sampler_module

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    state, _ = make_sampler()
    logits, columns = torch.randn(W, 4), torch.arange(4)
    with Record() as record:
        slots = sampler_module._check_step(state, np.array([0]), [W], logits, None, None, {0: 2},
                                           {0: [1, 2]}, columns)
    assert slots == [0] and record.ops == []


def test_step_after_remove_and_prefill_order():
    """The out-of-order calls of a request's life: step before prefill, prefill twice, step
    after remove; in order they run."""
    state, sampler = make_sampler()
    with pytest.raises(ValueError, match="slot 1 has not been prefilled"):
        sampler.step(torch.randn(W, V), [1])
    sampler.prefill(np.array([1]))
    with pytest.raises(ValueError, match="slot 1 was already prefilled"):
        sampler.prefill([1])
    out = sampler.step(torch.randn(2 * W, V), np.array([0, 1]), valid_len=np.array([W, W]))
    assert out.sampled.shape[0] == 2
    state.remove_request(1)
    with pytest.raises(ValueError, match="slot 1 holds no request"):
        sampler.step(torch.randn(W, V), [1])


@pytest.mark.parametrize("method, args, kwargs, exc, match", [
    ("graphable", ([1],), {}, ValueError, "slot 1 has not been prefilled"),
    ("graphable", ([0],), dict(valid_len=[W + 1]), ValueError, "valid_len must hold one length"),
    ("graphable", ([0.0],), {}, TypeError, r"slots\[0\] must be an int"),
    ("temperature_of", ([0],), {}, TypeError, "slots must be a torch.Tensor"),
    ("temperature_of", (torch.tensor([0.0]),), {}, TypeError, "slots must have dtype"),
    ("temperature_of", (torch.tensor([[0]]),), {}, ValueError, "slots must be 1-D"),
    ("tile_requests", (0, V, 4), {}, ValueError, "width must be an int >= 1"),
    ("tile_requests", (W, V, -1), {}, ValueError, "logits_itemsize must be an int >= 0"),
    ("tile_requests", (3.0, V, 4), {}, TypeError, "width must be an int"),
])
def test_sampler_methods_reject(method, args, kwargs, exc, match):
    _, sampler = make_sampler()
    with pytest.raises(exc, match=match):
        getattr(sampler, method)(*args, **kwargs)


def test_empty_batch_is_a_no_op():
    state, sampler = make_sampler()
    before = state.canvas.clone()
    out = sampler.step(torch.randn(0, V), [])
    assert out.num_sampled.numel() == 0 and torch.equal(state.canvas, before)
    assert out.stats.argmax.shape == (0, 0) and out.sampled.shape == (0, 0)
    s = ds.row_stats(torch.randn(0, W, V), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                     torch.zeros(0, dtype=torch.int64), backend="torch")
    assert s.argmax.shape == (0, W)


def test_nan_row_does_not_poison_its_neighbours():
    x = torch.randn(1, 3, V)
    clean = ds.row_stats(x, torch.tensor([0.7]), torch.tensor([9]), torch.tensor([0]), backend="torch")
    x[0, 1, 7] = NAN
    dirty = ds.row_stats(x, torch.tensor([0.7]), torch.tensor([9]), torch.tensor([0]), backend="torch")
    assert dirty.has_nan[0].tolist() == [False, True, False]
    for name in ("argmax", "sample", "entropy", "lse"):
        a, b = getattr(clean, name)[0, [0, 2]], getattr(dirty, name)[0, [0, 2]]
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("args, exc, match", [
    ((0, 0, 1), ValueError, "vocab_size must be an int >= 1"),
    ((100.0, 0, 1), TypeError, "vocab_size must be an int"),
    ((100, -1, 2), ValueError, r"rank must be an int in \[0, 2\)"),
    ((100, 2, 2), ValueError, r"rank must be an int in \[0, 2\)"),
    ((100, True, 2), TypeError, "rank must be an int"),
    ((100, 0, 0), ValueError, "world_size must be an int >= 1"),
    ((100, 0, 2.0), TypeError, "world_size must be an int"),
    ((100, 0, 2, 100), ValueError, "sample_block must be a power of two"),
    ((100, 0, 2, 16.0), TypeError, "sample_block must be an int"),
])
def test_vocab_slice_rejects(args, exc, match):
    with pytest.raises(exc, match=match):
        tp.vocab_slice(*args)


def test_vocab_slice_takes_numpy_integers():
    assert tp.vocab_slice(np.int64(100), np.int32(1), np.int64(2), 16) == tp.vocab_slice(100, 1, 2, 16)


N = 4


@pytest.mark.parametrize("over, exc, match", [
    (dict(gathered=torch.zeros(1, N, tp.NUM_FIELDS)), TypeError, "gathered must have dtype"),
    (dict(gathered=torch.zeros(N, tp.NUM_FIELDS, dtype=torch.int32)), ValueError, "gathered must be 3-D"),
    (dict(gathered=torch.zeros(1, N, 6, dtype=torch.int32)), ValueError, "must have 7 fields"),
    (dict(gathered=torch.zeros(0, N, tp.NUM_FIELDS, dtype=torch.int32)), ValueError, "at least one rank"),
    (dict(gathered=[[0]]), TypeError, "gathered must be a torch.Tensor"),
    (dict(greedy=torch.zeros(N + 1, dtype=torch.bool)), ValueError, "greedy must have shape"),
    (dict(greedy=torch.zeros(N)), TypeError, "greedy must have dtype"),
    (dict(greedy=torch.zeros(N, dtype=torch.bool, device=META)), ValueError, "greedy must be on"),
])
def test_merge_row_partials_rejects(over, exc, match):
    call = {"gathered": torch.zeros(2, N, tp.NUM_FIELDS, dtype=torch.int32),
            "greedy": torch.zeros(N, dtype=torch.bool), **over}
    with pytest.raises(exc, match=match):
        tp.merge_row_partials(**call)


TP_REQUEST_CASES = [
    (dict(local_logits=torch.randn(R, V)), ValueError, "local_logits must be 3-D"),
    (dict(local_logits=torch.randint(0, 3, (R, W, V))), TypeError, "local_logits must have dtype"),
    (dict(local_logits=lambda d: torch.randn(R, W, 2 * V, device=d)[..., ::2]), ValueError,
     "local_logits must be contiguous"),
    (dict(temperature=torch.tensor([0.5, NAN])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([0.5, -1.0])), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([0.5])), ValueError, "temperature must have shape"),
    (dict(seeds=torch.tensor([1.0, 2.0])), TypeError, "seeds must have dtype"),
    (dict(draws=torch.tensor([0, 0], device=META)), ValueError, "draws must be on"),
    (dict(softcap=-1.0), ValueError, "softcap must be None"),
    (dict(softcap="30"), TypeError, "softcap must be None"),
    (dict(sample_block=100), ValueError, "sample_block must be a power of two"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
]


def tp_stats_base():
    return dict(local_logits=torch.randn(R, W, V), temperature=torch.tensor([0.5, 1.0]),
                seeds=torch.tensor([1, 2]), draws=torch.tensor([0, 0]))


@pytest.mark.parametrize("over, exc, match", TP_REQUEST_CASES + [
    (dict(vocab_start=1.0), TypeError, "vocab_start must be an int"),
    (dict(vocab_start=True), TypeError, "vocab_start must be an int"),
    (dict(vocab_start=16), ValueError, "cut padding columns off"),
    (dict(vocab_size=V + 16), ValueError, "with one rank the local logits must hold the whole vocabulary"),
    (dict(vocab_size=0), ValueError, r"vocab_size must be in \[1, 2\^31\)"),
    (dict(vocab_size=float(V)), TypeError, "vocab_size must be an int"),
    (dict(top_k=torch.full((R,), 5)), NotImplementedError, "tensor_parallel_size=1"),
])
def test_row_stats_sharded_rejects(over, exc, match, backend):
    name, device = backend
    base = {**tp_stats_base(), "vocab_start": 0, "vocab_size": V, "backend": name}
    with pytest.raises(exc, match=match):
        tp.row_stats_sharded(**build(device, base, over))


@pytest.mark.parametrize("over, exc, match", TP_REQUEST_CASES + [
    (dict(vocab_start=-16), ValueError, "vocab_start must be an int >= 0"),
    (dict(vocab_start=16.0), TypeError, "vocab_start must be an int"),
    (dict(vocab_start=8, sample_block=16), ValueError, "sampling-block boundary"),
])
def test_local_row_partials_rejects(over, exc, match, backend):
    name, device = backend
    base = {**tp_stats_base(), "vocab_start": 0, "backend": name}
    with pytest.raises(exc, match=match):
        tp.local_row_partials(**build(device, base, over))


@pytest.mark.parametrize("v_local", [V, 0], ids=["slice", "empty-slice"])
@pytest.mark.parametrize("over, exc, match", [
    (dict(local_logits=torch.randn(R, W)), ValueError, "local_logits must be 3-D"),
    (dict(temperature=torch.tensor([0.5, NAN])), ValueError, "temperature must be finite"),
    (dict(temperature=torch.tensor([-0.5, 1.0])), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=torch.tensor([0.5, 1.0, 1.0])), ValueError, "temperature must have shape"),
    (dict(global_lse=torch.zeros(R, W + 1)), ValueError, "global_lse must have shape"),
    (dict(global_lse=torch.zeros(R, W, dtype=torch.float64)), TypeError, "global_lse must have dtype"),
    (dict(normalizer=NAN), ValueError, "normalizer must be finite"),
    (dict(normalizer="1"), TypeError, "normalizer must be a float"),
    (dict(normalizer=torch.tensor(INF)), ValueError, "normalizer must be finite"),
    (dict(normalizer=torch.ones(2)), ValueError, "normalizer must be a scalar"),
    (dict(keep=torch.ones(R, W)), TypeError, "keep must have dtype"),
    (dict(softcap=0.0), ValueError, "softcap must be None"),
    (dict(tail_eps=0.5), ValueError, "tail_eps must be"),
    (dict(out=torch.zeros(R, W, H, dtype=torch.float64)), TypeError, "out must have dtype"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
    (dict(threshold=torch.zeros(R, W)), NotImplementedError, "threshold is not supported"),
])
def test_soft_embedding_sharded_rejects(over, exc, match, backend, v_local):
    """The same refusals for a rank with a slice and a rank with none (whose call never
    reaches ``ops.soft_embedding``)."""
    name, device = backend
    out = torch.full((R, W, H), 7.0, device=device)
    base = dict(local_logits=torch.randn(R, W, v_local), temperature=torch.tensor([0.5, 1.0]),
                global_lse=torch.zeros(R, W), local_embed_weight=torch.randn(v_local, H),
                normalizer=2.0, out=out, backend=name)
    with pytest.raises(exc, match=match):
        tp.soft_embedding_sharded(**build(device, base, over))
    assert (out == 7.0).all()
