"""Draft-model proposals: a small model that shares the target's tokenizer, run as a nested
engine in the same process, proposing its greedy tokens (so ``q`` is one-hot and verification is
the id comparison of ``rejection.py``: seeded output equals non-speculative output).

NOTE: the draft keeps no per-request state between steps. Each round submits every decoding
request's tokens as a fresh greedy request of ``k`` tokens; the draft engine's own prefix cache
holds the blocks of the previous round, so a round computes the last partial block and the ``k``
drafts, batched over all requests like any engine step. Rounds run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import torch

from common.config import EngineConfig, LoraConfig, ModelConfig
from common.memory_profile import KVReserve
from common.models.llama import LlamaArgs
from common.models.loader import build_on_meta, kv_cache_torch_dtype, read_hf_config, resolve_dtype
from common.models.tiny import resolve_model_path
from common.request import Request
from common.sampling_params import SamplingParams
from common.spec_decode.config import SpeculativeConfig
from common.spec_decode.rejection import wants_drafts


def draft_footprint(config: SpeculativeConfig, target: EngineConfig) -> KVReserve:
    """The draft's weights and KV bytes per block, from its config alone (its shapes built on
    ``meta``): what the target's cache sizing must leave for it before either cache exists."""
    assert config.model is not None
    model_dir = resolve_model_path(config.model)
    hf_config = read_hf_config(model_dir)
    dtype = resolve_dtype(target.model.dtype, hf_config)
    args = LlamaArgs.from_hf(hf_config)
    model = build_on_meta(args, None, 1, None)  # type: ignore[arg-type]  # shapes only
    elem = torch.empty((), dtype=dtype).element_size()
    weights = {id(p): p.numel() for p in model.parameters()}  # a tied tensor once
    per_block = args.num_layers * 2 * target.cache.block_size * args.num_kv_heads * args.head_dim
    kv_elem = kv_cache_torch_dtype(target.cache.kv_cache_dtype, dtype).itemsize  # (as the target)
    return KVReserve(sum(weights.values()) * elem, per_block * kv_elem)


class DraftModelProposer:
    """``num_blocks``: the draft's cache, sized with the target's (never more blocks)."""

    def __init__(
        self, config: SpeculativeConfig, target: EngineConfig, max_model_len: int, num_blocks: int
    ):
        from common.engine import EngineCore  # the nested engine (engine.py imports us)

        assert config.model is not None
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        draft_config = dataclasses.replace(
            target,
            model=ModelConfig(config.model, target.model.dtype, max_model_len=max_model_len),
            cache=dataclasses.replace(target.cache, num_blocks=num_blocks),
            kv_store=None,
            kv_role=None,
            enforce_eager=True,
            async_scheduling=False,
            speculative_config=None,
            tensor_parallel_size=1,  # a small draft runs whole beside the target's rank 0
            lora=LoraConfig(),  # drafts come from the base draft; the target verifies with it
        )
        self.engine = EngineCore(draft_config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Close the draft's engine (idempotent)."""
        self.engine.close()

    def check_vocab(self, vocab_size: int) -> None:
        if self.engine.vocab_size != vocab_size:
            raise ValueError(
                f"draft model vocabulary {self.engine.vocab_size} differs from the target's"
                f" {vocab_size}: the draft must share the tokenizer"
            )

    def propose(self, requests: Iterable[Request]) -> None:
        asked: dict[str, Request] = {}
        for request in requests:
            k = min(wants_drafts(request, self.k), self.max_model_len - request.num_tokens - 1)
            if k <= 0:
                continue
            draft_id = f"draft-{next(self._ids)}"
            params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            self.engine.add_request(draft_id, request.all_token_ids, params)
            asked[draft_id] = request
            request.spec_token_ids = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                asked[out.request_id].spec_token_ids += out.new_token_ids
