"""Multi-LoRA on the CPU: what the adapters' deltas cost a batch, against the base model alone.

One script, one process, three modes over the same prompts (greedy, ``ignore_eos``):

- ``base``: LoRA off, every request on the base model (the peer);
- ``one adapter``: LoRA on, every request under one adapter;
- ``mixed``: LoRA on, the requests spread round-robin over ``--adapters`` adapters and the base
  model, so every step mixes them (``--max-loras`` = ``--adapters``: all resident).

The adapters are random PEFT-format directories of rank ``--rank`` over all seven projections
(the heaviest case), written for the model's shapes. Reported per mode: decode seconds (from the
step that gave every request its first token to the end; median of ``--runs``, modes
alternating), decode tokens per second, its ratio to ``base``, engine steps. The base rows of
``mixed`` are checked to equal ``base``'s tokens, and an adapter to change them.

    python -m benchmarks.lora                                        # tiny-llama
    python -m benchmarks.lora --shape llama-3.2-1b --shape-layers 2 --rank 16 --plot lora.png
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from benchmarks.report_io import parser, pyplot, save_figure, write_outputs
from common.config import EngineConfig
from common.engine import EngineCore
from common.lora.adapter import LoraRef, read_adapter
from common.models.names import resolve_model_path
from common.sampling_params import SamplingParams

MODULES = {  # PEFT module → the block of the decoder layer holding it
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-family config."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    q = heads * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def write_random_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory of random weights over every projection of every layer."""
    cfg = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in module_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted(MODULES)}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run_mode(engine: EngineCore, prompts, loras, max_tokens: int) -> tuple[float, int, list]:
    """(decode seconds, engine steps, tokens per request) for one batch run to completion; the
    decode time runs from the step that gave every request its first token to the last."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps, decode_start = 0, None
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, params, lora=lora)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if decode_start is None and all(tokens.values()):
            decode_start = time.perf_counter()
    assert decode_start is not None
    return time.perf_counter() - decode_start, steps, [tokens[i] for i in ids]


def measure(args) -> dict:
    model = args.model
    load_format = "auto"
    if args.shape:
        from common.models.shapes import write_dummy_shape

        model, load_format = str(write_dummy_shape(args.shape, args.shape_layers)), "dummy"
    model_dir = resolve_model_path(model)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    dirs = [write_random_adapter(model_dir, workdir / f"a{i}", args.rank, i)
            for i in range(args.adapters)]  # fmt: skip
    refs: list[LoraRef] = [read_adapter(f"a{i}", d, args.rank)[0] for i, d in enumerate(dirs)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    common = dict(model=model, load_format=load_format, num_blocks=args.batch * 8 + 64,
                  max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_seqs=args.batch, cpu_threads=args.cpu_threads)  # fmt: skip
    lora = dict(enable_lora=True, max_loras=max(1, args.adapters), max_lora_rank=args.rank)
    engines = {
        "base": EngineCore(EngineConfig.from_kwargs(**common)),
        "one adapter": EngineCore(EngineConfig.from_kwargs(**common, **lora)),
        "mixed": EngineCore(EngineConfig.from_kwargs(**common, **lora)),
    }
    choices = [None, *refs]
    loras = {
        "base": [None] * args.batch,
        "one adapter": [refs[0]] * args.batch,
        "mixed": [choices[i % len(choices)] for i in range(args.batch)],
    }
    times: dict[str, list[float]] = {m: [] for m in engines}
    steps: dict[str, int] = {}
    outputs: dict[str, list] = {}
    with tqdm(total=args.runs * len(engines), desc="lora benchmark") as bar:
        for _ in range(args.runs + 1):  # the first round warms up and is dropped
            for mode, engine in engines.items():
                wall, steps[mode], outputs[mode] = run_mode(
                    engine, prompts, loras[mode], args.max_tokens
                )
                times[mode].append(wall)
                bar.update(1 if len(times[mode]) > 1 else 0)
    for engine in engines.values():
        engine.close()
    assert outputs["one adapter"] != outputs["base"], "the adapter changed nothing"
    base_rows = [i for i, c in enumerate(loras["mixed"]) if c is None]
    assert [outputs["mixed"][i] for i in base_rows] == [outputs["base"][i] for i in base_rows]
    tokens = args.batch * (args.max_tokens - 1)  # after each request's first
    rows = []
    base_wall = statistics.median(times["base"][1:])
    for mode in engines:
        wall = statistics.median(times[mode][1:])
        rows.append(dict(mode=mode, decode_s=round(wall, 4), tok_s=round(tokens / wall, 1),
                         vs_base=round(base_wall / wall, 3), steps=steps[mode]))  # fmt: skip
    return dict(model=model, rank=args.rank, adapters=args.adapters, batch=args.batch,
                prompt_len=args.prompt_len, max_tokens=args.max_tokens, rows=rows)  # fmt: skip


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rows = report["rows"]
    ax.bar([r["mode"] for r in rows], [r["tok_s"] for r in rows], color="#4c72b0")
    for i, r in enumerate(rows):
        ax.text(i, r["tok_s"], f"{r['vs_base']:.2f}×", ha="center", va="bottom")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"LoRA on CPU: {Path(report['model']).name}, rank {report['rank']}, "
                 f"batch {report['batch']}")  # fmt: skip
    save_figure(fig, path)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--shape", default=None, help="dummy weights of a named shape")
    p.add_argument("--shape-layers", type=int, default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    report = measure(args)
    print(f"{'mode':<12} {'decode s':>8} {'tok/s':>8} {'vs base':>8} {'steps':>6}")
    for r in report["rows"]:
        print(
            f"{r['mode']:<12} {r['decode_s']:>8} {r['tok_s']:>8} {r['vs_base']:>8} {r['steps']:>6}"
        )
    write_outputs(report, args, plot)


if __name__ == "__main__":
    main()
