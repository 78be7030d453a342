"""Chaos run on a live ``pdserve up``: steady streamed load, SIGKILL of one process at a time.

    python -m benchmarks.chaos                      # Redis store, 1 prefill + 2 decode, 8 streams
    python -m benchmarks.chaos --streams 8 --settle 8 --json chaos.json
    python -m benchmarks.chaos --faults decode-stop   # a hung (SIGSTOPped) decode node

A ``pdserve up --kv-store redis`` cluster serves ``--streams`` concurrent streamed, greedy
completions, one after another per stream, each checked against the offline engine's text for
the same prompt (``common.LLM``): a request *fails* (HTTP error, dropped connection), is
*truncated* (no finish reason, fewer tokens than asked) or *differs* (other text). Nothing is
retried. Then, one at a time, a decode node, the prefill node, the router and Redis get SIGKILL;
after each, the run waits until the cluster is back to full strength (the replacement up and
``/ready`` ready with every instance), lets the load run ``--settle`` seconds more, and goes on.

Each fault's row counts the requests that *ended* from its kill to the next kill (or the end),
so the streams in flight at a kill count under it: the fault-tolerance table of
docs/DEPLOYMENT.md, in Dynamo's format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In a distant galaxy",
    "The capital of France is",
    "def fibonacci(n):",
    "Roses are red,",
    "The meaning of life",
    "Breaking news:",
]
MAX_TOKENS = 16
FAULTS = ("decode", "prefill", "router", "redis")
# also: "decode-rank" / "prefill-rank", a tensor-parallel rank of a node (with --decode-tp /
# --prefill-tp > 1): its engine fails, the node stops and is replaced; "decode-stop" /
# "prefill-stop", SIGSTOP of a node: it hangs, alive; the router moves its requests at its
# --progress-timeout and `up`'s watchdog (--node-watchdog) kills and replaces it


@dataclass
class Outcome:
    """One request: when it ran (monotonic s) and what was wrong with it ('' when nothing)."""

    start: float
    end: float
    problem: str = ""  # "failed: ..." | "truncated" | "different"


@dataclass
class FaultRow:
    """One line of the fault-tolerance table."""

    fault: str
    replicas: str
    requests: int = 0
    failed: int = 0
    truncated: int = 0
    different: int = 0
    recovery_s: float = 0.0
    failing_s: float = 0.0  # first failed request's start to last one's end
    in_flight_s: float = 0.0  # the last request in flight at the fault ended this long after it
    examples: list[str] = field(default_factory=list)


def expected_texts(model: str = "tiny-llama") -> list[str]:
    """The offline engine's greedy text for each prompt (what every request must answer)."""
    from common import LLM, SamplingParams

    llm = LLM(model=model, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


async def one_request(client: httpx.AsyncClient, prompt: str, expected: str) -> Outcome:
    """A streamed greedy completion, checked; never retried."""
    start = time.monotonic()
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    text, finish, done = "", None, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(start, time.monotonic(), f"failed: {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text", "")
                finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return Outcome(start, time.monotonic(), f"failed: {type(exc).__name__}")
    end = time.monotonic()
    if not done or finish != "length":
        return Outcome(start, end, "truncated")
    return Outcome(start, end, "" if text == expected else "different")


async def drive(url: str, expected: list[str], streams: int, stop: asyncio.Event,
                outcomes: list[Outcome]) -> None:  # fmt: skip
    """``streams`` concurrent loops of requests until ``stop``."""
    limits = httpx.Limits(max_connections=streams * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False,
                                 limits=limits) as client:  # fmt: skip

        async def loop(i: int) -> None:
            n = i
            while not stop.is_set():
                prompt = n % len(PROMPTS)
                outcome = await one_request(client, PROMPTS[prompt], expected[prompt])
                outcomes.append(outcome)
                if outcome.problem.startswith("failed"):
                    await asyncio.sleep(0.25)  # no busy spin on a refused connection
                n += streams

        await asyncio.gather(*(loop(i) for i in range(streams)))


# -- the cluster's processes --------------------------------------------------------------------


def cluster_pids(tag: str, redis: str) -> dict[str, list[int]]:
    """Live processes carrying ``UP_TEST_TAG=tag``, by what they run (node frontends only), and
    the redis-server serving ``redis`` ("127.0.0.1:PORT": it rewrites its environ area)."""
    needle = f"UP_TEST_TAG={tag}".encode()
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if argv and "redis-server" in argv[0] and redis in argv[0]:
                found.setdefault("redis", []).append(int(entry.name))
                continue
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        kind = _kind(argv)
        if kind:
            found.setdefault(kind, []).append(int(entry.name))
    return found


def _ranks(node: int) -> list[int]:
    """The tensor-parallel worker ranks of a node: its engine core's children."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    cores = [pid for pid, parent in parents.items() if parent == node]
    return sorted(pid for pid, parent in parents.items() if parent in cores)


def _victim(tag: str, redis: str, fault: str) -> int:
    pool, _, part = fault.partition("-")
    pid = cluster_pids(tag, redis)[pool][0]
    if part != "rank":
        return pid  # the process itself: SIGKILL, or SIGSTOP for a "-stop" fault
    ranks = _ranks(pid)
    if not ranks:
        raise ValueError(f"{fault}: the {pool} node has no tensor-parallel ranks (--{pool}-tp 2)")
    return ranks[0]


def _kind(argv: list[str]) -> str | None:
    if "pdserve_cli" in argv:
        rest = argv[argv.index("pdserve_cli") + 1 :]
        if rest and rest[0] in ("prefill", "decode", "router", "up"):
            return rest[0]
    return None


def ready_counts(url: str) -> tuple[bool, dict[str, int]]:
    try:
        body = httpx.get(f"{url}/ready", timeout=2.0, trust_env=False).json()
        return body.get("ready") is True, dict(body.get("instances", {}))
    except (httpx.HTTPError, ValueError):
        return False, {}


async def wait_full(url: str, replaced: Callable[[], bool], full: dict[str, int],
                    timeout_s: float) -> float:  # fmt: skip
    """Seconds from now until ``replaced()`` (the killed process has a serving successor) and
    ``/ready`` is ready with at least ``full`` instances (a killed node stays counted until
    the router drops it: the successor is what shows the pool whole again)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        ready, counts = await asyncio.to_thread(ready_counts, url)
        whole = all(counts.get(pool, 0) >= n for pool, n in full.items())
        if ready and whole and replaced():
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    raise TimeoutError(f"not back to full strength {timeout_s:.0f} s after the kill")


def _replaced(up: object, tag: str, redis: str, fault: str, victim: int) -> Callable[[], bool]:
    """When the killed ``fault`` process counts as replaced: a node once whoever starts nodes
    (`up`, or under ``--autoscale`` the router's actuator, in router.log) logged another node of
    its pool ready (it registers right after), the router or Redis once another process of that
    kind runs (``/ready`` then shows the router's nodes)."""
    if fault in ("prefill", "decode"):
        pattern = re.compile(rf"{fault}-\d+ ready at")
        router_log = up.log_dir / "router.log"  # type: ignore[attr-defined]

        def text() -> str:
            if "--autoscale" in up.args:  # type: ignore[attr-defined]
                return router_log.read_text(errors="replace") if router_log.exists() else ""
            return up.output  # type: ignore[attr-defined]

        before = len(pattern.findall(text()))
        return lambda: len(pattern.findall(text())) > before
    return lambda: any(p != victim for p in cluster_pids(tag, redis).get(fault, []))


# -- the run -------------------------------------------------------------------------------------


@dataclass
class ChaosResult:
    rows: list[FaultRow]
    baseline: FaultRow
    leftovers: list[int]
    up_exit: int | None
    command: str


async def run_chaos(up: object, url: str, expected: list[str], streams: int = 8,
                    settle_s: float = 6.0, faults: tuple[str, ...] = FAULTS,
                    timeout_s: float = 180.0) -> list[FaultRow]:  # fmt: skip
    """Load on ``url`` while each of ``faults`` is SIGKILLed in turn (``up``: the harness's
    UpProcess, for its tag); the baseline row first (``fault="none"``)."""
    tag: str = up.tag  # type: ignore[attr-defined]
    found = re.search(r"redis://(?:[^@\s]*@)?(127\.0\.0\.1:\d+)", up.output)  # type: ignore[attr-defined]
    redis = found.group(1) if found else "-"
    full = {"prefill": 1, "decode": 2}
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    load = asyncio.ensure_future(drive(url, expected, streams, stop, outcomes))
    marks: list[tuple[str, float, float]] = []  # (fault, kill time, recovery s)
    try:
        await asyncio.sleep(settle_s)
        for fault in faults:
            victim = _victim(tag, redis, fault)
            kind = fault.removesuffix("-rank").removesuffix("-stop")
            replaced = _replaced(up, tag, redis, kind, victim)
            os.kill(victim, signal.SIGSTOP if fault.endswith("-stop") else signal.SIGKILL)
            killed_at = time.monotonic()
            recovery = await wait_full(url, replaced, full, timeout_s)
            marks.append((fault, killed_at, recovery))
            await asyncio.sleep(settle_s)
    finally:
        stop.set()
        await load
    return _rows(outcomes, marks)


_REPLICAS = {"none": "-", "decode": "1 of 2 decode", "prefill": "1 of 1 prefill",
             "router": "1 of 1 router", "redis": "1 of 1 Redis",
             "decode-rank": "rank 1 of 2, 1 of 2 decode", "prefill-rank": "rank 1 of 2, 1 of 1 prefill",
             "decode-stop": "1 of 2 decode (SIGSTOP)", "prefill-stop": "1 of 1 prefill (SIGSTOP)"}  # fmt: skip


def _rows(outcomes: list[Outcome], marks: list[tuple[str, float, float]]) -> list[FaultRow]:
    bounds = [("none", 0.0, 0.0), *marks]
    rows = []
    for i, (fault, since, recovery) in enumerate(bounds):
        until = bounds[i + 1][1] if i + 1 < len(bounds) else float("inf")
        row = FaultRow(fault, _REPLICAS[fault], recovery_s=round(recovery, 1))
        failing: list[Outcome] = []
        for outcome in (o for o in outcomes if since <= o.end < until):
            row.requests += 1
            kind = outcome.problem.split(":")[0]
            if kind:
                failing.append(outcome)
                setattr(row, kind, getattr(row, kind) + 1)
                if len(row.examples) < 3:
                    row.examples.append(outcome.problem)
        if failing:
            row.failing_s = round(max(o.end for o in failing) - min(o.start for o in failing), 1)
        in_flight = [o.end - since for o in outcomes if o.start < since <= o.end]
        row.in_flight_s = round(max(in_flight, default=0.0), 1) if fault != "none" else 0.0
        rows.append(row)
    return rows


def table(rows: list[FaultRow]) -> str:
    """The Markdown table (Dynamo's columns, plus how the failures failed)."""
    lines = [
        "| fault | replicas | requests | failed | truncated / different | failing for"
        " | in flight done after | recovery time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recovery, in_flight = ("-", "-") if r.fault == "none" else (
            f"{r.recovery_s:.1f} s", f"{r.in_flight_s:.1f} s")  # fmt: skip
        lines.append(f"| {r.fault if r.fault != 'none' else 'none (baseline)'} | {r.replicas}"
                     f" | {r.requests} | {r.failed} | {r.truncated} / {r.different}"
                     f" | {r.failing_s:.1f} s | {in_flight} | {recovery} |")  # fmt: skip
    return "\n".join(lines)


def run_on(up: object, expected: list[str], **kwargs: object) -> list[FaultRow]:
    """:func:`run_chaos` (``kwargs``) once ``up`` (the harness's UpProcess) serves; on any
    failure its output and logs are printed and it is stopped."""
    try:
        url = up.wait_ready()  # type: ignore[attr-defined]
        return asyncio.run(run_chaos(up, url, expected, **kwargs))  # type: ignore[arg-type]
    except BaseException:
        print(up.output, up.logs(), sep="\n")  # type: ignore[attr-defined]
        stop_on_failure(up)
        raise


def stop_on_failure(up: object) -> None:
    """Stop `up` as Ctrl-C would (it removes its directory, which the harness's kill cannot
    find with a Redis store), SIGKILL only if that hangs."""
    with contextlib.suppress(AssertionError):
        up.stop(signal.SIGTERM)  # type: ignore[attr-defined]


def main() -> None:
    from tests.launcher.cluster_harness import UpProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--settle", type=float, default=6.0, help="seconds of load per phase")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--faults", default=",".join(FAULTS), help="in order, comma-separated")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the cluster's logs")
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="the router's autoscaler keeps the pools (min = max: 1 prefill, 2 decode) instead"
        " of up's supervisor",
    )
    parser.add_argument("--prefill-tp", type=int, default=1, help="TP size of the prefill node")
    parser.add_argument("--decode-tp", type=int, default=1, help="TP size of the decode nodes")
    parser.add_argument("--up-args", default="", help='more `up` flags, e.g. "--node-watchdog 8"')
    args = parser.parse_args()
    faults = tuple(args.faults.split(","))
    expected = expected_texts()
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        logs = args.log_dir or Path(tmp) / "logs"
        pools = ["--prefill", "1", "--decode", "2"]
        if args.autoscale:
            pools += ["--autoscale", "--prefill-min", "1", "--prefill-max", "1",
                      "--decode-min", "2", "--decode-max", "2"]  # fmt: skip
        pools += ["--prefill-tp", str(args.prefill_tp), "--decode-tp", str(args.decode_tp)]
        up = UpProcess(logs, "--kv-store", "redis", *pools, *shlex.split(args.up_args))
        rows = run_on(up, expected, streams=args.streams, settle_s=args.settle, faults=faults)
        code = up.stop(signal.SIGTERM)
        leftovers = up.leftovers()
    print(table(rows))
    print(f"pdserve up exit {code}, processes left after SIGTERM: {len(leftovers)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if shutil.which("nproc"):
        print(f"on {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
