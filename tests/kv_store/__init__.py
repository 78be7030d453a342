"""KV store tests. Payloads are derived from their keys, so any reader can check what it got."""

from __future__ import annotations

import hashlib

import numpy as np

from kv_store.entry import make_key


def block_key(fingerprint: str, i: int) -> str:
    """The store key of the i-th synthetic block of a fingerprint."""
    return make_key(fingerprint, hashlib.sha256(b"block-%d" % i).digest())


def payload_for(key: str, size: int) -> bytes:
    """`size` pseudo-random bytes determined by the key alone."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).bytes(size)
