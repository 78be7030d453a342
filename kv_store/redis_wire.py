"""The RESP2 wire under `RedisStore`: batched commands written on a pooled connection's socket,
their replies read in place.

Contract of `exchange(pool, command, indices, scratch)`:

- Socket: checks one connection out of a redis-py `pool` (which owns connect, AUTH, SELECT, TLS
  and timeouts), writes the requests of batch items `indices` in one pipelined burst, reads
  exactly one reply per item, in order, and releases the connection.
- Writes: a SET goes out as `*N $3 SET $k <key> $len <64-byte header>`, then every payload chunk
  as its own iovec (`sendmsg`, up to 1024 pieces per call; `sendall` per piece under TLS); only
  the framing and headers are joined. The payload is never copied in user space, and 256 entries
  take ~13 syscalls instead of 513.
- Reads: reply lines pass through the caller's `scratch` buffer (`SCRATCH_BYTES`, one per
  thread); a GET's `$len` + header + payload is received with `recv_into` straight into the
  caller's destination chunks and verified there. Through redis-py, hiredis copied each value into
  its read buffer, then into a fresh `bytes` (page faults on every large value), and the store
  copied it once more: 0.6 → 1.2-1.3 GB/s on 512 KiB - 2 MiB entries (2-core box, local server).
- Failures: never raised. An error reply (`OOM …`, `MOVED …`) is a `Failure(connection=False)`
  for its item only; a failed checkout, a lost connection, EOF or a malformed reply is a
  `Failure(connection=True)` for every item not yet answered, and the connection is dropped
  (a half-read exchange leaves the socket out of step).

Which node, how many connections, threads and retries are the store's (`redis_store.py`);
`split_batch` only cuts a batch into slices of about equal cost for it.
"""

from __future__ import annotations

import inspect
import socket
import ssl
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import redis

from kv_store import entry

SCRATCH_BYTES = 1 << 16  # reply lines + the start of a payload land here; the rest goes direct
_IOV_MAX = 1024  # Linux's limit on iovecs per sendmsg
_KEY_COST = 64  # bytes-equivalent of a command without a payload (EXISTS, UNLINK)
_CONNECTION_ERRORS = (redis.RedisError, OSError)
# redis-py >= 5.3 deprecates get_connection's command-name argument that older versions require
_CHECKOUT_ARGS = (
    ()
    if inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is None
    else ("GET",)
)


class Failure(NamedTuple):
    """A key that got no answer: an error reply (`OOM …`, `MOVED …`) or a lost connection."""

    message: str
    connection: bool

    @property
    def moved(self) -> bool:
        """The slot lives on another node now (cluster resharding or failover)."""
        return self.message.startswith(("MOVED ", "ASK "))


# -- requests as socket pieces, replies read in place -------------------------------------------


class _Replies:
    """RESP replies off a socket: lines through a scratch buffer, bulk payloads straight into
    caller buffers (`read_into`). Raises ConnectionError on EOF or a malformed reply."""

    def __init__(self, sock: socket.socket, scratch: bytearray) -> None:
        self._sock, self._buf, self._view = sock, scratch, memoryview(scratch)
        self._start = self._end = 0

    def head(self) -> tuple[bytes, bytes]:
        """The next reply's type byte (`+ - : $ _`) and the rest of its first line."""
        while (eol := self._buf.find(b"\r\n", self._start, self._end)) < 0:
            self._fill()
        line = bytes(self._view[self._start : eol])
        self._start = eol + 2
        if line[:1] not in (b"+", b"-", b":", b"$", b"_"):
            raise redis.ConnectionError(f"unexpected reply {line[:40]!r}")
        return line[:1], line[1:]

    def read_into(self, dst: memoryview) -> None:
        """Fill `dst` with the next bytes: what is buffered, then the rest from the socket."""
        have = min(len(dst), self._end - self._start)
        dst[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < len(dst):
            got = self._sock.recv_into(dst[have:])
            if not got:
                raise redis.ConnectionError("connection closed by the server")
            have += got

    def skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start, n = self._start + take, n - take

    @property
    def drained(self) -> bool:
        return self._start == self._end

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep a partial line, make room after it
            if self._start == 0:
                raise redis.ConnectionError("reply line longer than the read buffer")
            n = self._end - self._start
            self._buf[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise redis.ConnectionError("connection closed by the server")
        self._end += got


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _simple_reply(replies: _Replies) -> bytes | int | Failure | None:
    """A reply without a payload: status text, integer, nil, or the error as a Failure."""
    kind, rest = replies.head()
    if kind == b"-":
        return Failure(rest.decode(errors="replace"), connection=False)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        if int(rest) < 0:
            return None
        value = bytearray(int(rest) + 2)
        replies.read_into(memoryview(value))
        return bytes(value[:-2])
    return rest if kind == b"+" else None


def _send(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """Write every piece in order; large pieces are never joined (gather write)."""
    if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
        for piece in pieces:
            sock.sendall(piece)
        return
    i = 0
    while i < len(pieces):
        sent = sock.sendmsg(pieces[i : i + _IOV_MAX])
        while i < len(pieces) and len(pieces[i]) <= sent:
            sent -= len(pieces[i])
            i += 1
        if sent:
            pieces[i] = memoryview(pieces[i])[sent:]


def _coalesce(pieces: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Join runs of `bytes` (command framing, headers); payload views stay separate."""
    out: list[bytes | memoryview] = []
    run: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes):
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return out


# -- the batched commands ------------------------------------------------------------------------


class BatchCommand(ABC):
    """One batched command: the request pieces of batch item i, and how to read its reply."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys

    def cost(self, i: int) -> int:
        """Bytes item i moves (slicing balances these)."""
        return _KEY_COST

    @abstractmethod
    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        """Append item i's command to `out`."""

    def reply(self, replies: _Replies, i: int) -> object:
        return _simple_reply(replies)


class SetCommand(BatchCommand):
    """SET key <header + payload chunks> [EX ttl]; reply True, False or a Failure."""

    def __init__(
        self,
        keys: Sequence[bytes],
        chunks: Sequence[list[memoryview]],
        num_tokens: Sequence[int],
        fp_digest: bytes,
        ttl_s: int | None,
    ) -> None:
        super().__init__(keys)
        self._chunks, self._num_tokens, self._fp = chunks, num_tokens, fp_digest
        self._sizes = [entry.payload_size(c) for c in chunks]
        self._ex = b"" if ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)

    def cost(self, i: int) -> int:
        return self._sizes[i]

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        key, chunks = self.keys[i], self._chunks[i]
        header = entry.encode_header(self._fp, self._num_tokens[i], chunks)  # one xxh3 pass
        argc = 5 if self._ex else 3
        out.append(
            b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
            % (argc, len(key), key, entry.HEADER_SIZE + self._sizes[i], header)
        )
        out.extend(chunks)
        out.append(b"\r\n" + self._ex)

    def reply(self, replies: _Replies, i: int) -> object:
        value = _simple_reply(replies)
        return value if isinstance(value, Failure) else value == b"OK"


class GetCommand(BatchCommand):
    """GET key, verified against the header. With destinations (`get_many_into`) the payload is
    received into them and the reply is True/False; without, it is the payload bytes or None."""

    def __init__(
        self,
        keys: Sequence[bytes],
        num_tokens: Sequence[int],
        fp_digest: bytes,
        dsts: list[list[memoryview]] | None,
    ) -> None:
        super().__init__(keys)
        self._num_tokens, self._fp, self._dsts = num_tokens, fp_digest, dsts
        self._sizes = None if dsts is None else [entry.payload_size(d) for d in dsts]

    def cost(self, i: int) -> int:
        return _KEY_COST if self._sizes is None else self._sizes[i]

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        out.append(_command(b"GET", self.keys[i]))

    def reply(self, replies: _Replies, i: int) -> object:
        kind, rest = replies.head()
        if kind == b"-":
            return Failure(rest.decode(errors="replace"), connection=False)
        size = int(rest) if kind == b"$" else -1
        if size < 0:  # nil, or a reply no GET gives
            return None if self._dsts is None else False
        if self._dsts is None or self._sizes is None:
            value = bytearray(size + 2)
            replies.read_into(memoryview(value))
            view = entry.parse_and_verify(memoryview(value)[:size], self._fp, self._num_tokens[i])
            return None if view is None else view.tobytes()
        if size != entry.HEADER_SIZE + self._sizes[i]:
            replies.skip(size + 2)
            return False
        header = bytearray(entry.HEADER_SIZE)
        replies.read_into(memoryview(header))
        for chunk in self._dsts[i]:
            replies.read_into(chunk)
        replies.skip(2)
        return entry.verify(header, self._dsts[i], self._fp, self._num_tokens[i])


class KeyCommand(BatchCommand):
    """A one-key command with an integer reply (EXISTS, UNLINK)."""

    def __init__(self, name: bytes, keys: Sequence[bytes]) -> None:
        super().__init__(keys)
        self._name = name

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        out.append(_command(self._name, self.keys[i]))


# -- slices and exchanges ------------------------------------------------------------------------


def split_batch(
    indices: list[int], command: BatchCommand, parts_max: int, min_bytes: int
) -> list[list[int]]:
    """Cut `indices` into at most `parts_max` contiguous runs of about equal cost, none below
    `min_bytes`."""
    costs = [command.cost(i) for i in indices]
    total = sum(costs)
    parts = min(parts_max, len(indices), total // min_bytes)
    if parts <= 1:
        return [indices]
    runs: list[list[int]] = [[]]
    done = 0
    for i, cost in zip(indices, costs):
        if done >= total * len(runs) / parts and runs[-1]:
            runs.append([])
        runs[-1].append(i)
        done += cost
    return runs


def exchange(
    pool: redis.ConnectionPool, command: BatchCommand, indices: list[int], scratch: bytearray
) -> list[object]:
    """The replies of `indices` (in that order) from one pipelined exchange on one connection of
    `pool`; a lost connection fails the rest. `scratch` is the calling thread's own."""
    n = len(indices)
    pieces: list[bytes | memoryview] = []
    for i in indices:
        command.request(i, pieces)
    try:
        conn = pool.get_connection(*_CHECKOUT_ARGS)
    except _CONNECTION_ERRORS as exc:
        return [Failure(str(exc) or type(exc).__name__, connection=True)] * n
    out: list[object] = []
    clean = False
    try:
        sock = _socket_of(conn)
        _send(sock, _coalesce(pieces))
        replies = _Replies(sock, scratch)
        out.extend(command.reply(replies, i) for i in indices)
        clean = replies.drained
    except _CONNECTION_ERRORS as exc:
        out += [Failure(str(exc) or type(exc).__name__, connection=True)] * (n - len(out))
    finally:
        if not clean:  # a half-read exchange leaves the socket out of step: drop it
            conn.disconnect()
        pool.release(conn)
    return out


def _socket_of(conn: object) -> socket.socket:
    """The socket of a checked-out (hence connected) redis-py connection."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise redis.ConnectionError(_NO_SOCKET)
    return sock


_NO_SOCKET = "pooled connection has no socket"


class RawWireUnsupported(RuntimeError):
    """This redis-py does not expose a connection's socket: the raw wire cannot run on it."""


def check_raw_wire(pool: redis.ConnectionPool | None) -> None:
    """Refuse, in one line, a redis-py whose connections do not keep their socket where the
    raw wire reads it (``Connection._sock``, a private attribute): without this check every
    exchange would fail as a lost connection, every load would be a miss and every prompt
    recomputed, silently. Checked on the connection class, then with one round trip when the
    server answers (a server not up yet is not this check's business: the store retries)."""
    version = getattr(redis, "__version__", "?")
    hint = (
        f"redis-py {version} keeps no socket in Connection._sock, which pdserve's raw Redis"
        " wire needs: install a redis-py in the range pyproject.toml names"
    )
    if pool is None:  # a cluster whose slots are not known yet
        return
    if "_sock" not in vars(pool.connection_class()):
        raise RawWireUnsupported(hint)
    replies = exchange(pool, KeyCommand(b"EXISTS", [b"pdkv:probe"]), [0], bytearray(SCRATCH_BYTES))
    if isinstance(replies[0], Failure) and replies[0].message == _NO_SOCKET:
        raise RawWireUnsupported(hint)
