"""Shared fixtures of the engine tests: built-in models cached once per session."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _offline_cache(tmp_path_factory):
    """Generate the tiny models once per test session, with no network."""
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
