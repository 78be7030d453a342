"""Who proposes drafts: the ``Proposer`` interface and the factory the engine calls once.

The proposers themselves live beside this (``ngram.py``, ``draft_model.py``) and are imported
when chosen: a draft model pulls in a second engine's worth of model code, which an engine
without speculation never needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from common.request import Request
from common.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from common.config import EngineConfig


class Proposer(Protocol):
    def propose(self, requests: Iterable[Request]) -> None:
        """Set ``spec_token_ids`` of the decoding requests among ``requests`` (others: left)."""


def make_proposer(
    config: SpeculativeConfig | None, engine: EngineConfig, max_model_len: int, num_blocks: int
) -> Proposer | None:
    """``num_blocks``: the target's KV cache blocks (a draft model's cache gets as many)."""
    if config is None:
        return None
    if config.method == "ngram":
        from common.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    from common.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, engine, max_model_len, num_blocks)
