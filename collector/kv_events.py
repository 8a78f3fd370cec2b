"""Source: vLLM KV-cache events over ZMQ (``--kv-events-config`` publisher "zmq") → ``KvEventBatch`` events.

Messages are decoded by ``collector/kv_decode.py`` (the wire format; bad input costs only itself). When the
pod's endpoint has a concrete host, vLLM *connects* to it, so the collector *binds* one SUB socket (one port per
data-parallel rank) that every pod publishes to; the topic names the pod (the demo sets topic = pod name, and
``topic_pods`` maps other topics).

Gaps: ``seq`` counts batches per publisher (one per pod and data-parallel rank, from 0 at each vLLM start), so
:class:`KvEventSubscriber` tracks each stream (topic, dp_rank). A seq past the last one + 1 is a gap
(``missed``; ``collector_restart`` for the first batch after a start, compared with the checkpoint); a seq at
or below the last one is a duplicate when its batch is not newer (batch_ts) and its seq was delivered with that
batch_ts, a dead letter when that seq was delivered with another batch or when the batch is newer by less than
:data:`MIN_RESTART_SECONDS` (two vLLM processes on one topic), else a restarted vLLM (``publisher_restart``, a gap
when its first seq seen is not 0). Gaps are fetched back from the pod's replay
socket (``collector/kv_replay.py``) and reported as ``KvEventGap`` events either way.

Token ids: each delivered batch's ``BlockStored`` token ids are turned into kvscope chain hashes and a token
count (``collector/kv_chains.py``) in delivery order (replayed batches before the batch that revealed the gap),
so the ids themselves are not published; neither are the events' ``extra_keys`` (a ``cache_salt`` can be a secret).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, KvEventBatch, KvEventGap, envelope
from collector.kv_chains import BlockChains, without_extra_keys
from collector.kv_decode import message_events
from collector.kv_replay import (
    BATCHES_LOST,
    BATCHES_REPLAYED,
    CONFLICTS,
    DUPLICATES,
    GAPS,
    LATE,
    ReplayClient,
    rank_endpoint,
)

log = logging.getLogger("kvscope.collector")

MIN_RESTART_SECONDS = 2.0
"""A seq that goes back is a vLLM restart only when its batch is at least this much newer than the stream's last
one: a restart loads the model before the scheduler creates its publisher (``vllm/v1/core/sched/scheduler.py``),
which takes longer. Sooner, two vLLM processes publish on one topic, and the batch is dead-lettered."""

RECENT_SEQS = 1024
"""Seqs per stream whose batch_ts the subscriber keeps, to tell a duplicate from another batch under that seq."""
RECENT_GAPS = 64
"""Gaps per stream the subscriber keeps, to tell a late batch (its seq in one) from another process's batch."""

def checkpoint_key(topic: str, dp_rank: int | None) -> str:
    """CheckpointStore key of one KV-event stream: ``kv_events:<topic>:<dp_rank>`` (dp_rank None → empty)."""
    return f"kv_events:{topic}:{'' if dp_rank is None else dp_rank}"


@dataclass
class _Stream:
    """Where one stream (topic, dp_rank) is: last ``seq`` delivered and its ``batch_ts`` (None when restored from
    a checkpoint without one); ``restored`` = the state came from the checkpoint, no batch seen since."""

    seq: int
    batch_ts: float | None
    restored: bool = False


def _remember(delivered: dict[int, float], batches: list[KvEventBatch]) -> None:
    """Record ``batches`` as delivered (seq → batch_ts, latest last), keeping a stream's last :data:`RECENT_SEQS`."""
    for b in batches:
        delivered.pop(b.seq, None)
        delivered[b.seq] = b.batch_ts
    while len(delivered) > RECENT_SEQS:
        del delivered[next(iter(delivered))]


class KvEventSubscriber:
    """A SUB socket bound at ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``) receiving from every pod, tracking each
    stream's sequence numbers and fetching what it missed from vLLM's replay socket (``collector/kv_replay.py``).

    A stream is one vLLM publisher: (topic, dp_rank). ``topic_pods`` maps topics to pod names (default: the topic
    is the pod). ``replay_endpoints`` maps pod name → the replay endpoint of its dp rank 0 (rank r: port + r);
    pods without one have their gaps reported as lost. ``checkpoints``: where :meth:`poll`'s ack stores each
    stream's last delivered position (``{"seq": int, "batch_ts": float}``, key :func:`checkpoint_key`); a new
    subscriber compares each stream's first batch with it. ``replay_timeout_seconds`` bounds the time spent per
    gap; a replay endpoint that failed is not asked again for ``replay_backoff_seconds``, doubling per failure in
    a row up to 60 s (:class:`collector.kv_replay.ReplayClient`): its gaps meanwhile are lost at once.
    ``dp_ranks``: data-parallel ranks per pod; vLLM offsets a rank's endpoint by its rank even when it connects
    (``ZmqEventPublisher.offset_endpoint_port``), so the socket binds ``endpoint`` and the next ``dp_ranks - 1``
    ports (:func:`collector.kv_replay.rank_endpoint`). Raises ``zmq.ZMQError`` when one cannot be bound (e.g.
    already bound by another socket).
    """

    def __init__(self, endpoint: str, topic_pods: dict[str, str] | None = None, max_messages: int = 1000,
                 *, checkpoints: CheckpointStore | None = None, replay_endpoints: dict[str, str] | None = None,
                 replay_timeout_seconds: float = 2.0, replay_backoff_seconds: float = 5.0,
                 dp_ranks: int = 1) -> None:
        self.endpoint = endpoint
        self.topic_pods = topic_pods or {}
        self.max_messages = max_messages
        self.checkpoints = checkpoints
        self.replay_endpoints = dict(replay_endpoints or {})
        self.replay_timeout_seconds = replay_timeout_seconds
        self.dropped: list[list[bytes]] = []  # frames discarded by the drop_next test hook
        self._drop_left = 0
        self._drop_topic: bytes | None = None
        self._streams: dict[tuple[str, int | None], _Stream] = {}
        self._delivered: dict[tuple[str, int | None], dict[int, float]] = {}  # stream → seq → batch_ts, recent
        #: stream → the seq ranges (first, last) its gaps reported, the latest :data:`RECENT_GAPS`: where a late batch
        #: may come from
        self._missing: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
        self._polls = 0
        self._acked: dict[tuple[str, int | None], int] = {}  # stream → number of the last poll acked
        self._ack_lock = threading.Lock()
        self._replay = ReplayClient(self.replay_endpoints, lambda frames: message_events(frames, self.topic_pods),
                                    backoff_seconds=replay_backoff_seconds)
        self.chains = BlockChains()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            for rank in range(dp_ranks):  # vLLM's rank r connects to (or binds) the configured port + r
                self._sock.bind(rank_endpoint(endpoint, rank))
        except (zmq.ZMQError, ValueError):
            self._sock.close(linger=0)
            raise

    def drop_next(self, n: int, topic: str | None = None) -> None:
        """TEST HOOK (never used by the collector): discard the next ``n`` messages received, only those of
        ``topic`` when given, as if the network had lost them; their frames go to :attr:`dropped`."""
        self._drop_left = n
        self._drop_topic = None if topic is None else topic.encode()

    def poll(self, timeout_ms: int = 200) -> tuple[list[Envelope], Callable[[], None] | None]:
        """Wait up to ``timeout_ms`` for messages, then take up to ``max_messages`` waiting ones.

        Returns (envelopes, ack). Envelopes in arrival order: ``KvEventBatch`` (duplicates left out), each
        followed by a ``DeadLetter`` per event of it that did not decode (:func:`message_events`), a
        ``DeadLetter`` for an undecodable message, and before a batch that reveals a gap the ``KvEventGap`` and
        the replayed batches (``replayed=True``, ascending seq, with their dead letters); BlockStored events
        carry ``token_count`` and ``chain_hashes`` instead of their token ids (:attr:`chains`). ``ack()``
        (thread safe, call it once the envelopes are durable downstream) checkpoints each stream delivered
        here; None when there is nothing to ack. Bad input and replay failures never raise (they become dead
        letters and lost gaps).
        """
        out: list[Envelope] = []
        touched: set[tuple[str, int | None]] = set()
        if self._sock.poll(timeout_ms):
            for _ in range(self.max_messages):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if self._drop_left > 0 and (self._drop_topic is None or frames[:1] == [self._drop_topic]):
                    self._drop_left -= 1
                    self.dropped.append(frames)
                    continue
                envs = message_events(frames, self.topic_pods)
                try:
                    admitted = self._admit(envs, touched, frames)
                except Exception:  # a bug in gap tracking must not lose the batch or stop the loop
                    log.exception("KV-event gap tracking failed; batch delivered as is. pod=%s", envs[0].pod)
                    admitted = envs
                out.extend(self._hashed(admitted))
        return out, self._ack_for(touched)

    def _hashed(self, envs: list[Envelope]) -> list[Envelope]:
        """``envs`` with BlockStored token ids turned into chain hashes; a failure leaves an envelope as is
        (its token ids are then published and counted by the ingester, its chain hashes unknown)."""
        out = []
        for env in envs:
            try:
                out.append(self.chains.envelope(env))
            except Exception:  # noqa: BLE001 - hashing must never cost the batch
                log.exception("KV-event chain hashing failed; batch delivered with its token ids. pod=%s", env.pod)
                out.append(without_extra_keys(env))
        return out

    def close(self) -> None:
        self._sock.close(linger=0)

    def _admit(self, envs: list[Envelope], touched: set[tuple[str, int | None]],
               frames: list[bytes]) -> list[Envelope]:
        """The envelopes one received message (``frames``) yields (``envs``: :func:`message_events`' answer): []
        for a duplicate batch, [gap, replayed..., *envs] after a gap, one dead letter for a batch under a seq
        that the stream delivered with another batch among its last :data:`RECENT_SEQS` (a duplicate is the
        same batch: vLLM re-sends only through replay, the same bytes), else ``envs``: also for a *late* batch, an
        older seq (and ts) the stream never delivered, inside a gap the stream reported (one of its last
        :data:`RECENT_GAPS`; a reordering proxy, a replay that came in after the gap was declared lost): stored,
        counted in ``kvscope_collector_kv_late_batches_total``; the stream's position stays at its latest batch."""
        env = envs[0]
        b = env.payload
        if not isinstance(b, KvEventBatch):
            return envs
        key = (b.topic, b.dp_rank)
        st = self._streams.get(key) or self._restore(key)
        out: list[Envelope] = []
        if st is None or b.seq == st.seq + 1:
            pass
        elif b.seq > st.seq + 1:
            self._gap(key, st.seq + 1, b.seq - 1)
            out = self._recover(env.pod, b, st.seq + 1, "collector_restart" if st.restored else "missed",
                                st if st.batch_ts is not None else None, st.batch_ts)
        elif st.batch_ts is not None and b.batch_ts <= st.batch_ts:  # an older batch of the same publisher
            delivered = self._delivered.setdefault(key, {})
            delivered_ts = delivered.get(b.seq)
            if delivered_ts is None and any(lo <= b.seq <= hi for lo, hi in self._missing.get(key, ())):
                # never delivered, in a gap the stream reported: late (a later seq came first). Stored: kv_gaps
                # counts it against the store. (A never-delivered seq outside the gaps stays a duplicate: another
                # process on the topic, or a batch from before the stream was followed.)
                LATE.labels(env.pod).inc()
                _remember(delivered, [b])
                return envs
            if delivered_ts is not None and delivered_ts != b.batch_ts:
                return [self._conflict(env, frames, f"seq {b.seq} was already delivered with another batch (ts "
                                                    f"{delivered_ts}, this one {b.batch_ts})")]
            DUPLICATES.labels(env.pod).inc()
            return []
        elif st.batch_ts is not None and b.batch_ts - st.batch_ts < MIN_RESTART_SECONDS:  # too soon for a restart
            return [self._conflict(env, frames, f"seq went back from {st.seq} to {b.seq} "
                                                f"{b.batch_ts - st.batch_ts:.3f} s after the stream's last batch")]
        else:  # seq went back and the batch is newer: vLLM restarted (and we missed its first batches if seq > 0)
            self._delivered.pop(key, None)
            self._missing.pop(key, None)
            if b.seq > 0:
                self._gap(key, 0, b.seq - 1)
                out = self._recover(env.pod, b, 0, "publisher_restart", None, st.batch_ts)
        self._streams[key] = _Stream(b.seq, b.batch_ts)
        touched.add(key)
        out.extend(envs)
        _remember(self._delivered.setdefault(key, {}), [e.payload for e in out if isinstance(e.payload, KvEventBatch)])
        return out

    def _gap(self, key: tuple[str, int | None], first: int, last: int) -> None:
        """Note that stream ``key`` reported seqs ``first..last`` missing (the latest :data:`RECENT_GAPS` kept)."""
        gaps = self._missing.setdefault(key, [])
        gaps.append((first, last))
        del gaps[:-RECENT_GAPS]

    def _conflict(self, env: Envelope, frames: list[bytes], what: str) -> Envelope:
        """The dead letter of a batch that cannot be the stream's next (``what`` says why): under a seq the stream
        already delivered with another batch, or a seq that went back too soon for a vLLM restart."""
        b = env.payload
        assert isinstance(b, KvEventBatch)
        CONFLICTS.labels(env.pod).inc()
        log.warning("KV-event batch that cannot follow its stream; dead-lettered. pod=%s topic=%s dp_rank=%s seq=%d "
                    "why=%s", env.pod, b.topic, b.dp_rank, b.seq, what)
        reason = (f"{what}: two vLLM processes publish on topic {b.topic[:100]!r} (each needs its own), or one "
                  f"restarted with its clock behind; not read")
        dl = DeadLetter(source="kv_events", reason=reason, raw=base64.b64encode(b"".join(frames))[:65536].decode(),
                        location=f"zmq:{b.topic}:{env.engine}:seq {b.seq}")
        return envelope(dl, pod=env.pod, natural_key=(b.topic, b.dp_rank, b.seq, b.batch_ts, "conflict"),
                        observed_at_ms=env.observed_at_ms, engine=env.engine)

    def _restore(self, key: tuple[str, int | None]) -> _Stream | None:
        value = self.checkpoints.get(checkpoint_key(*key)) if self.checkpoints is not None else None
        if isinstance(value, dict):
            ts = value.get("batch_ts")
            ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
            value = value.get("seq")
        else:
            ts = None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return _Stream(value, ts, restored=True)
        return None

    def _recover(self, pod: str, b: KvEventBatch, first: int, reason: str, verify: _Stream | None,
                 prev_batch_ts: float | None) -> list[Envelope]:
        """Replay ``first..b.seq-1`` of ``b``'s stream; → [KvEventGap envelope, replayed batches (each followed by
        the dead letters of its bad events) and the dead letter of each replayed message that does not decode,
        in seq order...]. Only decoded batches count as replayed.

        ``verify`` (the stream's last position, with its batch_ts): also fetch the last delivered batch; if vLLM
        now holds a different batch under that seq, vLLM restarted unseen (e.g. while the collector was down) and
        its seq already passed ours, so the gap is the new publisher's [0, b.seq-1] (``publisher_restart``).
        ``prev_batch_ts``: the ts of the stream's last delivered batch (None: unknown), reported with ``b.batch_ts``
        so that readers can tell which missing batches the store holds anyway (a previous run stored them and
        died before its checkpoint; ``kv_gaps``, sql/migrations/0030): this collector cannot know, so its
        metrics count what it did not receive and could not replay.
        Replay takes at most ``replay_timeout_seconds`` in all; failures leave the gap lost, never raise."""
        now_ms = int(time.time() * 1000)
        deadline = time.monotonic() + self.replay_timeout_seconds
        last = b.seq - 1
        got = self._replay.batches(pod, b.topic, b.dp_rank, first - 1 if verify else first, last, deadline)
        previous = got.get(first - 1, [None])[0]
        if verify is not None and previous is not None and (not isinstance(previous.payload, KvEventBatch)
                                                            or previous.payload.batch_ts != verify.batch_ts):
            reason, first = "publisher_restart", 0
            got = self._replay.batches(pod, b.topic, b.dp_rank, 0, last, deadline)
        seqs = [s for s in sorted(got) if s >= first]
        missing, n = last - first + 1, sum(isinstance(got[s][0].payload, KvEventBatch) for s in seqs)
        outcome = "recovered" if n == missing else "partial" if n else "lost"
        GAPS.labels(pod, reason, outcome).inc()
        BATCHES_REPLAYED.labels(pod).inc(n)
        BATCHES_LOST.labels(pod).inc(missing - n)
        log.log(logging.INFO if n == missing else logging.WARNING,
                "KV-event gap. pod=%s topic=%s dp_rank=%s seqs=%d..%d reason=%s replayed=%d/%d",
                pod, b.topic, b.dp_rank, first, last, reason, n, missing)
        gap = KvEventGap(topic=b.topic, dp_rank=b.dp_rank, first_seq=first, last_seq=last, detected_at_ms=now_ms,
                         reason=reason, replayed_batches=n, recovered=n == missing, prev_batch_ts=prev_batch_ts,
                         next_batch_ts=b.batch_ts)
        gap_env = envelope(gap, pod=pod, natural_key=(b.topic, b.dp_rank, first, last), observed_at_ms=now_ms,
                           engine="" if b.dp_rank is None else str(b.dp_rank))
        return [gap_env, *(e for s in seqs for e in got[s])]

    def _ack_for(self, touched: set[tuple[str, int | None]]) -> Callable[[], None] | None:
        if not touched or self.checkpoints is None:
            return None
        self._polls += 1
        poll_no, store = self._polls, self.checkpoints
        positions = {key: {"seq": self._streams[key].seq, "batch_ts": self._streams[key].batch_ts} for key in touched}

        def ack() -> None:
            with self._ack_lock:  # a late ack of an earlier poll must not move a checkpoint back
                for key, position in positions.items():
                    if self._acked.get(key, 0) < poll_no:
                        self._acked[key] = poll_no
                        store.put(checkpoint_key(*key), position)

        return ack
