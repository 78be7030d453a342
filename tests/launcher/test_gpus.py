"""GPU placement of local nodes: distinct GPUs per node, least used first, freed on stop."""

from __future__ import annotations

import pytest

from launcher.gpus import GpuAllocator, check_tp_fits


def test_tp_nodes_get_distinct_gpus_least_used_first() -> None:
    gpus = GpuAllocator(("0", "1", "2", "3"))
    assert gpus.acquire(2) == ("0", "1")
    assert gpus.acquire(1) == ("2",)
    assert gpus.acquire(2) == ("3", "0")  # 3 is free; then the first of the once-used
    assert gpus.in_use() == {"0": 2, "1": 1, "2": 1, "3": 1}
    gpus.release(("0", "1"))
    assert gpus.acquire(2) == ("1", "0")  # unused first, then the order of --gpus


def test_no_gpus_no_placement_and_impossible_sizes_refused() -> None:
    assert GpuAllocator(()).acquire(4) == ()
    with pytest.raises(ValueError, match="tensor_parallel_size 3 needs 3 GPUs"):
        GpuAllocator(("0", "1")).acquire(3)
    check_tp_fits("prefill", 8, ())  # CPU: any size
    with pytest.raises(ValueError, match="--prefill-tp must be >= 1"):
        check_tp_fits("prefill", 0, ())
