"""The entry format: every header field and every payload byte is checked on read."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kv_store import entry

FP = entry.fingerprint_digest("tiny-llama|float32|16|4|2|32")


def _entry(payload: bytes, num_tokens: int = 16, *, committed: bool = True) -> bytes:
    return entry.encode_header(FP, num_tokens, payload, committed=committed) + payload


def test_header_round_trip() -> None:
    payload = os.urandom(1000)
    header = entry.encode_header(FP, 7, payload)
    assert len(header) == entry.HEADER_SIZE == 64
    assert entry.parse_header(header) == entry.EntryHeader(
        entry.FLAG_COMMITTED, 7, 1000, entry.payload_checksum(payload), FP
    )


@pytest.mark.parametrize("size", [0, 1, 63, 64, 4096, 1 << 20])
def test_parse_and_verify_returns_payload(size: int) -> None:
    payload = os.urandom(size)
    view = entry.parse_and_verify(_entry(payload), FP, 16, size)
    assert view is not None and view.tobytes() == payload


@pytest.mark.parametrize("offset", range(entry.HEADER_SIZE))
def test_any_header_byte_flip_is_a_miss(offset: int) -> None:
    data = bytearray(_entry(b"x" * 100))
    data[offset] ^= 0x01
    assert entry.parse_and_verify(data, FP, 16) is None


@pytest.mark.parametrize("offset", [0, 1, 50, 99])
def test_payload_byte_flip_is_a_miss(offset: int) -> None:
    data = bytearray(_entry(bytes(100)))
    data[entry.HEADER_SIZE + offset] ^= 0x80
    assert entry.parse_and_verify(data, FP, 16) is None


def test_mismatches_are_misses() -> None:
    data = _entry(b"p" * 32)
    assert entry.parse_and_verify(data, entry.fingerprint_digest("other"), 16) is None
    assert entry.parse_and_verify(data, FP, 15) is None
    assert entry.parse_and_verify(data, FP, 16, payload_len=31) is None
    assert entry.parse_and_verify(data[:-1], FP, 16) is None  # truncated
    assert entry.parse_and_verify(data + b"\0", FP, 16) is None  # trailing bytes
    assert entry.parse_and_verify(_entry(b"p" * 32, committed=False), FP, 16) is None


@pytest.mark.parametrize("junk", [b"", b"PDKV", b"hello world", bytes(64), os.urandom(500)])
def test_junk_is_a_miss_not_an_exception(junk: bytes) -> None:
    assert entry.parse_and_verify(junk, FP, 16) is None


def test_typed_buffers_are_framed_by_bytes() -> None:
    # A typed memoryview (e.g. of a tensor's numpy view) has len() in elements, not bytes.
    array = np.arange(48, dtype=np.float16).reshape(2, 3, 8)
    header = entry.encode_header(FP, 16, memoryview(array))
    parsed = entry.parse_header(header)
    assert parsed is not None and parsed.payload_len == array.nbytes
    assert len(entry.byte_view(memoryview(array))) == array.nbytes


def test_make_key() -> None:
    block_hash = bytes(range(32))
    assert entry.make_key("fp", block_hash) == f"pdkv:fp:{block_hash.hex()}"
    assert entry.make_key("fp", block_hash, 5) == f"pdkv:fp:{block_hash.hex()}:5"
    assert entry.fingerprint_digest("a") != entry.fingerprint_digest("b")
    assert len(entry.fingerprint_digest("a")) == 16
