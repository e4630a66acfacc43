"""The vLLM plugin: choice by release, lazy registration, logging, seeds through vLLM's API.

``register()`` runs in every vLLM process, so these tests check that it imports no model code,
that the DiffusionGemma architecture resolves to our module only when loaded, and that a release
we do not support is left alone with one warning. The seed test goes through vLLM's own request
validation (``SamplingParams.verify``) and then drives the adapter through ``vllm_harness``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

# Not pytest.importorskip("vllm"): vllm_harness must set the CPU environment before vLLM loads.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs the vllm extra", allow_module_level=True)

import vllm_harness as vh  # first: sets the CPU environment before vLLM loads
from vllm import ModelRegistry, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_harness import Decode, Prefill

import dgemma_sampler.vllm as dgemma_vllm
from dgemma_sampler.vllm import plugin, seeds

pytestmark = pytest.mark.vllm

V, CL, H = 64, 8, 16


def fused_sampler_class() -> type:
    """The adapter for the installed release (``v0_33`` / ``v0_34``); before those modules
    existed, 0.33's adapter was ``dgemma_sampler.vllm.sampler``."""
    name = plugin.adapter_name(plugin.vllm_version())
    try:
        return plugin.load_adapter().FusedDiffusionSampler
    except ModuleNotFoundError as exc:
        if exc.name != f"dgemma_sampler.vllm.{name}":
            raise  # the adapter exists but cannot be imported: a failure, not a skip
        if name == "v0_33":
            from dgemma_sampler.vllm.sampler import FusedDiffusionSampler

            return FusedDiffusionSampler
        pytest.skip(f"no adapter module for vLLM {plugin.vllm_version()} in this tree")


class Records(logging.Handler):
    """What ``vllm.dgemma_sampler`` logs (vLLM's "vllm" logger does not propagate to the root,
    so pytest's caplog does not see it)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records():
    logger = logging.getLogger("vllm.dgemma_sampler")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def vllm_untouched(monkeypatch):
    """vLLM's registry entry and seed validation as vLLM ships them; restored afterwards."""
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    monkeypatch.setitem(ModelRegistry.models, plugin.ARCHITECTURE,
                        ModelRegistry.models[plugin.ARCHITECTURE])
    validate = SamplingParams._validate_diffusion
    while getattr(validate, "__wrapped__", None) is not None:
        validate = validate.__wrapped__
    monkeypatch.setattr(SamplingParams, "_validate_diffusion", validate)
    return validate


def diffusion_gemma_config(architecture: str = plugin.ARCHITECTURE) -> SimpleNamespace:
    """What ``SamplingParams.verify`` reads of a ``ModelConfig`` (a real one needs the model's
    files): a diffusion model (the HF config has a ``canvas_length``) of the given architecture."""
    return SimpleNamespace(is_diffusion=True, architectures=[architecture], max_logprobs=20,
                           max_model_len=4096, get_vocab_size=lambda: V)


def verify(params: SamplingParams, model_config=None) -> None:
    """vLLM's request validation, as its input processor calls it."""
    params.verify(model_config or diffusion_gemma_config(), None, None, None)


# ------------------------------------------------------------------------------------------
# Choosing the adapter
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, name", [
    ("0.33.0", "v0_33"), ("0.33.2rc1", "v0_33"), ("0.34.0", "v0_34"),
    ("0.34.1.dev12+g0123abc", "v0_34"), ("0.34.0+cu130", "v0_34"),
    ("0.32.1", None), ("0.35.0", None), ("0.330.0", None), ("0.3.4", None), ("1.0.0.dev3", None),
    ("0.34", None), ("unknown", None),
])
def test_adapter_by_release(version, name):
    assert plugin.adapter_name(version) == name
    assert plugin.supported(version) is (name is not None)


def test_fused_sampler_importable_from_the_package():
    cls = fused_sampler_class()
    assert issubclass(cls, vh.DiffusionSampler)
    name = plugin.adapter_name(plugin.vllm_version())
    if importlib.util.find_spec(f"dgemma_sampler.vllm.{name}") is not None:
        from dgemma_sampler.vllm import FusedDiffusionSampler

        assert FusedDiffusionSampler is cls
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        dgemma_vllm.NoSuchName  # noqa: B018


def test_fused_sampler_name_on_another_release(monkeypatch):
    monkeypatch.setattr("vllm.__version__", "0.36.0")
    with pytest.raises(ImportError, match=r"0\.33\.x and 0\.34\.x; vLLM 0\.36\.0"):
        from dgemma_sampler.vllm import FusedDiffusionSampler  # noqa: F401


# ------------------------------------------------------------------------------------------
# register()
# ------------------------------------------------------------------------------------------


def test_register_points_the_architecture_at_our_module(vllm_untouched):
    assert plugin.register() is True
    entry = ModelRegistry.models[plugin.ARCHITECTURE]
    assert f"{entry.module_name}:{entry.class_name}" == plugin.MODEL_CLASS
    assert SamplingParams._validate_diffusion is not vllm_untouched
    assert plugin.register() is True  # idempotent: vLLM may load its plugins more than once
    assert SamplingParams._validate_diffusion.__wrapped__ is vllm_untouched


@pytest.mark.parametrize("version", ["0.32.9", "0.35.0", "1.0.0.dev3"])
def test_register_refuses_other_releases(vllm_untouched, monkeypatch, records, version):
    monkeypatch.setattr("vllm.__version__", version)
    before = ModelRegistry.models[plugin.ARCHITECTURE]
    assert plugin.register() is False
    assert plugin.register() is False
    assert ModelRegistry.models[plugin.ARCHITECTURE] is before
    assert SamplingParams._validate_diffusion is vllm_untouched
    assert len(records) == 1  # once per process
    record = records[0]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    for part in (version, "0.33.x and 0.34.x", "DGEMMA_SAMPLER_DISABLE=1", "VLLM_PLUGINS"):
        assert part in message


@pytest.mark.parametrize("value", ["1", "yes"])
def test_register_disabled_by_env(vllm_untouched, monkeypatch, records, value):
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    before = ModelRegistry.models[plugin.ARCHITECTURE]
    assert plugin.register() is False
    assert ModelRegistry.models[plugin.ARCHITECTURE] is before
    assert SamplingParams._validate_diffusion is vllm_untouched
    assert len(records) <= 1 and all(plugin.DISABLE_ENV in r.getMessage() for r in records)
    monkeypatch.setenv(plugin.DISABLE_ENV, "0")
    assert plugin.register() is True


def test_install_sampler_logs_the_active_line(monkeypatch, records):
    model_module = SimpleNamespace(DiffusionSampler=vh.DiffusionSampler)
    cls = fused_sampler_class()
    monkeypatch.setattr(plugin, "load_adapter", lambda version=None: SimpleNamespace(
        FusedDiffusionSampler=cls))
    assert plugin.install_sampler(model_module) is True
    assert model_module.DiffusionSampler is cls
    (record,) = [r for r in records if "active" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    for part in (f"dgemma-sampler {plugin.__version__}", f"vLLM {plugin.vllm_version()}",
                 "PyTorch reference", "DGEMMA_SAMPLER_DISABLE=1"):
        assert part in message


def test_install_sampler_leaves_vllm_alone_when_the_adapter_fails(monkeypatch, records):
    model_module = SimpleNamespace(DiffusionSampler=vh.DiffusionSampler)
    monkeypatch.setitem(plugin.ADAPTERS, ".".join(plugin.vllm_version().split(".")[:2]),
                        "no_such_adapter")
    assert plugin.install_sampler(model_module) is False
    assert model_module.DiffusionSampler is vh.DiffusionSampler
    assert any(r.levelno == logging.WARNING and "no_such_adapter" in r.getMessage()
               for r in records)


def test_registration_imports_no_model_code_until_the_model_loads():
    """In a fresh process that has imported what ``vllm serve`` imports before it calls the
    plugins: register() adds no DiffusionGemma (or other model) module; resolving the
    architecture imports ours, which installs the adapter and logs the active line."""
    adapter = plugin.adapter_name(plugin.vllm_version())
    if importlib.util.find_spec(f"dgemma_sampler.vllm.{adapter}") is None:
        pytest.skip(f"dgemma_sampler.vllm.{adapter} is not in this tree")
    script = textwrap.dedent("""
        import sys
        import vllm.engine.arg_utils
        from vllm import ModelRegistry
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())  # as the engine does
        from dgemma_sampler.vllm import plugin
        before = set(sys.modules)
        assert plugin.register()
        added = sorted(set(sys.modules) - before)
        models = [m for m in added if m.startswith("vllm.model_executor.models.")]
        assert models in ([], ["vllm.model_executor.models.registry"]), models
        assert "dgemma_sampler.vllm.diffusion_gemma" not in sys.modules
        assert not plugin.active()
        cls = ModelRegistry.models[plugin.ARCHITECTURE].load_model_cls()  # what vLLM calls
        from vllm.model_executor.models import diffusion_gemma
        assert cls is diffusion_gemma.DiffusionGemmaForConditionalGeneration, cls
        assert plugin.active(), diffusion_gemma.DiffusionSampler
        import torch
        assert not torch.cuda.is_initialized()  # the process may still fork its workers
        print("added", len(added))
    """)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", TRITON_INTERPRET="1",
               CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="INFO")
    env.pop(plugin.DISABLE_ENV, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    active = [line for line in output.splitlines() if "dgemma-sampler" in line and "active" in line]
    assert len(active) == 1, output[-4000:]


# ------------------------------------------------------------------------------------------
# Seeds through the API
# ------------------------------------------------------------------------------------------


def test_vllm_alone_rejects_a_seed(vllm_untouched):
    with pytest.raises(VLLMValidationError, match="seed"):
        verify(SamplingParams(seed=7))


def test_seed_accepted_only_seed_lifted(vllm_untouched):
    assert seeds.accept_seed(plugin.ARCHITECTURE)
    verify(SamplingParams(seed=7))
    verify(SamplingParams(seed=7, top_k=5, top_p=0.9, logprobs=3))
    # Everything else vLLM rejects for diffusion models stays rejected, seed or not.
    for kwargs in ({"temperature": 0.5}, {"min_p": 0.1}, {"min_tokens": 2},
                   {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [1, 2]}):
        for seed in (None, 7):
            with pytest.raises(VLLMValidationError, match="not yet supported"):
                verify(SamplingParams(seed=seed, **kwargs))
    # Another diffusion model keeps vLLM's rule: its sampler does not honour seeds.
    with pytest.raises(VLLMValidationError, match="seed"):
        verify(SamplingParams(seed=7), diffusion_gemma_config("SomeOtherDiffusionLM"))
    # Autoregressive models never ran this check.
    verify(SamplingParams(seed=7), SimpleNamespace(**{**vars(diffusion_gemma_config()),
                                                      "is_diffusion": False}))


BAD_SEEDS = [
    (True, TypeError, "must be None or an int, got bool"),
    (1.5, TypeError, "must be None or an int, got float"),
    ("7", TypeError, "must be None or an int, got str"),
    (2**63, ValueError, r"must be in \[-2\^63, 2\^63\)"),
    (-(2**63) - 1, ValueError, r"must be in \[-2\^63, 2\^63\)"),
]


@pytest.mark.parametrize("seed, exc, match", BAD_SEEDS)
def test_bad_seed_refused_at_admission_and_by_the_adapter(vllm_untouched, seed, exc, match):
    """The seed is the one request parameter the plugin adds. vLLM would store it in an int64
    array as it is (True as 1, 1.5 as 1, "7" as 7) and fail in the engine past 2^63: the
    plugin refuses it at admission (a 400 on the server) and the adapter before any state
    changes (a request built without admission)."""
    assert seeds.accept_seed(plugin.ARCHITECTURE)
    with pytest.raises(VLLMValidationError, match="SamplingParams.seed " + match):
        verify(SamplingParams(seed=seed))
    h = vh.make_vllm_sampler(max_num_reqs=2, canvas_length=CL, vocab_size=V, hidden=H,
                             sampler_cls=fused_sampler_class())
    h.add_request(0, seed=11)
    before = h.sampler.sampling_states.seeds.np.copy(), h.states.seeds.clone()
    with pytest.raises(exc, match="SamplingParams.seed " + match):
        h.sampler.add_request(0, SamplingParams(seed=seed))
    assert (h.sampler.sampling_states.seeds.np == before[0]).all()
    assert torch.equal(h.states.seeds, before[1])


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0, np.int64(5)])
def test_good_seed_accepted_at_admission_and_by_the_adapter(vllm_untouched, seed):
    assert seeds.accept_seed(plugin.ARCHITECTURE)
    verify(SamplingParams(seed=seed))
    h = vh.make_vllm_sampler(max_num_reqs=2, canvas_length=CL, vocab_size=V, hidden=H,
                             sampler_cls=fused_sampler_class())
    h.add_request(1, seed=seed)
    assert h.states.seeds[1].item() == int(seed)


def _logits(request: int, step: int) -> torch.Tensor:
    """A request's logits at a step: a function of the request and step only, never of the
    batch, with a spread wide enough that the draws matter (temperature, renoise)."""
    g = torch.Generator().manual_seed(1000 * request + step)
    return 1.5 * torch.randn(CL, V, generator=g)


def _generate(batch: dict[int, tuple[int, int | None]], order: list[int], steps: int = 6):
    """Run ``batch`` {slot: (request id, seed)} through the adapter, each step's batch in
    ``order``; returns {request id: [the canvas fed back after each step]}. The seeded requests'
    ``SamplingParams`` pass vLLM's validation first."""
    h = vh.make_vllm_sampler(max_num_reqs=6, canvas_length=CL, vocab_size=V, hidden=H,
                             max_denoising_steps=12, stability_threshold=2, t_min=0.4,
                             sampler_cls=fused_sampler_class())
    for slot, (_, seed) in batch.items():
        params = h.add_request(slot, seed=seed)
        verify(params)
    h.step(torch.zeros(0, V), vh.make_input_batch([Prefill(s, 5) for s in order]))
    canvases = {req: [h.draft_tokens[slot].clone()] for slot, (req, _) in batch.items()}
    for step in range(steps):
        logits = torch.cat([_logits(batch[s][0], step) for s in order])
        h.step(logits, vh.make_input_batch([Decode(s, CL, context_len=5) for s in order]))
        for slot, (req, _) in batch.items():
            canvases[req].append(h.draft_tokens[slot].clone())
    return canvases


def test_seed_reproduces_tokens_whatever_the_batch(vllm_untouched):
    assert seeds.accept_seed(plugin.ARCHITECTURE)
    alone = _generate({0: (1, 1234)}, [0])[1]
    crowded = _generate({3: (1, 1234), 0: (2, 99), 5: (3, None)}, [5, 3, 0])[1]
    for a, b in zip(alone, crowded):
        assert torch.equal(a, b)
    other_seed = _generate({0: (1, 4321)}, [0])[1]
    differs = [not torch.equal(a, b) for a, b in zip(alone, other_seed)]
    assert differs[0]  # the first canvas is drawn from the seed
    assert sum(differs) >= len(differs) // 2


def test_soft_embedding_paths_logged_at_debug_only(records):
    """The per-path row counts are read (a host sync) and logged only when DEBUG is enabled."""
    common = pytest.importorskip("dgemma_sampler.vllm.common")

    class Rows:
        def __init__(self):
            self.read = False

        def tolist(self):
            self.read = True
            return [1, 2, 3, 4, 5]

    logger = logging.getLogger("vllm.dgemma_sampler")
    out = SimpleNamespace(sc_path_rows=Rows())
    common._log_soft_embedding_paths(out)
    assert out.sc_path_rows.read
    assert any(r.levelno == logging.DEBUG and "2 top token" in r.getMessage() for r in records)
    records.clear()
    logger.setLevel(logging.INFO)
    out = SimpleNamespace(sc_path_rows=Rows())
    common._log_soft_embedding_paths(out)
    assert not out.sc_path_rows.read and not records
    common._log_soft_embedding_paths(SimpleNamespace(sc_path_rows=None))
