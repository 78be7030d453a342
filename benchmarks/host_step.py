"""Host time per decode step: what the engine's own Python (scheduling, inputs, sampling launch,
outputs) costs each step, per request, with the model's work taken away.

    python -m benchmarks.host_step                      # batches 1, 64, 256; ~30 s on 2 cores
    python -m benchmarks.host_step --batches 64 --steps 100
    python -m benchmarks.host_step --temperature 0.6    # random draws: the sampler's rows too

The model is the ``host-overhead`` dummy shape (one layer, hidden 64, ``common/models/shapes.py``):
its forward is a few dozen microsecond-scale ops, so a step's wall time is the host's. On a GPU
the same host work runs beside the device's step (the overlapped loop) and is on the critical
path wherever it is longer: the H200 run of 2026-11-28 measured a batch-64 decode step of
Llama-3.2-1B at 1.92 ms with the device busy 70 % of it. The model's forward
alone is microseconds; what each added request costs is the slope between two batches. One
torch thread.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from benchmarks.gpu_check_measure import decoding


def measure(
    batches: list[int], context: int, steps: int, repeat: int, freeze: bool, temperature: float
) -> list[dict]:
    from common import LLM
    from common.host_memory import freeze_startup_objects
    from common.models.shapes import write_dummy_shape

    model = str(write_dummy_shape("host-overhead"))
    llm = LLM(model=model, load_format="dummy", async_scheduling=True, max_model_len=4096)
    engine, rows = llm.engine, []
    if freeze:  # what the engine-core process does once its engine is built
        freeze_startup_objects()
    for batch in batches:
        with decoding(llm, batch, context, (repeat + 1) * steps + 8, temperature) as _:
            for _ in range(steps):  # warm
                engine.step()
            best = float("inf")
            for _ in range(repeat):
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                best = min(best, (time.perf_counter() - start) / steps)
        rows.append({"batch": batch, "step_ms": best * 1e3})
    llm.close()
    for lo, hi in itertools.pairwise(rows):  # the cost of one more request, fixed costs apart
        hi["us_per_added_request"] = (
            (hi["step_ms"] - lo["step_ms"]) * 1e3 / (hi["batch"] - lo["batch"])
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=16, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeat", type=int, default=3, help="timed rounds; the best is kept")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() after startup, as a node")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(
        args.batches, args.context, args.steps, args.repeat, args.freeze, args.temperature
    )
    print(f"{'batch':>6} {'step ms':>9} {'us per added request':>21}")
    for r in rows:
        added = r.get("us_per_added_request")
        print(f"{r['batch']:>6} {r['step_ms']:>9.3f} {'' if added is None else f'{added:.1f}':>21}")


if __name__ == "__main__":
    main()
