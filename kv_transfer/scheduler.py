"""The scheduler half of the store connector: decides, never moves bytes, never waits.

Entries are one block × all layers: the payload of block ``b`` is
``kv_cache[:, :, b]`` laid out as ``(num_layers, 2, block_size, num_kv_heads, head_dim)``, keyed by
the block's chained hash (``pdkv:{fingerprint}:{hash}``; a final partial prompt block adds its
token count). docs/BENCHMARKS.md ("KV path") has the measurement behind that granularity.

It makes one batched existence check for how many prompt tokens a request can load, load specs
for the blocks allocated to them, save specs for the prompt blocks a step completes, the KV
handle when a request ends. The worker half, which moves the bytes, is ``kv_transfer/worker.py``;
``kv_transfer/connector.py`` wires both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from common.block_hash import prompt_block_hashes
from common.kv_connector import KVConnectorScheduler
from common.kv_interface import (
    ConnectorMetadata,
    KVHandle,
    LoadSpec,
    MatchedTokens,
    SaveSpec,
)
from common.lora.adapter import handle_fingerprint
from common.request import Request
from common.step_outputs import SchedulerOutput
from kv_store.base import KVStore
from kv_store.entry import make_key

logger = logging.getLogger(__name__)


def prompt_hashes(request: Request) -> list[bytes]:
    """Hashes of the request's prompt blocks (reusing the hashes it already carries)."""
    return prompt_block_hashes(
        request.prompt_token_ids, request.block_size, request.hash_salt, request.block_hashes
    )


def prompt_entries(
    request: Request, fingerprint: str, hashes: list[bytes] | None = None
) -> list[tuple[str, int]]:
    """(key, num_tokens) of the prompt's store entries: full blocks, then a final partial one."""
    n, bs = request.num_prompt_tokens, request.block_size
    out = []
    for i, block_hash in enumerate(prompt_hashes(request) if hashes is None else hashes):
        tokens = min(bs, n - i * bs)
        out.append((make_key(fingerprint, block_hash, None if tokens == bs else tokens), tokens))
    return out


class _Prompt(NamedTuple):
    """A request's prompt as the store names it: block hashes and (key, num_tokens) entries."""

    hashes: list[bytes]
    entries: list[tuple[str, int]]


class StoreConnectorScheduler(KVConnectorScheduler):
    """Decides loads and saves. Never waits for the store on the scheduling path: a request
    with a KV handle loads what the handle names without asking (a missing entry is a failed
    block, recomputed); one without asks the store on the lookup thread and is "not known yet"
    (``MatchedTokens(None, …)``) until the answer is in."""

    def __init__(self, store: KVStore, fingerprint: str, block_size: int, role: str, url: str):
        self.store, self.fingerprint, self.block_size = store, fingerprint, block_size
        self.role, self.url = role, url
        self._loads: list[LoadSpec] = []
        self._saved: dict[str, int] = {}  # request id → prompt entries already saved
        self._lookups: dict[str, Future[list[bool]]] = {}  # request id → store's answer
        self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-lookup")
        self._prompts: dict[str, _Prompt] = {}  # request id → its store names, made once
        self._wake: Callable[[], None] = lambda: None

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def _prompt(self, request: Request) -> _Prompt:
        """The request's store names, hashed once per request (dropped when it finishes)."""
        prompt = self._prompts.get(request.request_id)
        if prompt is None:
            hashes = prompt_hashes(request)
            prompt = _Prompt(hashes, prompt_entries(request, self.fingerprint, hashes))
            self._prompts[request.request_id] = prompt
        return prompt

    @property
    def loads(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def saves(self) -> bool:
        return self.role in ("producer", "both")

    def check_handle(self, request: Request, handle: KVHandle) -> None:
        own = handle_fingerprint(self.fingerprint, request.lora)
        if handle.fingerprint != own or handle.block_size != self.block_size:
            raise ValueError(
                f"KV handle is for another layout or adapter ({handle.fingerprint}, block size"
                f" {handle.block_size}); this request is {own}, {self.block_size}"
            )
        if handle.num_tokens != request.num_prompt_tokens or list(handle.block_hashes) != (
            self._prompt(request).hashes
        ):
            self._prompts.pop(request.request_id, None)  # refused: the request never runs
            raise ValueError("KV handle names another prompt's KV")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if not self.loads:
            return MatchedTokens(0, False)
        candidates = self._candidates(request, num_computed_tokens)
        if not candidates:
            return MatchedTokens(0, False)
        if request.kv_transfer is not None:  # the handle is the contract: no existence check
            return MatchedTokens(sum(n for _, n in candidates), True)
        present = self._lookup(request)
        if present is None:
            return MatchedTokens(None, True)
        first = num_computed_tokens // self.block_size
        matched = 0
        for (_, n), ok in zip(candidates, present[first:]):
            if not ok:
                break
            matched += n
        return MatchedTokens(matched, True)

    def _lookup(self, request: Request) -> list[bool] | None:
        """Which of the prompt's entries the store holds, asked on the lookup thread: None until
        it answers (a failed ask is an answer: nothing there)."""
        future = self._lookups.get(request.request_id)
        if future is None:
            keys = [key for key, _ in self._prompt(request).entries]
            future = self._lookup_thread.submit(self.store.contains_many, keys)
            future.add_done_callback(lambda _: self._wake())
            self._lookups[request.request_id] = future
        if not future.done():
            return None
        return future.result() if future.exception() is None else []

    def _candidates(self, request: Request, num_computed: int) -> list[tuple[str, int]]:
        """Entries after the local hit whose tokens still leave one token to compute."""
        entries = self._prompt(request).entries[num_computed // self.block_size :]
        budget = request.num_tokens - 1 - num_computed
        out = []
        for key, n in entries:
            if n > budget:
                break
            out.append((key, n))
            budget -= n
        return out

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self._lookups.pop(request.request_id, None)
        first = request.num_computed_tokens // self.block_size
        entries, total = [], 0
        for key, n in self._candidates(request, request.num_computed_tokens):
            if total >= num_external_tokens:
                break
            entries.append((key, n))
            total += n
        ids = block_ids[first : first + len(entries)]
        # blocks that come from the store are not saved back to it (gathered, copied to the
        # host, then found present): this request's saves start after them
        self._saved[request.request_id] = first + len(entries)
        self._loads.append(
            LoadSpec(request.request_id, [k for k, _ in entries], ids, [n for _, n in entries])
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.saves:
            for item in scheduler_output.scheduled:
                spec = self._save_spec(item.request, item.num_new_tokens, item.block_ids)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _save_spec(self, request: Request, num_new: int, block_ids: list[int]) -> SaveSpec | None:
        """Prompt entries whose tokens are all computed once this step's forward pass is done."""
        done = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
        # below what was saved or loaded only when blocks are recomputed (a failed load)
        start = min(
            self._saved.get(request.request_id, 0), request.num_computed_tokens // self.block_size
        )
        ready = done // self.block_size
        if done == request.num_prompt_tokens:
            ready = -(-done // self.block_size)  # the final partial block is complete too
        if ready <= start:
            return None  # every step of a decoding request ends here, before any hashing
        self._saved[request.request_id] = ready
        chosen = self._prompt(request).entries[start:ready]
        return SaveSpec(
            request.request_id,
            [k for k, _ in chosen],
            block_ids[start:ready],
            [n for _, n in chosen],
            final=done == request.num_prompt_tokens,
        )

    def request_finished(self, request: Request, block_ids: list[int]):
        self._saved.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        prompt = self._prompts.pop(request.request_id, None)
        if not self.saves:
            return False, None
        hashes = prompt_hashes(request) if prompt is None else prompt.hashes
        fingerprint = handle_fingerprint(self.fingerprint, request.lora)
        handle = KVHandle(fingerprint, self.block_size, request.num_prompt_tokens, hashes, self.url)
        return False, handle  # blocks are copied out during the step: nothing to hold

    def close(self) -> None:
        self._lookup_thread.shutdown(wait=True, cancel_futures=True)
        self.store.close()
