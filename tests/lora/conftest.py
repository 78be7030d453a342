"""Adapters written once per session: two of tiny-llama (ranks 8 and 16, different targets)."""

from __future__ import annotations

import pytest

from common.models.names import resolve_model_path
from tests.lora.adapters import write_test_adapters


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory) -> dict[str, object]:
    return write_test_adapters(
        resolve_model_path("tiny-llama"), tmp_path_factory.mktemp("adapters")
    )
