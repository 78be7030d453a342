"""``pdserve up --demo``: what a freshly started cluster does, shown in half a minute.

1. a few sample requests through the OpenAI HTTP endpoint (completion, chat, streamed), each
   printed with its output and latency;
2. a short open-loop load (``bench.load``'s workload and load functions) and the SLO report
   of it (``bench.slo``'s Markdown table): throughput, goodput, TTFT/TPOT/ITL/E2E percentiles.

The built-in tiny model has random weights, so its text is gibberish by design.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.client import open_http_sender
from bench.load import arrival_offsets, random_requests, run_load
from bench.slo import SLOConfig, SLOReport, summarize

SAMPLE_PROMPTS = ("The capital of France is", "Disaggregated serving splits", "Once upon a time")


@dataclass(frozen=True)
class DemoLoad:
    """The demo's load: ``num_requests`` random-token prompts at ``rate`` req/s (Poisson)."""

    num_requests: int = 24
    rate: float = 4.0
    input_len: int = 128
    output_len: int = 32
    seed: int = 0


async def run_demo(
    base_url: str, model: str, api_key: str | None, slo: SLOConfig, load: DemoLoad
) -> SLOReport:
    """Print the samples and the load's SLO report; returns the report."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300.0,
                                 trust_env=False) as client:  # fmt: skip
        print("\n== sample requests ==")
        if model.startswith("tiny-"):
            print("(the built-in tiny models have random weights: gibberish by design)")
        for prompt in SAMPLE_PROMPTS[:2]:
            await _completion(client, model, prompt)
        await _chat(client, model, "Say hello to the cluster.")
        await _streamed(client, model, SAMPLE_PROMPTS[2])
    print(f"\n== load: {load.num_requests} requests at {load.rate:g} req/s, "
          f"{load.input_len} prompt / {load.output_len} output tokens ==")  # fmt: skip
    report = await _bench(base_url, model, api_key, slo, load)
    print(report.to_markdown())
    return report


async def _completion(client: httpx.AsyncClient, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    data, ms = await _post(client, "/v1/completions", body)
    _show(prompt, data["choices"][0]["text"], data["usage"], ms)


async def _chat(client: httpx.AsyncClient, model: str, text: str) -> None:
    messages = [{"role": "user", "content": text}]
    body = {"model": model, "messages": messages, "max_tokens": 16, "seed": 1}
    data, ms = await _post(client, "/v1/chat/completions", body)
    _show(f"[chat] {text}", data["choices"][0]["message"]["content"], data["usage"], ms)


async def _streamed(client: httpx.AsyncClient, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "stream": True}
    start, first, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                first = first or time.perf_counter()
                chunks += 1
    ttft_ms = ((first or start) - start) * 1e3
    total_ms = (time.perf_counter() - start) * 1e3
    print(f"[stream] {prompt!r}: {chunks} chunks, first after {ttft_ms:.0f} ms, "
          f"done after {total_ms:.0f} ms")  # fmt: skip


async def _post(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    response = await client.post(path, json=body)
    response.raise_for_status()
    return response.json(), (time.perf_counter() - start) * 1e3


def _show(prompt: str, text: str, usage: dict[str, int], ms: float) -> None:
    tokens = usage.get("completion_tokens", 0)
    print(f"{prompt!r} -> {text!r}  ({tokens} tokens, {ms:.0f} ms)")


async def _bench(
    base_url: str, model: str, api_key: str | None, slo: SLOConfig, load: DemoLoad
) -> SLOReport:
    rng = np.random.default_rng(load.seed)
    requests = random_requests(load.num_requests, load.input_len, load.output_len, 0.5, 256, rng)
    offsets = arrival_offsets(len(requests), load.rate, 1.0, rng)
    async with open_http_sender(base_url, model, api_key, timeout_s=300.0) as send:
        records, duration_s = await run_load(requests, send, offsets, progress=False)
    return summarize(records, duration_s, slo)
