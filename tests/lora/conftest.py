"""Adapters written once per session: two of tiny-llama (ranks 8 and 16, different targets)."""

from __future__ import annotations

import pytest

from common.models.names import resolve_model_path
from tests.lora.adapters import ADAPTERS, write_adapter


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory) -> dict[str, object]:
    model = resolve_model_path("tiny-llama")
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_adapter(model, root / name, seed, **args)
        for seed, (name, args) in enumerate(ADAPTERS.items())
    }
