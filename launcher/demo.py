"""``pdserve demo``: offline generation on the built-in tiny model, with tokens/s."""

from __future__ import annotations

import argparse
import time

DEMO_PROMPTS = [
    "The capital of France is",
    "Disaggregated serving splits prefill and decode because",
    "Once upon a time, in a café in Zürich,",
    "def fibonacci(n):",
    "The three laws of robotics are",
    "A paged KV cache stores attention keys and values in fixed-size blocks so that",
    "日本の首都は",
    "Summer, autumn, winter and",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="offline generation demo on a built-in tiny model")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_prompts)]
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs[: len(DEMO_PROMPTS)]:
        sample = out.outputs[0]
        print(
            f"\n>>> {out.prompt!r}\n    {sample.text!r}  [{len(sample.token_ids)} tokens,"
            f" {sample.finish_reason}]"
        )
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f} s:"
        f" {n_out / elapsed:,.0f} output tokens/s on {llm.engine.runner.device}"
        f" ({args.model}; tiny random weights, so the text is gibberish by design)"
    )
    return 0
