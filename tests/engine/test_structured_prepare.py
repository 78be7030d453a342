"""The first constrained request never stalls the engine loop: xgrammar and the tokenizer's
grammar data are prepared on a worker thread while the other streams keep stepping (they froze
for seconds when ``add_request`` built them). Run in a fresh interpreter, so that xgrammar is
not imported yet, as on a node's first grammar."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launcher.cluster_harness import REPO

pytestmark = pytest.mark.slow  # a fresh interpreter each, xgrammar imported in it

SCRIPT = r"""
import json, sys, time
from common import LLM, SamplingParams
from common.sampling_params import StructuredOutputsParams

llm = LLM(model="tiny-llama", num_blocks=256, prepare_structured_outputs=PREPARE)
engine = llm.engine
engine.add_request("stream", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
for _ in range(3):
    engine.step()
loaded_before = "xgrammar" in sys.modules and not PREPARE
t0 = time.perf_counter()
engine.add_request(
    "json", [5, 6, 7],
    SamplingParams(temperature=0.0, max_tokens=8,
                   structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")),
)
add_s = time.perf_counter() - t0
gaps, last, stream_tokens, constrained = [], time.perf_counter(), 0, []
while engine.has_unfinished():
    outs = engine.step()
    now = time.perf_counter()
    for out in outs:
        if out.request_id == "stream":
            stream_tokens += len(out.new_token_ids)
            gaps.append(now - last)
            last = now
        elif out.request_id == "json":
            if not constrained:
                first_at = stream_tokens
            constrained += out.new_token_ids
print(json.dumps(dict(add_s=add_s, max_gap_s=max(gaps), first_at=first_at,
                      text=llm.tokenizer.decode(constrained, skip_special_tokens=True), loaded_before=loaded_before)))
"""


def _run(prepare: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("PREPARE", str(prepare))],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_first_grammar_request_is_prepared_off_the_loop() -> None:
    got = _run(prepare=False)
    assert not got["loaded_before"]
    # add_request returns at once (it used to import xgrammar and build the tokenizer data)
    assert got["add_s"] < 0.5, got
    # the running stream kept getting tokens while the grammar was being prepared
    assert got["first_at"] > 0, got
    # no gap near the seconds the import takes on the loop (a step of this model is ~ms)
    assert got["max_gap_s"] < 2.0, got
    assert got["text"].isdigit() and len(got["text"]) == 4, got


def test_a_node_prepares_grammars_from_start_up() -> None:
    got = _run(prepare=True)
    assert got["add_s"] < 0.5 and got["text"].isdigit(), got
