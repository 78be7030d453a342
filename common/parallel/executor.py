"""One scheduler, N ranks: rank 0 lives in the engine process (it schedules, prepares the step's
inputs and samples), ranks 1…N-1 are worker processes that only run the forward pass.

NOTE: the per-step protocol. Rank 0 prepares the step's flat host buffers as on one device
(``common/step_inputs.py``) and broadcasts them on the gloo control group: a header
(``_Header``: the step's ``StepShape`` and what else follows), then the used prefixes of the
int64 and int32 buffers. The int32 prefix holds the block-table *changes* of the step, never
the tables: every rank keeps its own device rows and applies them (``InputBuffers.adopt``); a
worker receives into two host sets in turn, so its copies to the device never block (as rank
0's). Every rank then runs the same
forward over its heads (two all-reduces a layer, one for the embedding) and the LM head on the
rows to sample; rank 0 receives the gathered logits and samples, the others drop theirs. Only
tensors cross between processes (no pickle on any socket); the workers' start-up arguments are
plain values handed to ``multiprocessing``'s spawn.

```
rank 0 (engine)  schedule → prepare → bcast header, int64, int32 → forward → gather → sample
rank k (worker)               recv header, int64, int32 → adopt → forward → lm_head ┘
```

Besides steps, rank 0 sends two KV operations for the store connector (it is the group's only
store client, ``common/parallel/block_exchange.py``): *land* (blocks fetched from the store into
every rank's heads) and *collect* (every rank's heads of blocks to save, gathered at rank 0); a
header with the op and the block count, then the block ids, then the collective. Both come
between steps (lands when rank 0's connector reports finished loads, collects once a step's
sampling is launched), so a worker's loop reads one op at a time: a step, a KV op, or stop.

CUDA graphs: every rank captures the same decode graphs (rank 0's config, sizes included) at
start-up, in the same order, so the all-reduces inside them are captured in lockstep (NCCL
collectives are capturable; each rank's graph holds its own communicator's kernels). The
header names the graph rank 0 replays (``graph``: its padded size, 0 for an eager step) and the
step's shape is that graph's padded shape, so ``adopt`` gives every worker the graph's fixed
views; each replays the same size. Overlapped scheduling works: a step's input ids that come
from the previous step's samples (still on rank 0's device) are broadcast on the device group
after the inputs, into the same fixed buffer the graphs read.

A failed rank fails the engine with ``TensorParallelError``, never a hang, on gloo and on NCCL:
rank 0's ``RankMonitor`` (``common/parallel/monitor.py``) waits on the workers' sentinels and
on the deadline of the group call in progress (``STEP_TIMEOUT_S``). At a worker's exit, or a
step past its deadline (a stuck rank), it aborts the communicators (NCCL's kernels spinning on
a dead peer return; gloo already fails on the closed sockets) and kills the other workers (a
gloo wait on a stuck peer ends). The engine thread's collective then fails, or the tokens it
reads next are refused (``_CheckedResult``: an aborted NCCL collective leaves noise in its
buffers), and it raises with the monitor's reason. Workers die with rank 0
(``common/parent_death.py``). ``close()`` stops the monitor first (the exits that follow are
asked for), sends ``_STOP``, joins the workers and destroys the process groups, so another
group can form in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from common.config import CacheConfig, LoraConfig, RunnerConfig
from common.memory_profile import KVReserve
from common.model_runner import ModelRunner, StepResult
from common.parallel.block_exchange import collect, land
from common.parallel.group import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    rendezvous_store,
)
from common.parallel.monitor import RankMonitor
from common.parent_death import die_with
from common.prompt_logprobs import prompt_rows
from common.step_faults import EngineFailure
from common.step_inputs import StepInputs, StepShape
from common.step_outputs import SampledToken, SchedulerOutput

logger = logging.getLogger(__name__)

_STEP, _STOP, _LAND, _COLLECT = 0, 1, 2, 3


class _Header(NamedTuple):
    """What rank 0 announces before each operation, as int64s on the control group."""

    op: int  # _STEP, _STOP, _LAND or _COLLECT
    step: StepShape  # a step's sizes (a KV op: its block count in ``num_tokens``)
    # rows scored for prompt logprobs: their ids follow the inputs; their LM head comes before
    # the sampled rows', as on rank 0
    num_scored: int = 0
    # input ids were filled on the device from the last step's samples (overlapped scheduling:
    # rank 0 then broadcasts its input ids on the device group, no host sync)
    filled: bool = False
    # the decode graph every rank replays (its size: the step's padded rows), 0: eager
    graph: int = 0

    SIZE = 4 + len(StepShape._fields)

    def tensor(self) -> torch.Tensor:
        values = [self.op, *self.step, self.num_scored, self.filled, self.graph]
        return torch.tensor(values, dtype=torch.int64)

    @staticmethod
    def read(t: torch.Tensor) -> _Header:
        op, *step, scored, filled, graph = t.tolist()
        return _Header(op, StepShape(*step), scored, bool(filled), graph)

    @staticmethod
    def kv_op(op: int, num_blocks: int = 0) -> _Header:
        return _Header(op, StepShape(num_blocks, 0, 0, 0, 0, 0, 0))


TIMEOUT_S = 120.0  # start-up rendezvous and the longest a collective may wait
STEP_TIMEOUT_S = TIMEOUT_S  # the longest a step (or a KV exchange) may wait on the group


class TensorParallelError(EngineFailure):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the module's parameters (a tied tensor once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def _gather_weight_bytes(runner: ModelRunner, tp: TensorParallel) -> list[int]:
    mine = torch.tensor([weight_bytes(runner.model)], dtype=torch.int64)
    parts = [torch.zeros_like(mine) for _ in range(tp.size)]
    dist.all_gather(parts, mine, group=tp.control_group)
    return [int(p.item()) for p in parts]


def _cpu_threads(asked: int | None, size: int) -> int:
    return asked or max(1, (os.cpu_count() or 1) // size)


def _rank_device(name: str, rank: int) -> str:
    """Rank ``k`` runs on ``cuda:k`` (when the engine names cuda) or on the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        return f"cuda:{(device.index or 0) + rank}"
    return str(device)


class ParallelModelRunner(ModelRunner):
    """Rank 0's runner: the single-device runner plus the step broadcast and the workers."""

    def __init__(self, *args: Any, workers: list[Any], monitor: RankMonitor, **kwargs: Any) -> None:
        self.workers, self.monitor = workers, monitor
        self._closed = False
        super().__init__(*args, **kwargs)
        assert self.tp is not None
        self.rank_weight_bytes = _gather_weight_bytes(self, self.tp)

    def execute(self, out: SchedulerOutput) -> StepResult | None:
        self._check_workers()
        try:
            with self.monitor.step():
                result = super().execute(out)
        except RuntimeError as e:  # a collective failed: most likely a rank is gone
            self._failed(e)
        return None if result is None else _CheckedResult(result, self)

    def _failed(self, error: RuntimeError) -> NoReturn:
        if isinstance(error, TensorParallelError):
            raise error
        reason = self.monitor.wait_failed(timeout_s=2)  # a dead rank: named by the monitor
        raise TensorParallelError(f"tensor-parallel step failed: {reason or error}") from error

    # -- the store connector's block exchange (``BlockExchange``) ------------------------------
    def land_blocks(self, block_ids: list[int], full: torch.Tensor) -> None:
        try:
            with self.monitor.step():
                ids = self._announce(_LAND, block_ids)
                land(self._group, self.kv_cache, ids, self.store_spec.num_kv_heads, full)
        except RuntimeError as e:
            self._failed(e)

    def collect_blocks(self, block_ids: list[int]) -> torch.Tensor:
        try:
            with self.monitor.step():
                ids = self._announce(_COLLECT, block_ids)
                full = collect(self._group, self.kv_cache, ids, self.store_spec.num_kv_heads)
        except RuntimeError as e:
            self._failed(e)
        assert full is not None
        return full

    @property
    def _group(self) -> TensorParallel:
        assert self.tp is not None
        return self.tp

    def _announce(self, op: int, block_ids: list[int]) -> torch.Tensor:
        """Tell the workers which KV operation over which blocks comes next."""
        self._check_workers()
        ids = torch.tensor(block_ids, dtype=torch.int64)
        dist.broadcast(
            _Header.kv_op(op, len(block_ids)).tensor(), 0, group=self._group.control_group
        )
        dist.broadcast(ids, 0, group=self._group.control_group)
        return ids.to(self.device)

    def _announce_step(
        self, inputs: StepInputs, out: SchedulerOutput, graph: int | None, hooked: bool
    ) -> None:
        assert not hooked, "under tensor parallelism the connector moves KV between steps"
        self._broadcast(inputs, prompt_rows(out.scheduled), graph or 0)

    def _broadcast(self, inputs: StepInputs, prompt: list[int], graph: int) -> None:
        assert self.tp is not None
        shape = inputs.shape
        header = _Header(_STEP, shape, len(prompt), inputs.num_fill > 0, graph)
        host64, host32 = self.inputs.last_host
        used64, used32 = self.inputs.used_prefixes(shape)
        group = self.tp.control_group
        dist.broadcast(header.tensor(), 0, group=group)
        dist.broadcast(host64[:used64], 0, group=group)
        dist.broadcast(host32[:used32], 0, group=group)
        if prompt:
            dist.broadcast(torch.tensor(prompt, dtype=torch.int64), 0, group=group)
        if inputs.num_fill:  # on the device group: queued behind the step, not waited for
            dist.broadcast(inputs.input_ids, 0, group=self.tp.device_group)

    def _check_workers(self) -> None:
        """Raise if the group failed (the monitor's verdict) or a worker has exited."""
        if self.monitor.failure is not None:
            raise TensorParallelError(self.monitor.failure)
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def close(self) -> None:
        """Stop the workers and destroy the process groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.monitor.stop()  # the workers' exits from here on are asked for
        assert self.tp is not None
        alive = self.monitor.failure is None and all(p.exitcode is None for p in self.workers)
        if alive:
            try:
                dist.broadcast(_Header.kv_op(_STOP).tensor(), 0, group=self.tp.control_group)
            except RuntimeError:
                alive = False
        for proc in self.workers:
            proc.join(timeout=10 if alive else 0.1)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        destroy_tensor_parallel()


class _CheckedResult(StepResult):
    """A TP step's tokens, refused when the group failed before they were read: an aborted
    NCCL collective returns with whatever its buffers held, and tokens sampled from that are
    noise. The wait for them counts as group time (the monitor's step deadline)."""

    def __init__(self, result: StepResult, runner: ParallelModelRunner) -> None:
        vars(self).update(vars(result))  # the same step's state; this adds the check
        self._runner = runner

    def tokens(self) -> dict[str, SampledToken]:
        with self._runner.monitor.step():
            tokens = super().tokens()
        self._runner._check_workers()
        return tokens

    def verified_tokens(self) -> dict[str, list[SampledToken]]:
        with self._runner.monitor.step():
            tokens = super().verified_tokens()
        self._runner._check_workers()
        return tokens


def _abort_group(tp: TensorParallel, workers: list[Any], reason: str) -> None:
    """The monitor's answer to a failed rank: abort this rank's communicators (a NCCL kernel
    waiting for a dead peer returns; gloo's abort does not interrupt a wait), then kill the
    other workers (their closed sockets end any gloo wait; they could not go on anyway)."""
    logger.error("%s: aborting the tensor-parallel group", reason)
    groups = [tp.device_group] + (
        [tp.control_group] if tp.control_group is not tp.device_group else []
    )
    for group in groups:
        with contextlib.suppress(RuntimeError):
            group.abort()
    for proc in workers:
        if proc.exitcode is None:
            proc.kill()


def start_tensor_parallel(
    size: int,
    model_dir: Path,
    hf_config: dict[str, Any],
    *,
    config: RunnerConfig,
    cache_config: CacheConfig,
    max_model_len: int,
    cpu_threads: int | None,
    reserve: KVReserve | None = None,
) -> ParallelModelRunner:
    """Spawn ranks 1…size-1, join the group as rank 0 and build rank 0's runner
    (``reserve``: a draft model beside rank 0; the ranks agree on the smallest block count)."""
    store = rendezvous_store(0, size, TIMEOUT_S)
    ctx = mp.get_context("spawn")
    plain = {
        "size": size,
        "port": store.port,
        "model_dir": str(model_dir),
        "hf_config": hf_config,
        "runner": dataclasses.asdict(config),
        "cache": dataclasses.asdict(cache_config),
        "max_model_len": max_model_len,
        "cpu_threads": cpu_threads,
        "parent": os.getpid(),
    }
    workers = [
        ctx.Process(target=_worker_main, args=(rank, plain), daemon=True, name=f"tp-rank-{rank}")
        for rank in range(1, size)
    ]
    for proc in workers:
        proc.start()
    monitor: RankMonitor | None = None
    try:
        device = torch.device(_rank_device(config.device, 0))
        if device.type == "cpu":
            torch.set_num_threads(_cpu_threads(cpu_threads, size))
        else:
            torch.cuda.set_device(device)  # NCCL binds each rank to its current device
        _wait_for_workers(store, workers)
        tp = init_tensor_parallel(0, size, store, device, TIMEOUT_S)
        monitor = RankMonitor(
            workers, lambda reason: _abort_group(tp, workers, reason), STEP_TIMEOUT_S
        )
        return ParallelModelRunner(
            model_dir,
            hf_config,
            config=dataclasses.replace(config, device=str(device)),
            cache_config=cache_config,
            max_model_len=max_model_len,
            tp=tp,
            reserve=reserve,
            workers=workers,
            monitor=monitor,
        )
    except BaseException:
        if monitor is not None:
            monitor.stop()
        for proc in workers:
            proc.kill()
            proc.join()
        destroy_tensor_parallel()
        raise


def _wait_for_workers(store: dist.TCPStore, workers: list[Any]) -> None:
    """Until every worker has reached the store: one that exits first fails the start at once
    (rather than after the rendezvous timeout)."""
    keys = [f"joined/{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + TIMEOUT_S
    while not store.check(keys):
        for rank, proc in enumerate(workers, start=1):
            if proc.exitcode is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited with code {proc.exitcode} at start"
                )
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not start in {TIMEOUT_S} s")
        time.sleep(0.05)


def _worker_main(rank: int, plain: dict[str, Any]) -> None:
    """Rank ``rank``: build its shard, then run the forward of every step rank 0 broadcasts."""
    die_with(plain["parent"])  # a rank never outlives its engine (SIGKILL included)
    logging.basicConfig(level=logging.WARNING)
    size = plain["size"]
    # rank 0's (the same graphs, captured in lockstep), its nested config rebuilt from asdict's
    config = RunnerConfig(**{**plain["runner"], "lora": LoraConfig(**plain["runner"]["lora"])})
    device = torch.device(_rank_device(config.device, rank))
    if device.type == "cpu":
        torch.set_num_threads(_cpu_threads(plain["cpu_threads"], size))
    else:
        torch.cuda.set_device(device)
    store = rendezvous_store(plain["port"], size, TIMEOUT_S)
    store.set(f"joined/{rank}", "1")
    tp = init_tensor_parallel(rank, size, store, device, TIMEOUT_S)
    try:
        runner = ModelRunner(
            Path(plain["model_dir"]),
            plain["hf_config"],
            config=dataclasses.replace(config, device=str(device)),
            cache_config=CacheConfig(**plain["cache"]),
            max_model_len=plain["max_model_len"],
            tp=tp,
        )
        _gather_weight_bytes(runner, tp)
        _serve(runner, tp)
    finally:
        destroy_tensor_parallel()


@torch.inference_mode()
def _serve(runner: ModelRunner, tp: TensorParallel) -> None:
    received = torch.zeros(_Header.SIZE, dtype=torch.int64)
    buffers = runner.inputs
    while True:
        dist.broadcast(received, 0, group=tp.control_group)
        header = _Header.read(received)
        if header.op == _STOP:
            return
        if header.op != _STEP:
            _kv_op(runner, tp, header.op, header.step.num_tokens)
            continue
        host64, host32 = buffers.next_host()  # the other set's copy may still be running
        used64, used32 = buffers.used_prefixes(header.step)
        dist.broadcast(host64[:used64], 0, group=tp.control_group)
        dist.broadcast(host32[:used32], 0, group=tp.control_group)
        prompt = torch.empty(header.num_scored, dtype=torch.int64)
        if header.num_scored:
            dist.broadcast(prompt, 0, group=tp.control_group)
        inputs = buffers.adopt(header.step)
        if header.filled:
            dist.broadcast(inputs.input_ids, 0, group=tp.device_group)
        if header.graph and runner.graphs is not None:
            hidden = runner.graphs.replay(header.graph, inputs)
        else:  # eager (on a CPU, a graph's padded step runs eagerly, as rank 0's does)
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_layers, inputs.meta)
        if header.num_scored:  # prompt logprobs first, as rank 0 computes them
            runner.model.lm_head(hidden.index_select(0, prompt.to(runner.device)))
        if inputs.num_logits_rows:
            runner.model.lm_head(hidden.index_select(0, inputs.logits_rows))


def _kv_op(runner: ModelRunner, tp: TensorParallel, op: int, num_blocks: int) -> None:
    """A worker's side of ``land_blocks`` / ``collect_blocks``."""
    ids = torch.empty(num_blocks, dtype=torch.int64)
    dist.broadcast(ids, 0, group=tp.control_group)
    ids = ids.to(runner.device)
    heads = runner.store_spec.num_kv_heads
    if op == _LAND:
        land(tp, runner.kv_cache, ids, heads, None)
    elif op == _COLLECT:
        collect(tp, runner.kv_cache, ids, heads)
    else:
        raise TensorParallelError(f"unknown tensor-parallel op {op}")
