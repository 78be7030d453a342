"""The ``compose`` marker: tests that drive a live Docker engine (deploy/compose_test.sh runs them)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "compose: live docker compose tests (deploy/compose_test.sh; skipped otherwise)"
    )
