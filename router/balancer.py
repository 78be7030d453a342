"""Choosing instances: prefill by prefix affinity weighed against load, decode by load.

NOTE on the default prefill policy (``cache_aware``). A prefill's time to first token is
roughly the prompt tokens its instance must compute before it is done: the tokens already
queued there, plus this prompt's tokens *minus those the instance's prefix cache already
holds*. So both signals are priced in one unit, tokens, and we pick the cheapest instance::

    cost(i) = queued_tokens(i) + (prompt_tokens - cached_tokens(i)) + request_cost * queued(i)

``cached_tokens(i)`` is estimated from what the router itself sent to ``i`` recently: an LRU set
of chained block hashes per instance (``common.block_hash``, the same digests the nodes' prefix
caches use). Hashes chain, so the leading run of hits is the shared prefix. ``queued_tokens``
and ``queued`` take the larger of the node's last report and the router's own in-flight count
(reports are up to a heartbeat old; the router's count is exact for its own traffic). The
per-request term prices fixed overheads (scheduling, the KV save round trip) so an idle
instance wins a tie against a busy one. Affinity therefore wins while it saves more compute
than the extra queue costs, and load wins once an instance is hot - the trade SGLang's
cache-aware router makes with a threshold, here with no threshold to tune. Ties rotate.

The default decode policy (``least_load``) balances memory and batch: ``kv_usage`` (the
fraction of KV blocks in use, what runs out first under long contexts) plus ``running /
max_num_seqs`` (batch occupancy, what drives inter-token latency). Decode has no affinity: its
KV comes from the store whichever instance loads it.

Policies are small objects satisfying :class:`PrefillPolicy` / :class:`DecodePolicy`; pick
them by name with ``--prefill-policy`` / ``--decode-policy``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol
from weakref import WeakKeyDictionary

from common.block_hash import BlockHash
from router.registry import Instance

# Assumed batch capacity of a node that does not report max_num_seqs.
_DEFAULT_MAX_NUM_SEQS = 256


class PromptInfo(NamedTuple):
    """What a policy may look at: the prompt's length and its full-block hashes."""

    num_tokens: int
    block_hashes: Sequence[BlockHash]
    block_size: int


class PrefillPolicy(Protocol):
    def choose(self, candidates: Sequence[Instance], prompt: PromptInfo) -> Instance:
        """Pick one of ``candidates`` (non-empty) and record the dispatch."""
        ...


class DecodePolicy(Protocol):
    def choose(self, candidates: Sequence[Instance], prompt: PromptInfo) -> Instance:
        """Pick one of ``candidates`` (non-empty)."""
        ...


class RecentBlocks:
    """A bounded LRU set of block hashes an instance has recently prefilled."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` present (does not touch recency)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def add(self, block_hashes: Sequence[BlockHash]) -> None:
        """Insert or refresh ``block_hashes``, evicting the least recently used beyond capacity."""
        for block_hash in block_hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)


class _Rotation:
    """Breaks ties by rotating through the tied instances, so equal ones share the load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Instance], key: Callable[[Instance], float]) -> Instance:
        scored = [(key(i), i) for i in candidates]
        best = min(score for score, _ in scored)
        tied = sorted((i for score, i in scored if score == best), key=lambda i: i.instance_id)
        return tied[next(self._counter) % len(tied)]


def queued_requests(instance: Instance) -> int:
    """Requests ahead on a node: its report or the router's own count, whichever is larger."""
    reported = instance.load.num_waiting + instance.load.num_running
    return max(reported, instance.inflight)


class CacheAwarePrefill:
    """Cheapest estimated prefill work, in tokens (see the module NOTE).

    ``affinity=False`` drops the cache term: pure least-work balancing.
    """

    def __init__(
        self, capacity_blocks: int = 8192, request_cost_tokens: int = 64, affinity: bool = True
    ) -> None:
        self._capacity = capacity_blocks
        self._request_cost = request_cost_tokens
        self._affinity = affinity
        self._recent: WeakKeyDictionary[Instance, RecentBlocks] = WeakKeyDictionary()
        self._rotation = _Rotation()

    def recent(self, instance: Instance) -> RecentBlocks:
        """The instance's recent-block set (created empty on first use)."""
        recent = self._recent.get(instance)
        if recent is None:
            recent = self._recent[instance] = RecentBlocks(self._capacity)
        return recent

    def cost(self, instance: Instance, prompt: PromptInfo) -> int:
        """Estimated tokens ``instance`` computes before this prompt's first token."""
        cached = 0
        if self._affinity:
            cached = self.recent(instance).matched_blocks(prompt.block_hashes) * prompt.block_size
        queued_tokens = max(instance.load.queued_prompt_tokens, instance.inflight_tokens)
        compute = max(prompt.num_tokens - cached, 1)
        return queued_tokens + compute + self._request_cost * queued_requests(instance)

    def choose(self, candidates: Sequence[Instance], prompt: PromptInfo) -> Instance:
        chosen = self._rotation.pick(candidates, lambda i: self.cost(i, prompt))
        if self._affinity:
            self.recent(chosen).add(prompt.block_hashes)
        return chosen


class LeastLoadDecode:
    """Lowest ``kv_usage + running / max_num_seqs`` (see the module docstring)."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    @staticmethod
    def score(instance: Instance) -> float:
        capacity = instance.load.max_num_seqs or _DEFAULT_MAX_NUM_SEQS
        return instance.load.kv_usage + queued_requests(instance) / capacity

    def choose(self, candidates: Sequence[Instance], prompt: PromptInfo) -> Instance:
        return self._rotation.pick(candidates, self.score)


class RoundRobin:
    """Ignores load and prompts; a baseline for comparisons."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, candidates: Sequence[Instance], prompt: PromptInfo) -> Instance:
        return self._rotation.pick(candidates, lambda _: 0.0)


PREFILL_POLICIES: dict[str, Callable[[], PrefillPolicy]] = {
    "cache_aware": CacheAwarePrefill,
    "least_load": lambda: CacheAwarePrefill(affinity=False),
    "round_robin": RoundRobin,
}
DECODE_POLICIES: dict[str, Callable[[], DecodePolicy]] = {
    "least_load": LeastLoadDecode,
    "round_robin": RoundRobin,
}
