"""The gateway's HTTP client to the vLLM pods (gateway → vLLM pod): aiohttp's `ClientSession` over one
`TCPConnector` keep-alive pool, with the gateway's errors and timeouts.

aiohttp does the HTTP/1.1 work (Content-Length, chunked and until-close bodies, 1xx responses, keep-alive,
dropping a pooled connection the pod has closed or that idled longer than `keepalive_seconds`). This
module adds only what the proxy needs on top: its three error types, a bound on the wait for the response
head, and one more attempt of a POST that the pod closed the connection on without a response byte (the
race aiohttp's idle checks cannot see: the pod closes a kept-alive connection just as the request goes
out). aiohttp retries only idempotent methods (RFC 9112 §9.3.1); a completion request changes nothing on
the pod but its cache, so sending it again costs at most a second prefill.

The session sends no cookies, follows no redirects, does not decompress (the proxy asks for identity)
and adds no User-Agent, Accept or Content-Type of its own: the pod sees the client's headers.

Errors: `UpstreamConnectError` (nothing reached the pod: refused, unreachable, connect timeout; safe to
try another pod), `UpstreamTimeout` (no response head within the read timeout, or no body byte within it
between two reads), `UpstreamError` (any other failure: reset, closed before the end, malformed response).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import aiohttp
from yarl import URL


class UpstreamError(Exception):
    """A request to a pod failed (the gateway answers 502)."""


class UpstreamConnectError(UpstreamError):
    """No connection to the pod: nothing was sent, so another pod may be tried."""


class UpstreamTimeout(UpstreamError):
    """The pod sent nothing within the read timeout (the gateway answers 504)."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `connect`: to open a connection. `read`: for the response head once the request is sent,
    then between two reads of the body (vLLM answers a non-streaming request only when its generation is
    done, so it is long). aiohttp has no write timeout: sending the request counts against a bound of
    `connect + read` on the whole wait for the response head."""

    connect: float = 5.0
    read: float = 600.0


def pod_url(base_url: str, path: str) -> URL:
    """`base_url` ("http://host:port/v1") joined with `path` ("/chat/completions"), parsed once so that
    requests do not parse it again. Raises ValueError unless it is an http(s) URL with a host."""
    url = URL(base_url.rstrip("/") + path)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    return url


def _mapped(exc: BaseException, timeouts: Timeouts) -> UpstreamError:
    """The gateway's error for an aiohttp (or asyncio timeout) failure."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return UpstreamConnectError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, TimeoutError):  # aiohttp's SocketTimeoutError or our bound on the response head
        return UpstreamTimeout(f"no data within {timeouts.read:g} s")
    return UpstreamError(f"{type(exc).__name__}: {exc}")


# the connection failed before any response byte (ClientConnectorError, also a ClientOSError, is excluded)
_CLOSED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError)
# what aiohttp itself retries once in that case (RFC 9110 §9.2.2 idempotent methods)
_RETRIED_BY_AIOHTTP = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class UpstreamResponse:
    """A pod's response: `status_code`, `headers` (case-insensitive mapping), then the body by `aread()` or
    `aiter_bytes()` (transfer framing removed, content encoding kept). Reading raises `UpstreamError` /
    `UpstreamTimeout`. `close()` (synchronous, idempotent) hands the connection back to the pool when the
    body was read to its end, else closes it (vLLM then aborts the generation when it notices; not at once)."""

    __slots__ = ("_response", "_timeouts", "headers", "status_code")

    def __init__(self, response: aiohttp.ClientResponse, timeouts: Timeouts) -> None:
        self._response = response
        self._timeouts = timeouts
        self.status_code = response.status
        self.headers = response.headers

    async def aread(self) -> bytes:
        """The whole body."""
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _mapped(exc, self._timeouts) from exc

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces as they arrive (whatever is buffered; no piece is empty)."""
        content = self._response.content
        while True:
            try:
                data = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _mapped(exc, self._timeouts) from exc
            if not data:
                return
            yield data

    def close(self) -> None:
        self._response.release()  # closes the connection unless the body was read to its end

    async def aclose(self) -> None:
        self.close()


class UpstreamClient:
    """One aiohttp session and connection pool for all pods. Create it inside the running event loop
    (`Gateway.start`), `aclose()` it on shutdown.

    No limit on connections (the router limits requests per pod); idle connections are reused first in,
    first out and closed after `keepalive_seconds` (below uvicorn's 5 s keep-alive timeout, which vLLM
    uses, so the pod rarely closes a connection the gateway is about to reuse)."""

    def __init__(self, timeouts: Timeouts = Timeouts(), *, keepalive_seconds: float = 4.0) -> None:
        self.timeouts = timeouts
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_seconds),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeouts.connect, sock_read=timeouts.read),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Content-Type"),
        )

    async def request(
        self, method: str, url: URL | str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send one request (`body` with its Content-Length) and read the response head. When the pod
        closes the connection before a response byte, the request is sent once more (by aiohttp for GET)."""
        headers = list(headers)
        retry = method not in _RETRIED_BY_AIOHTTP
        while True:
            try:
                async with asyncio.timeout(self.timeouts.connect + self.timeouts.read):
                    response = await self._session.request(
                        method, url, headers=headers, data=body or None, allow_redirects=False
                    )
                return UpstreamResponse(response, self.timeouts)
            except _CLOSED as exc:
                if retry and not isinstance(exc, aiohttp.ClientConnectorError):
                    retry = False
                    continue
                raise _mapped(exc, self.timeouts) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _mapped(exc, self.timeouts) from exc

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called."""
        return self._session.closed

    async def aclose(self) -> None:
        """Close the session: idle connections and any still in use."""
        await self._session.close()
