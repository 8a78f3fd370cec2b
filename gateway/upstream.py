"""The gateway's HTTP/1.1 client to the vLLM pods: a keep-alive connection pool on asyncio streams
(gateway → vLLM pod).

httpx was the gateway's ceiling: its connection pool scans every connection for every queued request
(httpcore 1.0.9 `_assign_requests_to_connections`, with a `poll(2)` per idle connection), ~700 requests/s
at 16 concurrent requests on this repo's 2-core box, and ~0.3 ms of CPU per request even on one
connection. This client does what the gateway needs and no more: one request per connection at a time,
`Content-Length` request bodies, responses framed by `Content-Length`, `chunked` (vLLM's streams) or the
connection's end; no redirects, cookies, proxies or decompression (the gateway asks for identity).

Errors: `UpstreamConnectError` (nothing reached the pod: refused, unreachable, connect timeout; safe to
try another pod), `UpstreamTimeout` (no byte within the read or write timeout), `UpstreamError` (any
other failure: reset, malformed response). A pooled connection that turns out closed before a single
response byte arrived is retried once on a new connection (the pod closed it while idle, e.g. uvicorn's
5 s keep-alive timeout); idle connections older than `idle_seconds` are not reused.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

_READ_CHUNK = 1 << 16
_HEAD_LIMIT = 1 << 16  # bytes of status line + headers


class UpstreamError(Exception):
    """A request to a pod failed (the gateway answers 502)."""


class UpstreamConnectError(UpstreamError):
    """No connection to the pod: nothing was sent, so another pod may be tried."""


class UpstreamTimeout(UpstreamError):
    """The pod sent nothing within the read timeout, or took nothing within the write timeout (504)."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds: to connect, between two reads of a response, for a request's bytes to be taken."""

    connect: float = 5.0
    read: float = 600.0
    write: float = 60.0


@dataclass(frozen=True)
class Origin:
    """Where a base URL points: scheme, host, port and path prefix (no trailing slash)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, idle_seconds: float) -> bool:
        return (
            not self.reader.at_eof()
            and not self.writer.transport.is_closing()
            and now - self.idle_since < idle_seconds
        )

    def close(self) -> None:
        self.writer.transport.close()


class UpstreamResponse:
    """A pod's response: `status_code`, `headers` (lowercase names), then the body by `aread()` or
    `aiter_bytes()` (chunked framing removed). `close()` (synchronous, idempotent) hands the connection back
    to the pool when the body was read to its end, else closes it (vLLM then aborts the generation)."""

    def __init__(
        self, pool: UpstreamPool, key: Origin, conn: _Connection, status: int, headers: dict[str, str],
        keep_alive: bool, timeouts: Timeouts,
    ) -> None:
        self.status_code = status
        self.headers = headers
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self._timeouts = timeouts
        self._complete = False
        self._keep_alive = keep_alive
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._remaining: int | None = None
        if not self._chunked and length is not None:
            try:
                self._remaining = int(length)
            except ValueError as exc:
                raise UpstreamError(f"bad content-length {length!r}") from exc
            if self._remaining < 0:
                raise UpstreamError(f"bad content-length {length!r}")
        elif not self._chunked:
            self._keep_alive = False  # body ends with the connection
        if self._remaining == 0:
            self._complete = True

    async def aread(self) -> bytes:
        """The whole body."""
        if self._remaining is not None and not self._chunked:
            if self._remaining == 0:
                self._complete = True
                return b""
            data = await self._read(self._readexactly(self._remaining))
            self._remaining = 0
            self._complete = True
            return data
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces as they arrive."""
        conn = self._conn
        if conn is None or self._complete:
            return
        reader = conn.reader
        if self._chunked:
            while True:
                line = await self._read(reader.readuntil(b"\r\n"))
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError as exc:
                    raise UpstreamError(f"bad chunk size line {line[:40]!r}") from exc
                if size == 0:
                    while (await self._read(reader.readuntil(b"\r\n"))) != b"\r\n":  # trailers
                        pass
                    self._complete = True
                    return
                data = await self._read(self._readexactly(size + 2))
                yield data[:-2]
        elif self._remaining is not None:
            while self._remaining > 0:
                data = await self._read(reader.read(min(self._remaining, _READ_CHUNK)))
                if not data:
                    raise UpstreamError("the pod closed the connection before the body's end")
                self._remaining -= len(data)
                yield data
            self._complete = True
        else:
            while True:
                data = await self._read(reader.read(_READ_CHUNK))
                if not data:
                    self._complete = True
                    return
                yield data

    def _readexactly(self, n: int):
        assert self._conn is not None
        return self._conn.reader.readexactly(n)

    async def _read(self, awaitable) -> bytes:
        try:
            async with asyncio.timeout(self._timeouts.read):
                return await awaitable
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no data within {self._timeouts.read:g} s") from exc
        except asyncio.IncompleteReadError as exc:
            raise UpstreamError("the pod closed the connection before the body's end") from exc
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self._keep_alive:
            self._pool._release(self._key, conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self.close()


class UpstreamPool:
    """Keep-alive connections per origin, reused last-in first-out; at most `max_idle_per_origin` idle
    ones are kept. No limit on connections in use (the router limits requests per pod)."""

    def __init__(
        self, timeouts: Timeouts = Timeouts(), *, max_idle_per_origin: int = 64, idle_seconds: float = 4.0
    ) -> None:
        self.timeouts = timeouts
        self.max_idle_per_origin = max_idle_per_origin
        self.idle_seconds = idle_seconds
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(
        self, method: str, origin: Origin, path: str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send one request to `origin` (`path` appended to its prefix) and read the response head."""
        head = [f"{method} {origin.prefix}{path} HTTP/1.1\r\nhost: {origin.host_header}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers]
        if body or method not in ("GET", "HEAD"):
            head.append(f"content-length: {len(body)}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        conn, reused = self._checkout(origin)
        while True:
            if conn is None:
                conn = await self._connect(origin)
            try:
                status, headers_out, keep_alive = await self._exchange(conn, data, reused)
                return UpstreamResponse(self, origin, conn, status, headers_out, keep_alive, self.timeouts)
            except _StaleConnection:
                conn.close()
                conn, reused = None, False  # the pod closed it while idle: once more on a new connection
            except BaseException:
                conn.close()
                raise

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when their response is closed."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    def _checkout(self, origin: Origin) -> tuple[_Connection | None, bool]:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.idle_seconds):
                return conn, True
            conn.close()
        return None, False

    def _release(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, deque())
        if self._closed or len(idle) >= self.max_idle_per_origin or conn.reader._buffer:  # type: ignore[attr-defined]
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, origin: Origin) -> _Connection:
        context = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.timeouts.connect):
                reader, writer = await asyncio.open_connection(
                    origin.host, origin.port, ssl=context, limit=_HEAD_LIMIT
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect timeout after {self.timeouts.connect:g} s") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"{type(exc).__name__}: {exc}") from exc
        return _Connection(reader, writer)

    async def _exchange(self, conn: _Connection, data: bytes, reused: bool) -> tuple[int, dict[str, str], bool]:
        writer, reader = conn.writer, conn.reader
        try:
            writer.write(data)
            if writer.transport.get_write_buffer_size():
                async with asyncio.timeout(self.timeouts.write):
                    await writer.drain()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"request not sent within {self.timeouts.write:g} s") from exc
        except OSError as exc:
            if reused:
                raise _StaleConnection from exc
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        while True:
            try:
                async with asyncio.timeout(self.timeouts.read):
                    raw = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError as exc:
                raise UpstreamTimeout(f"no response within {self.timeouts.read:g} s") from exc
            except asyncio.IncompleteReadError as exc:
                if reused and not exc.partial:
                    raise _StaleConnection from exc
                raise UpstreamError("the pod closed the connection without a response") from exc
            except ConnectionError as exc:
                if reused:
                    raise _StaleConnection from exc
                raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
            except (OSError, asyncio.LimitOverrunError) as exc:
                raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
            status, headers, version = _parse_head(raw)
            if 100 <= status < 200:  # interim response (e.g. 100 Continue): the real one follows
                continue
            connection = headers.get("connection", "").lower()
            keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
            return status, headers, keep_alive


class _StaleConnection(Exception):
    """A reused connection failed before any response byte."""


def _parse_head(raw: bytes) -> tuple[int, dict[str, str], str]:
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    try:
        status = int(rest[:3])
    except ValueError as exc:
        raise UpstreamError(f"bad status line {lines[0][:80]!r}") from exc
    if not version.startswith("HTTP/1."):
        raise UpstreamError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamError(f"bad header line {line[:80]!r}")
        name = name.strip().lower()
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return status, headers, version
