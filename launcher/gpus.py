"""Which GPUs each local node gets: ``tensor_parallel_size`` distinct ones, least used first.

A node's ranks run on ``cuda:0…N-1`` of what ``CUDA_VISIBLE_DEVICES`` shows it
(``common/parallel/executor.py``), so giving a TP=N node N distinct ids puts each rank on its own
GPU. Nodes are placed where the fewest nodes already are (ties: the order of ``--gpus``); with
more nodes than GPUs they share, as one-GPU nodes did before (``--kv-cache-gb`` then bounds each
one's cache). A stopped node's GPUs are free again.
"""

from __future__ import annotations


def check_tp_fits(pool: str, size: int, gpus: tuple[str, ...]) -> None:
    """A ``--{pool}-tp`` of ``size`` is at least 1 and, with GPUs named, at most their count."""
    if size < 1:
        raise ValueError(f"--{pool}-tp must be >= 1, got {size}")
    if gpus and size > len(gpus):
        raise ValueError(f"--{pool}-tp {size} needs {size} GPUs; there are {len(gpus)}")


class GpuAllocator:
    """Hands out GPU ids from ``gpus`` (not thread-safe: the actuator's event loop owns it)."""

    def __init__(self, gpus: tuple[str, ...]) -> None:
        self.gpus = gpus
        self._users: dict[str, int] = {gpu: 0 for gpu in gpus}

    def acquire(self, count: int) -> tuple[str, ...]:
        """``count`` distinct GPUs, the least used first; ``()`` when there are no GPUs."""
        if not self.gpus:
            return ()
        if count > len(self.gpus):
            raise ValueError(
                f"a node with tensor_parallel_size {count} needs {count} GPUs; --gpus has"
                f" {len(self.gpus)} ({','.join(self.gpus)})"
            )
        order = sorted(self.gpus, key=lambda gpu: (self._users[gpu], self.gpus.index(gpu)))
        chosen = tuple(order[:count])
        for gpu in chosen:
            self._users[gpu] += 1
        return chosen

    def release(self, gpus: tuple[str, ...]) -> None:
        for gpu in gpus:
            self._users[gpu] -= 1

    def in_use(self) -> dict[str, int]:
        """Nodes per GPU now."""
        return dict(self._users)
