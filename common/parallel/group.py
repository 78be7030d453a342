"""One rank's view of a tensor-parallel group, and the shard arithmetic every layer shares.

Two process groups: the *device* group carries the model's collectives (NCCL on CUDA, gloo on
CPU); the *control* group (always gloo, host tensors) carries each step's inputs from rank 0 to
the workers. Nothing crosses a socket as pickle: only tensors.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``. ``device_group``: model collectives; ``control_group``: gloo,
    host tensors (step inputs)."""

    rank: int
    size: int
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated on the last dim; the others get None."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads ``[begin, end)`` (see ``kv_head_range``)."""
        return kv_head_range(self.rank, self.size, num_kv_heads)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's ``[begin, end)`` of ``n`` rows split evenly (``n % size == 0``)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's ``[begin, end)`` of the vocabulary, padded to ``size`` equal parts (the
        last part may reach past ``vocab_size``: those rows are zeros, their logits dropped)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, (self.rank + 1) * per


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """Rank ``rank`` of ``size``'s KV heads ``[begin, end)``. With fewer KV heads than ranks
    each head is replicated on ``size // num_kv_heads`` consecutive ranks (vLLM's rule)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // size
    return head, head + 1


def check_divisible(size: int, num_heads: int, num_kv_heads: int, intermediate: int) -> None:
    """Refuse a model that cannot be split evenly ``size`` ways."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide {num_heads} heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and {num_kv_heads} KV heads: one must divide the other"
        )
    if intermediate % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide intermediate_size {intermediate}"
        )


def rendezvous_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCP store on 127.0.0.1: ``port=0`` makes rank 0's (the server, on a free
    port, not waiting for anyone), a port joins it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if port == 0:
        return dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, size, False, timeout)


def init_tensor_parallel(
    rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the group (every rank calls this with the same store)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    world = dist.group.WORLD
    assert world is not None
    return TensorParallel(rank, size, world, control or world)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_on_min(tp: TensorParallel, value: int) -> int:
    """Every rank: the smallest ``value`` of the group (e.g. the KV blocks each rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control_group)
    return int(t.item())
