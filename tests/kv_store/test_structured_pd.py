"""Structured outputs across the prefill → decode hand-off: the producer samples the first token
under the grammar, the consumer rebuilds the matcher, advances it by that token and continues;
the tokens equal one colocated engine's, with seeded sampling at temperature 0.8."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_outputs import SCHEMA
from tests.kv_store.test_connector import engine, prompts, run

SPECS = [
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=r"[a-c]{2,5}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
]


def constrained(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, seed=100 + i, max_tokens=max_tokens, structured_outputs=SPECS[i]
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "overlapped"])
def test_disaggregated_equals_colocated(tmp_path, async_scheduling):
    url = f"file://{tmp_path}/kv"
    ps = prompts(lens=(5, 16, 40, 20))
    colocated = engine()
    ref = run(colocated, [(f"r{i}", p, constrained(i, 80), None) for i, p in enumerate(ps)])
    producer = engine(url, "producer")
    first = run(producer, [(str(i), p, constrained(i, 1), None) for i, p in enumerate(ps)])
    producer.close()
    consumer = engine(url, "consumer")
    consumer.async_scheduling = async_scheduling
    rest = run(
        consumer,
        [
            (str(i), p, constrained(i, 80), first[str(i)]["tokens"], first[str(i)]["handle"])
            for i, p in enumerate(ps)
        ],
    )
    consumer.close()
    for i in range(len(ps)):
        assert first[str(i)]["tokens"] + rest[str(i)]["tokens"] == ref[f"r{i}"]["tokens"], i
    assert rest["2"]["loaded"] > 0  # the 40-token prompt's KV came from the store


def test_resumed_tokens_off_the_grammar_are_refused():
    """A consumer handed tokens the grammar cannot produce refuses the request (no output)."""
    colocated = engine()
    colocated.add_request("x", [5, 6, 7], constrained(3, 8), output_token_ids=[999])
    while colocated.has_unfinished():
        assert not colocated.step()
    [(request_id, reason)] = colocated.take_refused()
    assert request_id == "x" and "does not match the grammar" in reason
    colocated.check_integrity()
    assert colocated.num_free_blocks() == colocated.runner.num_blocks


def test_disaggregated_json_validates(tmp_path):
    from transformers import AutoTokenizer

    url = f"file://{tmp_path}/kv"
    ps = prompts(lens=(7, 30, 18, 9), seed=3)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=SPECS[0])
        for i in range(len(ps))
    ]
    producer = engine(url, "producer")
    first = run(
        producer,
        [(str(i), p, dataclasses.replace(params[i], max_tokens=1), None) for i, p in enumerate(ps)],
    )
    producer.close()
    consumer = engine(url, "consumer")
    rest = run(
        consumer,
        [
            (str(i), p, params[i], first[str(i)]["tokens"], first[str(i)]["handle"])
            for i, p in enumerate(ps)
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(str(consumer.model_dir))
    consumer.close()
    eos = consumer.eos_token_ids[0]
    for i in range(len(ps)):
        tokens = first[str(i)]["tokens"] + rest[str(i)]["tokens"]
        if tokens[-1] == eos:
            jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)
