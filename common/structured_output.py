"""Structured outputs: xgrammar matchers per request, one bitmask per step for the whole batch.

NOTE: how a constrained request moves through the engine.

1. ``add``: its grammar is compiled on a worker thread (never on the engine loop), through a
   cache keyed by (tokenizer, spec); the request is flagged ``waiting_for_grammar`` and the
   scheduler passes it over, step after step, while others run (like a KV lookup in flight).
2. ``poll`` (each step): a compiled grammar gets a fresh matcher, advanced by the tokens the
   request already carries (``output_token_ids``: a decode node continues what the prefill node
   sampled), and the flag drops. A spec that does not compile is refused: (request id, reason).
3. ``bitmask`` (each step, after ``schedule``): one int32 row per sampling row of the step, all
   ones for rows without a grammar, filled for the others by xgrammar's batched fill in one call;
   the sampler applies it with one ``masked_fill`` (``common.sampler.apply_token_bitmask``).
4. ``accept`` (after each step): matchers advance by the tokens sampled. The mask of a step
   needs the previous token accepted, so the overlapped loop finishes a step holding a
   constrained request before it schedules the next (``Scheduler.must_sync``).

EOS (and the model's other stop ids) are the grammar's stop tokens: the mask allows them only
once the output is complete, so a constrained request ends with ``stop`` when its text is done.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from common.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from common.request import Request
    from common.step_outputs import EngineCoreOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 256
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


def compile_error_message(error: BaseException) -> str:
    """xgrammar's error text without its C++ source location (what a client should read)."""
    text = str(error).strip()
    text = _NATIVE_PREFIX.sub("", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")


class GrammarCache:
    """Compiles specs for one tokenizer on a worker thread; futures are cached by spec (the
    tokenizer is fixed per cache, so the key is (tokenizer, spec)). Failures are cached too:
    the same bad schema is refused at once. Least recently used entries go past 256."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        # The model's vocab (its logits' width) may exceed the tokenizer's: padded ids are
        # never allowed by a mask.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.tokenizer_dir = str(tokenizer_dir)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()

    def get(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = spec.key()
        future = self._futures.get(key)
        if future is None:
            future = self._executor.submit(self._compile, spec)
            self._futures[key] = future
            if len(self._futures) > _CACHE_ENTRIES:
                self._futures.popitem(last=False)
        self._futures.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The spec's grammar; ValueError if it admits no output at all (a schema whose
        ``$ref`` refers only to itself compiles, and would mask every token of every step)."""
        grammar = self._compile_spec(spec)
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        if not matcher.is_terminated() and not bool(mask.any()):  # not even a stop token
            raise ValueError(
                "it admits no output at all (e.g. a $ref cycle with nothing else to match)"
            )
        return grammar

    def _compile_spec(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.json is not None:
            return c.compile_json_schema(
                str(spec.json), any_whitespace=not spec.disable_any_whitespace
            )
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice)
            return c.compile_grammar(f"root ::= {alternatives}")
        if spec.grammar is not None:
            return c.compile_grammar(spec.grammar)
        return c.compile_builtin_json_grammar()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    """The engine's matchers, one per constrained request it holds (keyed by request id)."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._pending: dict[str, tuple[Request, Future[xgr.CompiledGrammar]]] = {}
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        request.waiting_for_grammar = True
        self._pending[request.request_id] = (request, self.cache.get(spec))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self) -> list[tuple[str, str]]:
        """Start matchers for compiled grammars; (request id, reason) for each refused one."""
        refused: list[tuple[str, str]] = []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            reason = self._start(request, future)
            if reason is not None:
                refused.append((request_id, reason))
        return refused

    def _start(self, request: Request, future: Future[xgr.CompiledGrammar]) -> str | None:
        error = future.exception()
        if error is not None:
            return f"invalid structured output spec: {compile_error_message(error)}"
        matcher = xgr.GrammarMatcher(future.result())
        for token_id in request.output_token_ids:
            if not matcher.accept_token(token_id):
                return f"output token {token_id} already generated does not match the grammar"
        self._matchers[request.request_id] = matcher
        request.waiting_for_grammar = False
        return None

    def bitmask(self, out: SchedulerOutput) -> torch.Tensor | None:
        """(rows, ceil(V/32)) int32 for the step's sampling rows, in the model runner's row
        order (a request verifying ``k`` drafts owns ``k + 1`` rows); None when no row has a
        grammar (the sampler then skips the mask). Rows without a grammar are all ones."""
        first: list[tuple[int, xgr.GrammarMatcher, list[int]]] = []
        num_rows = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            drafts = getattr(s, "spec_token_ids", None) or []
            matcher = self._matchers.get(s.request.request_id)
            if matcher is not None:
                first.append((num_rows, matcher, drafts))
            num_rows += 1 + len(drafts)
        if not first:
            return None
        mask = xgr.allocate_token_bitmask(num_rows, self.cache.vocab_size)  # all ones
        matchers = [m for _, m, _ in first]
        self._batch.batch_fill_next_token_bitmask(matchers, mask, [row for row, _, _ in first])
        for row, matcher, drafts in first:
            if drafts:
                _fill_draft_rows(matcher, mask, row, drafts)
        return mask

    def accept(self, outputs: Iterable[EngineCoreOutput]) -> None:
        """Advance matchers by a step's sampled tokens; forget requests that finished."""
        for out in outputs:
            matcher = self._matchers.get(out.request_id)
            if matcher is None:
                continue
            for token_id in out.new_token_ids:
                if not matcher.is_terminated() and not matcher.accept_token(token_id):
                    logger.warning("request %s: token %d off its grammar", out.request_id, token_id)
            if out.finish_reason is not None:
                del self._matchers[out.request_id]

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._pending.pop(request_id, None)

    def close(self) -> None:
        self.cache.close()


def _fill_draft_rows(
    matcher: xgr.GrammarMatcher, mask: torch.Tensor, row: int, drafts: list[int]
) -> None:
    """Rows ``row + 1 …`` of a request verifying drafts: the mask after each draft, found by
    accepting the drafts and rolling back. Past a draft the grammar refuses, rows stay all
    ones: the target never samples that draft, so nothing after it is kept."""
    accepted = 0
    for j, token_id in enumerate(drafts):
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        accepted += 1
        matcher.fill_next_token_bitmask(mask, row + 1 + j)
    if accepted:
        matcher.rollback(accepted)
