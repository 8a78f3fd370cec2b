"""The collector process: runs every source (vLLM /metrics scrapes, the gateway log tail, KV events) in its
own thread and hands their envelopes to one publisher (Kafka, or the in-process queue in embedded mode).

Nothing read is lost (docs/reliability.md): a publish failure keeps the events and retries with backoff and
jitter until it succeeds or the collector stops; sources advance their persisted checkpoints (log offsets,
KV-event sequence numbers; :mod:`collector.checkpoint`) only from the publisher's acknowledgement, so a
collector killed at any instant resumes where the downstream confirmed and re-sends the rest (the ingester
drops what the store already holds).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter

from collector.checkpoint import CheckpointStore
from collector.events import Envelope
from collector.gateway_log import GatewayLogSource
from collector.kv_events import KvEventSubscriber
from collector.publish import Ack, Publisher, PublishError
from collector.vllm_metrics import ScrapeError, scrape

log = logging.getLogger("kvscope.collector")

EVENTS_PUBLISHED = Counter("kvscope_collector_events_published", "Envelopes published", ["kind"])
SCRAPE_FAILURES = Counter("kvscope_collector_scrape_failures", "Failed /metrics scrapes (that interval's "
                          "sample is missing; counters are cumulative, so the next scrape's deltas cover it)",
                          ["pod", "reason"])
PUBLISH_FAILURES = Counter("kvscope_collector_publish_failures", "Publish attempts that failed and were retried",
                           ["source"])
UNPUBLISHED_AT_STOP = Counter("kvscope_collector_unpublished_at_stop", "Envelopes still unpublished when the "
                              "collector stopped (re-read from the checkpoint at the next start)", ["source"])


@dataclass(frozen=True)
class Target:
    """A vLLM pod to scrape: ``pod`` name and its ``/metrics`` URL."""

    pod: str
    metrics_url: str


def parse_target(spec: str) -> Target:
    """``name=http://host:port`` or ``http://host:port`` (name = host:port); ``/metrics`` is appended to a
    URL without a path."""
    name, _, url = spec.rpartition("=") if "=" in spec.split("://", 1)[0] else ("", "", spec)
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"vLLM target {spec!r} must be an http(s) URL, optionally prefixed with NAME=")
    if url.count("/") == 2:
        url += "/metrics"
    if not name:
        name = url.split("://", 1)[1].split("/", 1)[0]
    return Target(name, url)


@dataclass
class Collector:
    """Runs the sources until ``stop`` is set. ``targets``: pods to scrape every ``scrape_interval_seconds``;
    ``gateway_logs``: JSONL files to tail; ``kv_events_endpoint``: ZMQ endpoint to bind (None = off)."""

    publisher: Publisher
    targets: list[Target] = field(default_factory=list)
    gateway_logs: list[str] = field(default_factory=list)
    kv_events_endpoint: str | None = None
    kv_events_replay: dict[str, str] = field(default_factory=dict)
    checkpoints: CheckpointStore = field(default_factory=lambda: CheckpointStore(None))
    scrape_interval_seconds: float = 5.0
    log_poll_seconds: float = 0.5
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _publish_lock: threading.Lock = field(default_factory=threading.Lock)
    _failing: set[str] = field(default_factory=set)
    _failing_logs: set[GatewayLogSource] = field(default_factory=set)

    def _publish(self, source: str, events: list[Envelope], on_ack: Ack | None = None, *,
                 final: bool = False) -> bool:
        """Publish, retrying with backoff and jitter until it works; ``on_ack`` runs once the events are
        durable downstream. Returns False (events not published, checkpoint not advanced) only if ``stop``
        is set before it works; ``final`` (the drain at stop) tries a few more times first."""
        attempt = 0
        while True:
            try:
                with self._publish_lock:
                    self.publisher.publish(events, on_ack)
                for ev in events:
                    EVENTS_PUBLISHED.labels(ev.schema).inc()
                return True
            except PublishError as exc:
                PUBLISH_FAILURES.labels(source).inc()
                wait = min(30.0, 0.5 * 2 ** min(attempt, 10)) * random.uniform(0.5, 1.5)
                log.warning("publish failed, keeping events. source=%s retry_in_s=%.1f error=%s", source, wait, exc)
                attempt += 1
                if self.stop.is_set() and (not final or attempt >= 5):
                    UNPUBLISHED_AT_STOP.labels(source).inc(len(events))
                    return False
                if not final and self.stop.wait(wait):
                    UNPUBLISHED_AT_STOP.labels(source).inc(len(events))
                    return False
                if final:
                    time.sleep(min(wait, 1.0))

    def scrape_all(self, client: httpx.Client) -> int:
        """One scrape of every target; returns envelopes published."""
        n = 0
        for t in self.targets:
            try:
                events = scrape(client, t.pod, t.metrics_url)
            except ScrapeError as exc:
                SCRAPE_FAILURES.labels(t.pod, exc.kind).inc()
                if t.pod not in self._failing:  # say it once per outage, not every interval
                    log.warning("scrape failed; retrying every interval. pod=%s url=%s reason=%s",
                                t.pod, t.metrics_url, exc.reason)
                self._failing.add(t.pod)
                continue
            except Exception:  # a bug on one pod's body must not stop the scrape loop for every pod
                SCRAPE_FAILURES.labels(t.pod, "bug").inc()
                log.exception("scrape of one pod failed unexpectedly; other pods continue. pod=%s", t.pod)
                continue
            if t.pod in self._failing:
                self._failing.discard(t.pod)
                log.info("scrape recovered. pod=%s", t.pod)
            if self._publish("vllm_metrics", events):
                n += len(events)
        return n

    def _scrape_loop(self) -> None:
        with httpx.Client(timeout=max(1.0, self.scrape_interval_seconds)) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                self.scrape_all(client)
                self.stop.wait(max(0.0, self.scrape_interval_seconds - (time.monotonic() - t0)))

    def _poll_log(self, source: GatewayLogSource) -> tuple[list[Envelope], Ack | None]:
        """One poll; a file-system error (permissions, a vanished mount) is logged once per outage and
        retried next time: the checkpoint has not moved, so nothing is skipped meanwhile."""
        try:
            result = source.poll()
        except OSError as exc:
            if source not in self._failing_logs:
                log.error("cannot read the gateway log; retrying. path=%s error=%s", source.path, exc)
                self._failing_logs.add(source)
            return [], None
        self._failing_logs.discard(source)
        return result

    def _log_loop(self, source: GatewayLogSource) -> None:
        try:
            while not self.stop.is_set():
                events, ack = self._poll_log(source)
                if (events or ack) and not self._publish("gateway_log", events, ack):
                    return  # stopped before the publish: the checkpoint stays, the next start re-reads
                if not events:
                    self.stop.wait(self.log_poll_seconds)
            while True:  # lines written before the stop still go out
                events, ack = self._poll_log(source)
                if not (events or ack) or not self._publish("gateway_log", events, ack, final=True):
                    return
        finally:
            source.close()

    def _kv_loop(self, sub: KvEventSubscriber) -> None:
        try:
            while not self.stop.is_set():
                events, ack = sub.poll(200)
                if events or ack:
                    self._publish("kv_events", events, ack)
        finally:
            sub.close()

    def start(self) -> None:
        """Start one thread per source (the KV socket is bound here, so a bad endpoint fails at once)."""
        loops: list[tuple[str, Callable[[], None]]] = []
        if self.targets:
            loops.append(("scrape", self._scrape_loop))
        for path in self.gateway_logs:
            source = GatewayLogSource(path, self.checkpoints)
            loops.append((f"tail:{path}", lambda src=source: self._log_loop(src)))
        if self.kv_events_endpoint:
            sub = KvEventSubscriber(self.kv_events_endpoint, checkpoints=self.checkpoints,
                                    replay_endpoints=self.kv_events_replay)
            loops.append(("kv_events", lambda: self._kv_loop(sub)))
        for name, fn in loops:
            th = threading.Thread(target=fn, name=f"collector-{name}", daemon=True)
            th.start()
            self._threads.append(th)

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        for th in self._threads:
            th.join(timeout)
