"""``n > 1`` as ``n`` requests: a request asking for several samples is split here (vLLM V1's
parallel sampling), so the engine core only ever runs requests with one sample.

Sample ``i`` of request ``R`` is the engine request ``R#i`` with ``n = 1`` and the seed
``child_seed(seed, i)`` (sample 0 keeps the request's seed; an unseeded request's samples are
seeded by the engine, each on its own). The caller sends the samples together and gathers their
outputs by index; the offline ``LLM`` and the node's ``CoreClient`` both split here, so a request
samples the same tokens through either. The samples compute their shared prompt once, through
the prefix cache (see the NOTE on ``n > 1`` in ``common/scheduler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.sampling_params import SamplingParams, child_seed


@dataclass(frozen=True)
class Sample:
    """One sample of a request, as the engine runs it."""

    request_id: str  # the engine's request id: the request's own when n == 1
    index: int  # its place among the request's samples
    params: SamplingParams  # n == 1, with this sample's seed


def split_samples(request_id: str, params: SamplingParams, max_n: int) -> list[Sample]:
    """The engine requests of ``request_id``. Raises ValueError when ``n`` is over ``max_n``."""
    if params.n > max_n:
        raise ValueError(f"n={params.n} is over its cap of {max_n} (max_n)")
    if params.n == 1:
        return [Sample(request_id, 0, params)]
    return [Sample(f"{request_id}#{i}", i, _sample_params(params, i)) for i in range(params.n)]


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else child_seed(params.seed, index)
    return replace(params, n=1, seed=seed)
