"""The correctness sections of ``benchmarks/gpu_check.py``: the test suites run on the device
(pytest in a subprocess, pointed at CUDA by the conftests' switches), and eager against graph
replay."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check_measure import close, free_memory
from benchmarks.gpu_check_types import Context, Row

REPO = Path(__file__).resolve().parents[1]
PER_TEST_S = 120  # one hung test fails alone rather than eating its section's whole cap


# -- the test suites on the device ----------------------------------------------------------------
def pytest_row(ctx: Context, name: str, args: tuple[str, ...], cap_s: float, **env: str) -> Row:
    """One pytest run in a subprocess pointed at the run's device; passes when every selected
    test passed (and at least one ran). ``env``: extra variables (the tests' switches)."""
    junit = ctx.work_dir / f"{name.replace(' ', '-')}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={junit}", f"--timeout={PER_TEST_S}", *args]
    timeout = max(1.0, min(cap_s, ctx.remaining()))
    print(f"    pytest {' '.join(args)} (timeout {timeout:.0f} s)", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO, env=pytest_env(ctx, env), capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        keep_log(ctx, name, e.stdout, e.stderr)
        tail = (e.stdout or b"")[-2000:]
        return Row.check(name, False, f"timeout after {timeout:.0f} s", "all pass", tail=str(tail))
    keep_log(ctx, name, done.stdout, done.stderr)
    counts = junit_counts(junit)
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    secs = time.monotonic() - start
    measured = f"{passed} passed, {failed} failed, {counts['skipped']} skipped ({secs:.0f} s)"
    ok = done.returncode == 0 and passed > 0
    return Row.check(name, ok, measured, "all pass", **counts, tail=done.stdout[-3000:])


def keep_log(ctx: Context, name: str, stdout, stderr) -> None:
    """The run's whole output under ``--log-dir`` (a failure's traceback outgrows the row)."""
    if not ctx.args.log_dir:
        return
    text = "\n".join(
        o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (stdout, stderr)
    )
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    path = Path(ctx.args.log_dir) / f"{slug}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pytest_env(ctx: Context, extra: dict[str, str]) -> dict[str, str]:
    from common.cache_dir import default_cache_root

    env = dict(os.environ, **extra)
    env["PDSERVE_CACHE_DIR"] = str(default_cache_root())  # built-in models built once, shared
    if ctx.device.type == "cuda":
        env["PDSERVE_TEST_DEVICE"] = "cuda"  # the conftests fail rather than fall back to CPU
        env.pop("TRITON_INTERPRET", None)
    return env


def junit_counts(path: Path) -> dict[str, int]:
    keys = ("tests", "failures", "errors", "skipped")
    if not path.is_file():
        return dict.fromkeys(keys, 0)
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def kernel_tests(ctx: Context) -> list[Row]:
    cap = ctx.profile.test_caps_s[0]
    return [pytest_row(ctx, "kernel tests", ctx.profile.kernel_tests, cap)]


def hf_graphs_on(ctx: Context) -> list[Row]:
    cap = ctx.profile.test_caps_s[1]
    return [pytest_row(ctx, "HF equivalence, graphs+overlap on", ctx.profile.engine_tests, cap)]


def hf_graphs_off(ctx: Context) -> list[Row]:
    cap, tests = ctx.profile.test_caps_s[2], ctx.profile.eager_tests
    name = "HF equivalence, graphs+overlap off"
    return [pytest_row(ctx, name, tests, cap, PDSERVE_TEST_EAGER="1")]


# -- eager == graph replay ------------------------------------------------------------------------
def eager_vs_graph(ctx: Context) -> list[Row]:
    """Greedy tokens of an eager, serial engine against a graph-replaying, overlapped one (tiny
    Llama in fp32), and against graph-replayed speculative verification (n-gram drafts, each
    draft its own attention row). On CPU the graphs run their padded, fixed-address forward
    uncaptured."""
    from common import SamplingParams

    count, max_tokens = ctx.profile.eager_graph
    rng = random.Random(0)
    prompts = []  # a random motif repeated, for the n-gram drafts to find
    for _ in range(count):
        motif = [rng.randrange(3, 1000) for _ in range(rng.randint(2, 8))]
        prompts.append((motif * 200)[: rng.randint(len(motif) + 1, 200)])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want, _, _ = greedy(ctx, prompts, params, enforce_eager=True, async_scheduling=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    runs = {
        "eager == graph replay": ({"async_scheduling": True}, "all equal, replays > 0"),
        "eager == graph-replayed verification": (
            {"speculative_config": ngram},
            "all equal, verifications replayed",
        ),
    }
    rows = []
    for name, (engine_args, goal) in runs.items():
        got, replays, verified = greedy(ctx, prompts, params, **engine_args)
        same = sum(a == b for a, b in zip(got, want))
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        measured = f"{same}/{count} prompts equal, {replays} graph replays"
        if "speculative_config" in engine_args:
            measured += f" ({verified} of them verifying drafts)"
        measured += f" (first divergence: prompt {first})" if first is not None else ""
        needed = verified if "speculative_config" in engine_args else replays
        rows.append(Row.check(name, same == count and needed > 0, measured, goal))
    return rows


def greedy(ctx: Context, prompts, params, **engine_args) -> tuple[list[list[int]], int, int]:
    """(token ids per prompt, graph replays, replays verifying drafts) of one tiny-llama
    engine, released after."""
    from common import LLM

    bounded = {"kv_cache_memory_gb": 2.0} if ctx.device.type == "cuda" else {}
    llm = LLM(model="tiny-llama", device=str(ctx.device), **bounded, **engine_args)
    try:
        replays = count_replays(llm) if not engine_args.get("enforce_eager") else [0, 0]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], replays[0], replays[1]
    finally:
        close(llm)
        del llm
        free_memory()


def count_replays(llm) -> list[int]:
    """Counts the runner's graph replays and those verifying drafts (a two-item list, updated
    as it runs). On CPU, where no
    graph is captured, the runner gets the uncaptured graph-shaped path first."""
    from common.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    if runner.graphs is None:
        runner.graphs = DecodeGraphs.for_config(
            runner.model,
            runner.inputs,
            runner.config,
            runner.block_size,
            runner.max_model_len,
            capture=False,
        )
        runner.graphs.capture_all(runner.kv_layers)
    graphs, replays = runner.graphs, [0, 0]
    real, size_for = graphs.replay, graphs.size_for

    def replay(size, inputs, lora_slots=None):
        replays[0] += 1
        return real(size, inputs, lora_slots)

    def sized(scheduled):
        size = size_for(scheduled)
        replays[1] += size is not None and any(s.spec_token_ids for s in scheduled)
        return size

    graphs.size_for = sized

    graphs.replay = replay
    return replays
