"""Precise mode's helper process: the gateway hands each answered request's chain work (the pod's /tokenize call
and the block hashing, ``gateway.block_chain.BlockChainer``) to one child process, so that it costs the gateway's
own core only a message each way (gateway → child over a socket pair → vLLM pod's /tokenize and /metrics).

Messages are MessagePack, each after its length (4 bytes, big-endian): request ``[seq, pod, body, endpoint,
prompt_tokens]``, answer ``[seq, hashes, block_size, reason]`` (reason '' = a chain). The child is started with the
gateway (``python -m gateway.chain_worker FD CONFIG_JSON``), answers in any order, and exits when the socket
closes, after finishing what it holds (at most 15 s). If it cannot start or dies, :class:`RemoteChainer` computes
chains in the gateway process instead (and logs why), so a line is never lost and never waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from gateway.block_chain import TIMEOUT_SECONDS, BlockChainer, count
from gateway.upstream import Timeouts, UpstreamClient

log = logging.getLogger("kvscope.gateway.chain_worker")

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
DRAIN_SECONDS = 15.0
"""How long the child finishes the chains it holds once the gateway closed the socket."""


def _frame(obj: Any) -> bytes:
    data = _encode(obj)
    return len(data).to_bytes(4, "big") + data


async def _frames(reader: asyncio.StreamReader) -> AsyncIterator[Any]:
    """Decoded messages until the other end closes (a cut message ends it too)."""
    while True:
        try:
            head = await reader.readexactly(4)
            data = await reader.readexactly(int.from_bytes(head, "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        yield _decode(data)


class RemoteChainer:
    """``BlockChainer``'s interface for the proxy (``enabled``, ``mode``, ``wanted``, ``chain``, ``aclose``), with
    the work done in the helper process. Arguments as :class:`gateway.block_chain.BlockChainer` (ValueError the
    same way). Use from one event loop."""

    def __init__(self, pods: Mapping[str, str], mode: str = "auto", block_size: int = 0) -> None:
        self.local = BlockChainer(pods, mode, block_size)  # validates; and the fallback
        self._config = json.dumps({"pods": dict(pods), "mode": mode, "block_size": block_size})
        self._seq = itertools.count()
        self._waiting: dict[int, asyncio.Future[tuple[list[str], int, str]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._starting: asyncio.Lock | None = None
        self._broken = False

    @property
    def enabled(self) -> bool:
        return self.local.enabled

    @property
    def mode(self) -> str:
        return self.local.mode

    def wanted(self, pod: str, status: int) -> bool:
        return self.local.wanted(pod, status)

    async def chain(self, client: UpstreamClient, pod: str, body: Mapping[str, Any], endpoint: str,
                    prompt_tokens: int | None) -> tuple[list[str], int]:
        """As :meth:`BlockChainer.chain`, computed by the helper process when it runs."""
        if not await self._started():
            return await self.local.chain(client, pod, body, endpoint, prompt_tokens)
        seq = next(self._seq)
        try:
            message = _frame([seq, pod, body, endpoint, prompt_tokens])
        except (TypeError, OverflowError, msgspec.EncodeError):  # e.g. an integer beyond 64 bits in the body
            return count([], 0, "unsupported_body")
        return count(*await self._send(seq, message))

    async def _send(self, seq: int, message: bytes) -> tuple[list[str], int, str]:
        future = asyncio.get_running_loop().create_future()
        self._waiting[seq] = future
        assert self._writer is not None
        self._writer.write(message)
        try:
            return await future
        finally:
            self._waiting.pop(seq, None)

    async def start(self) -> None:
        """Start the helper now (it imports while the gateway starts), unless chains are off."""
        if self.enabled:
            await self._started()

    async def _started(self) -> bool:
        if self._broken:
            return False
        if self._writer is not None:
            return True
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._writer is None and not self._broken:
                try:
                    await self._start()
                except (OSError, subprocess.SubprocessError):
                    log.exception("block chain helper process did not start; chains computed in the gateway")
                    self._broken = True
        return self._writer is not None

    async def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.chain_worker", str(theirs.fileno()), self._config],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        async for seq, hashes, size, reason in _frames(reader):
            future = self._waiting.get(seq)
            if future is not None and not future.done():
                future.set_result((hashes, size, reason))
        # the helper is gone: later chains are computed here; the ones it held are lost
        if not self._broken:
            log.error("block chain helper process ended; chains computed in the gateway from now on")
        self._broken = True
        for future in self._waiting.values():
            if not future.done():
                future.set_result(([], 0, "tokenize_failed"))

    async def aclose(self) -> None:
        """Close the socket, let the helper finish and exit (killed after DRAIN_SECONDS + 5 s)."""
        self._broken = True
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            try:
                await asyncio.wait_for(self._reading, DRAIN_SECONDS + 5)
            except TimeoutError:
                pass
        if self._proc is not None and not await _exited(self._proc, 5.0):
            self._proc.kill()
            await _exited(self._proc, 30.0)


async def _exited(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    """Whether ``proc`` exits within ``seconds`` (polled every 50 ms on the loop, reaped). Not a thread: the
    gateway's shutdown may run once the interpreter is stopping, when the loop's executor takes no more work
    (``RuntimeError: cannot schedule new futures after interpreter shutdown``)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while proc.poll() is None:
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _serve(fd: int, config: Mapping[str, Any]) -> None:
    """The helper's loop: read requests, compute each chain as a task, write answers; drain at EOF."""
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    chainer = BlockChainer(config["pods"], config["mode"], config["block_size"])
    client = UpstreamClient(Timeouts(connect=5.0, read=TIMEOUT_SECONDS))
    tasks: set[asyncio.Task[None]] = set()

    async def one(seq: int, pod: str, body: dict[str, Any], endpoint: str, prompt_tokens: int | None) -> None:
        hashes, size, reason = await chainer.compute(client, pod, body, endpoint, prompt_tokens)
        writer.write(_frame([seq, hashes, size, reason]))

    async for seq, pod, body, endpoint, prompt_tokens in _frames(reader):
        task = asyncio.get_running_loop().create_task(one(seq, pod, body, endpoint, prompt_tokens))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(set(tasks), timeout=DRAIN_SECONDS)
    await client.aclose()
    writer.close()


def main(argv: list[str]) -> None:
    """``python -m gateway.chain_worker FD CONFIG_JSON`` (started by :class:`RemoteChainer`). Ignores SIGINT: a
    Ctrl-C reaches the whole foreground process group, and the gateway owns this helper's lifetime (it closes
    the socket at shutdown, the helper drains and exits; the socket's end-of-file also ends it if the gateway
    dies), so the helper neither dies with a traceback first nor loses the chains it holds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(int(argv[0]), json.loads(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
