"""Engine-core messages: what encoding and decoding one step's ``Outputs`` costs.

    python benchmarks/core_messages.py            # a few seconds
    python benchmarks/core_messages.py --batch 256

The engine-core process sends one ``Outputs`` message per step and the frontend decodes it
(``common/core_messages.py``): both sit on every token's path. Three shapes of a step, ``--batch``
requests each: a decode step (one token per request, no logprobs), the same with 5 top logprobs
per token, and a step where every request completes its prompt on a prefill node (a KV handle of
``--handle-blocks`` block hashes each, a timing each). Reported: µs per message to encode, to
decode, and the message's size; best of ``--repeat`` rounds of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import timeit

from common.core_messages import Outputs, RequestTiming, decode, encode
from common.kv_interface import KVHandle
from common.request import TokenLogprobs
from common.step_outputs import EngineCoreOutput


def decode_step(batch: int, logprobs: int = 0) -> Outputs:
    outputs = []
    for i in range(batch):
        token = 1000 + i
        lps = [TokenLogprobs(token, -0.25, list(range(logprobs)), [-0.5] * logprobs)]
        outputs.append(
            EngineCoreOutput(f"req-{i}", [token], lps if logprobs else [], num_cached_tokens=32)
        )
    return Outputs(outputs, [None] * batch)


def prefill_step(batch: int, handle_blocks: int) -> Outputs:
    outputs = []
    for i in range(batch):
        hashes = [bytes([i % 256, b % 256]) * 16 for b in range(handle_blocks)]
        handle = KVHandle("fp-0123456789abcdef", 16, 16 * handle_blocks, hashes, "shm://pdserve")
        outputs.append(EngineCoreOutput(f"req-{i}", [7], [], "length", kv_handle=handle))
    return Outputs(outputs, [RequestTiming(1.5, 0.0, 12.25)] * batch)


def measure(message: Outputs, number: int, repeat: int) -> tuple[float, float, int]:
    """(encode µs, decode µs, bytes) per message."""
    data = encode(message)
    assert decode(data) == message
    enc = min(timeit.repeat(lambda: encode(message), number=number, repeat=repeat))
    dec = min(timeit.repeat(lambda: decode(data), number=number, repeat=repeat))
    return enc / number * 1e6, dec / number * 1e6, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--handle-blocks", type=int, default=32)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    shapes = {
        f"decode step, {args.batch} requests": decode_step(args.batch),
        f"decode step, {args.batch} requests, 5 logprobs": decode_step(args.batch, 5),
        f"prefill step, {args.batch} KV handles": prefill_step(args.batch, args.handle_blocks),
    }
    print(f"{'step':<44} {'encode µs':>10} {'decode µs':>10} {'bytes':>8}")
    for name, message in shapes.items():
        enc, dec, size = measure(message, args.number, args.repeat)
        print(f"{name:<44} {enc:>10.1f} {dec:>10.1f} {size:>8}")


if __name__ == "__main__":
    main()
