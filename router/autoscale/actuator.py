"""The actuator interface: how the autoscale loop's decisions become instances.

The router's loop (``router.autoscale.loop``) calls an :class:`Actuator`; the back ends that
implement it (local processes, docker compose, Kubernetes) live in ``launcher.actuators`` and are
built when the loop starts. A leaf: it imports nothing of the router but ``Pool``, so the
launcher can implement it without importing the router's serving code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.autoscale.policy import Pool


class ActuatorError(RuntimeError):
    """A scaling call failed; the pool keeps its previous size (the loop tries again later)."""


class Actuator(Protocol):
    """Changes pool sizes. Called from the router's event loop, one call at a time."""

    async def current(self, pool: Pool) -> int:
        """Instances the pool is set to have (running or starting, not stopping)."""
        ...

    def choose_victims(self, pool: Pool, count: int, ranked: Sequence[str]) -> list[str]:
        """Addresses (from ``ranked``, least busy first) that a scale-down by ``count`` will
        stop; empty when the back end chooses for itself."""
        ...

    async def scale(self, pool: Pool, replicas: int, victims: Sequence[str] = ()) -> None:
        """Set the pool to ``replicas`` instances, stopping ``victims`` first on a scale-down.
        Returns once the change is requested (instances start and drain in the background)."""
        ...

    async def close(self) -> None:
        """Release resources; the local actuator also stops every instance it started."""
        ...
