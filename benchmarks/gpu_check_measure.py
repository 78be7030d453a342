"""The measuring sections of ``benchmarks/gpu_check.py`` and what they share.

Each reuses the benchmark that owns its figure (``benchmarks/throughput.py``,
``benchmarks/kv_connector.py``); the engine-level ones share one dummy-weight ``LLM`` of the run's
shape (built on first use, released before the KV section, which builds engines of its own).
Heavy imports (``common``, ``kernels``) happen inside the sections: ``gpu_check`` decides about
Triton's interpreter before anything imports Triton.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check_types import Context, Row


def environment(ctx: Context) -> dict[str, Any]:
    import transformers
    import triton

    env = {"device": str(ctx.device), "torch": torch.__version__, "triton": triton.__version__}
    env["transformers"] = transformers.__version__
    env["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if ctx.device.type == "cuda":
        from kernels._common import device_peak

        env["device_name"] = torch.cuda.get_device_name(ctx.device)
        peak = device_peak(ctx.device)
        env["hbm_peak_TBps"] = peak.hbm_tbps if peak else None
    else:
        env["device_name"] = "cpu"
    return env


# -- environment ----------------------------------------------------------------------------------
def env_section(ctx: Context) -> list[Row]:
    env = environment(ctx)
    peak = env.get("hbm_peak_TBps")
    measured = f"{env['device_name']}, torch {env['torch']}, triton {env['triton']}"
    if ctx.device.type == "cuda":
        measured += f", HBM peak {peak} TB/s" if peak else ", HBM peak unknown (not in the table)"
    return [Row.perf("environment", None, measured, "", **env)]


# -- the shared dummy-weight engine ---------------------------------------------------------------
def shared_llm(ctx: Context):
    """The run's dummy-weight ``LLM`` (built once). On CUDA it keeps half the memory free: HF
    transformers runs beside it in the throughput section."""
    if "llm" not in ctx.shared:
        from common import LLM
        from common.models.shapes import write_dummy_shape

        p = ctx.profile
        model = str(write_dummy_shape(p.shape, p.layers))
        extra = {"gpu_memory_utilization": 0.5} if ctx.device.type == "cuda" else {}
        ctx.shared["llm"] = LLM(
            model=model, load_format="dummy", dtype=p.dtype, device=str(ctx.device), **extra
        )
    return ctx.shared["llm"]


def close(llm) -> None:
    """Release an ``LLM``'s workers and threads (``close()`` where it has one)."""
    closer = getattr(llm, "close", None)
    if closer is not None:
        closer()


def free_memory() -> None:
    """Collect what the released engines left (their reference cycles) and hand the cached
    device memory back, so the next engine's KV budget sees it free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_shared(ctx: Context) -> None:
    llm = ctx.shared.pop("llm", None)
    if llm is not None:
        close(llm)
    del llm
    free_memory()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def decoding(llm, batch: int, context: int, steps: int, temperature: float = 0.0) -> Iterator[Any]:
    """``batch`` requests of ``context`` prompt tokens, prefilled and decoding for at least
    ``steps`` more steps (greedy, or seeded draws at ``temperature``); yields the engine, aborts
    them after."""
    from common import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"check{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [3 + (i + j) % 97 for j in range(context)], params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled: each yields a first token
        started.update(out.request_id for out in engine.step())
    try:
        yield engine
    finally:
        engine.abort(ids)


def timed_ms(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Mean wall ms of ``fn`` over ``repeat`` calls after one warm-up, device work included."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeat * 1e3


def kv_section_args(ctx: Context) -> argparse.Namespace:
    """``benchmarks/kv_connector.py``'s arguments for one store and prompt set of the run."""
    p = ctx.profile
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 4 * 2**30
    return argparse.Namespace(
        shape=p.kv_shape, dtype=p.dtype, device=str(ctx.device), stores=["file"],
        prompts=list(p.kv_prompts), repeat=1, max_num_batched_tokens=2048, cpu_threads=None,
        raw_threads=2, dir=str(shm if roomy else ctx.work_dir), kv_cache_dtype=["auto"],
    )  # fmt: skip


# -- prefill kernel vs torch's flash attention ----------------------------------------------------
def prefill_vs_sdpa(ctx: Context) -> list[Row]:
    """Whole-prompt prefill of ``S`` sequences: the paged kernel over a shuffled paged cache
    against SDPA's flash backend on the same q/k/v laid out contiguously."""
    from kernels import paged_prefill_attention

    S, L, H, Hkv, D = ctx.profile.prefill
    dev, dtype, bs = ctx.device, torch.bfloat16 if ctx.device.type == "cuda" else torch.float32, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, L, h, D, generator=g).to(dev, dtype) for h in (H, Hkv, Hkv))
    per_seq = L // bs
    tables = torch.randperm(S * per_seq, generator=g).view(S, per_seq).to(dev, torch.int32)
    cache = torch.empty(2, S * per_seq, bs, Hkv, D, device=dev, dtype=dtype)
    cache[0][tables.long()] = k.view(S, per_seq, bs, Hkv, D)
    cache[1][tables.long()] = v.view(S, per_seq, bs, Hkv, D)
    starts = torch.arange(0, S * L + 1, L, device=dev, dtype=torch.int32)
    lens = torch.full((S,), L, device=dev, dtype=torch.int32)
    flat_q, scale = q.reshape(S * L, H, D), D**-0.5

    def ours() -> torch.Tensor:
        return paged_prefill_attention(flat_q, cache, tables, starts, lens, L, scale)

    theirs, backend = flash_sdpa(q, k, v, scale)
    err = (ours().float() - theirs().transpose(1, 2).reshape(S * L, H, D).float()).abs().max()
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    ms_ours, ms_theirs = bench(ours, dev), bench(theirs, dev)
    shapes = f"{S}x{L} tokens, {H}/{Hkv} heads x {D}, {str(dtype)[6:]}"
    rows = [Row.check("prefill kernel == SDPA", err.item() <= tol,
                      f"max abs error {err.item():.1e} ({shapes})", f"<= {tol:g}")]  # fmt: skip
    ratio = ms_ours / ms_theirs
    measured = f"{ms_ours:.2f} ms vs {ms_theirs:.2f} ms {backend}: {ratio:.2f}x"
    goal_ok = ratio <= 1.5 if dev.type == "cuda" else None  # the interpreter's time means nothing
    rows.append(Row.perf("prefill kernel / SDPA time", goal_ok, measured, "<= 1.5x (CUDA)",
                         ours_ms=ms_ours, sdpa_ms=ms_theirs, ratio=ratio))  # fmt: skip
    return rows


def flash_sdpa(q, k, v, scale: float) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA over ``(S, L, h, D)`` inputs, causal, grouped-query: ``(S, H, L, D)`` out. Flash
    when the build has it for these inputs (else SDPA's own choice, named)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run() -> torch.Tensor:
        return sdpa(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return run()

    try:
        flash()
        return flash, "SDPA flash"
    except RuntimeError:
        return run, "SDPA (no flash for these inputs)"


def bench(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        from kernels._common import bench_ms

        return bench_ms(fn)
    return timed_ms(fn, device, repeat=2)


# -- the decode step ------------------------------------------------------------------------------
def decode_steps(ctx: Context) -> list[Row]:
    """Pure decode steps at the profile's two batch sizes (1 and 64 on a GPU) with
    ``benchmarks/throughput.py``'s roofline: all weights plus every sequence's KV read once per
    step, over the device's peak HBM bandwidth."""
    from benchmarks.throughput import decode_roofline

    llm, p = shared_llm(ctx), ctx.profile
    rows = []
    for batch in p.batches:
        r = decode_roofline(llm, batch, p.decode_context, steps=p.decode_steps)
        ctx.shared[f"step_ms_b{batch}"] = r["step_ms"]
        name = f"decode step, batch {batch}"
        if "fraction_of_roofline" not in r:
            measured = f"{r['step_ms']:.2f} ms, {r['achieved_GBps']:.1f} GB/s (no HBM peak)"
            rows.append(Row.perf(name, None, measured, ">= 50% of HBM roofline", **r))
            continue
        frac = r["fraction_of_roofline"]
        measured = f"{r['step_ms']:.2f} ms, {frac:.0%} of HBM roofline ({r['roofline_ms']:.2f} ms)"
        rows.append(Row.perf(name, frac >= 0.5, measured, ">= 50% of HBM roofline", **r))
    return rows


def mixed_step(ctx: Context) -> list[Row]:
    """A step of the larger batch's decodes plus one uncached prompt chunk (2k tokens on a GPU)
    against the pure decode step plus that chunk's step alone: what a chunk costs the decodes
    it rides with. Every chunk is a fresh random prompt (no prefix-cache hit) of one output
    token; each timed loop runs ``steps`` consecutive steps."""
    from common import SamplingParams

    llm, p, dev, steps = shared_llm(ctx), ctx.profile, ctx.device, 8
    engine, batch = llm.engine, p.batches[-1]
    chunk = min(
        2048 if dev.type == "cuda" else 64, engine.config.scheduler.max_num_batched_tokens - batch
    )
    g = torch.Generator().manual_seed(1)
    vocab = engine.vocab_size
    prompts = iter(torch.randint(3, vocab, (5 * steps, chunk), generator=g).tolist())
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    added = [0]

    def chunk_steps() -> None:  # each step takes one fresh prompt whole
        for _ in range(steps):
            added[0] += 1
            engine.add_request(f"mixed{added[0]}", next(prompts), params)
            engine.step()

    def plain_steps() -> None:
        for _ in range(steps):
            engine.step()

    def drain() -> None:
        while any(r.startswith("mixed") for r in engine.request_ids()):
            engine.step()

    def per_step(run: Callable[[], None]) -> float:
        sync(dev)
        start = time.perf_counter()
        run()
        sync(dev)
        return (time.perf_counter() - start) / steps * 1e3

    with decoding(llm, batch, p.decode_context, 5 * steps + 8) as _:
        plain_steps()  # warm
        decode_ms = per_step(plain_steps)
        chunk_steps()  # warm: a mixed step's kernel variants compile on first use
        mixed_ms = per_step(chunk_steps)
    drain()
    chunk_steps()  # warm
    drain()
    alone_ms = per_step(chunk_steps)
    drain()
    ratio = mixed_ms / (decode_ms + alone_ms)
    measured = (f"{mixed_ms:.2f} ms vs {decode_ms:.2f} + {alone_ms:.2f} ms: {ratio:.2f}x "
                f"({batch} decodes x {p.decode_context} + a {chunk}-token chunk)")  # fmt: skip
    ok = ratio <= 1.15 if dev.type == "cuda" else None
    return [Row.perf(f"mixed step / (decode + chunk), b{batch}", ok, measured, "<= 1.15x (CUDA)",
                     mixed_ms=mixed_ms, decode_ms=decode_ms, chunk_ms=alone_ms, ratio=ratio)]  # fmt: skip


def host_step(ctx: Context) -> list[Row]:
    """The host's own work per decode step on this machine's CPU (``benchmarks/host_step.py``:
    a one-layer, hidden-64 model, so a step's wall is scheduling, inputs, launch and outputs),
    against the device's decode step at the same batch: above 1, the host paces the step."""
    from benchmarks.host_step import measure

    p = ctx.profile
    release_shared(ctx)  # the shared engine's memory back before a second engine starts
    rows = []
    for r in measure(list(p.batches), 16, 30, 2, freeze=False, temperature=0.0):
        step_ms = ctx.shared.get(f"step_ms_b{r['batch']}")
        ratio = f", {r['step_ms'] / step_ms:.2f}x the device's step" if step_ms else ""
        rows.append(Row.perf(f"host work per decode step, b{r['batch']}", None,
                             f"{r['step_ms']:.2f} ms{ratio}", "info", **r))  # fmt: skip
    return rows


def profiled_step(ctx: Context) -> list[Row]:
    """Kernels per decode step and the device's busy share at the larger batch (64 on a GPU),
    from ``torch.profiler``. On CPU: top-level aten ops per step and their share of the wall."""
    from torch.profiler import ProfilerActivity, profile

    llm, p, dev, steps = shared_llm(ctx), ctx.profile, ctx.device, 8
    batch = p.batches[-1]
    activities = [ProfilerActivity.CPU]
    activities += [ProfilerActivity.CUDA] if dev.type == "cuda" else []
    with decoding(llm, batch, p.decode_context, steps + 4) as engine:
        for _ in range(3):
            engine.step()
        sync(dev)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(dev)
            wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    if dev.type == "cuda":
        work = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e for e in work if not e.name.startswith(("Memcpy", "Memset"))]
        what = "kernels"
    else:
        work = kernels = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
        what = "top-level ops (CPU)"
    busy = union_us([(e.time_range.start, e.time_range.end) for e in work]) / wall_us
    per_step, copies = len(kernels) / steps, (len(work) - len(kernels)) / steps
    on_gpu = dev.type == "cuda"
    count = f"{per_step:.0f}" + (f" (+ {copies:.0f} copies)" if on_gpu else "")
    share = f"{busy:.0%} of {wall_us / steps / 1e3:.2f} ms per step"
    return [
        Row.perf(f"{what} per decode step, b{batch}", None, count, "info", per_step=per_step),
        Row.perf(f"device busy share, b{batch}", busy >= 0.9 if on_gpu else None, share,
                 ">= 90% (CUDA)", busy=busy),
    ]  # fmt: skip


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def sampler_share(ctx: Context) -> list[Row]:
    """The sampler with temperature + top-p over the model's vocabulary at the larger batch (64
    on a GPU), against the decode step of that batch (greedy, as ``decode step`` timed it), on
    two kinds of logits: flat (standard normal: top-p keeps tens of thousands of tokens, the
    kernels' slow path, a search over each row) and Zipf-shaped (``-1.2 log rank``, shuffled:
    the kept set is small, as a trained model's usually is, and the candidates settle it)."""
    from common import SamplingParams
    from common.sampler import Sampler, SampleRow

    llm, dev, batch = shared_llm(ctx), ctx.device, ctx.profile.batches[-1]
    params = SamplingParams(temperature=0.6, top_p=0.9, max_tokens=16)
    rows = [SampleRow(params, i, 0, [], [], None) for i in range(batch)]
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(batch, vocab, generator=g)
    ranks = torch.argsort(torch.rand(batch, vocab, generator=g), dim=1).float()
    kinds = {"flat": flat, "Zipf": -1.2 * torch.log1p(ranks)}
    sampler, step_ms, out = Sampler(), ctx.shared.get(f"step_ms_b{batch}"), []
    for kind, logits in kinds.items():
        logits = logits.to(dev)
        ms = timed_ms(lambda logits=logits: sampler.sample(logits, rows), dev, repeat=10)
        name = f"sampler share of step, b{batch}, {kind} logits"
        if step_ms is None:
            out.append(Row.perf(name, None, f"{ms:.2f} ms (no decode step timed)", "", ms=ms))
            continue
        share = ms / step_ms
        measured = f"{ms:.2f} ms (temp + top-p) = {share:.0%} of the {step_ms:.2f} ms step"
        ok = share <= 0.1 if dev.type == "cuda" else None
        out.append(Row.perf(name, ok, measured, "<= 10% (CUDA)", ms=ms, share=share))
    return out


def host_tier_copies(ctx: Context) -> list[Row]:
    """The host KV tier's step copies (``common/host_kv_tier.py``: offloads, then loads, of
    whole blocks of the run's cache shape) against raw pinned copies of the same bytes (one
    contiguous device-to-host and one host-to-device copy): what the tier's gather, scatter and
    per-block copies cost over the link's own speed. The cache's prefix entries are dropped
    after: the loads wrote blocks some of them name."""
    from common.host_kv_tier import HostCopies, HostKVTier

    llm, dev = shared_llm(ctx), ctx.device
    runner = llm.engine.runner
    n = min(64, runner.num_blocks // 2)
    tier = HostKVTier(n, runner.kv_cache)
    copies = HostCopies([(b, b) for b in range(n)], [(s, n + s) for s in range(n)])
    nbytes = 2 * n * runner.spec.bytes_per_block
    ms = timed_ms(lambda: tier.copy(copies, runner.kv_cache), dev, repeat=10)
    flat = runner.kv_cache.new_empty(nbytes // 2 // runner.kv_cache.element_size())
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=dev.type == "cuda")

    def raw() -> None:
        host.copy_(flat, non_blocking=True)
        flat.copy_(host, non_blocking=True)

    raw_ms = timed_ms(raw, dev, repeat=10)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    gbps, ratio = nbytes / ms / 1e6, raw_ms / ms
    measured = (
        f"{n} blocks out + {n} in: {ms:.2f} ms, {gbps:.1f} GB/s = {ratio:.0%} of raw pinned"
        f" copies ({raw_ms:.2f} ms)"
    )
    return [Row.perf("host KV tier copies", None, measured, "info", ms=ms, raw_ms=raw_ms)]


def fp8_gemm(ctx: Context) -> list[Row]:
    """The FP8 projection (``common/models/fp8.py``: per-token e4m3 activations, per-channel
    weights, one ``torch._scaled_mm``) at the run shape's widest projection (gate|up) and the
    larger decode batch, against the same GEMM in the run's dtype: its error against the
    dequantized product (correctness) and its time (CUDA: FP8 tensor cores on sm_89+)."""
    from common.models.fp8 import FP8, FP8_MAX, fp8_matmul, quantize_rows
    from common.models.shapes import SHAPES

    dev, p = ctx.device, ctx.profile
    shape = SHAPES[p.shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    dtype = getattr(torch, p.dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(p.batches[-1], hidden, generator=g).to(dev, dtype)
    w = (torch.randn(2 * inter, hidden, generator=g) * 0.02).to(dev, dtype)
    w8, scale = quantize_rows(w)
    got = fp8_matmul(x, w8, scale).float()
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    want = ((x.float() / x_scale).to(FP8).float() * x_scale) @ (w8.float() * scale).t()
    err = float(((got - want).norm() / want.norm()).item())
    ok = err <= 1e-2
    rows = [Row.check("fp8 GEMM == dequantized product", ok, f"relative error {err:.1e}",
                      "<= 1e-2")]  # fmt: skip
    ms8 = timed_ms(lambda: fp8_matmul(x, w8, scale), dev, repeat=20)
    ms = timed_ms(lambda: torch.nn.functional.linear(x, w), dev, repeat=20)
    measured = f"{ms8:.3f} ms vs {ms:.3f} ms in {p.dtype} ({x.shape[0]} x {hidden} x {2 * inter})"
    rows.append(Row.perf("fp8 GEMM time", None, measured, "info", ms_fp8=ms8, ms=ms))
    return rows


def fp8_kv_decode(ctx: Context) -> list[Row]:
    """The decode kernel over an FP8 KV cache (``--kv-cache-dtype fp8``) at the larger batch and
    4x the decode context, Llama-3-8B's attention heads (32/8 of 128): the same output as over
    the cache widened to the run's dtype first (e4m3 values are exact in it), and both times
    (the FP8 cache reads half a bf16 cache's bytes)."""
    from kernels.paged_decode_attention import paged_decode_attention

    dev, p = ctx.device, ctx.profile
    dtype = getattr(torch, p.dtype)
    heads, kv_heads, dim, bs = (32, 8, 128, 16) if dev.type == "cuda" else (4, 2, 32, 16)
    cuda = dev.type == "cuda"
    batch, context = p.batches[-1], (4 if cuda else 1) * p.decode_context
    repeat = 20 if cuda else 1  # (the CPU runs the interpreter: seconds per call)
    blocks_per_seq = -(-context // bs)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, batch * blocks_per_seq, bs, kv_heads, dim, generator=g) * 4
    fp8 = cache.to(torch.float8_e4m3fn).to(dev)
    wide = fp8.to(dtype)
    tables = torch.randperm(batch * blocks_per_seq, generator=g).view(batch, -1)
    tables = tables.to(dev, torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, dim, generator=g).to(dev, dtype)
    scale = dim**-0.5
    got = paged_decode_attention(q, fp8, tables, lens, scale, max_seq_len=context)
    want = paged_decode_attention(q, wide, tables, lens, scale, max_seq_len=context)
    same = bool(torch.equal(got, want))
    rows = [Row.check("decode over fp8 KV == over the widened cache", same,
                      "bit-identical" if same else "differs", "equal")]  # fmt: skip
    ms8 = timed_ms(lambda: paged_decode_attention(q, fp8, tables, lens, scale,
                                                  max_seq_len=context), dev, repeat)  # fmt: skip
    ms = timed_ms(lambda: paged_decode_attention(q, wide, tables, lens, scale,
                                                 max_seq_len=context), dev, repeat)  # fmt: skip
    measured = f"{ms8:.3f} ms vs {ms:.3f} ms in {p.dtype} ({batch} x {context} tokens)"
    rows.append(Row.perf("fp8 KV decode time", None, measured, "info", ms_fp8=ms8, ms=ms))
    return rows


def fused_moe_kernel(ctx: Context) -> list[Row]:
    """``kernels/fused_moe.py`` against the plain per-expert path (``common.models.moe``) at
    Qwen3-30B-A3B's MoE shape (hidden 2048, 128 experts of 768, top 8; on CPU a small one) for
    the larger decode batch: the same output within the dtype's tolerance, and both times."""
    from common.models.moe import fused_experts, route
    from kernels.fused_moe import fused_moe

    dev, p = ctx.device, ctx.profile
    dtype = getattr(torch, p.dtype)
    hidden, inter, experts, k = (2048, 768, 128, 8) if dev.type == "cuda" else (64, 48, 8, 2)
    g = torch.Generator().manual_seed(4)
    tokens = p.batches[-1]
    x = torch.randn(tokens, hidden, generator=g).to(dev, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dev, dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dev, dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g).to(dev), k, True, dtype)
    plain = fused_experts(x, gate_up, down, weights, ids).float()
    fused = fused_moe(x, gate_up, down, weights, ids).float()
    err = float(((fused - plain).norm() / plain.norm()).item())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = [Row.check("fused MoE == plain experts", err <= tol, f"relative error {err:.1e}",
                      f"<= {tol:g}")]  # fmt: skip
    ms = timed_ms(lambda: fused_moe(x, gate_up, down, weights, ids), dev, repeat=20)
    ms_plain = timed_ms(lambda: fused_experts(x, gate_up, down, weights, ids), dev, repeat=20)
    measured = f"{ms:.3f} ms vs {ms_plain:.3f} ms plain ({tokens} tokens, {experts} experts)"
    rows.append(Row.perf("fused MoE time", None, measured, "info", ms=ms, ms_plain=ms_plain))
    return rows


# -- throughput and the KV path -------------------------------------------------------------------
def throughput_vs_hf(ctx: Context) -> list[Row]:
    """The nano-vllm workload, short form: pdserve's ``generate`` against HF's in one run."""
    from benchmarks.throughput import Workload, run_hf, run_pdserve

    llm = shared_llm(ctx)
    n, inputs, outputs, hf_batch = ctx.profile.throughput
    work = Workload.random(n, inputs, outputs, llm.engine.vocab_size, seed=0)
    ours = run_pdserve(llm, work, temperature=0.6)
    runner = llm.engine.runner
    model_dir = str(llm.engine.model_dir)
    hf = run_hf(model_dir, work, hf_batch, runner.dtype, runner.device, temperature=0.6)
    ratio = ours.tokens_per_s / hf.tokens_per_s
    measured = (f"{ours.tokens_per_s:,.0f} vs {hf.tokens_per_s:,.0f} tok/s: {ratio:.1f}x "
                f"({n} requests)")  # fmt: skip
    ok = ratio >= 3.0 if ctx.device.type == "cuda" else None
    return [Row.perf("throughput vs HF", ok, measured, ">= 3x HF (CUDA)", ratio=ratio,
                     pdserve_tok_s=ours.tokens_per_s, hf_tok_s=hf.tokens_per_s)]  # fmt: skip


def kv_load(ctx: Context) -> list[Row]:
    """A prompt set's KV loaded through the connector (file store) against recomputing it
    (``benchmarks/kv_connector.py``). Its engines get a bounded KV cache each: three engines
    share the device, and each would otherwise size its cache to 90% of it."""
    from benchmarks import kv_connector
    from common.config import EngineConfig

    release_shared(ctx)
    gb = 8.0 if ctx.device.type == "cuda" else 0.25

    class Bounded:  # no CUDA graphs either: their capture, per engine, is not what is timed
        @staticmethod
        def from_kwargs(**kwargs: Any) -> EngineConfig:
            return EngineConfig.from_kwargs(**kwargs, kv_cache_memory_gb=gb, enforce_eager=True)

    real = kv_connector.EngineConfig
    kv_connector.EngineConfig = Bounded  # type: ignore[assignment,misc]
    try:
        report = kv_connector.measure(kv_section_args(ctx))
    finally:
        kv_connector.EngineConfig = real  # type: ignore[misc]
    r = report["rows"][0]
    measured = (f"load {r['load_ms']:.0f} ms vs prefill {r['prefill_ms']:.0f} ms "
                f"({r['load_over_prefill']:.2f}x), transfer {r['transfer_GBps']:.2f} GB/s, "
                f"{r['prompts']}")  # fmt: skip
    ok = r["load_over_prefill"] < 1.0 if ctx.device.type == "cuda" else None
    return [Row.perf("KV load vs recompute", ok, measured, "load < prefill (CUDA)", **r)]
