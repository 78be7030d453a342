"""A step that raises fails the request that caused it; the engine and the others go on.

The runner is wrapped in-process to raise whenever a chosen request is in the step (at its
prefill, or later in its decode): the others must finish with exactly the tokens of a run
without the poison, the poison must be reported once (``take_failed``), and no block may leak.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from common import LLM, SamplingParams
from common.engine import EngineCore
from common.step_outputs import SchedulerOutput

PROMPTS = {f"ok{i}": [1, *range(10 + 7 * i, 30 + 9 * i)] for i in range(4)}
POISON = [1, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", max_model_len=256, enable_prefix_caching=True)


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12)
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(engine: EngineCore, requests: dict[str, list[int]]) -> dict[str, list[int]]:
    """Add every request in one go, step until all end; each request's tokens."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for i, (rid, prompt) in enumerate(requests.items()):
        engine.add_request(rid, prompt, params(i))
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert not engine.has_unfinished()
    return tokens


def poisoned(
    engine: EngineCore, monkeypatch: pytest.MonkeyPatch, when: Callable[[int], bool]
) -> list[int]:
    """Make the runner raise on a step holding ``poison`` while ``when(its output count)``;
    returns a list that counts the raises."""
    execute = engine.runner.execute
    raised: list[int] = []

    def execute_or_raise(out: SchedulerOutput):  # type: ignore[no-untyped-def]
        for item in out.scheduled:
            if item.request.request_id == "poison" and when(item.request.num_output_tokens):
                raised.append(len(out.scheduled))
                raise IndexError("selected index k out of range")
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", execute_or_raise)
    return raised


@pytest.mark.parametrize("at", ["prefill", "decode"])
def test_a_poison_request_fails_alone(llm, monkeypatch, at) -> None:  # type: ignore[no-untyped-def]
    engine: EngineCore = llm.engine
    expected = run(engine, PROMPTS)
    engine.kv_cache_manager.reset_prefix_cache()
    raised = poisoned(engine, monkeypatch, (lambda n: n == 0) if at == "prefill" else bool)
    got = run(engine, {**PROMPTS, "poison": POISON})
    failed = engine.take_failed()
    assert [rid for rid, _ in failed] == ["poison"]
    assert "IndexError: selected index k out of range" in failed[0][1]
    assert raised and raised[0] == 5  # it shared its first failed step with all four others
    assert {rid: got[rid] for rid in PROMPTS} == expected
    engine.check_integrity()
    assert engine.num_free_blocks() == engine.runner.num_blocks
    monkeypatch.undo()
    assert run(engine, PROMPTS) == expected  # and it goes on serving
    assert engine.take_failed() == []


def test_a_poison_request_alone_fails_at_once(llm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine: EngineCore = llm.engine
    raised = poisoned(engine, monkeypatch, lambda n: True)
    got = run(engine, {"poison": POISON})
    assert got == {"poison": []} and len(raised) == 1
    assert [rid for rid, _ in engine.take_failed()] == ["poison"]
    engine.check_integrity()
    assert engine.num_free_blocks() == engine.runner.num_blocks


def test_an_error_no_request_can_be_blamed_for_is_raised(llm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine: EngineCore = llm.engine

    def broken() -> SchedulerOutput:
        raise RuntimeError("the scheduler itself is broken")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    with pytest.raises(RuntimeError, match="scheduler itself"):
        engine.step()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_top_k_over_the_vocabulary_is_refused(llm, name) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=f"{name}=1000000 exceeds the vocabulary"):
        llm.engine.add_request("big-k", [1, 2, 3], SamplingParams(**{name: 1000000}))
    assert not llm.engine.has_unfinished()
