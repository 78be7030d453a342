"""End to end through pdserve's own connector: is loading a prompt's KV cheaper than recomputing
it, and what does saving it add to a prefill? Beside the box's raw limits, measured in the run.

    python -m benchmarks.kv_connector                # CPU: 32 KiB of KV per token, file + shm
    python -m benchmarks.kv_connector --stores file shm redis
    python -m benchmarks.kv_connector --kv-cache-dtype auto fp8   # FP8 rows beside the dtype's
    python -m benchmarks.kv_connector --shape llama-3.2-1b --dtype bfloat16 \\
        --prompts 32x1024 8x4096 2x16384             # the GPU table of docs/BENCHMARKS.md

Per store and prompt set, four timed phases on dummy weights of one shape:
  prefill       an engine without a store runs the prompts (max_tokens=1): the recompute cost;
  prefill+save  a producer engine runs them and returns once every entry is durable;
  load          a consumer engine gets each prompt with its first token (as the router sends
                it), loads every prompt block from the store and computes that one token (whose
                attention reads the whole loaded context once more);
  transfer      the consumer's connector alone, driven as the scheduler drives it: existence
                check, fetch and verify, land in the paged cache (the KV path itself).
Raw limits in the same run, moving the same bytes with the same parallelism: files of one entry
each written and read by N threads in a sibling directory of the store, redis-py pipelines on N
connections, and on CUDA pinned host<->device copies. Each figure is the best of --repeat; the
store is cleared before every save and the engines' prefix caches between repeats, so every
phase really moves or computes everything. 1 GB = 1e9 B.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from common.config import EngineConfig
from common.engine import EngineCore
from common.models.shapes import write_dummy_shape
from common.request import Request
from common.sampling_params import SamplingParams
from common.step_outputs import SchedulerOutput
from kv_transfer.connector import create_store_connector

GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


# -- engine phases --------------------------------------------------------------------------------
def make_engine(
    args: argparse.Namespace, model: str, url: str | None, role: str | None, kv_dtype: str = "auto"
):
    longest = max(n for _, n in args.prompts)
    return EngineCore(
        EngineConfig.from_kwargs(
            model=model,
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            max_model_len=longest + 16,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_store=url,
            kv_role=role,
            cpu_threads=args.cpu_threads,
            kv_cache_dtype=kv_dtype,
        ),
        create_store_connector,
    )


def run(engine: EngineCore, requests: list[tuple[list[int], list[int] | None]]) -> float:
    """Seconds to run ``(prompt, output_token_ids)`` requests to completion (max_tokens=1)."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None
    engine.kv_cache_manager.reset_prefix_cache()
    sync()
    start = time.perf_counter()
    for i, (prompt, outs) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY_ONE, output_token_ids=outs)
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts[out.request_id] = out.new_token_ids
    sync()
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    return elapsed


def transfer(engine: EngineCore, prompts: list[list[int]]) -> float:
    """Seconds for the connector alone to bring the prompts' KV from the store into the paged
    cache (existence check, fetch, verify, land), driven the way the scheduler drives it."""
    sched, worker = engine.connector  # type: ignore[misc]
    bs = engine.block_size
    requests = [
        Request(
            f"t{i}", [*p, 1], GREEDY_ONE, eos_token_id=None, block_size=bs, seed=0, max_tokens=1
        )
        for i, p in enumerate(prompts)
    ]
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None
    engine.kv_cache_manager.reset_prefix_cache()  # the blocks below are free: nothing cached
    sync()
    start = time.perf_counter()
    first = 0
    for request in requests:
        # no handle: the store is asked on the connector's lookup thread, and the scheduler
        # asks again on a later step until the answer is in (None: not known yet)
        while (matched := sched.get_num_new_matched_tokens(request, 0).num_tokens) is None:
            time.sleep(0.0002)
        blocks = list(range(first, first + -(-matched // bs)))
        first += len(blocks)
        sched.update_state_after_alloc(request, blocks, matched)
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput()))
    worker.start_load_kv(engine.runner.kv_cache)
    worker.clear_connector_metadata()
    pending = {r.request_id for r in requests}
    while pending:
        pending -= worker.get_finished(set())[1]
        time.sleep(0.0002)
    for layer in range(engine.runner.spec.num_layers):  # staged (CUDA): land, layer by layer
        worker.wait_for_layer_load(layer)
    sync()
    elapsed = time.perf_counter() - start
    assert not worker.get_failed_blocks(), "the transfer phase missed entries"
    return elapsed


def prompts_of(spec: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    count, length = spec
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def engine_phases(
    args, model: str, url: str, prompts: list[list[int]], kv_dtype: str
) -> dict[str, float]:
    """Best seconds of prefill, prefill+save and load for one store and prompt set."""
    plain = make_engine(args, model, None, None, kv_dtype)
    producer = make_engine(args, model, url, "producer", kv_dtype)
    consumer = make_engine(args, model, url, "consumer", kv_dtype)
    store = producer.connector[1].store  # type: ignore[index]
    warm = [([5, 6, 7] * 11, None)]
    for engine in (plain, producer, consumer):
        run(engine, warm)
    best = dict.fromkeys(("prefill", "save", "load", "transfer"), float("inf"))
    first = [[1] for _ in prompts]  # the first token: any id, the load only needs the prompt
    for _ in range(args.repeat):
        best["prefill"] = min(best["prefill"], run(plain, [(p, None) for p in prompts]))
        store.clear()
        best["save"] = min(best["save"], run(producer, [(p, None) for p in prompts]))
        loaded_before = consumer.connector[1].num_loaded_blocks  # type: ignore[index]
        best["load"] = min(best["load"], run(consumer, list(zip(prompts, first))))
        loaded = consumer.connector[1].num_loaded_blocks - loaded_before  # type: ignore[index]
        bs = consumer.block_size
        want = sum(-(-len(p) // bs) for p in prompts)
        assert loaded == want, f"loaded {loaded} of {want} blocks: the load phase recomputed"
        best["transfer"] = min(best["transfer"], transfer(consumer, prompts))
    for engine in (plain, producer, consumer):
        engine.close()
    return best


# -- raw limits -------------------------------------------------------------------------------------
def parallel(threads: int, items: list, fn: Callable[[list], None]) -> float:
    parts = [items[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=fn, args=(part,)) for part in parts if part]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def raw_files(directory: Path, entry_bytes: int, count: int, threads: int, repeat: int):
    """(write s, read s): ``count`` files of ``entry_bytes`` each, ``threads`` at a time."""
    payload = os.urandom(entry_bytes)
    paths = [str(directory / f"raw-{i}") for i in range(count)]

    def write(part: list[str]) -> None:
        for path in part:
            with open(path, "wb") as f:
                f.write(payload)

    def read(part: list[str]) -> None:
        buf = bytearray(entry_bytes)  # one per thread, like a reader's own buffer
        for path in part:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

    best_w = best_r = float("inf")
    for _ in range(repeat):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        best_w = min(best_w, parallel(threads, paths, write))
        best_r = min(best_r, parallel(threads, paths, read))
    shutil.rmtree(directory, ignore_errors=True)
    return best_w, best_r


def raw_redis(url: str, entry_bytes: int, count: int, threads: int, repeat: int, batch: int):
    """(write s, read s): redis-py pipelines of ``batch`` SET/GET on ``threads`` connections."""
    import redis

    payload = os.urandom(entry_bytes)
    keys = [f"raw:{i}" for i in range(count)]
    pool = redis.ConnectionPool.from_url(url, max_connections=threads + 1)

    def write(part: list[str]) -> None:
        client = redis.Redis(connection_pool=pool)
        for lo in range(0, len(part), batch):
            pipe = client.pipeline(transaction=False)
            for key in part[lo : lo + batch]:
                pipe.set(key, payload)
            pipe.execute()

    def read(part: list[str]) -> None:
        client = redis.Redis(connection_pool=pool)
        for lo in range(0, len(part), batch):
            pipe = client.pipeline(transaction=False)
            for key in part[lo : lo + batch]:
                pipe.get(key)
            pipe.execute()

    best_w = best_r = float("inf")
    for _ in range(repeat):
        best_w = min(best_w, parallel(threads, keys, write))
        best_r = min(best_r, parallel(threads, keys, read))
    redis.Redis(connection_pool=pool).unlink(*keys)
    pool.disconnect()
    return best_w, best_r


def raw_pinned(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """(device→host s, host→device s) of one pinned copy of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = {"d2h": float("inf"), "h2d": float("inf")}
    for _ in range(repeat + 1):
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times[name] = min(times[name], time.perf_counter() - start)
    return times["d2h"], times["h2d"]


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server (no persistence, no eviction limit) on a free port."""
    import socket

    import redis

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen([*cmd, "--dir", workdir], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            for _ in range(200):
                with contextlib.suppress(redis.ConnectionError):
                    redis.Redis.from_url(url).ping()
                    break
                time.sleep(0.02)
            yield url
        finally:
            proc.kill()
            proc.wait()


# -- the run ------------------------------------------------------------------------------------------
def store_urls(stores: list[str], base: Path, stack: contextlib.ExitStack) -> dict[str, str]:
    urls = {}
    for name in stores:
        if name == "file":
            urls[name] = f"file://{base}/file"
        elif name == "shm":
            urls[name] = f"shm://{base}/shm"
        elif name == "redis":
            urls[name] = stack.enter_context(redis_server())
        else:
            raise ValueError(f"unknown store {name!r}: file, shm or redis")
    return urls


def measure(args: argparse.Namespace) -> dict:
    model = str(write_dummy_shape(args.shape))
    specs = {}
    for kv_dtype in args.kv_cache_dtype:
        probe = make_engine(args, model, None, None, kv_dtype)
        specs[kv_dtype], vocab, device = probe.runner.spec, probe.vocab_size, probe.runner.device
        probe.close()
    spec = specs[args.kv_cache_dtype[0]]
    per_token = spec.bytes_per_block // spec.block_size
    report: dict = {"shape": args.shape, "device": str(device), "kv_bytes_per_token": per_token}
    report["rows"] = []
    base = Path(args.dir) / f"pdserve-kvbench-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        urls = store_urls(args.stores, base, stack)
        cases = [(s, p, d) for s in urls for p in args.prompts for d in args.kv_cache_dtype]
        for store, spec_p, kv_dtype in tqdm(cases, desc="kv connector phases"):
            prompts = prompts_of(spec_p, vocab, seed=spec_p[1])
            best = engine_phases(args, model, urls[store], prompts, kv_dtype)
            block = specs[kv_dtype].bytes_per_block
            nbytes = sum(-(-len(p) // spec.block_size) for p in prompts) * block
            report["rows"].append(row(store, spec_p, nbytes, best))
            report["rows"][-1].update(
                kv_dtype=kv_dtype, kv_bytes_per_token=block // spec.block_size
            )
        report["raw"] = raw_limits(args, urls, base, spec.bytes_per_block, device)
    return report


def row(store: str, prompts: tuple[int, int], nbytes: int, best: dict[str, float]) -> dict:
    return {
        "store": store,
        "prompts": f"{prompts[0]}x{prompts[1]}",
        "kv_GB": nbytes / 1e9,
        "prefill_ms": best["prefill"] * 1e3,
        "prefill_save_ms": best["save"] * 1e3,
        "load_ms": best["load"] * 1e3,
        "save_over_prefill": best["save"] / best["prefill"],
        "load_over_prefill": best["load"] / best["prefill"],
        "load_GBps": nbytes / best["load"] / 1e9,
        "transfer_ms": best["transfer"] * 1e3,
        "transfer_GBps": nbytes / best["transfer"] / 1e9,
    }


def raw_limits(args, urls: dict[str, str], base: Path, entry_bytes: int, device) -> dict:
    nbytes = max(args.prompts, key=lambda p: p[0] * p[1])
    count = max(64, nbytes[0] * nbytes[1] // 16)
    count = min(count, int(2e9 // entry_bytes))
    total = count * entry_bytes
    raw: dict[str, float] = {}
    w, r = raw_files(base / "raw", entry_bytes, count, args.raw_threads, args.repeat)
    raw["file_write_GBps"], raw["file_read_GBps"] = total / w / 1e9, total / r / 1e9
    if "redis" in urls:
        w, r = raw_redis(urls["redis"], entry_bytes, count, args.raw_threads, args.repeat, 32)
        raw["redis_write_GBps"], raw["redis_read_GBps"] = total / w / 1e9, total / r / 1e9
    if device.type == "cuda":
        d2h, h2d = raw_pinned(total, device, args.repeat)
        raw["pinned_d2h_GBps"], raw["pinned_h2d_GBps"] = total / d2h / 1e9, total / h2d / 1e9
    return raw


def markdown(report: dict) -> str:
    raw = report["raw"]
    lines = [
        f"shape {report['shape']} on {report['device']}, {report['kv_bytes_per_token']} B of KV"
        " per token",
        "",
        "| store | prompts | KV dtype (B/token) | KV GB | prefill ms | prefill+save ms (x) |"
        " load ms (x) | load GB/s | transfer ms | transfer GB/s (of raw read) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        raw_read = raw.get("redis_read_GBps" if r["store"] == "redis" else "file_read_GBps")
        vs_raw = f" ({r['transfer_GBps'] / raw_read:.0%})" if raw_read else ""
        lines.append(
            f"| {r['store']} | {r['prompts']} | {r['kv_dtype']} ({r['kv_bytes_per_token']}) |"
            f" {r['kv_GB']:.3f} | {r['prefill_ms']:.0f} |"
            f" {r['prefill_save_ms']:.0f} ({r['save_over_prefill']:.2f}x) |"
            f" {r['load_ms']:.0f} ({r['load_over_prefill']:.2f}x) | {r['load_GBps']:.2f} |"
            f" {r['transfer_ms']:.0f} | {r['transfer_GBps']:.2f}{vs_raw} |"
        )
    lines += ["", "raw limits: " + ", ".join(f"{k} {v:.2f}" for k, v in raw.items())]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['store']} {r.get('kv_dtype', '')}\n{r['prompts']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    phases = (
        ("prefill_ms", "prefill (recompute)"),
        ("prefill_save_ms", "prefill + save"),
        ("load_ms", "load instead"),
    )
    for k, (key, name) in enumerate(phases):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], 0.27, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(f"KV through the connector: {report['shape']} on {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_prompts(text: str) -> tuple[int, int]:
    count, length = text.lower().split("x")
    return int(count), int(length)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="cpu-kv32k", help="a shape of common/models/shapes.py")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                   help="KV cache dtypes to run side by side (auto fp8: the FP8 rows too)")  # fmt: skip
    p.add_argument("--device", default="auto")
    p.add_argument("--stores", nargs="+", default=["file", "shm"], help="file, shm, redis")
    p.add_argument("--prompts", nargs="+", type=parse_prompts, default=None, help="COUNTxLEN")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--raw-threads", type=int, default=2, help="threads of the raw baselines")
    p.add_argument("--dir", default="/dev/shm", help="where the file stores live")
    p.add_argument("--out", default=None, help="directory for report.json/.md and the plot")
    args = p.parse_args()
    if args.prompts is None:
        gpu = torch.cuda.is_available() and args.device != "cpu"
        args.prompts = [(32, 1024), (8, 4096), (2, 16384)] if gpu else [(16, 512), (4, 2048)]
    report = measure(args)
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(text + "\n")
        plot(report, out / "kv_connector.png")


if __name__ == "__main__":
    main()
