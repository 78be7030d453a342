"""Offline inference, vLLM style: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, TopLogprobs
from common.config import EngineConfig
from common.engine import EngineCore
from common.lora.adapter import LoraRef, read_adapter
from common.output_processor import CompletionOutput, RequestOutput, TextStream
from common.parallel_sampling import split_samples
from common.request import RequestStatus
from common.sampling_params import SamplingParams
from common.step_outputs import EngineCoreOutput

if TYPE_CHECKING:
    from common.kv_connector import ConnectorFactory

PromptType = str | list[int]


class LLM:
    """An engine in this process. Keyword arguments are engine arguments (``block_size=``,
    ``max_num_batched_tokens=``, ``num_blocks=``, ``enable_prefix_caching=``, ``device=`` …).

    It owns what its engine holds: tensor-parallel worker processes and process groups, the KV
    connector's threads and staging memory. ``close()``, the end of a ``with LLM(...) as llm:``
    block, or dropping the last reference (a ``weakref.finalize``, also run at interpreter
    exit) release them; then another engine, tensor-parallel too, can start in this process."""

    def __init__(self, model: str = "tiny-llama", dtype: str = "auto", **engine_args: Any):
        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args)
        self._engine: EngineCore | None = EngineCore(self.config, _connector_factory(self.config))
        # holds the engine, never self: the LLM stays collectable
        self._finalizer = weakref.finalize(self, self._engine.close)
        try:
            self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                str(self._engine.model_dir)
            )
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        """The engine; RuntimeError once the LLM is closed."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed: create a new one")
        return self._engine

    def close(self) -> None:
        """Release the engine (workers, process groups, connector threads, staging memory).
        Idempotent; the LLM cannot be used afterwards."""
        self._finalizer()  # runs the engine's close once, then forgets the engine
        self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoraRef | Sequence[LoraRef | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.
        ``lora_request``: the adapter of every prompt, or one per prompt (``LLM.lora``)."""
        engine = self.engine  # RuntimeError once closed
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        states: list[_RequestState] = []
        samples: dict[str, tuple[_RequestState, int]] = {}  # engine request id → sample
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                states.append(self._add(prompt, p, samples, lora))
        except Exception:  # all or nothing (the engine runs only this call's requests)
            engine.abort(engine.request_ids())
            raise
        self._run(samples, len(states), use_tqdm)
        return [s.output for s in states]

    def _add(
        self,
        prompt: PromptType,
        params: SamplingParams,
        samples: dict[str, tuple[_RequestState, int]],
        lora: LoraRef | None = None,
    ) -> _RequestState:
        """Queue the prompt's samples (one engine request each), recording them in ``samples``."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        request_id = str(next(self._ids))
        split = split_samples(request_id, params, self.config.scheduler.max_n)
        for sample in split:  # the engine validates the prompt before anything decodes it
            self.engine.add_request(sample.request_id, token_ids, sample.params, lora=lora)
        state = _RequestState(request_id, text, token_ids, params, self.tokenizer)
        samples.update((sample.request_id, (state, sample.index)) for sample in split)
        return state

    def _run(
        self, samples: dict[str, tuple[_RequestState, int]], num_requests: int, use_tqdm: bool
    ) -> None:
        unfinished = num_requests
        num_out = 0
        with tqdm(total=unfinished, desc="generating", disable=not use_tqdm) as bar:
            while unfinished:
                stopped: list[str] = []
                for out in self.engine.step():
                    state, index = samples[out.request_id]
                    num_out += len(out.new_token_ids)
                    if state.update(out, index, stopped):
                        unfinished -= 1
                        bar.update(1)
                        bar.set_postfix(
                            tok_s=f"{num_out / max(bar.format_dict['elapsed'], 1e-9):.0f}"
                        )
                self.engine.finish_stopped(stopped)
                self._raise_refused()
                self._raise_failed()

    def lora(self, name: str, path: str) -> LoraRef:
        """An adapter to pass as ``lora_request``: a PEFT LoRA directory, checked."""
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA is not enabled: LLM(..., enable_lora=True)")
        return read_adapter(name, path, self.config.lora.max_lora_rank)[0]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoraRef | None = None,
    ) -> list[BeamSearchOutput]:
        """Each prompt's ``beam_width`` best hypotheses, best first: HF's ``generate(num_beams=
        beam_width, do_sample=False, length_penalty=…, num_return_sequences=beam_width)``.

        Rounds of one-token requests, one per live beam of every prompt, that share their
        prefix through the prefix cache (``common/beam_search.py``). ``max_tokens`` is cut to
        the room ``max_model_len`` leaves, as in ``generate``."""
        searches = [self._beam_search_of(prompt, params) for prompt in _as_prompt_list(prompts)]
        rounds = max((s.max_tokens for s in searches), default=0)
        with tqdm(total=rounds, desc="beam search", disable=not use_tqdm) as bar:
            while live := [s for s in searches if not s.done]:
                beams = [(b, s.num_logprobs) for s in live for b in s.beams()]
                tops = self._score_beams(beams, lora_request)
                for search in live:
                    n = len(search.running)
                    search.advance(tops[:n])
                    tops = tops[n:]
                bar.update(1)
        return [self._beam_output(s) for s in searches]

    def _beam_search_of(self, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        room = self.engine.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate: max_model_len"
                f" is {self.engine.max_model_len}"
            )
        max_tokens = min(params.max_tokens, room)
        return BeamSearch(token_ids, params, self.engine.eos_token_ids, max_tokens)

    def _score_beams(
        self, beams: list[tuple[list[int], int]], lora: LoraRef | None = None
    ) -> list[TopLogprobs]:
        """The top-k next tokens of each (token ids, k): one engine request each, run
        together to completion."""
        engine = self.engine
        request_ids = [f"beam-{next(self._ids)}" for _ in beams]
        tops: dict[str, TopLogprobs] = {}
        try:
            for request_id, (token_ids, k) in zip(request_ids, beams):
                params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
                engine.add_request(request_id, token_ids, params, lora=lora)
            while len(tops) < len(beams):
                for out in engine.step():
                    if out.new_logprobs:  # its one token: the request has ended
                        lp = out.new_logprobs[0]
                        tops[out.request_id] = TopLogprobs(lp.top_ids, lp.top_logprobs)
                self._raise_refused()
                self._raise_failed()
        except Exception:  # all or nothing (the engine runs only this call's requests)
            engine.abort(engine.request_ids())
            raise
        return [tops[request_id] for request_id in request_ids]

    def _beam_output(self, search: BeamSearch) -> BeamSearchOutput:
        sequences = search.sequences()
        for seq in sequences:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return BeamSearchOutput(search.prompt, sequences)

    def _raise_refused(self) -> None:
        """A request the engine refused after accepting it (its grammar does not compile)
        fails the whole call, like a refusal at ``add_request``."""
        refused = self.engine.take_refused()
        if refused:
            self.engine.abort(self.engine.request_ids())
            raise ValueError(refused[0][1])

    def _raise_failed(self) -> None:
        """A request a failed step ended (``EngineCore.take_failed``) fails the whole call: it
        will never finish, and waiting for it would never end."""
        failed = self.engine.take_failed()
        if failed:
            self.engine.abort(self.engine.request_ids())
            raise RuntimeError(failed[0][1])

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

    def update(self, out: EngineCoreOutput, index: int, stopped: list[str]) -> bool:
        """Apply one engine output of sample ``index``; returns True when the whole request has
        finished."""
        sample, stream = self.output.outputs[index], self.streams[index]
        if sample.finish_reason is not None:
            return False  # tokens after a stop string, from the step that found it
        kept = _add_until_stop(stream, out.new_token_ids, final=out.finish_reason is not None)
        sample.token_ids.extend(out.new_token_ids[:kept])
        if sample.logprobs is not None:
            sample.logprobs.extend(out.new_logprobs[:kept])
        if index == 0:  # its siblings hit the prompt blocks it computed: count them once
            self.output.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.output.prompt_logprobs = out.prompt_logprobs
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


def _add_until_stop(stream: TextStream, token_ids: list[int], final: bool) -> int:
    """Feed ``token_ids`` to ``stream``; returns how many to keep. Several tokens at once (a
    speculative step) go one by one while stop strings are watched, so the output ends at the
    token that completed the stop string, as it does when tokens come one per step."""
    if len(token_ids) == 1 or not stream.stop:
        stream.add(token_ids, final=final)
        return len(token_ids)
    for i, token_id in enumerate(token_ids):
        stream.add([token_id], final=final and i == len(token_ids) - 1)
        if stream.stopped is not None:
            return i + 1
    return len(token_ids)


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


def _as_lora_list(lora: LoraRef | Sequence[LoraRef | None] | None, n: int) -> list[LoraRef | None]:
    if lora is None or isinstance(lora, LoraRef):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
    return loras


__all__ = ["LLM", "BeamSearchParams", "RequestOutput", "RequestStatus"]


def _connector_factory(config: EngineConfig) -> ConnectorFactory | None:
    """The store connector when the engine is given a KV store (``kv_store=…``), else None.

    Imported only then: an engine without a store never loads the store clients."""
    if config.kv_store is None:
        return None
    from kv_transfer.connector import create_store_connector

    return create_store_connector
