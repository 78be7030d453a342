"""Verification: how many drafts a step keeps, and which requests should propose at all.

Plain ints (the scheduler's side): the runner already sampled the target at every verified
position with the request's seeded stream, so with a deterministic proposal (one-hot ``q``),
rejection sampling reduces to comparing ids — accept draft ``j`` iff it equals the target's sample
at the position before it, and the first mismatch is the target's own token there (the residual
``max(0, p - q)`` renormalised is ``p`` without the draft, which is what a draw from ``p`` that
missed the draft already is).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.request import Request, RequestStatus


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Length of the run of drafts equal to the target's samples (``len(targets) ==
    len(drafts) + 1``); the step emits ``targets[: num_accepted + 1]``."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


MAX_BACKOFF_TOKENS = 64


def record_verification(request: Request, accepted: int) -> None:
    """Back off a request whose drafts keep missing: after ``n`` verifications in a row that
    accepted nothing, it proposes no drafts for its next ``2 ** (n - 1)`` output tokens (at most
    ``MAX_BACKOFF_TOKENS``); one accepted draft ends the back-off. A verification step costs
    ``k + 1`` query tokens and attention rows (and the overlapped loop),
    so drafts that are never right make decoding slower than not speculating; drafts that are
    sometimes right keep being proposed. Tokens never change: only whether drafts are tried."""
    if accepted:
        request.spec_misses = 0
        return
    request.spec_misses += 1
    skip = min(2 ** (request.spec_misses - 1), MAX_BACKOFF_TOKENS)
    request.spec_resume_at = request.num_output_tokens + skip


def wants_drafts(request: Request, k: int) -> int:
    """How many drafts are worth proposing for ``request`` now (0: none): it is decoding (only
    its newest token is uncomputed, nothing in flight), may emit more than one token, and is
    not backing off (``record_verification``). (Under a grammar every verified row gets the
    mask after the drafts before it: ``common/structured_output.py``.)"""
    if (
        request.status != RequestStatus.RUNNING
        or request.num_output_placeholders
        or request.num_computed_tokens != request.num_tokens - 1
        or request.num_output_tokens < request.spec_resume_at
    ):
        return 0
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1))
