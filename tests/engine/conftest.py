"""Shared fixtures of the engine tests: built-in models cached once per session.

Two switches for running these tests on a GPU (``benchmarks/gpu_check.py`` sets them; CPU runs
leave them unset): ``PDSERVE_TEST_DEVICE=cuda`` fails every test when torch sees no CUDA device
(engines take CUDA by default when there is one), and ``PDSERVE_TEST_EAGER=1`` builds every engine
without CUDA graphs and without the overlapped loop (``enforce_eager=True``,
``async_scheduling=False``) unless a test asks for them by name.
"""

import os

import pytest
import torch

from common.config import EngineConfig


@pytest.fixture(scope="session", autouse=True)
def _offline_cache(tmp_path_factory):
    """Generate the tiny models once per test session, with no network."""
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield


@pytest.fixture(autouse=True)
def _device_switches(monkeypatch):
    if os.environ.get("PDSERVE_TEST_DEVICE") == "cuda" and not torch.cuda.is_available():
        pytest.fail("PDSERVE_TEST_DEVICE=cuda, but torch sees no CUDA device")
    if os.environ.get("PDSERVE_TEST_EAGER") == "1":
        from_kwargs = EngineConfig.from_kwargs

        def eager(**kwargs):
            kwargs.setdefault("enforce_eager", True)
            kwargs.setdefault("async_scheduling", False)
            return from_kwargs(**kwargs)

        monkeypatch.setattr(EngineConfig, "from_kwargs", staticmethod(eager))
