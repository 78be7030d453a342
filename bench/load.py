"""``pdserve bench``: drive an OpenAI-compatible (or gRPC) endpoint with load, report SLO metrics.

NOTE on the load model. Arrivals are open-loop: request ``i`` is sent at a precomputed offset
whatever happened to the earlier ones, so a slow server faces a growing queue instead of a
politely slowing client. Inter-arrival gaps are gamma distributed with shape ``burstiness`` and
mean ``1/rate`` (vLLM's definition): ``burstiness = 1`` is a Poisson process, smaller values are
burstier (coefficient of variation ``1/sqrt(burstiness)``), larger ones more regular. ``--rate
inf`` sends everything at once. ``--max-concurrency`` caps in-flight requests; a request waiting
for a slot is not yet timed (as in vLLM), so that cap turns the run into a closed loop.

A sweep (``--sweep 1,2,4,8``) replays the same prompts with the same arrival seed at each rate
and reports the goodput curve and the highest rate whose SLO attainment (fraction of requests
meeting every SLO) stays at or above ``--attainment-target`` (default 90%), or that the limit
was not found when every swept rate met it.

vLLM's ``vllm bench serve`` names are accepted as aliases: ``--base-url``, ``--request-rate``,
``--dataset-name``, ``--random-input-len``, ``--random-output-len``, ``--random-range-ratio``,
``--result-dir``, ``--save-result`` and ``--goodput ttft:500 tpot:50`` (ms; ``e2el`` is E2E).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.client import (
    BenchRequest,
    Sender,
    fetch_first_model,
    open_grpc_sender,
    open_http_sender,
)
from bench.report import (
    BenchRun,
    compare_markdown,
    load_report,
    pace,
    render_markdown,
    run_warnings,
    write_report,
)
from bench.server_stats import scrape_spec_counters
from bench.slo import RequestRecord, parse_slo, summarize

DEFAULT_GRPC_TARGET = "127.0.0.1:50051"
# Random prompt ids are drawn from [_FIRST_RANDOM_ID, vocab_size): the lowest ids are the usual
# BOS/EOS/PAD of Llama-style vocabularies.
_FIRST_RANDOM_ID = 3


# --------------------------------------------------------------------------- workload


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times of ``n`` requests in seconds from the start, shape ``(n,)``, first at 0.

    Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean ``1/rate``; ``rate=inf``
    gives all zeros.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def sample_lengths(mean: int, n: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` integer lengths, uniform over ``[mean*(1-r), mean*(1+r)]`` (rounded down), >= 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high, size=n, endpoint=True)


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """``n`` prompts of uniformly random token ids (sent as a list of ints, no tokenizer)."""
    if vocab_size <= _FIRST_RANDOM_ID:
        raise ValueError(f"vocab_size must be > {_FIRST_RANDOM_ID}")
    input_lens = sample_lengths(input_len, n, range_ratio, rng)
    output_lens = sample_lengths(output_len, n, range_ratio, rng)
    return [
        BenchRequest(
            rng.integers(_FIRST_RANDOM_ID, vocab_size, size=int(i)).tolist(), int(i), int(o)
        )
        for i, o in zip(input_lens, output_lens, strict=True)
    ]


def file_requests(path: Path, n: int, default_output_len: int) -> list[BenchRequest]:
    """The first ``n`` JSONL entries ``{"prompt": str | [int], "output_len": int?}``, in order,
    cycled when the file has fewer. A text prompt's length comes from the server's usage."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        entry = json.loads(line)
        prompt = entry.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise ValueError(f"{path}:{number}: 'prompt' must be a non-empty string or id list")
        output_len = int(entry.get("output_len", default_output_len))
        prompt_len = len(prompt) if isinstance(prompt, list) else 0
        entries.append(BenchRequest(prompt, prompt_len, output_len))
    if not entries:
        raise ValueError(f"{path} holds no prompt")
    return [entries[i % len(entries)] for i in range(n)]


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The workload the arguments describe; deterministic for a given ``--seed``."""
    if args.dataset == "file":
        if not args.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        return file_requests(Path(args.dataset_path), args.num_prompts, args.output_len)
    rng = np.random.default_rng(args.seed)
    return random_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.vocab_size, rng
    )


# --------------------------------------------------------------------------- load generation


async def run_load(
    requests: Sequence[BenchRequest],
    send: Sender,
    offsets: np.ndarray,
    max_concurrency: int | None = None,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests[i]`` at ``offsets[i]`` seconds from now; return (records, duration_s).

    Records are in request order; duration runs from the first send to the last completion.
    """
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), unit="req", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestRecord:
        # Sleep to an absolute deadline so that scheduling jitter does not accumulate.
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if slots is None:
            record = await send(request)
        else:
            async with slots:
                record = await send(request)
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*map(one, requests, offsets.tolist()))
    finally:
        bar.close()
    return list(records), time.perf_counter() - start


async def _resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    if args.grpc:
        return ""  # the router's GenerateRequest.model: empty means the served model
    return await fetch_first_model(args.url, args.api_key)


def prompts_per_rate(args: argparse.Namespace, rates: list[float]) -> list[int]:
    """Requests of each run: ``--num-prompts``, or with ``--duration`` as many as arrive in
    that time at the rate (``--num-prompts`` still for ``inf``)."""
    if args.duration is None:
        return [args.num_prompts] * len(rates)
    return [
        max(1, math.ceil(rate * args.duration)) if math.isfinite(rate) else args.num_prompts
        for rate in rates
    ]


async def _run_all(args: argparse.Namespace, rates: list[float]) -> list[BenchRun]:
    """One run per rate over the same workload and arrival seed (a run of fewer requests
    takes the first ones). Sets ``args.model`` to the resolved model so the report records
    it."""
    counts = prompts_per_rate(args, rates)
    args.num_prompts = max(counts)
    workload = build_requests(args)
    args.model = await _resolve_model(args)
    slo = parse_slo(args.slo)
    if args.grpc:
        opener = open_grpc_sender(args.grpc, args.model, args.request_timeout)
    else:
        opener = open_http_sender(args.url, args.model, args.api_key, args.request_timeout)
    runs = []
    async with opener as send:
        for rate, count in zip(rates, counts, strict=True):
            requests = workload[:count]
            offsets = arrival_offsets(
                len(requests), rate, args.burstiness, np.random.default_rng(args.seed)
            )
            before = None if args.grpc else await scrape_spec_counters(args.url, args.api_key)
            records, duration = await run_load(
                requests, send, offsets, args.max_concurrency, not args.no_progress
            )
            report = summarize(records, duration, slo)
            after = None if before is None else await scrape_spec_counters(args.url, args.api_key)
            spec = None if after is None or before is None else after - before
            if spec is not None and spec.drafts == 0:
                spec = None  # the server did not speculate: nothing to report
            run = BenchRun(rate, args.burstiness, report, records, spec)
            runs.append(run)
            print(_one_line(run))
    return runs


def _one_line(run: BenchRun) -> str:
    """A run's outcome, and what makes its figures untrustworthy."""
    r, p = run.report, pace(run.records)
    achieved = "-" if p.achieved is None else f"{p.achieved:.2f}"
    line = (
        f"rate {run.rate:g} req/s: achieved {achieved} req/s, goodput {r.goodput:.2f} req/s,"
        f" {r.num_failed} failed"
    )
    return "\n".join([line, *(f"  warning: {w}" for w in run_warnings(run))])


# --------------------------------------------------------------------------- CLI


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf, got {text!r}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (also used by ``python -m bench.load``); vLLM's names as aliases."""
    add = parser.add_argument
    add("--url", "--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible base URL")
    add("--model", help="model name (default: the first of GET /v1/models)")
    add("--api-key", help="sent as 'Authorization: Bearer KEY'")
    add("--rate", "--request-rate", type=_rate, default=math.inf, help="req/s, or inf (default)")
    add("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson (default: 1)")
    add("--num-prompts", type=int, default=100)
    add("--duration", type=float, help="seconds of arrivals per rate (instead of --num-prompts)")
    add("--dataset", "--dataset-name", choices=("random", "file"), default="random")
    add("--dataset-path", help='JSONL of {"prompt": str | [int], "output_len": int}')
    add("--input-len", "--random-input-len", type=int, default=256, help="mean prompt tokens")
    add("--output-len", "--random-output-len", type=int, default=128, help="mean output tokens")
    add("--range-ratio", "--random-range-ratio", type=float, default=0.0, help="len*(1±r)")
    add("--vocab-size", type=int, default=256, help="random ids drawn below this (default 256)")
    add("--slo", default="", help="e.g. ttft=200,tpot=50,e2e=2000 (ms)")
    add("--goodput", nargs="+", metavar="KEY:MS", help="vLLM's form of --slo: ttft:500 tpot:50")
    add("--attainment-target", type=float, default=0.9, help="sweep: fraction meeting every SLO")
    add("--seed", type=int, default=0)
    add("--sweep", type=_rates, help="comma-separated rates, e.g. 1,2,4,8 (overrides --rate)")
    add(
        "--grpc",
        nargs="?",
        const=DEFAULT_GRPC_TARGET,
        metavar="HOST:PORT",
        help=f"drive the router's gRPC Generate (default target {DEFAULT_GRPC_TARGET})",
    )
    add("--max-concurrency", type=int, help="cap on in-flight requests")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--out", "--result-dir", help="write report.json, report.md, records.jsonl, PNG plots here")
    add("--save-result", action="store_true", help="write them (default dir: ./pdserve-bench-TIME)")
    add("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two reports and exit")
    add("--no-progress", action="store_true", help="no progress bar")


_GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e", "e2e": "e2e"}


def goodput_slo(items: Sequence[str]) -> str:
    """vLLM's ``--goodput ttft:500 tpot:50`` (ms; ``e2el`` = E2E) as a ``--slo`` string."""
    parts = []
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key.strip().lower() not in _GOODPUT_KEYS:
            raise ValueError(
                f"bad --goodput item {item!r}: expected KEY:MS, KEY one of ttft, tpot, e2el"
            )
        parts.append(f"{_GOODPUT_KEYS[key.strip().lower()]}={value.strip()}")
    return ",".join(parts)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to a ``pdserve`` argparse subparsers object.

    The handler is stored as ``func`` (``args.func(args) -> int``).
    """
    parser = subparsers.add_parser(
        "bench",
        help="load-test a pdserve endpoint",
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _resolve_aliases(args: argparse.Namespace) -> None:
    """Fold vLLM's forms into ours: ``--goodput`` into ``--slo``, ``--save-result`` into
    ``--out``."""
    if args.goodput:
        if args.slo:
            raise ValueError("give the SLO once: --slo or --goodput")
        args.slo = goodput_slo(args.goodput)
    if args.save_result and not args.out:
        args.out = f"pdserve-bench-{time.strftime('%Y%m%d-%H%M%S')}"


def _quiet_http_logs() -> None:
    """No INFO line per request from httpx/httpcore (they would break the progress bar), nor
    matplotlib's while it draws the report."""
    level = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    for name in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(name).setLevel(level)


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.duration is not None and not args.duration > 0:
        raise ValueError("--duration must be > 0 seconds")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0 < args.attainment_target <= 1:
        raise ValueError("--attainment-target must be in (0, 1]")
    parse_slo(args.slo)


def _label(path: Path) -> str:
    """A report's name in a comparison: its folder when the file is the usual report.json."""
    if path.stem == "report" and path.parent.name:
        return path.parent.name
    return path.stem


def _compare(args: argparse.Namespace) -> int:
    a, b = (Path(p) for p in args.compare)
    try:
        text = compare_markdown(load_report(a), load_report(b), _label(a), _label(b))
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve bench --compare: {exc}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "compare.md").write_text(text)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed ``args`` describe. 0: done; 1: a run had no success;
    2: bad arguments."""
    if args.compare:
        return _compare(args)
    _quiet_http_logs()
    try:
        _resolve_aliases(args)
        _check(args)
        rates = args.sweep or [args.rate]
        runs = run_uvloop(_run_all(args, rates))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    config = _config(args)
    print(render_markdown(config, runs, args.attainment_target))
    if args.out:
        for path in write_report(Path(args.out), config, runs, args.attainment_target):
            print(f"wrote {path}")
    return 1 if any(run.report.num_completed == 0 for run in runs) else 0


def run_uvloop(main: Any) -> Any:
    """Run on uvloop: its event loop reads sockets in C, which keeps a loaded client's arrival
    times close to the wire (``bench.http_stream``)."""
    import uvloop

    return uvloop.run(main)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """What the report records about the run (JSON-safe)."""
    keys = (
        "model",
        "burstiness",
        "num_prompts",
        "duration",
        "dataset",
        "dataset_path",
        "input_len",
        "output_len",
        "range_ratio",
        "seed",
        "max_concurrency",
        "slo",
    )
    config: dict[str, Any] = {key: getattr(args, key) for key in keys}
    config["target"] = f"grpc://{args.grpc}" if args.grpc else args.url
    config["slo"] = str(parse_slo(args.slo))
    config["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.load ...``: the same as ``pdserve bench ...``."""
    parser = argparse.ArgumentParser(
        prog="pdserve bench", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
