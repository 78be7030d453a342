"""Speculative decoding: cheap proposals, verified by the target model in one batched forward.

NOTE: the idea. A decoding request normally computes one token per step. With speculation a
*proposer* guesses the next ``k`` tokens (prompt lookup over the request's own tokens, or a small
draft model), and the scheduler schedules the request's last token plus the ``k`` drafts as
``k + 1`` query tokens of one step — a tiny prefill chunk over the paged KV cache. The runner
samples the target model at every one of those positions with the request's seeded stream
(position ``p + j`` draws what a plain decode at ``p + j`` would draw, given the drafts before it)
and the scheduler keeps the longest run of drafts that equal those samples, plus the sample after
that run: between 1 and ``k + 1`` tokens per step. The KV of rejected drafts is rolled back
(``num_computed_tokens`` trimmed, the blocks past it freed).

Both proposers here are deterministic (a draft model proposes its greedy tokens), so the draft
distribution ``q`` is one-hot and "accept iff the draft equals the target's own seeded sample" is
rejection sampling with ``min(1, p/q)``: the output distribution is the target's exactly, and the
tokens are the very tokens of non-speculative decoding, greedy and seeded alike.

- ``config.py``: ``SpeculativeConfig`` (vLLM's ``speculative_config`` dict).
- ``ngram.py``: prompt lookup (vectorised numpy, O(len) per request).
- ``draft_model.py``: a small model sharing the tokenizer, run as a nested greedy engine.
- ``rejection.py``: how many drafts a step keeps, the back-off of a request whose drafts keep
  missing.
- ``proposer.py``: the proposer interface and its factory (``make_proposer``: not re-exported
  here, since it names the engine's config, which imports ``config.py`` of this package).
"""

from common.spec_decode.config import SpeculativeConfig
from common.spec_decode.rejection import num_accepted, record_verification

__all__ = ["SpeculativeConfig", "num_accepted", "record_verification"]
