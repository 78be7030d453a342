"""Offline inference, vLLM style: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.config import EngineConfig
from common.engine import EngineCore
from common.output_processor import CompletionOutput, RequestOutput, TextStream
from common.request import RequestStatus
from common.sampling_params import SamplingParams
from common.scheduler import EngineCoreOutput

PromptType = str | list[int]


class LLM:
    """An engine in this process. Keyword arguments are engine arguments (``block_size=``,
    ``max_num_batched_tokens=``, ``num_blocks=``, ``enable_prefix_caching=``, ``device=`` …)."""

    def __init__(self, model: str = "tiny-llama", dtype: str = "auto", **engine_args: Any):
        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(self.engine.model_dir)
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        states: list[_RequestState] = []
        try:
            for prompt, p in zip(prompts, params):
                states.append(self._add(prompt, p))
        except Exception:
            self.engine.abort([s.output.request_id for s in states])  # all or nothing
            raise
        self._run({s.output.request_id: s for s in states}, use_tqdm)
        return [s.output for s in states]

    def _add(self, prompt: PromptType, params: SamplingParams) -> _RequestState:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, token_ids, params)
        return _RequestState(request_id, text, token_ids, params, self.tokenizer)

    def _run(self, by_id: dict[str, _RequestState], use_tqdm: bool) -> None:
        unfinished = len(by_id)
        num_out = 0
        with tqdm(total=unfinished, desc="generating", disable=not use_tqdm) as bar:
            while unfinished:
                stopped: list[str] = []
                for out in self.engine.step():
                    state = by_id[out.request_id.split("#")[0]]
                    num_out += len(out.new_token_ids)
                    if state.update(out, stopped):
                        unfinished -= 1
                        bar.update(1)
                        bar.set_postfix(
                            tok_s=f"{num_out / max(bar.format_dict['elapsed'], 1e-9):.0f}"
                        )
                self.engine.finish_stopped(stopped)

    def check_integrity(self) -> None:
        """All blocks consistent; with nothing running, every block is free again."""
        self.engine.check_integrity()


class _RequestState:
    """Accumulates one request's (``n``) samples as the engine reports them."""

    def __init__(self, request_id, prompt, token_ids, params: SamplingParams, tokenizer) -> None:
        self.params = params
        self.output = RequestOutput(request_id, prompt, token_ids)
        self.streams = [TextStream(tokenizer, token_ids, params) for _ in range(params.n)]
        self.output.outputs = [
            CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        self.num_done = 0

    def update(self, out: EngineCoreOutput, stopped: list[str]) -> bool:
        """Apply one engine output; returns True when the whole request has finished."""
        index = int(out.request_id.split("#")[1]) if "#" in out.request_id else 0
        sample, stream = self.output.outputs[index], self.streams[index]
        if sample.finish_reason is not None:
            return False  # tokens after a stop string, from the step that found it
        sample.token_ids.extend(out.new_token_ids)
        if sample.logprobs is not None:
            sample.logprobs.extend(out.new_logprobs)
        self.output.num_cached_tokens = out.num_cached_tokens
        stream.add(out.new_token_ids, final=out.finish_reason is not None)
        if stream.stopped is not None and out.finish_reason is None:
            stopped.append(out.request_id)
            sample.finish_reason, sample.stop_reason = "stop", stream.stopped
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if sample.finish_reason is None:
            return False
        sample.text = stream.text
        self.num_done += 1
        self.output.finished = self.num_done == len(self.streams)
        return self.output.finished


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params


__all__ = ["LLM", "RequestOutput", "RequestStatus"]
