"""Chained SHA-256 block hashes.

The hash of block ``i`` covers its parent's hash, its token ids and an optional salt, so equal
hashes mean equal *prefixes*, not merely equal blocks. The same digests key the local prefix
cache, the KV store entries and the router's prefix affinity. Never Python ``hash()``: it is
salted per process and would differ between instances.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes  # 32-byte SHA-256 digest


def root_hash(salt: str | None = None) -> BlockHash:
    """The parent of a sequence's first block (depends on the optional cache salt)."""
    return hashlib.sha256(b"pdserve/v1/root" + (salt or "").encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent. Tokens are serialised as little-endian int32."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


def hash_partial_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a final, partial block: keyed with its token count so it never equals a full one."""
    h = hashlib.sha256(parent)
    h.update(b"partial:%d:" % len(token_ids))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent: BlockHash | None = None,
    start: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids[start:]``, chained from ``parent``.

    ``start`` must be a multiple of ``block_size``; ``parent`` is the hash of the block that ends
    at ``start`` (``None``: the root for ``salt``).
    """
    assert start % block_size == 0
    prev = parent if parent is not None else root_hash(salt)
    out: list[BlockHash] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[begin : begin + block_size])
        out.append(prev)
    return out


def prompt_block_hashes(
    prompt_token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    full_hashes: Sequence[BlockHash] | None = None,
) -> list[BlockHash]:
    """Hashes naming a prompt's KV: every full block, then a final partial block (if any).

    ``full_hashes``: the full blocks' hashes when the caller already has them (a request's
    ``block_hashes``); otherwise they are computed here.
    """
    num_full = len(prompt_token_ids) // block_size
    if full_hashes is None:
        full_hashes = hash_blocks(prompt_token_ids[: num_full * block_size], block_size, salt)
    hashes = list(full_hashes[:num_full])
    tail = prompt_token_ids[num_full * block_size :]
    if len(tail):
        parent = hashes[-1] if hashes else root_hash(salt)
        hashes.append(hash_partial_block(parent, tail))
    return hashes
