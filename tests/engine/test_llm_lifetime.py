"""An ``LLM`` releases what it holds: ``close()``, ``with``, and ``del`` (a finaliser) stop the
tensor-parallel workers, destroy the process group (a second TP engine can start in the same
process), and stop the KV connector's threads and staging memory. A dead or stuck rank fails a
step with ``TensorParallelError`` within seconds, through rank 0's monitor (CPU, gloo)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import common.parallel.executor as executor
from common import LLM, SamplingParams
from common.kv_interface import ConnectorMetadata, KVCacheSpec, LoadSpec
from common.parallel.executor import ParallelModelRunner, TensorParallelError
from common.parallel.monitor import RankMonitor
from kv_store import FileStore
from kv_transfer.staging import RingClosed
from kv_transfer.worker import StoreConnectorWorker

ENGINE_ARGS = dict(num_blocks=64, block_size=8, cpu_threads=1, max_model_len=256)
PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _children() -> set[int]:
    """Pids of this process's live children (zombies, already dead, left out), from /proc."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z":
            found.add(int(entry.name))
    return found


def _worker_pids(llm: LLM) -> list[int]:
    runner = llm.engine.runner
    assert isinstance(runner, ParallelModelRunner)
    return runner.worker_pids


def _assert_released(pids: list[int]) -> None:
    """No rank process is left (running or unreaped) and no process group is up."""
    assert pids and not set(pids) & _children()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]
    assert not dist.is_initialized()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


# -- close, with, del ----------------------------------------------------------------------------
@pytest.mark.slow
def test_two_tp_engines_one_after_the_other():
    """``close()``, then ``del``: each releases its ranks and group; the next engine starts in
    this process and gives the same greedy tokens."""
    first = LLM(tensor_parallel_size=2, **ENGINE_ARGS)
    pids = _worker_pids(first)
    assert set(pids) <= _children()
    want = _tokens(first)
    first.close()
    _assert_released(pids)

    second = LLM(tensor_parallel_size=2, **ENGINE_ARGS)
    pids = _worker_pids(second)
    assert _tokens(second) == want
    del second
    gc.collect()
    _assert_released(pids)


@pytest.mark.slow
def test_context_manager_releases_the_ranks():
    with LLM(tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        pids = _worker_pids(llm)
        assert len(_tokens(llm)) == len(PROMPTS)
    _assert_released(pids)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_closed_llm_refuses_use():
    llm = LLM(**ENGINE_ARGS)
    engine = llm.engine
    llm.close()
    llm.close()  # idempotent
    for use in (
        lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        lambda: llm.generate([], GREEDY, use_tqdm=False),
        llm.check_integrity,
        lambda: llm.engine,
    ):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            use()
    engine.close()  # the engine's own close is idempotent too


def test_del_closes_at_once():
    """The finaliser holds the engine, never the LLM: dropping the last reference closes the
    engine at once, with no reference cycle left for the collector."""
    llm = LLM(**ENGINE_ARGS)
    finalizer = llm._finalizer
    assert finalizer.alive
    gc.disable()
    try:
        del llm
        assert not finalizer.alive
    finally:
        gc.enable()


# -- a dead or stuck rank ------------------------------------------------------------------------
def _fail_at_step(monkeypatch, step: int, sig: signal.Signals) -> dict[str, float]:
    """Send ``sig`` to rank 1 as the ``step``-th TP step starts; returns when it was sent."""
    sent: dict[str, float] = {}
    count = [0]
    execute = ParallelModelRunner.execute

    def counting(self, out):
        count[0] += 1
        if count[0] == step:
            os.kill(self.worker_pids[0], sig)
            sent["at"] = time.monotonic()
        return execute(self, out)

    monkeypatch.setattr(ParallelModelRunner, "execute", counting)
    return sent


def _spy_aborts(monkeypatch) -> list[str]:
    """The reasons the monitor aborted the group for (the path that aborts NCCL)."""
    reasons: list[str] = []
    abort = executor._abort_group

    def spy(tp, workers, reason):
        reasons.append(reason)
        abort(tp, workers, reason)

    monkeypatch.setattr(executor, "_abort_group", spy)
    return reasons


@pytest.mark.slow
def test_killed_worker_fails_the_step_within_seconds(monkeypatch):
    sent = _fail_at_step(monkeypatch, 6, signal.SIGKILL)
    aborts = _spy_aborts(monkeypatch)
    llm = LLM(tensor_parallel_size=2, **ENGINE_ARGS)
    pids = _worker_pids(llm)
    try:
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        elapsed = time.monotonic() - sent["at"]
        print(f"time to TensorParallelError after SIGKILL: {elapsed:.3f} s")
        assert elapsed < 5
        assert len(aborts) == 1 and "rank 1" in aborts[0]  # the monitor saw the death
        with pytest.raises(TensorParallelError):  # the engine stays failed
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    _assert_released(pids)


@pytest.mark.slow
def test_stuck_worker_fails_at_the_step_deadline(monkeypatch):
    """A stopped rank keeps its sockets open: gloo waits for it as NCCL waits for a dead peer.
    Only the monitor ends that wait (its deadline; an exit for NCCL): it aborts the group and
    kills the workers, and the step raises."""
    monkeypatch.setattr(executor, "STEP_TIMEOUT_S", 2.0)
    sent = _fail_at_step(monkeypatch, 6, signal.SIGSTOP)
    aborts = _spy_aborts(monkeypatch)
    llm = LLM(tensor_parallel_size=2, **ENGINE_ARGS)
    pids = _worker_pids(llm)
    try:
        with pytest.raises(TensorParallelError, match="ran past 2 s"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        elapsed = time.monotonic() - sent["at"]
        print(f"time to TensorParallelError after SIGSTOP (deadline 2 s): {elapsed:.3f} s")
        assert 2 <= elapsed < 6
        assert len(aborts) == 1
    finally:
        llm.close()
    _assert_released(pids)


# -- the monitor alone ---------------------------------------------------------------------------
def _sleeper() -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    return proc


def test_monitor_reports_an_exit_once_and_not_after_stop():
    procs = [_sleeper(), _sleeper()]
    reasons: list[str] = []
    monitor = RankMonitor(procs, reasons.append, step_timeout_s=60)
    try:
        procs[1].kill()
        start = time.monotonic()
        assert monitor.wait_failed(timeout_s=5) is not None
        assert time.monotonic() - start < 2
        assert reasons == [f"tensor-parallel rank 2 (pid {procs[1].pid}) exited with code -9"]
    finally:
        monitor.stop()
    quiet = RankMonitor([procs[0]], reasons.append, step_timeout_s=60)
    quiet.stop()
    procs[0].kill()
    procs[0].join()
    assert len(reasons) == 1 and quiet.failure is None


def test_monitor_step_deadline():
    proc = _sleeper()
    reasons: list[str] = []
    monitor = RankMonitor([proc], reasons.append, step_timeout_s=0.3)
    try:
        with monitor.step():
            time.sleep(0.1)  # within the deadline
        time.sleep(0.6)  # between steps: no deadline
        assert reasons == []
        with monitor.step():
            assert monitor.wait_failed(timeout_s=3) is not None
        assert reasons == ["a tensor-parallel step ran past 0.3 s (a rank is stuck)"]
    finally:
        monitor.stop()
        proc.kill()
        proc.join()


# -- the KV connector ----------------------------------------------------------------------------
def _kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("kv-", "tp-monitor"))]


@pytest.mark.slow
def test_connector_threads_and_ranks_released(tmp_path):
    url = f"file://{tmp_path / 'kv'}"
    llm = LLM(tensor_parallel_size=2, kv_store=url, **ENGINE_ARGS)
    pids = _worker_pids(llm)
    worker = llm.engine.connector[1]
    assert isinstance(worker, StoreConnectorWorker)
    first = _tokens(llm)
    assert worker.num_saved_blocks > 0 and _kv_threads()
    del llm
    gc.collect()
    _assert_released(pids)
    assert _kv_threads() == []
    with pytest.raises(RingClosed):  # the staging memory is given back
        worker.saver.ring.acquire()
    with LLM(kv_store=url, **ENGINE_ARGS) as again:  # the store outlives its engines
        assert _tokens(again) == first


def test_close_does_not_wait_for_a_reader_blocked_on_staging(tmp_path):
    """A load whose staging slot never comes (every slot held): close returns, the reader ends."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    store = FileStore(tmp_path / "kv", "lifetime-test", capacity_bytes=64 * spec.bytes_per_block)
    worker = StoreConnectorWorker(
        store,
        spec,
        torch.device("cpu"),
        staging_slots=1,
        slot_bytes=spec.bytes_per_block,
        read_in_place=False,
    )
    ring = worker.loader.ring
    held = ring.acquire()  # the only slot
    worker.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r", ["k"], [3], [4])]))
    worker.start_load_kv(torch.zeros(2, 2, 8, 4, 2, 8))
    time.sleep(0.2)  # the reader is now waiting for a slot
    closer = threading.Thread(target=worker.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-")]
    ring.release(held)  # after close: dropped, not recycled
    with pytest.raises(RingClosed):
        ring.acquire()


@pytest.mark.timeout(120)
def test_a_request_failed_in_a_step_fails_generate(monkeypatch):
    """A step that raises ends its request (the engine contains it): ``generate`` raises
    instead of waiting forever for a request that will never finish."""
    llm = LLM(**ENGINE_ARGS)
    try:

        def boom(out):
            raise ValueError("boom")

        monkeypatch.setattr(llm.engine.runner, "execute", boom)
        with pytest.raises(RuntimeError, match="ValueError: boom"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert llm.engine.request_ids() == []
    finally:
        llm.close()
