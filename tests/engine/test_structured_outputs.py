"""Structured outputs (xgrammar) in the offline engine: JSON schema, regex, choice, EBNF.

The tiny model has random weights, so what it writes is noise: only the grammar gives it shape.
Every output that ends with ``stop`` must therefore parse and match its spec; EOS is allowed only
once the output is complete, so ``stop`` means "grammar complete". The mask is one batched call
per step, whatever the batch holds; the overlapped loop gives the serial loop's tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import common.sampler as sampler_module
from common import LLM, SamplingParams, StructuredOutputsParams
from common.request import RequestStatus

# The schema (an enum, a boolean, a bounded integer), shared by the PD and e2e tests
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
PROMPT = "Give me JSON:"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_blocks=256)


def constrained(i: int, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=i,
        max_tokens=96,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def test_json_schema_outputs_validate(llm):
    params = [constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    outs = llm.generate([PROMPT] * 8, params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 7, [o.outputs[0].text for o in outs]
    for completion in finished:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    llm.check_integrity()


def test_json_schema_with_whitespace_still_validates(llm):
    outs = llm.generate([PROMPT] * 3, [constrained(i, json=SCHEMA) for i in range(3)], False)
    for completion in (o.outputs[0] for o in outs):
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_regex_and_choice(llm):
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    choices = ["yes", "no", "maybe so"]
    params = [constrained(i, regex=regex) for i in range(4)]
    params += [constrained(i, choice=choices) for i in range(4)]
    outs = llm.generate([PROMPT] * 8, params, use_tqdm=False)
    for out in outs[:4]:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    for out in outs[4:]:
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in choices


def test_grammar_and_seeded_reproducible(llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+'
    params = [constrained(i, grammar=grammar) for i in range(3)]
    first = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    again = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\(\d+(,\d+)*\)", a.outputs[0].text)


def test_mask_applied_once_per_step_for_the_batch(llm, monkeypatch):
    calls: list[int] = []
    real = sampler_module.apply_token_bitmask

    def counting(logits, bitmask):
        calls.append(logits.shape[0])
        return real(logits, bitmask)

    monkeypatch.setattr(sampler_module, "apply_token_bitmask", counting)
    engine = llm.engine
    for i in range(4):  # two constrained, two free: one mask call covers all four rows
        spec = {"regex": "[a-z]{20}"} if i % 2 == 0 else None
        params = SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=8,
            ignore_eos=spec is None,
            structured_outputs=StructuredOutputsParams(**spec) if spec else None,
        )
        engine.add_request(f"m{i}", [5, 6, 7], params)
    steps = 0  # steps sampling a constrained request (the free ones may start earlier)
    while engine.has_unfinished():
        steps += any(o.request_id in ("m0", "m2") for o in engine.step())
    assert calls and len(calls) == steps
    assert max(calls) == 4  # constrained and free rows in the same call


def test_unconstrained_batch_never_builds_a_mask(llm, monkeypatch):
    monkeypatch.setattr(sampler_module, "apply_token_bitmask", pytest.fail)
    llm.generate([PROMPT], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": '{"type": "nonsense"}'}, "nonsense"),
        ({"regex": "a(b"}, "parenthesis"),
        ({"grammar": "root ::= missing"}, "missing"),
        # matches nothing: every token of every step was masked ("token 0 off its grammar", an
        # empty output) before the compiled grammar was tried once; xgrammar ≥ 0.2.9 refuses
        # the cycle itself, older ones compile it and our check finds it admits no output
        (
            {"json": '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'},
            r"no output|Circular \$ref",
        ),
    ],
)
def test_bad_spec_is_refused_and_engine_stays_up(llm, spec, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([PROMPT], constrained(0, **spec), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.check_integrity()
    out = llm.generate([PROMPT], constrained(1, choice=["a", "b"]), use_tqdm=False)
    assert out[0].outputs[0].text in ("a", "b")


def test_compiling_request_does_not_stall_others(llm):
    """A request whose grammar is still compiling waits; the others' steps go on."""
    engine = llm.engine
    structured = engine._structured_outputs().wait(timeout_s=300)  # xgrammar ready
    assert structured is not None
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("held", [5, 6, 7], constrained(0, regex="[0-9]{3}"))
    engine.scheduler.requests["held"].waiting_for_grammar = True
    pending = structured._pending.pop("held")  # as if its compile were slow
    outs = [o for _ in range(6) for o in engine.step()]
    assert [o.request_id for o in outs if o.finish_reason] == ["free"]
    held = engine.scheduler.requests["held"]
    assert held.status == RequestStatus.WAITING and held.num_computed_tokens == 0
    structured._pending["held"] = pending
    while engine.has_unfinished():
        engine.step()


def test_overlapped_loop_gives_serial_tokens():
    params = [constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(4)]
    params += [constrained(i, regex=r"[a-z]{3,8}") for i in range(2)]
    serial = LLM("tiny-llama", num_blocks=256, async_scheduling=False)
    overlapped = LLM("tiny-llama", num_blocks=256, async_scheduling=True)
    a = serial.generate([PROMPT] * 6, params, use_tqdm=False)
    b = overlapped.generate([PROMPT] * 6, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_schema_properties_keep_their_order() -> None:
    """A schema that puts a reasoning field before the answer keeps it first (it was
    alphabetised before compiling: {"name", "age"} came out as {"age", "name"})."""
    from common.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    spec = StructuredOutputsParams(json=schema)
    assert list(json.loads(spec.json)["properties"]) == ["name", "age"]
