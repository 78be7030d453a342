"""Fixtures of the service tests: real prefill/decode node processes on 127.0.0.1.

Nodes are slow to start on a small machine, so the file-store pair is started once per session
and shared by every module that only sends requests; modules that stop nodes (drain) start their
own. Every module leaves the shared nodes idle with every block free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services.nodes import Pair, Reference, start_nodes


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Built-in models in a per-session cache, shared by node processes and the reference."""
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))
    os.environ["HF_HUB_OFFLINE"] = "1"


def start_pair(store_url: str, workdir: Path, *extra: str) -> Pair:
    """A prefill and a decode node on ``store_url``, started side by side."""
    specs = [(kind, store_url, workdir, extra) for kind in ("prefill", "decode")]
    prefill, decode = start_nodes(specs)
    return Pair(prefill, decode, store_url)


@pytest.fixture(scope="session")
def file_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Prefill + decode nodes on a FileStore in a temp dir (max 32 running requests each)."""
    root = tmp_path_factory.mktemp("kv-files")
    workdir = tmp_path_factory.mktemp("node-logs")
    pair = start_pair(f"file://{root}", workdir, "--max-num-seqs", "32", "--max-queue", "256")
    yield pair
    codes = [pair.prefill.stop(), pair.decode.stop()]
    assert codes == [0, 0], (pair.prefill.log_tail(), pair.decode.log_tail())


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
