"""KV-event sequence gaps: detected per (pod, dp_rank), replayed from vLLM's replay socket, the rest counted.

Everything here talks to vLLM's own code over real ZMQ sockets: the unit-level tests run vLLM's
``ZmqEventPublisher`` (vllm/distributed/kv_events.py) in this process, connected to the subscriber's bound SUB
socket and serving replays from its ROUTER; the last test uses the session's vLLM CPU fleet. Gaps are forced
with the subscriber's ``drop_next`` test hook (it discards received messages as a lossy network would).

Note on ZMQ (pyzmq 27 / libzmq 4.3): a bound SUB sends its subscription to a newly connected PUB only when the
application touches the socket (poll/recv), and the PUB drops what it sends before the subscription arrives; a
connected PUB whose SUB went away queues later messages and delivers them on reconnect, except the one(s)
already handed to the dead connection. The helpers below poll while they publish for that reason.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Callable

import httpx
import msgspec
import pytest
import zmq
from conftest import free_port
from prometheus_client import REGISTRY
from test_kv_residency import ingest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch, ZmqEventPublisher

from collector.checkpoint import CheckpointStore
from collector.events import Envelope, KvEventBatch, KvEventGap
from collector.kv_decode import message_events
from collector.kv_events import MIN_RESTART_SECONDS, KvEventSubscriber, checkpoint_key
from ingest.store import Store
from kvscope.block_hash import chain_hashes


def retry(make: Callable, seconds: float = 5.0):  # type: ignore[no-untyped-def, type-arg]
    """``make()``, retried while its address is still held by a socket closed a moment ago (EADDRINUSE)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def subscriber(endpoint: str, **kwargs) -> KvEventSubscriber:  # type: ignore[no-untyped-def]
    return retry(lambda: KvEventSubscriber(endpoint, **kwargs))


class Pub:
    """vLLM's ZmqEventPublisher for ``topic`` (connecting to ``endpoint``, replay ROUTER bound at ``replay``) and
    the number of batches it published (vLLM numbers them 0, 1, ...)."""

    def __init__(self, endpoint: str, topic: str, replay: str | None = None, dp_rank: int = 0,
                 buffer_steps: int = 10_000) -> None:
        self.vllm = retry(lambda: ZmqEventPublisher(dp_rank, endpoint=endpoint, replay_endpoint=replay, topic=topic,
                                                    buffer_steps=buffer_steps))
        self.count = 0

    def publish(self, n: int = 1) -> list[int]:
        """Publish ``n`` batches (a BlockStored and a BlockRemoved each); returns their seqs."""
        seqs = []
        for _ in range(n):
            h = random.getrandbits(63)
            stored = BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, token_ids=list(range(8)),
                                 block_size=4, lora_id=None, medium="GPU", lora_name=None)
            seqs.append(self.send([stored, BlockRemoved(block_hashes=[h - 1], medium="GPU")]))
        return seqs

    def send(self, events: list[KVCacheEvent]) -> int:
        """Publish one batch of ``events`` (vLLM encodes them as they are, valid or not); returns its seq."""
        self.vllm.publish(KVEventBatch(ts=time.time(), events=events))
        self.count += 1
        return self.count - 1

    def close(self) -> None:
        self.vllm.shutdown()


def batches(out: list[Envelope], topic: str, dp_rank: int | None = 0) -> list[KvEventBatch]:
    return [e.payload for e in out
            if isinstance(e.payload, KvEventBatch) and e.payload.topic == topic and e.payload.dp_rank == dp_rank]


def gaps(out: list[Envelope]) -> list[KvEventGap]:
    return [e.payload for e in out if isinstance(e.payload, KvEventGap)]


def collect(sub: KvEventSubscriber, out: list[Envelope], until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll (acking each poll) into ``out`` until ``until()`` or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; got {[(type(e.payload).__name__, e.pod) for e in out]}"
        envs, ack_fn = sub.poll(50)
        out.extend(envs)
        if ack_fn:
            ack_fn()


def seen(out: list[Envelope], topic: str, seq: int, dp_rank: int | None = 0) -> Callable[[], bool]:
    return lambda: any(b.seq >= seq for b in batches(out, topic, dp_rank))


def publish_until(sub: KvEventSubscriber, pub: Pub, out: list[Envelope], until: Callable[[], bool],
                  timeout: float = 10.0) -> None:
    """Publish one batch, poll 50 ms (acking), repeat until ``until()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "vLLM's publisher never reached the subscriber"
        pub.publish()
        envs, ack = sub.poll(50)
        out.extend(envs)
        if ack:
            ack()


def warm_up(sub: KvEventSubscriber, pub: Pub, topic: str, dp_rank: int = 0) -> list[Envelope]:
    """Publish one batch at a time until one arrives (the link is up), then poll until the last one arrived."""
    out: list[Envelope] = []
    publish_until(sub, pub, out, lambda: bool(batches(out, topic, dp_rank)))
    collect(sub, out, seen(out, topic, pub.count - 1, dp_rank))
    return out


def idle(sub: KvEventSubscriber, out: list[Envelope], seconds: float) -> None:
    """Keep polling for ``seconds`` (a newly connected PUB gets the subscription only while the SUB is used)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.extend(sub.poll(50)[0])


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def gap_metrics(pod: str) -> dict[str, float]:
    out = {f"{reason}/{outcome}": metric("kvscope_collector_kv_gaps_total", pod=pod, reason=reason, outcome=outcome)
           for reason in ("missed", "collector_restart", "publisher_restart")
           for outcome in ("recovered", "partial", "lost")}
    out["replayed"] = metric("kvscope_collector_kv_batches_replayed_total", pod=pod)
    out["lost"] = metric("kvscope_collector_kv_batches_lost_total", pod=pod)
    out["duplicates"] = metric("kvscope_collector_kv_duplicates_total", pod=pod)
    out["late"] = metric("kvscope_collector_kv_late_batches_total", pod=pod)
    out["replay_failures"] = metric("kvscope_collector_kv_replay_failures_total", pod=pod)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_missed_batches_come_back_through_vllm_replay_in_order_exactly_once() -> None:
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        start = len(out)
        before = gap_metrics(topic)
        sub.drop_next(3)
        dropped = pub.publish(3)
        collect(sub, out, lambda: len(sub.dropped) == 3)
        after_gap = pub.publish(2)
        collect(sub, out, seen(out, topic, after_gap[-1]))
        new = out[start:]

        assert [int.from_bytes(f[1], "big") for f in sub.dropped] == dropped
        [gap_env] = [e for e in new if isinstance(e.payload, KvEventGap)]
        gap = gap_env.payload
        assert (gap.topic, gap.dp_rank, gap.first_seq, gap.last_seq) == (topic, 0, dropped[0], dropped[-1])
        assert (gap.reason, gap.replayed_batches, gap.recovered) == ("missed", 3, True)
        assert gap_env.pod == topic and gap_env.engine == "0"
        # the gap, then the replayed batches in order, then the live batch that revealed the gap
        i = new.index(gap_env)
        replayed = [e.payload for e in new[i + 1:i + 4]]
        assert [b.seq for b in replayed] == dropped and all(b.replayed for b in replayed)
        assert new[i + 4].payload.seq == after_gap[0] and not new[i + 4].payload.replayed
        # the replayed batches decode exactly as the dropped live messages would have (token ids hashed)
        lost_live = [sub.chains.envelope(message_events(f)[0]) for f in sub.dropped]
        assert [msgspec.structs.replace(b, replayed=True) for b in (e.payload for e in lost_live)] == replayed
        assert [e.event_id for e in lost_live] == [e.event_id for e in new[i + 1:i + 4]]
        assert {ev.type for b in replayed for ev in b.events} == {"BlockStored", "BlockRemoved"}
        for ev in (ev for b in batches(out, topic) for ev in b.events if ev.type == "BlockStored"):
            assert (ev.token_ids, ev.token_count, ev.chain_hashes) == ([], 8, chain_hashes(range(8), 4))
        # every seq exactly once, in order
        seqs = [b.seq for b in batches(out, topic)]
        assert seqs == list(range(seqs[0], pub.count))
        assert delta(before, gap_metrics(topic)) == {"missed/recovered": 1, "replayed": 3}
    finally:
        sub.close()
        pub.close()


def test_batch_arriving_live_after_its_replay_is_dropped_as_duplicate() -> None:
    """vLLM never re-sends, so the duplicates are the dropped frames sent again by a plain PUB on the same
    topic (the wire bytes vLLM produced)."""
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        out = warm_up(sub, pub, topic)
        sub.drop_next(2)
        pub.publish(2)
        collect(sub, out, lambda: len(sub.dropped) == 2)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        assert [g.recovered for g in gaps(out)] == [True]
        before = gap_metrics(topic)
        raw.connect(endpoint)
        got: list[Envelope] = []
        deadline = time.monotonic() + 10
        while not any(e.schema == "dead_letter" for e in got):  # until the plain PUB's link is up
            assert time.monotonic() < deadline, "a plain PUB never reached the subscriber"
            raw.send_multipart([b"probe", b"not a KV-event batch"])
            got.extend(sub.poll(50)[0])
        for frames in sub.dropped:
            raw.send_multipart(frames)
        raw.send_multipart([b"marker", b"x"])  # dead-lettered once the duplicates before it were processed
        collect(sub, got, lambda: any(e.schema == "dead_letter" and e.pod == "marker" for e in got))
        assert batches(got, topic) == [] and gaps(got) == []
        assert delta(before, gap_metrics(topic)) == {"duplicates": 2}
        nxt = pub.publish(1)[0]
        collect(sub, got, seen(got, topic, nxt))
        assert [b.seq for b in batches(got, topic)] == [nxt] and gaps(got) == []
    finally:
        raw.close()
        sub.close()
        pub.close()


def test_gap_without_replay_endpoint_is_lost_and_counted() -> None:
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    sub = subscriber(endpoint)
    pub = Pub(endpoint, topic, tcp())
    try:
        out = warm_up(sub, pub, topic)
        before = gap_metrics(topic)
        sub.drop_next(4)
        dropped = pub.publish(4)
        collect(sub, out, lambda: len(sub.dropped) == 4)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        [gap] = gaps(out)
        assert (gap.first_seq, gap.last_seq, gap.reason) == (dropped[0], dropped[-1], "missed")
        assert (gap.replayed_batches, gap.recovered) == (0, False)
        assert not any(b.replayed for b in batches(out, topic))
        assert delta(before, gap_metrics(topic)) == {"missed/lost": 1, "lost": 4}
    finally:
        sub.close()
        pub.close()


def test_a_batch_arriving_after_its_gap_was_reported_lost_is_stored_late(store: Store) -> None:
    """Four batches dropped with no replay socket: the gap after them is reported lost. The same frames then arrive
    (a reordering proxy, a replay that came in late): before, each was dropped as a duplicate (never delivered, yet
    counted in kvscope_collector_kv_duplicates_total) and kv_gaps counted 4 lost. Now each is stored once, counted
    late; kv_gaps, which counts against the store, says 4 stored and 0 lost; a second copy is a duplicate."""
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    sub = subscriber(endpoint)
    pub = Pub(endpoint, topic, tcp())
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        out = warm_up(sub, pub, topic)
        sub.drop_next(4)
        dropped = pub.publish(4)
        collect(sub, out, lambda: len(sub.dropped) == 4)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        assert [(g.first_seq, g.last_seq, g.recovered) for g in gaps(out)] == [(dropped[0], dropped[-1], False)]
        before = gap_metrics(topic)
        raw.connect(endpoint)
        deadline = time.monotonic() + 10
        while not any(e.schema == "dead_letter" for e in out):  # until the plain PUB's link is up
            assert time.monotonic() < deadline, "a plain PUB never reached the subscriber"
            raw.send_multipart([b"probe", b"not a KV-event batch"])
            out.extend(sub.poll(50)[0])
        for frames in sub.dropped + sub.dropped:  # late, then a copy
            raw.send_multipart(frames)
        raw.send_multipart([b"marker", b"x"])
        collect(sub, out, lambda: any(e.schema == "dead_letter" and e.pod == "marker" for e in out))
        assert [b.seq for b in batches(out, topic)][-4:] == dropped
        assert delta(before, gap_metrics(topic)) == {"late": 4, "duplicates": 4}
        ingest(store, out)
        assert store.query_rows(f"SELECT batches, stored_batches, lost_batches FROM kv_gaps WHERE pod = '{topic}'") \
            == [(4, 4, 0)]
    finally:
        raw.close()
        sub.close()
        pub.close()


def test_gap_older_than_vllms_replay_buffer_is_partly_recovered() -> None:
    """vLLM keeps only its last ``buffer_steps`` batches (10,000 by default; 2 here)."""
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay, buffer_steps=2)
    try:
        out = warm_up(sub, pub, topic)
        before = gap_metrics(topic)
        sub.drop_next(4)
        dropped = pub.publish(4)
        collect(sub, out, lambda: len(sub.dropped) == 4)
        last = pub.publish(1)[0]  # the buffer now holds dropped[-1] and last
        collect(sub, out, seen(out, topic, last))
        [gap] = gaps(out)
        assert (gap.first_seq, gap.last_seq, gap.replayed_batches, gap.recovered) == (dropped[0], dropped[-1], 1, False)
        assert [(b.seq, b.replayed) for b in batches(out, topic)][-2:] == [(dropped[-1], True), (last, False)]
        assert delta(before, gap_metrics(topic)) == {"missed/partial": 1, "lost": 3, "replayed": 1}
    finally:
        sub.close()
        pub.close()


def test_unreachable_replay_socket_never_raises_is_bounded_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: tcp()}, replay_timeout_seconds=0.5)  # nobody binds it
    pub = Pub(endpoint, topic, tcp())
    caplog.set_level(logging.WARNING, logger="kvscope.collector")
    try:
        out = warm_up(sub, pub, topic)
        before = gap_metrics(topic)
        for _ in range(2):  # two gaps in one outage
            n = len(sub.dropped)
            sub.drop_next(1)
            pub.publish(1)
            collect(sub, out, lambda n=n: len(sub.dropped) > n)
            last = pub.publish(1)[0]
            t0 = time.monotonic()
            collect(sub, out, seen(out, topic, last))
            assert time.monotonic() - t0 < 3.0
        assert [(g.recovered, g.replayed_batches) for g in gaps(out)] == [(False, 0), (False, 0)]
        assert delta(before, gap_metrics(topic)) == {"missed/lost": 2, "lost": 2, "replay_failures": 2}
        assert len([r for r in caplog.records if "replay failed" in r.getMessage()]) == 1
        # a malformed replay endpoint is a lost gap too, not an exception
        sub.replay_endpoints[topic] = "tcp://127.0.0.1:not-a-port"
        sub.drop_next(1)
        pub.publish(1)
        collect(sub, out, lambda: len(sub.dropped) == 3)
        last = pub.publish(1)[0]
        collect(sub, out, seen(out, topic, last))
        assert [g.recovered for g in gaps(out)] == [False, False, False]
    finally:
        sub.close()
        pub.close()


def test_publisher_restart_at_seq_0_is_no_gap_and_its_missed_first_batches_are_replayed() -> None:
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    sub = subscriber(endpoint, replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        pub.publish(5)
        collect(sub, out, seen(out, topic, pub.count - 1))
        pub.close()
        before = gap_metrics(topic)
        pub = Pub(endpoint, topic, replay)  # vLLM restarted: seq starts at 0 again
        idle(sub, out, MIN_RESTART_SECONDS)  # the link comes up; a restart takes at least this long
        start = len(out)
        pub.publish(3)
        collect(sub, out, lambda: sum(1 for b in batches(out[start:], topic)) == 3)
        assert [b.seq for b in batches(out[start:], topic)] == [0, 1, 2] and gaps(out) == []
        assert delta(before, gap_metrics(topic)) == {}

        pub.close()
        pub = Pub(endpoint, topic, replay)  # restarted again; this time its first two batches are lost
        idle(sub, out, MIN_RESTART_SECONDS)
        start = len(out)
        sub.drop_next(2)
        pub.publish(4)
        collect(sub, out, lambda: seen(out[start:], topic, 3)())
        [gap] = gaps(out)
        assert (gap.first_seq, gap.last_seq, gap.reason, gap.recovered, gap.replayed_batches) == (
            0, 1, "publisher_restart", True, 2)
        assert [(b.seq, b.replayed) for b in batches(out[start:], topic)] == [
            (0, True), (1, True), (2, False), (3, False)]
        assert delta(before, gap_metrics(topic)) == {"publisher_restart/recovered": 1, "replayed": 2}
    finally:
        sub.close()
        pub.close()


def test_collector_restart_replays_what_was_published_while_it_was_down(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    path = tmp_path / "checkpoints.json"
    sub = subscriber(endpoint, checkpoints=CheckpointStore(path), replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        pub.publish(3)
        collect(sub, out, seen(out, topic, pub.count - 1))  # acked
        acked = batches(out, topic)[-1]
        sub.close()
        assert CheckpointStore(path).get(checkpoint_key(topic, 0)) == {"seq": acked.seq, "batch_ts": acked.batch_ts}

        while_down = pub.publish(4)
        time.sleep(0.3)
        before = gap_metrics(topic)
        sub = subscriber(endpoint, checkpoints=CheckpointStore(path), replay_endpoints={topic: replay})
        # ZMQ queues part of what a connected PUB sent while the SUB was gone and delivers it on reconnect;
        # dropping the first 5 messages makes sure none of the batches published while down comes live
        sub.drop_next(5)
        out2: list[Envelope] = []
        publish_until(sub, pub, out2, lambda: len(sub.dropped) == 5)
        last = pub.publish(1)[0]
        collect(sub, out2, seen(out2, topic, last))

        [gap] = gaps(out2)
        assert (gap.reason, gap.first_seq, gap.recovered) == ("collector_restart", acked.seq + 1, True)
        replayed = [b.seq for b in batches(out2, topic) if b.replayed]
        assert set(while_down) <= set(replayed) and replayed == list(range(gap.first_seq, gap.last_seq + 1))
        assert [b.seq for b in batches(out2, topic)] == list(range(acked.seq + 1, pub.count))
        assert delta(before, gap_metrics(topic)) == {"collector_restart/recovered": 1, "replayed": len(replayed)}
        assert CheckpointStore(path).get(checkpoint_key(topic, 0))["seq"] == last
    finally:
        sub.close()
        pub.close()


def test_vllm_restarted_while_collector_was_down_replays_the_new_publisher_from_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The checkpointed seq is below the new publisher's first seq seen, so it looks like a collector restart;
    vLLM's replay holds a different batch under the checkpointed seq, which shows the publisher restarted."""
    topic, endpoint, replay = f"pod-{uuid.uuid4().hex[:8]}", tcp(), tcp()
    path = tmp_path / "checkpoints.json"
    sub = subscriber(endpoint, checkpoints=CheckpointStore(path), replay_endpoints={topic: replay})
    pub = Pub(endpoint, topic, replay)
    try:
        out = warm_up(sub, pub, topic)
        acked = batches(out, topic)[-1]
        sub.close()
        pub.close()
        pub = Pub(endpoint, topic, replay)
        pub.publish(acked.seq + 3)  # nobody is bound: all lost live
        time.sleep(0.3)
        sub = subscriber(endpoint, checkpoints=CheckpointStore(path), replay_endpoints={topic: replay})
        out2: list[Envelope] = []
        idle(sub, out2, 0.5)
        last = pub.publish(2)[-1]
        collect(sub, out2, seen(out2, topic, last))
        [gap] = gaps(out2)
        assert (gap.reason, gap.first_seq, gap.recovered) == ("publisher_restart", 0, True)
        assert [b.seq for b in batches(out2, topic)] == list(range(0, pub.count))
    finally:
        sub.close()
        pub.close()


def test_dp_ranks_are_separate_streams_replayed_from_port_plus_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM offsets both endpoints by the dp rank (``offset_endpoint_port``); rank 1 is pointed one port below
    the subscriber so it lands on it, and its replay ROUTER binds the configured replay port + 1."""
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    while True:  # rank 1 binds replay_port + 1: find a pair
        replay_port = free_port()
        try:
            probe = zmq.Context.instance().socket(zmq.REP)
            probe.bind(f"tcp://127.0.0.1:{replay_port + 1}")
            probe.close(linger=0)
            break
        except zmq.ZMQError:
            probe.close(linger=0)
    replay = f"tcp://127.0.0.1:{replay_port}"
    host, port = endpoint.rsplit(":", 1)
    store = CheckpointStore(tmp_path / "cp.json")
    sub = subscriber(endpoint, checkpoints=store, replay_endpoints={topic: replay})
    rank0 = Pub(endpoint, topic, replay, dp_rank=0)
    rank1 = Pub(f"{host}:{int(port) - 1}", topic, replay, dp_rank=1)
    try:
        out = warm_up(sub, rank0, topic)
        out += warm_up(sub, rank1, topic, dp_rank=1)
        sub.drop_next(2)
        dropped = rank1.publish(2)
        collect(sub, out, lambda: len(sub.dropped) == 2)
        rank0.publish(2)
        last = rank1.publish(1)[0]
        collect(sub, out, lambda: seen(out, topic, last, 1)() and seen(out, topic, rank0.count - 1, 0)())
        [gap] = gaps(out)
        assert (gap.dp_rank, gap.first_seq, gap.last_seq, gap.recovered) == (1, dropped[0], dropped[-1], True)
        for rank, pub in ((0, rank0), (1, rank1)):
            seqs = [b.seq for b in batches(out, topic, rank)]
            assert seqs == list(range(seqs[0], pub.count)), rank
            assert store.get(checkpoint_key(topic, rank))["seq"] == pub.count - 1
        assert {e.engine for e in out if isinstance(e.payload, KvEventBatch)} == {"0", "1"}
    finally:
        sub.close()
        rank0.close()
        rank1.close()


def test_a_late_ack_never_moves_a_checkpoint_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic, endpoint = f"pod-{uuid.uuid4().hex[:8]}", tcp()
    store = CheckpointStore(tmp_path / "cp.json")
    sub = subscriber(endpoint, checkpoints=store)
    pub = Pub(endpoint, topic)
    try:
        out = warm_up(sub, pub, topic)
        acked = batches(out, topic)[-1].seq
        acks = []
        for _ in range(2):
            last = pub.publish(1)[0]
            got: list[Envelope] = []
            while not seen(got, topic, last)():
                envs, ack = sub.poll(50)
                got += envs
                if ack:
                    acks.append(ack)
        assert sub.poll(50) == ([], None)  # nothing delivered, nothing to ack
        assert store.get(checkpoint_key(topic, 0))["seq"] == acked  # not acked yet
        acks[-1]()
        acks[-2]()  # the earlier poll's ack arrives last
        assert store.get(checkpoint_key(topic, 0))["seq"] == pub.count - 1 == acked + 2
    finally:
        sub.close()
        pub.close()


def _complete(base_url: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).raise_for_status()


def _prompt() -> str:
    return f"Case {uuid.uuid4()}: " + " ".join(f"{os.urandom(3).hex()} ticket refund" for _ in range(40))


@pytest.mark.vllm
def test_gap_on_a_real_vllm_server_is_recovered_from_its_replay_socket(vllm_fleet) -> None:  # type: ignore[no-untyped-def]
    """Three KV-event batches of pod-0 are dropped on arrival; the next one reveals the gap and vLLM's replay
    socket gives all three back, so pod-0's seqs are contiguous."""
    pod = vllm_fleet.pods[0]
    sub = subscriber(vllm_fleet.kv_events_endpoint, replay_timeout_seconds=5.0,
                     replay_endpoints={p.name: p.kv_replay_endpoint for p in vllm_fleet.pods})
    topic = pod.kv_events_topic
    try:
        out: list[Envelope] = []
        idle(sub, out, 1.0)  # the pods reconnect; what they queued while nobody was bound arrives
        deadline = time.monotonic() + 60
        while not batches(out, topic):
            assert time.monotonic() < deadline, f"no KV events from {topic} within 60 s"
            _complete(pod.base_url, _prompt())
            idle(sub, out, 1.0)
        start = len(out)
        sub.drop_next(3, topic=topic)
        deadline = time.monotonic() + 60
        while len(sub.dropped) < 3:
            assert time.monotonic() < deadline, f"only {len(sub.dropped)} batches from {topic} in 60 s"
            _complete(pod.base_url, _prompt())
            idle(sub, out, 0.5)
        dropped = [int.from_bytes(f[1], "big") for f in sub.dropped]
        assert {f[0] for f in sub.dropped} == {topic.encode()} and dropped == list(range(dropped[0], dropped[0] + 3))
        for _ in range(2):
            _complete(pod.base_url, _prompt())
        collect(sub, out, lambda: bool(gaps(out)) and seen(out, topic, dropped[-1] + 2)(), timeout=30)
        idle(sub, out, 0.5)

        [gap] = [g for g in gaps(out) if g.topic == topic]
        assert (gap.first_seq, gap.last_seq, gap.reason, gap.replayed_batches, gap.recovered) == (
            dropped[0], dropped[-1], "missed", 3, True)
        mine = batches(out[start:], topic)
        replayed = [b for b in mine if b.replayed]
        assert [b.seq for b in replayed] == dropped
        assert [msgspec.structs.replace(sub.chains.envelope(message_events(f)[0]).payload, replayed=True)
                for f in sub.dropped] == replayed
        assert any(ev.type == "BlockStored" and ev.block_size == 32 for b in replayed for ev in b.events)
        seqs = [b.seq for b in batches(out, topic)]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    finally:
        sub.close()
