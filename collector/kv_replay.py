"""Fetching missed vLLM KV-event batches back from a pod's replay socket (pod → here → ``KvEventSubscriber``).

Protocol (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): with
``replay_endpoint`` set, vLLM binds a ROUTER socket and keeps its last ``buffer_steps`` (10,000) batches. A
DEALER sends ``[b"", start_seq]`` (8-byte big-endian) and receives ``[b"", topic, seq, payload]`` for every
buffered batch with ``seq >= start_seq``, in seq order, then the end marker ``[b"", b"", seq -1 (8 bytes,
signed), b""]``. vLLM serves replays from its publisher thread between batches (at least every 0.1 s).
With data parallelism each rank has its own publisher; rank ``r`` binds the configured port + ``r``
(``ZmqEventPublisher.offset_endpoint_port``), as :func:`rank_endpoint` computes.

This module also holds the collector's self-metrics about gaps (prometheus_client, default registry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq
from prometheus_client import Counter

from collector.events import DeadLetter, Envelope, KvEventBatch

log = logging.getLogger("kvscope.collector")

GAPS = Counter("kvscope_collector_kv_gaps_total", "Runs of missing KV-event batches (seq gaps) found",
               ["pod", "reason", "outcome"])
BATCHES_LOST = Counter("kvscope_collector_kv_batches_lost_total",
                       "KV-event batches this collector did not receive live and replay did not bring back (after a "
                       "crash between store and checkpoint, also batches a previous run stored; the store's count "
                       "is kv_gaps.lost_batches)", ["pod"])
BATCHES_REPLAYED = Counter("kvscope_collector_kv_batches_replayed_total",
                           "Missing KV-event batches recovered from vLLM's replay socket", ["pod"])
REPLAY_FAILURES = Counter("kvscope_collector_kv_replay_failures_total",
                          "Replay requests that failed (unreachable socket, timeout, bad endpoint)", ["pod"])
CONFLICTS = Counter("kvscope_collector_kv_seq_conflicts_total",
                    "KV-event batches dead-lettered because their seq was already delivered with another batch "
                    "(two vLLM processes on one topic)", ["pod"])
DUPLICATES = Counter("kvscope_collector_kv_duplicates_total",
                     "KV-event batches dropped because their seq was already delivered", ["pod"])
LATE = Counter("kvscope_collector_kv_late_batches_total",
               "KV-event batches delivered after a later seq of their stream (late, not lost: stored; kv_gaps "
               "counts them as stored)", ["pod"])

END_SEQ = -1


class ReplayError(RuntimeError):
    """A replay request got no complete answer: bad endpoint, unreachable socket, or no end marker in time."""


def rank_endpoint(endpoint: str, dp_rank: int | None) -> str:
    """The endpoint (publisher or replay) of data-parallel rank ``dp_rank`` given rank 0's ``endpoint``: for ``tcp://host:port``
    the port + rank (port 0 stays 0), for ``inproc://name`` ``name_dp<rank>`` (as vLLM's
    ``offset_endpoint_port``); rank None or 0 → ``endpoint`` unchanged. Raises ``ValueError`` on a tcp endpoint
    without a numeric port."""
    if not dp_rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + dp_rank}"
    return endpoint


def fetch_replay(endpoint: str, first_seq: int, last_seq: int, timeout_seconds: float,
                 ctx: zmq.Context | None = None) -> list[list[bytes]]:
    """Ask vLLM's replay socket at ``endpoint`` for the batches ``first_seq..last_seq`` (inclusive).

    Returns the multipart messages ``[topic, seq (8 bytes), payload]`` (the live wire format) of the buffered
    batches in that range, in the order vLLM sent them (ascending seq); batches vLLM no longer holds are simply
    absent. Uses a fresh DEALER socket (closed with linger 0, so the rest of a long answer is discarded) and
    stops reading at the end marker or at the first seq past ``last_seq``. Never takes longer than
    ``timeout_seconds`` (wall clock, whole request). Raises :class:`ReplayError` when the endpoint is invalid
    or the answer does not complete in time (vLLM down, wrong port).
    """
    ctx = ctx or zmq.Context.instance()
    deadline = time.monotonic() + max(0.0, timeout_seconds)
    try:
        sock = ctx.socket(zmq.DEALER)
    except zmq.ZMQError as exc:
        raise ReplayError(f"cannot create a DEALER socket: {exc}") from exc
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart([b"", max(0, first_seq).to_bytes(8, "big")], flags=zmq.NOBLOCK)
        out: list[list[bytes]] = []
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms):
                raise ReplayError(f"no complete replay answer from {endpoint} within {timeout_seconds:.1f} s "
                                  f"({len(out)} batches received)")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                continue  # not vLLM's replay format: ignore the message, keep waiting for the end marker
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                return out
            seq = int.from_bytes(frames[2], "big")
            if seq > last_seq:
                return out
            if seq >= first_seq:
                out.append(frames[1:])
    except (zmq.ZMQError, ValueError, OverflowError) as exc:
        raise ReplayError(f"replay from {endpoint} failed: {exc}") from exc
    finally:
        sock.close(linger=0)


class ReplayClient:
    """Replays for many pods: ``endpoints`` maps pod → rank-0 replay endpoint (read at each call, so the caller
    may change it); ``decode`` turns a live-format message into envelopes, the batch first
    (``kv_decode.message_events``).
    Keeps which endpoints are failing, to log one WARNING per outage and to stop asking one that failed: after
    its n-th failure in a row an endpoint is not asked for ``backoff_seconds`` · 2^(n-1) seconds (at most 60),
    so an endpoint that never answers costs one timeout per backoff, not one per gap (each gap would hold the
    subscriber's loop, every pod's live events, for the whole timeout)."""

    def __init__(self, endpoints: dict[str, str], decode: Callable[[list[bytes]], list[Envelope]],
                 ctx: zmq.Context | None = None, backoff_seconds: float = 5.0) -> None:
        self.endpoints = endpoints
        self.decode = decode
        self.ctx = ctx or zmq.Context.instance()
        self.backoff_seconds = backoff_seconds
        self._failing: dict[str, tuple[int, float]] = {}  # url → (failures in a row, monotonic time to ask again)

    def batches(self, pod: str, topic: str, dp_rank: int | None, first: int, last: int,
                deadline: float) -> dict[int, list[Envelope]]:
        """seq → envelopes of the replayed ``KvEventBatch`` (``replayed=True``, first) and the dead letters of its
        bad events, of stream (topic, dp_rank) for ``first..last`` that ``pod``'s replay socket still holds, asked
        until ``deadline`` (``time.monotonic``); for a message of ``topic`` that does not decode (the live one was
        missed), its ``DeadLetter`` envelope alone (the same one the live message would have made).
        {} when the pod has no replay endpoint, or the replay fails or is not asked because the endpoint failed
        before and is backing off (both counted in ``kvscope_collector_kv_replay_failures_total``). Messages of
        another stream are skipped with a WARNING. Never raises for an unreachable, slow or malformed endpoint."""
        base = self.endpoints.get(pod)
        if base is None or last < first:
            return {}
        url = base
        try:
            url = rank_endpoint(base, dp_rank)
            failures, retry_at = self._failing.get(url, (0, 0.0))
            if time.monotonic() < retry_at:
                raise ReplayError(f"backing off after {failures} failed replays")
            answer = fetch_replay(url, first, last, deadline - time.monotonic(), self.ctx)
        except (ReplayError, ValueError) as exc:
            REPLAY_FAILURES.labels(pod).inc()
            if url not in self._failing:
                log.warning("KV-event replay failed; missing batches are lost until it answers. pod=%s "
                            "endpoint=%s error=%s", pod, url, exc)
            if time.monotonic() >= self._failing.get(url, (0, 0.0))[1]:  # asked (not skipped): back off longer
                n = self._failing.get(url, (0, 0.0))[0] + 1
                self._failing[url] = (n, time.monotonic() + min(60.0, self.backoff_seconds * 2 ** min(n - 1, 16)))
            return {}
        if self._failing.pop(url, None) is not None:
            log.info("KV-event replay answers again. pod=%s endpoint=%s", pod, url)
        got: dict[int, list[Envelope]] = {}
        for frames in answer:
            env, *dead_letters = self.decode(frames)
            p = env.payload
            if isinstance(p, KvEventBatch) and p.topic == topic and p.dp_rank == dp_rank:
                got[p.seq] = [msgspec.structs.replace(env, payload=msgspec.structs.replace(p, replayed=True)),
                              *dead_letters]
            elif isinstance(p, DeadLetter) and frames[0].decode("utf-8", "replace") == topic:
                got[int.from_bytes(frames[1], "big")] = [env]  # this stream's, undecodable: its only dead letter
            else:
                log.warning("replayed KV-event message skipped: of another stream (topic %r, expected %r). pod=%s "
                            "endpoint=%s", frames[0][:100], topic, pod, url)
        return got
