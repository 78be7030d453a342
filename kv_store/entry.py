"""The on-store format of one KV entry: a fixed 64-byte header followed by the payload.

```
offset  size  field
     0     4  magic            b"PDKV"
     4     2  version          u16, currently 1
     6     2  flags            u16, bit 0 = COMMITTED
     8     4  num_tokens       u32, tokens whose K/V the payload holds
    12     4  reserved         zero
    16     8  payload_len      u64, bytes after the header
    24     8  payload_xxh3     u64, xxh3_64 of the payload
    32    16  fingerprint      first 16 bytes of sha256(fingerprint string)
    48     8  reserved         zero
    56     8  header_xxh3      u64, xxh3_64 of bytes [0, 56)
    64        payload
```

All integers are little-endian. A reader accepts an entry only if every field checks out
(magic, version, COMMITTED, header checksum, fingerprint, token count, payload length and payload
checksum); anything else is a miss. xxh3_64 is used rather than CRC32 because it runs at memory
speed (measured: 48 GB/s vs 3.1 GB/s for zlib's CRC32 on 2 MiB, which would cap reads below
what tmpfs delivers). The 64-byte header also keeps the payload 64-byte aligned in the file.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from kv_store.base import Buffer, Destination, Payload

MAGIC = b"PDKV"
VERSION = 1
FLAG_COMMITTED = 1
HEADER_SIZE = 64
KEY_PREFIX = "pdkv"

# magic, version, flags, num_tokens, reserved, payload_len, payload_xxh3, fingerprint, reserved
_BODY = struct.Struct("<4sHHIIQQ16s8x")
_HEADER_XXH = struct.Struct("<Q")
assert _BODY.size + _HEADER_XXH.size == HEADER_SIZE

_xxh3_64 = xxhash.xxh3_64_intdigest
_xxh3_64_stream = xxhash.xxh3_64


class EntryHeader(NamedTuple):
    """A parsed header whose magic, version and header checksum were already verified
    (for inspection and tests; readers use `verify`)."""

    flags: int
    num_tokens: int
    payload_len: int
    payload_xxh3: int
    fingerprint_digest: bytes

    @property
    def committed(self) -> bool:
        return bool(self.flags & FLAG_COMMITTED)


def fingerprint_digest(fingerprint: str) -> bytes:
    """The 16-byte digest of a layout fingerprint stored in every header."""
    return hashlib.sha256(fingerprint.encode()).digest()[:16]


def make_key(fingerprint: str, block_hash: bytes, num_tokens: int | None = None) -> str:
    """Store key of one block: `pdkv:{fingerprint}:{block_hash_hex}`.

    A final partial block passes its token count, which is appended (`...:{hex}:{n}`) so a partial
    block never shadows the full block that later shares its prefix hash.
    """
    key = f"{KEY_PREFIX}:{fingerprint}:{block_hash.hex()}"
    return key if num_tokens is None else f"{key}:{num_tokens}"


def byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (e.g. a tensor's numpy view).

    `len()` of the result is its size in bytes, which `len()` of a typed memoryview is not.
    """
    if isinstance(buf, memoryview) and buf.format == "B" and buf.ndim == 1:
        return buf  # already flat bytes: no new view
    view = memoryview(buf)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def chunk_views(payload: Payload | Destination) -> list[memoryview]:
    """Flat byte views of a payload given as one buffer or as a sequence of chunks (views that
    are flat bytes already are kept as they are: a hot path, an entry may have 64 chunks)."""
    if isinstance(payload, list | tuple):
        return [_flat(chunk) for chunk in payload]
    if isinstance(payload, memoryview | bytes | bytearray) or _is_buffer(payload):
        return [byte_view(payload)]  # type: ignore[arg-type]  # one buffer (e.g. numpy array)
    return [byte_view(chunk) for chunk in payload]  # type: ignore[union-attr]


def _flat(chunk: Buffer) -> memoryview:
    if type(chunk) is memoryview and chunk.format == "B" and chunk.ndim == 1:
        return chunk
    return byte_view(chunk)


def _is_buffer(obj: object) -> bool:
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def payload_size(chunks: Sequence[memoryview]) -> int:
    """Bytes of a payload given as flat byte views."""
    return sum(len(c) for c in chunks)


def payload_checksum(payload: Payload) -> int:
    """xxh3_64 of a payload (one buffer, or chunks hashed as their concatenation)."""
    return _checksum(chunk_views(payload))


def _checksum(chunks: Sequence[memoryview]) -> int:
    if len(chunks) == 1:
        return _xxh3_64(chunks[0])
    state = _xxh3_64_stream()
    for chunk in chunks:
        state.update(chunk)
    return state.intdigest()


def encode_header(
    fp_digest: bytes,
    num_tokens: int,
    payload: Payload,
    *,
    committed: bool = True,
) -> bytes:
    """The 64-byte header for `payload`. Computes the payload checksum (one pass over it)."""
    chunks = chunk_views(payload)
    return _pack(fp_digest, num_tokens, payload_size(chunks), _checksum(chunks), committed)


def _pack(fp_digest: bytes, num_tokens: int, payload_len: int, xxh: int, committed: bool) -> bytes:
    flags = FLAG_COMMITTED if committed else 0
    body = _BODY.pack(MAGIC, VERSION, flags, num_tokens, 0, payload_len, xxh, fp_digest)
    return body + _HEADER_XXH.pack(_xxh3_64(body))


def parse_header(buf: Buffer) -> EntryHeader | None:
    """Parse the first 64 bytes of `buf`; None if too short, wrong magic/version or bad checksum."""
    view = byte_view(buf)
    if len(view) < HEADER_SIZE:
        return None
    (stored_xxh,) = _HEADER_XXH.unpack_from(view, _BODY.size)
    if _xxh3_64(view[: _BODY.size]) != stored_xxh:
        return None
    magic, version, flags, num_tokens, _, payload_len, xxh, fp = _BODY.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return None
    return EntryHeader(flags, num_tokens, payload_len, xxh, fp)


def verify(header: Buffer, payload: Payload, fp_digest: bytes, num_tokens: int) -> bool:
    """True iff `header` is a committed, intact header of exactly `payload` (a flat byte view,
    or chunks taken in order) for this fingerprint and token count, and the payload checksum
    matches. Never raises."""
    parsed = _committed_header(header)
    if parsed is None:
        return False
    chunks = chunk_views(payload)
    return (
        parsed.num_tokens == num_tokens
        and parsed.payload_len == payload_size(chunks)
        and parsed.fingerprint_digest == fp_digest
        and _checksum(chunks) == parsed.payload_xxh3
    )


def damaged(header: Buffer, payload: Payload) -> bool:
    """True iff an entry is broken in itself, not merely another reader's (another
    fingerprint, token count or size): its header fails its own checksum or is no committed
    header of this format, or its payload, of the length the header states, fails the payload
    checksum. Entries are renamed into place whole, so this is damage, never a write in
    progress. Never raises."""
    parsed = _committed_header(header)
    if parsed is None:
        return True
    chunks = chunk_views(payload)
    return parsed.payload_len == payload_size(chunks) and _checksum(chunks) != parsed.payload_xxh3


def _committed_header(header: Buffer) -> EntryHeader | None:
    """``parse_header`` of exactly one header, and only a committed one."""
    if len(header) != HEADER_SIZE:
        return None
    parsed = parse_header(header)
    return parsed if parsed is not None and parsed.flags & FLAG_COMMITTED else None


def parse_and_verify(
    entry: Buffer, fp_digest: bytes, num_tokens: int, payload_len: int | None = None
) -> memoryview | None:
    """Verify a whole entry (header + payload) and return a view of its payload, else None.

    `payload_len=None` accepts any length (the caller does not know it in advance). Never raises
    on malformed input: every mismatch is reported as None (a miss).
    """
    view = byte_view(entry)
    payload = view[HEADER_SIZE:]
    if payload_len is not None and len(payload) != payload_len:
        return None
    return payload if verify(view[:HEADER_SIZE], payload, fp_digest, num_tokens) else None
