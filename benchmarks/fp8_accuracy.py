"""FP8 weights (``--quantization fp8``) or an FP8 KV cache (``--kv-cache-dtype fp8``) against
the model as loaded, as vLLM reports quantization accuracy: greedy agreement and the mean
absolute logprob difference over a prompt set.

Both are taken teacher-forced, so that one early flip does not decide every later position:
the unquantized model's greedy continuation of each prompt is scored by both models
(``prompt_logprobs``), and at every scored position the two are compared:

- top-1 agreement: the share of positions where both models' most likely next token is the same;
- mean |Δ logprob|: of the token that actually follows (the reference's choice), in nats.

Also reported: free-running greedy agreement (the share of generated tokens equal to the
reference's, position by position, up to the first difference included) and the bytes the FP8
side changes (the projections' weights, or a KV block). The tiny models' random weights give
near-flat logits, where any perturbation flips an argmax: their figures are a floor, not what a
trained model loses.

    python -m benchmarks.fp8_accuracy                         # the tiny models (dense, MoE)
    python -m benchmarks.fp8_accuracy --kv-cache              # the FP8 KV cache instead
    python -m benchmarks.fp8_accuracy --model /path/to/hf/dir --json out.json

``compare(model, fp8_model=dir)`` takes an FP8 checkpoint of the model as the FP8 side instead
(block-wise checkpoints, ``tests/engine/test_fp8_weights.py``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from benchmarks.report_io import parser, pyplot, save_figure, write_outputs
from common import LLM, SamplingParams

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe")


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(count)]


def _projection_bytes(llm: LLM) -> int:
    """The projections' and MoE experts' weights and scales."""
    model = llm.engine.runner.model
    names = ("qkv_proj.", "o_proj.", "gate_up_proj", "down_proj")
    return sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if any(name in n for name in names)
    )


def compare(
    model: str,
    count: int = 16,
    new_tokens: int = 32,
    kv_cache: bool = False,
    fp8_model: str | None = None,
    **engine: object,
) -> dict:
    """One model's row: the reference (as loaded) against ``quantization="fp8"`` (its weights),
    with ``kv_cache`` ``kv_cache_dtype="fp8"``, or with ``fp8_model`` that FP8 checkpoint."""
    variant = {"kv_cache_dtype": "fp8"} if kv_cache else {"quantization": "fp8"}
    ref = LLM(model=model, **engine)  # type: ignore[arg-type]
    if fp8_model is not None:
        fp8 = LLM(model=fp8_model, **engine)  # type: ignore[arg-type]
    else:
        fp8 = LLM(model=model, **variant, **engine)  # type: ignore[arg-type]
    prompts = _prompts(ref.engine.vocab_size, count, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, greedy, use_tqdm=False)]
    free = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in
            zip(want, got, strict=True)]  # fmt: skip
    scored = [p + w for p, w in zip(prompts, want, strict=True)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    top_same, deltas = [], []
    pairs = zip(
        ref.generate(scored, score, use_tqdm=False),
        fp8.generate(scored, score, use_tqdm=False),
        strict=True,
    )
    for a, b in pairs:
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            top_same.append(x.top_ids[0] == y.top_ids[0])
            deltas.append(abs(x.logprob - y.logprob))
    return {
        "model": model,
        "positions": len(deltas),
        "top1_agreement": round(float(np.mean(top_same)), 4),
        "mean_abs_logprob_diff": round(float(np.mean(deltas)), 4),
        "free_running_agreement": round(sum(free) / sum(map(len, want)), 4),
        "what": "kv cache" if kv_cache else "weights",
        "bytes": _kv_block_bytes(ref) if kv_cache else _projection_bytes(ref),
        "bytes_fp8": _kv_block_bytes(fp8) if kv_cache else _projection_bytes(fp8),
    }


def _kv_block_bytes(llm: LLM) -> int:
    return llm.engine.runner.store_spec.bytes_per_block


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["rows"]
    names = [Path(r["model"]).name for r in rows]
    fig, (ax_top, ax_lp) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_top.bar(names, [r["top1_agreement"] for r in rows], color="tab:blue")
    ax_top.set_ylabel("teacher-forced top-1 agreement (higher is better)")
    ax_top.set_ylim(0, 1)
    ax_lp.bar(names, [r["mean_abs_logprob_diff"] for r in rows], color="tab:orange")
    ax_lp.set_ylabel("mean |Δ logprob|, nats (lower is better)")
    what = rows[0]["what"] if rows else "weights"
    fig.suptitle(f"FP8 {what} against the model as loaded")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.set_defaults(model=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache", action="store_true",
                   help="the FP8 KV cache (--kv-cache-dtype fp8), not FP8 weights")  # fmt: skip
    args = p.parse_args(argv)
    models = [args.model] if args.model else list(TINY)
    engine = {"dtype": args.dtype, "cpu_threads": args.cpu_threads}
    rows = [compare(m, args.prompts, args.new_tokens, args.kv_cache, **engine) for m in models]
    label = "KV bytes" if args.kv_cache else "proj. bytes"
    print(f"{'model':<14} {'positions':>9} {'top-1 agree':>11} {'mean|Δlp|':>10} "
          f"{'free-run':>9} {label:>13}")  # fmt: skip
    for r in rows:
        ratio = r["bytes_fp8"] / r["bytes"]
        print(
            f"{r['model'][:14]:<14} {r['positions']:>9} {r['top1_agreement']:>11.4f} "
            f"{r['mean_abs_logprob_diff']:>10.4f} {r['free_running_agreement']:>9.4f} "
            f"{ratio:>12.3f}x"
        )
    write_outputs({"rows": rows}, args, plot)


if __name__ == "__main__":
    main()
