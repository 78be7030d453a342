"""Speculative decoding on CPU tiny models: engine steps and wall time per output token, with
and without speculation, in one run, on prompts where prompt lookup applies.

Each prompt repeats a passage (code, prose, a list) so the suffix of the context reoccurs in it.
Requests run in groups of ``--batch`` at a time, greedy, ``ignore_eos``; both modes generate the
same tokens (checked). The modes alternate ``--runs`` times and times are medians (the machine
is shared: steps, tokens per step and acceptance are exact, times are not). Reported per mode and batch: engine steps, tokens per step, wall ms per
output token, per-request decode tokens/s (first token to last, prefill excluded), acceptance
rate and mean accepted length (tokens per verification).

    python -m benchmarks.speculative                                   # tiny-llama, batch 1 and 4
    python -m benchmarks.speculative --model tiny-qwen2 --k 5 --json out.json
    python -m benchmarks.speculative --method draft_model --draft tiny-llama
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from common.config import EngineConfig
from common.engine import EngineCore
from common.models.names import resolve_model_path
from common.sampling_params import SamplingParams

PASSAGES = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n",
    "The quick brown fox jumps over the lazy dog. ",
    "- item one\n- item two\n- item three\n- item four\n",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;\n",
    "Once upon a time there was a small village by the sea. ",
    "for i in range(10):\n    print(i * i)\n",
    "red, green, blue, yellow, red, green, blue, yellow, ",
    "<li><a href='/home'>Home</a></li>\n<li><a href='/about'>About</a></li>\n",
]


@dataclass
class Row:
    mode: str
    batch: int
    requests: int
    output_tokens: int
    steps: int
    wall_s: float
    decode_tok_s: float  # mean over requests: (tokens - 1) / (last token - first token)
    acceptance: float
    mean_accepted_len: float

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.wall_s / self.output_tokens


def prompts(model_dir: str, repeats: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p * repeats) for p in PASSAGES]


def run_mode(engine: EngineCore, mode: str, batch: int, prompt_ids, max_tokens: int):
    """All prompts in groups of ``batch``; returns the row and every request's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats()
    steps, tokens, rates = 0, {}, []
    start = time.perf_counter()
    for g in range(0, len(prompt_ids), batch):
        first: dict[str, float] = {}
        for i in range(g, min(g + batch, len(prompt_ids))):
            engine.add_request(f"{mode}-{batch}-{i}", prompt_ids[i], params)
            tokens[i] = []
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            now = time.perf_counter()
            for out in outs:
                i = int(out.request_id.rsplit("-", 1)[1])
                first.setdefault(out.request_id, now)
                tokens[i] += out.new_token_ids
                if out.finish_reason is not None and len(tokens[i]) > 1:
                    rates.append((len(tokens[i]) - 1) / (now - first[out.request_id]))
    wall = time.perf_counter() - start
    after = engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    row = Row(
        mode,
        batch,
        len(prompt_ids),
        sum(len(t) for t in tokens.values()),
        steps,
        wall,
        sum(rates) / max(len(rates), 1),
        accepted / max(proposed, 1),
        1 + accepted / max(drafts, 1),
    )
    return row, [tokens[i] for i in range(len(prompt_ids))]


def _median(runs: list[Row]) -> Row:
    wall = statistics.median(r.wall_s for r in runs)
    rate = statistics.median(r.decode_tok_s for r in runs)
    return Row(**{**asdict(runs[0]), "wall_s": wall, "decode_tok_s": rate})


def bigram_checkpoint(model: str) -> Path:
    """A copy of ``model``'s HF directory with the layers' output projections (``o_proj``,
    ``down_proj``) zeroed: the residual stream is the token's embedding, so the logits depend
    on the current token only. Random weights never copy their prompt; a cycle they do repeat.
    The copy has the same shapes, so a step costs what the original's does."""
    source = resolve_model_path(model)
    target = Path(tempfile.mkdtemp(prefix="pdserve-bigram-")) / f"{source.name}-bigram"
    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensor)
        save_file(tensors, path, metadata={"format": "pt"})
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    p.add_argument("--draft", default=None, help="draft model (draft_model; default: --model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=3)
    p.add_argument("--lookup-min", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="copies of the passage per prompt")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=3, help="alternating runs per mode (medians)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--bigram",
        action="store_true",
        help="the model with every attention and MLP output zeroed (same shapes and cost): its "
        "next token is a function of the current one, so greedy output falls into a cycle "
        "that prompt lookup predicts — how fast speculation is when lookup applies",
    )
    args = p.parse_args()
    if args.bigram:
        args.model = str(bigram_checkpoint(args.model))
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        spec |= {"prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    else:
        spec["model"] = args.draft or args.model
    common = {"model": args.model, "device": "cpu", "cpu_threads": args.cpu_threads}
    engines = {
        "plain": EngineCore(EngineConfig.from_kwargs(**common)),
        args.method: EngineCore(EngineConfig.from_kwargs(**common, speculative_config=spec)),
    }
    prompt_ids = prompts(str(engines["plain"].model_dir), args.repeats)
    for engine in engines.values():  # warm-up: first-call costs out of the figures
        run_mode(engine, "warmup", 1, prompt_ids[:1], 8)
    rows: list[Row] = []
    for batch in args.batch:
        runs: dict[str, list[Row]] = {mode: [] for mode in engines}
        for _ in range(args.runs):
            outputs = {}
            for mode, engine in engines.items():
                row, outputs[mode] = run_mode(engine, mode, batch, prompt_ids, args.max_tokens)
                runs[mode].append(row)
            same = outputs["plain"] == outputs[args.method]
            assert same, "speculative output differs from plain output"
        rows += [_median(r) for r in runs.values()]
    print(f"model {args.model}, {spec}, {len(prompt_ids)} prompts, max_tokens {args.max_tokens}")
    print(
        "| mode | batch | out tokens | steps | tokens/step | ms/token | decode tok/s/request"
        " | acceptance | mean accepted len | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {r.batch: r for r in rows if r.mode == "plain"}
    for r in rows:
        speedup = r.decode_tok_s / base[r.batch].decode_tok_s
        print(
            f"| {r.mode} | {r.batch} | {r.output_tokens} | {r.steps}"
            f" | {r.output_tokens / r.steps:.2f} | {r.ms_per_token:.2f} | {r.decode_tok_s:.0f}"
            f" | {r.acceptance:.2f} | {r.mean_accepted_len:.2f} | {speedup:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ms_per_token": r.ms_per_token} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
