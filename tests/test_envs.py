"""The environment variables (``dgemma_sampler.envs``) and how they reach the kernels: the package
reads them, the kernels take explicit arguments."""

from __future__ import annotations

import sys
import types

import pytest

from dgemma_sampler import backend, envs


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("yes", True), ("0", False),
                                       ("", False), ("off", False), (" False ", False)])
def test_switches_read_on_every_call(monkeypatch, value, on):
    for name, read in (("DGEMMA_GRAPH_UPDATE", envs.graph_update),
                       ("DGEMMA_SOFT_EMBEDDING_WGMMA", envs.soft_embedding_wgmma),
                       ("DGEMMA_SOFT_EMBEDDING_TUNE", envs.soft_embedding_tune)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert read() is on, name
    monkeypatch.delenv("DGEMMA_SAMPLER_DISABLE", raising=False)
    assert envs.sampler_disabled() is False


@pytest.fixture
def kernel_calls(monkeypatch):
    """A stand-in ``kernels.soft_embedding_dispatch`` module recording the keywords it is called with."""
    calls = []
    stub = types.ModuleType("dgemma_sampler.kernels.soft_embedding_dispatch")
    stub.soft_embedding_rows = lambda *args, **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "dgemma_sampler.kernels.soft_embedding_dispatch", stub)
    return calls


def test_soft_embedding_switches_become_arguments(monkeypatch, kernel_calls):
    monkeypatch.delenv("DGEMMA_SOFT_EMBEDDING_WGMMA", raising=False)
    monkeypatch.delenv("DGEMMA_SOFT_EMBEDDING_TUNE", raising=False)
    run = backend._triton_soft_embedding_rows
    run()
    monkeypatch.setenv("DGEMMA_SOFT_EMBEDDING_WGMMA", "0")
    monkeypatch.setenv("DGEMMA_SOFT_EMBEDDING_TUNE", "0")
    run()
    run(wgmma=True, tune=True)  # an explicit argument wins
    assert kernel_calls == [dict(wgmma=None, tune=True), dict(wgmma=False, tune=False),
                            dict(wgmma=True, tune=True)]


def test_the_step_gets_the_dispatcher():
    """The sampler's Triton soft embedding is the one that reads the environment."""
    pytest.importorskip("triton")
    assert backend.kernels("triton").soft_embedding_rows is backend._triton_soft_embedding_rows
