"""pdserve bench: workload generation, reports, and the clients' timing against local doubles.

The SSE and gRPC servers here are test doubles with known delays, only to check the clients'
timing logic; they are not the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    import pdserve_proto  # noqa: F401  (installed: pip install -e .)
except ImportError:  # plain checkout: the generated package lives in proto/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "proto"))

from bench import load
from bench.client import BenchRequest, open_grpc_sender, open_http_sender
from bench.http_stream import HttpStreamClient, HttpStreamError
from bench.report import (
    BenchRun,
    compare_markdown,
    load_report,
    max_rate_meeting_slo,
    render_markdown,
    report_dict,
    run_warnings,
    sweep_limit,
    sweep_verdict,
    write_report,
)
from bench.slo import RequestRecord, SLOConfig, summarize

TTFT_S = 0.15  # the doubles' delay before the first token
ITL_S = 0.05  # and between tokens


# --------------------------------------------------------------------------- workload


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_mean_and_burstiness(burstiness: float) -> None:
    rng = np.random.default_rng(0)
    offsets = load.arrival_offsets(20_001, rate=10.0, burstiness=burstiness, rng=rng)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Gamma(k) gaps have CV 1/sqrt(k): 2 (bursty), 1 (Poisson), 0.5 (regular).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_arrival_inf_rate_and_errors() -> None:
    rng = np.random.default_rng(0)
    assert np.all(load.arrival_offsets(5, float("inf"), 1.0, rng) == 0)
    with pytest.raises(ValueError):
        load.arrival_offsets(5, 0.0, 1.0, rng)


def test_random_dataset_lengths() -> None:
    rng = np.random.default_rng(1)
    requests = load.random_requests(500, 100, 20, 0.5, vocab_size=300, rng=rng)
    inputs = np.array([len(r.prompt) for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert (
        inputs.min() >= 50 and inputs.max() <= 150 and outputs.min() >= 10 and outputs.max() <= 30
    )
    assert inputs.max() - inputs.min() > 80  # actually spread, not constant
    assert all(3 <= t < 300 for r in requests for t in r.prompt)  # type: ignore[union-attr]
    assert all(r.prompt_len == len(r.prompt) for r in requests)
    exact = load.random_requests(10, 64, 8, 0.0, 300, np.random.default_rng(2))
    assert {(len(r.prompt), r.output_len) for r in exact} == {(64, 8)}
    with pytest.raises(ValueError):
        load.sample_lengths(10, 5, 1.0, rng)


def test_file_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 4}\n\n{"prompt": [5, 6, 7]}\n')
    requests = load.file_requests(path, 3, default_output_len=9)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        ("hello", 0, 4),
        ([5, 6, 7], 3, 9),
        ("hello", 0, 4),  # cycled
    ]
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError):
        load.file_requests(path, 1, 4)


# --------------------------------------------------------------------------- reports


def _record(start: float, ttft: float, gaps: list[float], success: bool = True) -> RequestRecord:
    times = list(np.cumsum([start + ttft, *gaps]))
    if not success:
        return RequestRecord(start, None, [], start + 1.0, 8, 0, success=False, error="HTTP 503")
    return RequestRecord(start, times[0], times, times[-1], 8, len(times))


def _runs(slo: SLOConfig) -> list[BenchRun]:
    """Three rates; latency grows with load, so attainment falls: 100%, 75%, 25%."""
    runs = []
    for rate, ttfts in ((1.0, [0.05] * 4), (2.0, [0.05] * 3 + [0.5]), (4.0, [0.5] * 3 + [0.05])):
        records = [_record(10.0 * i, t, [0.01, 0.02]) for i, t in enumerate(ttfts)]
        runs.append(BenchRun(rate, 1.0, summarize(records, 4.0, slo), records))
    return runs


def test_max_rate_meeting_slo() -> None:
    runs = _runs(SLOConfig(ttft_ms=100))
    assert max_rate_meeting_slo(runs, 0.9) == 1.0
    assert max_rate_meeting_slo(runs, 0.7) == 2.0
    assert max_rate_meeting_slo(runs, 0.2) == 4.0
    assert max_rate_meeting_slo(runs[1:], 0.9) is None


def test_sweep_says_when_the_limit_was_not_found() -> None:
    runs = _runs(SLOConfig(ttft_ms=100))
    found = sweep_limit(runs, 0.7)
    assert (found.best, found.first_missing, found.found) == (2.0, 4.0, True)
    assert "**2 req/s** (4 req/s missed it)" in sweep_verdict(runs, 0.7)
    # every swept rate met the target: the highest one tried is not the limit
    assert sweep_limit(runs, 0.2) == (4.0, None) and not sweep_limit(runs, 0.2).found
    verdict = sweep_verdict(runs, 0.2)
    assert verdict.startswith("Not found") and "above 4 req/s" in verdict
    # not even the lowest rate met it
    assert sweep_limit(runs[1:], 0.9) == (None, 2.0)
    assert "below 2 req/s" in sweep_verdict(runs[1:], 0.9)
    no_slo = _runs(SLOConfig())
    assert sweep_verdict(no_slo, 0.9).startswith("No SLO given")
    document = report_dict({}, runs, 0.2)
    assert document["max_rate_meeting_slo"] == 4.0 and document["slo_limit_found"] is False
    assert document["first_rate_missing_slo"] is None
    markdown = render_markdown({}, runs, 0.2)
    assert "Not found: every swept rate had" in markdown
    assert "Highest rate with" not in markdown


def test_write_report_sweep(tmp_path: Path) -> None:
    slo = SLOConfig(ttft_ms=100, tpot_ms=50)
    runs = _runs(slo)
    paths = write_report(tmp_path, {"model": "m", "slo": str(slo)}, runs, target=0.7)
    names = {p.name for p in paths}
    assert {"report.json", "report.md", "records.jsonl", "latency_cdf.png"} <= names
    assert {"sweep_latency.png", "sweep_goodput.png"} <= names
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    loaded = load_report(tmp_path / "report.json")
    assert [r.report for r in loaded["runs"]] == [r.report for r in runs]
    assert loaded["max_rate_meeting_slo"] == 2.0 and loaded["slo_limit_found"] is True
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 12
    assert RequestRecord.from_dict(json.loads(lines[0])) == runs[0].records[0]
    md = (tmp_path / "report.md").read_text()
    assert "## Sweep" in md and "**2 req/s**" in md and "![sweep_goodput](sweep_goodput.png)" in md


def test_compare_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _runs(SLOConfig(ttft_ms=100))
    write_report(tmp_path / "a", {}, runs[:1])
    write_report(tmp_path / "b", {}, runs[1:2])  # different rate: the first runs are paired
    text = compare_markdown(
        load_report(tmp_path / "a" / "report.json"),
        load_report(tmp_path / "b" / "report.json"),
        "a",
        "b",
    )
    assert "| metric | a | b | change |" in text and "## rate 1 vs 2 req/s" in text
    # TTFT mean 50 ms -> (3*50 + 500)/4 = 162.5 ms.
    assert "| TTFT mean (ms) | 50.00 | 162.50 | +225.0% |" in text
    assert "| SLO attainment | 1.00 | 0.75 | -25.0% |" in text

    args = _parse(["--compare", str(tmp_path / "a/report.json"), str(tmp_path / "b/report.json")])
    assert load.run(args) == 0
    assert "| metric | a | b | change |" in capsys.readouterr().out  # labelled by folder
    assert load.run(_parse(["--compare", str(tmp_path / "missing.json"), str(tmp_path)])) == 2


# --------------------------------------------------------------------------- HTTP client


def _sse_app() -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "double-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        return StreamingResponse(_sse_stream(body), media_type="text/event-stream")

    @app.post("/broken/v1/completions")
    async def broken() -> JSONResponse:
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

    return app


async def _sse_stream(body: dict[str, Any]) -> AsyncIterator[str]:
    """``max_tokens`` tokens: the first after TTFT_S, then one per ITL_S; the last chunk carries
    two tokens at once (so arrivals < tokens), then a terminator and a usage chunk."""
    n = body["max_tokens"]
    await asyncio.sleep(TTFT_S)
    for i in range(n - 1):
        if i:
            await asyncio.sleep(ITL_S)
        text = "xy" if i == n - 2 else "x"
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': None}]})}\n\n"
    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0}
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def sse_url() -> Iterator[str]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_sse_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    _warm_up(url)
    yield url
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _warm_up(url: str) -> None:
    """One full request first: the double's first response pays one-off set-up costs (lazy
    imports, route compilation) that would otherwise land in the first measured TTFT."""
    import httpx

    body = {"model": "m", "prompt": [1], "max_tokens": 2, "stream": True}
    with httpx.Client(trust_env=False) as client:
        client.post(f"{url}/v1/completions", json=body).raise_for_status()


def _check_timing(record: RequestRecord, output_len: int) -> None:
    assert record.success, record.error
    assert record.output_tokens == output_len  # from usage, not from the arrivals
    assert len(record.token_times_s) == output_len - 1  # the last chunk carried two tokens
    assert record.ttft_s == pytest.approx(TTFT_S, abs=0.1)
    assert float(np.median(record.itls_s)) == pytest.approx(ITL_S, abs=0.04)
    assert record.tpot_s is not None and 0 < record.tpot_s < 3 * ITL_S


def test_http_client_timing(sse_url: str) -> None:
    async def go() -> list[RequestRecord]:
        async with open_http_sender(sse_url, "double-model") as send:
            ok = await send(BenchRequest([1, 2, 3], 3, 6))
        async with open_http_sender(f"{sse_url}/broken", "double-model") as send:
            bad = await send(BenchRequest([1], 1, 6))
        async with open_http_sender("http://127.0.0.1:9", "m", timeout_s=2) as send:
            refused = await send(BenchRequest([1], 1, 6))
        return [ok, bad, refused]

    ok, bad, refused = asyncio.run(go())
    _check_timing(ok, 6)
    assert ok.prompt_tokens == 3
    assert not bad.success and bad.error == "HTTP 503"
    assert not refused.success and refused.error == "ConnectError"


def test_http_arrival_times_do_not_wait_for_handling(
    sse_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events are stamped when their bytes are read, not when the client gets round to them.

    A client that handles each event before it reads the next (httpx's pull model, as bench had)
    falls behind once handling takes longer than the gap between events; the events that waited
    are then read together and stamped a handling time apart, whatever their real gaps were
    (under load: a median HTTP ITL of 0.02 ms against 3.66 ms over gRPC). Here handling one
    event blocks the event loop for 3 ITLs: the gaps must still come out as one ITL."""
    from bench import client

    handle = client._on_chunk

    def slow_handle(timeline: Any, chunk: dict[str, Any], now_s: float) -> str | None:
        time.sleep(3 * ITL_S)  # blocks the loop, as a client out of CPU would be
        return handle(timeline, chunk, now_s)

    monkeypatch.setattr(client, "_on_chunk", slow_handle)

    async def go() -> RequestRecord:
        async with open_http_sender(sse_url, "double-model") as send:
            return await send(BenchRequest([1, 2, 3], 3, 6))

    _check_timing(asyncio.run(go()), 6)


def _parse(argv: list[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    load.register(sub)
    return parser.parse_args(["bench", *argv])


def test_bench_cli_end_to_end(sse_url: str, tmp_path: Path) -> None:
    argv = [
        "--url",
        sse_url,
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--sweep",
        "20,inf",
        "--slo",
        "ttft=1000,tpot=500",
        "--no-progress",
        "--max-concurrency",
        "4",
        "--out",
        str(tmp_path),
    ]
    args = _parse(argv)
    assert args.func(args) == 0
    data = load_report(tmp_path / "report.json")
    assert data["config"]["model"] == "double-model"  # resolved from /v1/models
    assert [r.rate for r in data["runs"]] == [20.0, float("inf")]
    for run in data["runs"]:
        report = run.report
        assert report.num_completed == 6 and report.overall_attainment == 1.0
        assert report.ttft.median_ms == pytest.approx(TTFT_S * 1e3, abs=100)
        assert report.total_output_tokens == 24
    assert (tmp_path / "latency_cdf.png").stat().st_size > 0


def test_bench_cli_takes_vllm_names(
    sse_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm bench serve``'s flags as aliases: the same run as with pdserve's names."""
    argv = ["--base-url", sse_url, "--dataset-name", "random", "--random-input-len", "8",
            "--random-output-len", "4", "--random-range-ratio", "0.0", "--num-prompts", "4",
            "--request-rate", "inf", "--max-concurrency", "2", "--goodput", "ttft:1000",
            "tpot:500", "--save-result", "--result-dir", str(tmp_path / "vllm"),
            "--no-progress"]  # fmt: skip
    args = _parse(argv)
    assert (args.url, args.dataset, args.input_len, args.output_len) == (sse_url, "random", 8, 4)
    assert (args.max_concurrency, args.out, args.rate) == (2, str(tmp_path / "vllm"), math.inf)
    assert args.func(args) == 0
    data = load_report(tmp_path / "vllm" / "report.json")
    assert data["config"]["slo"] == "ttft=1000,tpot=500"
    assert data["config"]["input_len"] == 8 and data["config"]["max_concurrency"] == 2
    assert data["runs"][0].report.num_completed == 4
    # --save-result alone writes into a fresh directory here, as vLLM writes into the cwd
    monkeypatch.chdir(tmp_path)
    args = _parse(["--url", sse_url, "--num-prompts", "1", "--output-len", "2", "--save-result",
                   "--no-progress"])  # fmt: skip
    assert args.func(args) == 0
    [saved] = tmp_path.glob("pdserve-bench-*/report.json")
    assert load_report(saved)["runs"][0].report.num_completed == 1


def test_goodput_spec() -> None:
    assert load.goodput_slo(["ttft:500", "tpot:50", "e2el:2000"]) == "ttft=500,tpot=50,e2e=2000"
    with pytest.raises(ValueError, match="KEY:MS"):
        load.goodput_slo(["ttft=500"])
    both = _parse(["--slo", "ttft=1", "--goodput", "ttft:1", "--no-progress", "--model", "m"])
    assert load.run(both) == 2


def test_bench_logs_no_line_per_request(
    sse_url: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """pdserve's CLI logs at INFO; httpx would add one INFO line per request."""
    caplog.set_level(logging.INFO)
    args = _parse(["--url", sse_url, "--num-prompts", "3", "--output-len", "2", "--no-progress"])
    assert args.func(args) == 0
    noisy = [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    assert noisy == [], [r.getMessage() for r in noisy]


def test_stream_client_reuses_connections_and_reports_failures(sse_url: str) -> None:
    body = json.dumps({"model": "m", "prompt": [1], "max_tokens": 3}).encode()

    async def go() -> None:
        client = HttpStreamClient(sse_url)
        try:
            first = await client.post("/v1/completions", body, "application/json")
            [connection] = client._idle
            second = await client.post("/v1/completions", body, "application/json")
            assert client._idle == [connection]  # kept alive, used again
            for response in (first, second):
                assert response.status == 200 and response.events[-1][1] == b"[DONE]"
                times = [t for t, _ in response.events]
                assert times == sorted(times) and response.end_s >= times[-1]
            broken = await client.post("/broken/v1/completions", body, "application/json")
            assert broken.status == 503 and b"overloaded" in broken.body and not broken.events
        finally:
            await client.aclose()
        with pytest.raises(HttpStreamError) as refused:
            await HttpStreamClient("http://127.0.0.1:9").post("/x", b"", "text/plain")
        assert refused.value.kind == "ConnectError"
        slow = HttpStreamClient(sse_url, timeout_s=TTFT_S / 3)
        with pytest.raises(HttpStreamError) as timed_out:
            await slow.post("/v1/completions", body, "application/json")
        assert timed_out.value.kind == "Timeout"

    asyncio.run(go())
    with pytest.raises(ValueError, match="http"):
        HttpStreamClient("ftp://example.org")


def test_bench_cli_bad_arguments(tmp_path: Path) -> None:
    assert load.run(_parse(["--slo", "ttft=fast", "--no-progress"])) == 2
    assert load.run(_parse(["--dataset", "file", "--model", "m"])) == 2


# --------------------------------------------------------------------------- gRPC client


def test_grpc_client_timing() -> None:
    pb = pytest.importorskip("pdserve_proto.pdserve_pb2")
    pb_grpc = pytest.importorskip("pdserve_proto.pdserve_pb2_grpc")
    import grpc

    class Router(pb_grpc.RouterServiceServicer):  # type: ignore[misc,name-defined]
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            n = request.sampling_params.max_tokens
            await asyncio.sleep(TTFT_S)
            for i in range(n - 1):  # the last item carries two tokens, like the SSE double
                if i:
                    await asyncio.sleep(ITL_S)
                yield pb.GenerateResponse(request_id="r", token_ids=[7] * (2 if i == n - 2 else 1))
            usage = pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=n)
            yield pb.GenerateResponse(
                request_id="r", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage
            )

    async def go() -> RequestRecord:
        server = grpc.aio.server()
        pb_grpc.add_RouterServiceServicer_to_server(Router(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with open_grpc_sender(f"127.0.0.1:{port}", "") as send:
                return await send(BenchRequest([1, 2], 2, 5))
        finally:
            await server.stop(grace=None)

    record = asyncio.run(go())
    _check_timing(record, 5)


# --------------------------------------------------------------------------- honest sweeps


def _paced_run(rate: float, n: int, sent_every: float, done_every: float, e2e: float = 0.2):
    """``n`` requests sent every ``sent_every`` s, completing every ``done_every`` s (a server
    that keeps up completes as fast as they come; one that falls behind, slower)."""
    records = []
    for i in range(n):
        start, end = i * sent_every, e2e + i * done_every
        records.append(RequestRecord(start, start + 0.05, [start + 0.05, end], end, 8, 2))
    slo = SLOConfig(ttft_ms=100)
    return BenchRun(rate, 1.0, summarize(records, records[-1].end_s, slo), records)


def test_a_server_that_falls_behind_misses_even_when_its_slos_looked_met() -> None:
    """The user's case: 8 req/s offered, ~4 achieved, every TTFT inside the SLO because the
    run ended before the queue showed: that rate missed, and the report says why."""
    kept_up = _paced_run(4.0, 120, 0.25, 0.25)
    behind = _paced_run(8.0, 240, 0.125, 0.253)
    assert kept_up.report.overall_attainment == behind.report.overall_attainment == 1.0
    assert sweep_limit([kept_up, behind], 0.9) == (4.0, 8.0)
    (warning,) = run_warnings(behind)
    assert "achieved 3.95 req/s of 8.00 sent: the server fell behind" in warning
    assert run_warnings(kept_up) == []
    text = render_markdown({}, [kept_up, behind], 0.9)
    assert "**4 req/s** (8 req/s missed it)" in text and "**Warning:** achieved 3.95" in text


def test_a_sweep_of_short_runs_finds_no_limit() -> None:
    short = [_paced_run(rate, 40, 1 / rate, 1 / rate) for rate in (4.0, 8.0)]  # 10 s and 5 s
    verdict = sweep_verdict(short, 0.9)
    assert verdict.startswith("Not found: runs whose arrivals span under 20 s (the shortest 5 s)")
    assert any("too short for a queue to build" in w for w in run_warnings(short[0]))


def test_a_starved_client_is_warned_about() -> None:
    """Token events stamped together (gaps of 0 ms) are the client's, not the server's."""
    records = [
        RequestRecord(i, i + 0.1, [i + 0.1, *([i + 0.2] * 9)], i + 0.2, 8, 10) for i in range(30)
    ]
    run = BenchRun(1.0, 1.0, summarize(records, 30.2, SLOConfig()), records)
    assert any("the client read events in bursts" in w for w in run_warnings(run))


def test_duration_sets_the_prompts_of_each_rate() -> None:
    args = load.argparse.Namespace(duration=30.0, num_prompts=100)
    assert load.prompts_per_rate(args, [1.0, 2.5, math.inf]) == [30, 75, 100]
    args.duration = None
    assert load.prompts_per_rate(args, [1.0, 2.0]) == [100, 100]


def test_a_401_says_to_pass_the_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class KeyWanted(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeyWanted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert load.main(["--url", url, "--num-prompts", "1", "--no-progress"]) == 2
    finally:
        server.shutdown()
    assert "wants an API key (HTTP 401): pass --api-key KEY" in capsys.readouterr().err
