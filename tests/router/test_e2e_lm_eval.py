"""lm-eval's ``local-completions`` model against a real router and nodes, offline: a
loglikelihood (multiple-choice) task and a generate task, from small task files written here.

The loglikelihood task sends batches of prompts with ``echo``, ``logprobs`` and
``max_tokens=1`` (lm-eval's request for scoring); the scores it reports must equal HF
transformers' for the tiny model. lm-eval is a test dependency (the
``[test]`` extra), so this runs wherever the tests do.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.router.conftest import Cluster, wait_no_leaks

MODEL = "tiny-llama"
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Cats like to", "choices": [" sleep", " fly", " swim", " sing"], "answer": 0},
]
GEN_DOCS = [{"question": "Once upon a time", "answer": "x"}, {"question": "Hello", "answer": "y"}]


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


def _task_files(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (tasks / "pdserve_mc.yaml").write_text(
        "task: pdserve_mc\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        + "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
        + "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )  # fmt: skip
    (tasks / "pdserve_gen.yaml").write_text(
        "task: pdserve_gen\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        + "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        + "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n"
    )  # fmt: skip
    return tasks


@functools.cache
def _hf():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.models.tiny import resolve_model_path

    path = str(resolve_model_path(MODEL))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(path), hf


def _hf_loglikelihood(context: str, continuation: str) -> float:
    """HF's score of ``continuation`` after ``context``, on the tokens lm-eval sends (its
    ``_encode_pair``: no special tokens added, so no BOS)."""
    tokenizer, hf = _hf()
    spaces = len(context) - len(context.rstrip())
    if spaces:  # lm-eval moves the context's trailing spaces onto the continuation
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    return sum(lp[i - 1, whole[i]].item() for i in range(ctx, len(whole)))


@pytest.mark.parametrize("tokenized", [False, True], ids=["text", "token_ids"])
def test_lm_eval_local_completions(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenized: bool
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from common.models.tiny import resolve_model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={cluster.router.base_url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={resolve_model_path(MODEL)}",
            f"tokenized_requests={tokenized}",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["pdserve_mc", "pdserve_gen"],
        task_manager=TaskManager(include_path=str(_task_files(tmp_path))),
        batch_size=4,
        log_samples=True,
    )
    assert results is not None
    assert 0.0 <= results["results"]["pdserve_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["results"]["pdserve_gen"]
    samples = results["samples"]["pdserve_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            got = resp[0][0]
            assert math.isfinite(got) and got < 0
            if tokenized:  # the ids lm-eval sent are scored exactly as HF scores them
                assert abs(got - _hf_loglikelihood(context, continuation)) < 1e-4
            # As text, the server tokenizes with the model's BOS (as vLLM does) and lm-eval's
            # ctxlen, counted without it, takes one context token into the score.
    generated = [s["resps"][0][0] for s in results["samples"]["pdserve_gen"]]
    assert len(generated) == len(GEN_DOCS) and all(isinstance(g, str) for g in generated)
