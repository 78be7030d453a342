"""A step that raises: whose fault it is, and who goes on.

NOTE (containment). An exception inside a step (the runner, the sampler, prompt logprobs, a
grammar mask) must not end the engine: the request that caused it fails, the others go on.
Which request caused it is known only when the step held one. Otherwise every request of the
step is a *suspect*: each gets a strike, is rolled back (its blocks freed, recomputed later as
after a preemption; the tokens it already produced stay, and its seeded stream makes the
recomputation sample them again) and *held* out of the scheduler. Held requests return one at
a time: the returned one is *on trial* until a step that ran it succeeds. A request with two
strikes, or alone in a failed step, has failed: it ends with an error, and its caller is told
why (``EngineCore.take_failed``). A culprit among k suspects is found within k trials; the
innocent ones lose one recomputation each.

Limit: a new request that fails in the same step as an innocent request on trial fails that
request too (two strikes). Two distinct poison requests inside one trial are that rare.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from common.request import Request


class EngineFailure(RuntimeError):
    """The engine itself cannot go on (a tensor-parallel rank died, a collective failed): no
    request is to blame, so a step raising it is not contained; the error ends the engine."""


class Verdict(NamedTuple):
    """After a failed step: the requests that failed and those rolled back and held."""

    failed: list[Request]
    held: list[Request]


class StepFaults:
    """Strikes, held requests and the one on trial. Owns no blocks: the engine rolls back
    and ends requests as the verdict says."""

    def __init__(self, max_strikes: int = 2) -> None:
        self.max_strikes = max_strikes
        self.strikes: dict[str, int] = {}
        self.held: deque[Request] = deque()
        self.trial: str | None = None

    def judge(self, suspects: list[Request]) -> Verdict:
        """Strike every request of a failed step and say which failed."""
        for request in suspects:
            self.strikes[request.request_id] = self.strikes.get(request.request_id, 0) + 1
        alone = len(suspects) == 1
        failed = [r for r in suspects if alone or self.strikes[r.request_id] >= self.max_strikes]
        held = [r for r in suspects if r not in failed]
        for request in failed:
            self.strikes.pop(request.request_id, None)
        self.held.extend(held)
        if self.trial is not None and any(r.request_id == self.trial for r in suspects):
            self.trial = None
        return Verdict(failed, held)

    def passed(self, ran: Iterable[str]) -> None:
        """A step that ran the request ids ``ran`` succeeded: the one on trial is cleared."""
        if self.trial is not None and self.trial in set(ran):
            self.strikes.pop(self.trial, None)
            self.trial = None

    def next_trial(self, alive: set[str]) -> Request | None:
        """The held request to return to the scheduler now (None: wait). ``alive``: the ids
        the engine still holds (a held request may have been aborted meanwhile)."""
        if self.trial is not None and self.trial in alive:
            return None
        self.trial = None
        while self.held:
            request = self.held.popleft()
            if request.request_id in alive and not request.is_finished:
                self.trial = request.request_id
                return request
            self.strikes.pop(request.request_id, None)
        return None
