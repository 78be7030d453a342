"""Offline throughput: pdserve's `LLM.generate` against HF transformers `generate`, in one run.

The nano-vllm workload, scaled by flags: random token-id prompts and output lengths, ignore_eos,
a fixed seed. HF runs the same requests in static batches (left-padded prompts, each batch runs
until its longest output); both are credited only with the tokens the requests asked for.

    python -m benchmarks.throughput                      # CPU default: 64 requests on tiny-llama
    python -m benchmarks.throughput --gpu-workload --shape llama-3.2-1b --dtype bfloat16
    python -m benchmarks.throughput --gpu-workload --shape qwen3-30b-a3b --shape-layers 2 \
        --dtype bfloat16 --enforce-eager        # the MoE shape (eager on CUDA until issue 30's
                                                # fused kernel: its experts read counts on the host)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from common import LLM, SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @staticmethod
    def random(n: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int):
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*inputs))] for _ in range(n)]
        return Workload(prompts, [rng.randint(*outputs) for _ in range(n)])

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_pdserve(llm: LLM, work: Workload, temperature: float) -> Result:
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(work.output_lens)
    ]
    llm.generate(work.prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == work.num_output_tokens, (produced, work.num_output_tokens)
    return Result("pdserve", elapsed, produced)


def decode_roofline(llm: LLM, batch: int, context: int, steps: int = 32) -> dict:
    """Time pure decode steps of ``batch`` sequences at ``context`` tokens and compare with the
    memory roofline: every step must read all weights plus every sequence's KV once."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"roof{i}", [3 + (i + j) % 97 for j in range(context)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill everything first: each request yields a first token
        started.update(out.request_id for out in engine.step())
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    engine.abort([f"roof{i}" for i in range(batch)])
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = engine.runner.spec.bytes_per_block // engine.runner.spec.block_size
    step_bytes = weight_bytes + batch * (context + steps // 2) * kv_per_token
    out = {"batch": batch, "context": context, "step_ms": step_ms, "bytes_per_step": step_bytes}
    out["achieved_GBps"] = step_bytes / step_ms / 1e6
    if engine.runner.device.type == "cuda":
        from kernels._common import device_peak

        peak = device_peak(engine.runner.device)
        if peak is not None:
            out["roofline_ms"] = step_bytes / (peak.hbm_tbps * 1e12) * 1e3
            out["fraction_of_roofline"] = out["roofline_ms"] / step_ms
    return out


def run_hf(model_dir: str, work: Workload, batch_size: int, dtype, device, temperature: float):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except OSError:  # a dummy shape: config only, random weights, drawn on the device (a 1B
        with torch.device(device):  # model's init on the host took most of a minute on the H200)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    _hf_batch(model, work.prompts[:2], 4, device, temperature)  # warm-up
    start = time.perf_counter()
    order = range(0, len(work.prompts), batch_size)
    for lo in tqdm(order, desc="HF generate (static batches)"):
        hi = lo + batch_size
        _hf_batch(model, work.prompts[lo:hi], max(work.output_lens[lo:hi]), device, temperature)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Result("hf-transformers", time.perf_counter() - start, work.num_output_tokens)


def _hf_batch(model, prompts: list[list[int]], max_new: int, device, temperature: float):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=None,
            top_k=None,
            pad_token_id=0,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--shape", default=None, help="dummy weights of a named shape (llama-3.2-1b…)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    p.add_argument(
        "--gpu-workload", action="store_true", help="nano-vllm's: 256 × 100–1024/100–1024"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--attention-backend", default="auto", choices=("auto", "cpu", "torch", "triton")
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads (both engines)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--shape-layers", type=int, default=None, help="override a shape's depth")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (MoE on CUDA)")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: FP8 projections")
    p.add_argument("--roofline-batch", type=int, default=0, help="also time pure decode steps")
    p.add_argument("--roofline-context", type=int, default=512)
    args = p.parse_args()
    if args.gpu_workload:
        args.num_requests, args.input_len, args.output_len = 256, (100, 1024), (100, 1024)
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def run(args: argparse.Namespace) -> dict:
    model, load_format = args.model, "auto"
    if args.shape:
        from common.models.shapes import write_dummy_shape

        model, load_format = str(write_dummy_shape(args.shape, args.shape_layers)), "dummy"
    llm = LLM(
        model=model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        load_format=load_format,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_threads=args.cpu_threads,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
    )
    work = Workload.random(
        args.num_requests, args.input_len, args.output_len, llm.engine.vocab_size, args.seed
    )
    ours = run_pdserve(llm, work, args.temperature)
    report = {"workload": vars(args) | {"output_tokens": work.num_output_tokens}}
    report["pdserve"] = asdict(ours) | {"tokens_per_s": ours.tokens_per_s}
    print(f"pdserve: {ours.tokens_per_s:,.0f} output tok/s ({ours.seconds:.1f} s)")
    if args.roofline_batch:
        report["decode_roofline"] = decode_roofline(llm, args.roofline_batch, args.roofline_context)
        print(f"decode step: {report['decode_roofline']}")
    if not args.skip_hf:
        dev, dtype = llm.engine.runner.device, llm.engine.runner.dtype
        model_dir = str(llm.engine.model_dir)
        del llm
        hf = run_hf(model_dir, work, args.hf_batch_size, dtype, dev, args.temperature)
        report["hf"] = asdict(hf) | {"tokens_per_s": hf.tokens_per_s}
        report["ratio"] = ours.tokens_per_s / hf.tokens_per_s
        print(f"HF:      {hf.tokens_per_s:,.0f} output tok/s ({hf.seconds:.1f} s)")
        print(f"ratio:   {report['ratio']:.2f}x")
    return report


if __name__ == "__main__":
    main()
