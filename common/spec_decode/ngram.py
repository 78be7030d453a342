"""Prompt lookup ("ngram"): propose the tokens that followed the last occurrence of the
request's own suffix, looked up over prompt + output tokens.

NOTE: the lookup is vectorised. For every earlier end position ``e`` the length of the common
suffix of ``tokens[:e]`` and ``tokens`` is counted with ``prompt_lookup_max`` numpy comparisons
over the whole array (O(len) per request for a fixed maximum), then the longest match wins (at
least ``prompt_lookup_min``), the most recent one. A match ``p`` tokens before the end proposes
the ``p`` tokens after it, repeated up to ``k`` (a loop of period ``p`` continues).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from common.request import Request
from common.spec_decode.config import SpeculativeConfig
from common.spec_decode.rejection import wants_drafts


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` draft tokens following a match of ``tokens``' last n-gram (n in
    [n_min, n_max]) earlier in ``tokens``; empty when none matches. ``tokens``: (L,) int64."""
    length = tokens.shape[0]
    if length < n_min + 1:
        return tokens[:0]
    ends = np.arange(1, length)  # candidate match ends (exclusive): the suffix itself excluded
    run = np.ones(ends.shape[0], dtype=bool)
    match_len = np.zeros(ends.shape[0], dtype=np.int64)
    for j in range(min(n_max, length - 1)):
        pos = ends - 1 - j
        run &= (pos >= 0) & (tokens[np.maximum(pos, 0)] == tokens[length - 1 - j])
        if not run.any():
            break
        match_len += run
    best = int(match_len.max())
    if best < n_min:
        return tokens[:0]
    start = int(ends[match_len >= best][-1])  # drafts start where the latest match ends
    period = length - start  # past the end, the continuation repeats (what looking up again
    return tokens[start + np.arange(k) % period]  # with the drafts appended would find)


MAX_LOOKUP_SKIP = 8  # output tokens without a lookup after lookups that keep finding nothing


class NgramProposer:
    """Prompt lookup per decoding request. A lookup costs O(context) host time every step (~0.1
    ms for a few hundred tokens), so after ``n`` lookups in a row that found no match a request
    skips the next ``min(2 ** (n - 1), MAX_LOOKUP_SKIP)`` tokens' lookups (``spec_resume_at``,
    shared with the verification back-off); a match resets it. The cap is small: text starts
    repeating itself suddenly (a copied passage), and a skipped lookup only loses drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Iterable[Request]) -> None:
        for request in requests:
            k = wants_drafts(request, self.k)
            if not k:
                continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            drafts = propose_ngram(tokens, k, self.n_min, self.n_max)
            request.spec_token_ids = drafts.tolist()
            if request.spec_token_ids:
                request.spec_lookup_misses = 0
                continue
            request.spec_lookup_misses += 1
            skip = min(2 ** (request.spec_lookup_misses - 1), MAX_LOOKUP_SKIP)
            request.spec_resume_at = request.num_output_tokens + skip
