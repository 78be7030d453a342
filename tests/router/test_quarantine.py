"""A request that fails in an engine is not retried; one that fails instances is quarantined.

Against fake nodes (``tests.router.fakes``): ABORTED is what a node answers when its engine
failed a request and went on; UNAVAILABLE is what a router sees when a node dies under one.
"""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from router.errors import RouterError
from router.quarantine import Quarantine
from tests.router.test_flow import PROMPT, generate, run


def _seen(h, role: str) -> int:  # type: ignore[no-untyped-def]
    return sum(len(s.seen) for s in h.scripts(role))


def test_a_request_that_failed_in_an_engine_is_not_retried() -> None:
    async def test(h) -> None:  # type: ignore[no-untyped-def]
        for script in h.scripts("prefill"):
            script.fail = "failed"
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4)
        assert (info.value.status, info.value.code) == (500, "request_failed")
        assert _seen(h, "prefill") == 1 and _seen(h, "decode") == 0  # no retry, no fallback

    run(test)


def test_a_request_that_fails_instances_is_quarantined() -> None:
    async def test(h) -> None:  # type: ignore[no-untyped-def]
        for script in h.scripts("prefill"):
            script.fail = "unavailable"
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4, seed=1)
        assert (info.value.status, info.value.code) == (400, "request_quarantined")
        assert _seen(h, "prefill") == 2 and _seen(h, "decode") == 0  # no fallback either
        for script in h.scripts("prefill"):
            script.fail = None
        with pytest.raises(RouterError) as info:  # resent (another seed): refused at once
            await generate(h, max_tokens=4, seed=2)
        assert info.value.code == "request_quarantined" and _seen(h, "prefill") == 2
        tokens, _, _ = await generate(h, max_tokens=5, seed=3)  # another request is served
        assert len(tokens[0]) == 5

    run(test, quarantine_after=2)


def test_a_request_that_finished_starts_its_count_again() -> None:
    """A prompt in flight at two unrelated faults, served whole after the first, is not
    refused: its success proved the first failure was not its doing."""

    async def test(h) -> None:  # type: ignore[no-untyped-def]
        h.prefill[0].script.fail = "unavailable"
        tokens, _, usage = await generate(h, max_tokens=4, seed=1)  # fails on one, served
        assert len(tokens[0]) == 4 and usage.retries == 1
        h.prefill[0].script.fail, h.prefill[1].script.fail = None, "unavailable"
        tokens, _, _ = await generate(h, max_tokens=4, seed=2)  # fails on the other, served
        assert len(tokens[0]) == 4 and _seen(h, "prefill") == 3
        h.prefill[1].script.fail = None
        tokens, _, _ = await generate(h, max_tokens=4, seed=3)
        assert len(tokens[0]) == 4

    run(test, quarantine_after=2)


def test_success_forgets_failures_but_not_a_quarantine() -> None:
    quarantine = Quarantine(max_failures=2, ttl_s=60.0, clock=lambda: 0.0)
    key = Quarantine.key(PROMPT, SamplingParams())
    quarantine.failed(key, "a")
    quarantine.succeeded(key)
    quarantine.failed(key, "b")
    quarantine.check(key)  # one failure since it finished
    quarantine.failed(key, "c")
    with pytest.raises(RouterError):
        quarantine.check(key)
    quarantine.succeeded(key)  # a concurrent copy that was already running finishes
    with pytest.raises(RouterError):
        quarantine.check(key)


def test_quarantine_counts_distinct_instances_and_expires() -> None:
    now = [0.0]
    quarantine = Quarantine(max_failures=2, ttl_s=60.0, clock=lambda: now[0])
    key = Quarantine.key(PROMPT, SamplingParams(seed=1))
    assert key == Quarantine.key(PROMPT, SamplingParams(seed=99))  # the seed is not the request
    assert key != Quarantine.key([*PROMPT, 5], SamplingParams(seed=1))
    quarantine.failed(key, "a")
    quarantine.failed(key, "a")  # the same instance twice is one
    quarantine.check(key)
    now[0] = 30.0
    quarantine.failed(key, "b")
    with pytest.raises(RouterError):
        quarantine.check(key)
    now[0] = 89.0  # 59 s into the quarantine
    with pytest.raises(RouterError):
        quarantine.check(key)
    now[0] = 91.0
    quarantine.check(key)


def test_failures_minutes_apart_never_add_up() -> None:
    """A prompt many clients send meets unrelated faults (a crash, a cut, a drain) minutes apart:
    only failures within the window count towards a quarantine."""
    now = [0.0]
    quarantine = Quarantine(max_failures=3, ttl_s=600.0, window_s=60.0, clock=lambda: now[0])
    key = Quarantine.key(PROMPT, SamplingParams())
    for t, instance in ((0.0, "decode-a"), (50.0, "decode-b"), (120.0, "prefill-a")):
        now[0] = t
        quarantine.failed(key, instance)
        quarantine.check(key)  # never three within 60 s
    now[0] = 150.0
    quarantine.failed(key, "decode-c")  # 120, 150 and now 170: three within the window
    now[0] = 170.0
    quarantine.failed(key, "decode-d")
    with pytest.raises(RouterError):
        quarantine.check(key)
