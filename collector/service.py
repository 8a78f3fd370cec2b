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
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter

from collector.checkpoint import CheckpointStore
from collector.events import Envelope
from collector.gateway_log import GatewayLogSource
from collector.kv_events import KvEventSubscriber
from collector.publish import Ack, Publisher, PublishError
from collector.vllm_metrics import (
    DEFAULT_BODY_SIZE_LIMIT,
    DEFAULT_LIMITS,
    BodyTooLarge,
    LabelLimits,
    ScrapeError,
    ScrapeJournal,
    ScrapeState,
    advance,
    dead_letter_event,
    fetch,
)

log = logging.getLogger("kvscope.collector")

EVENTS_PUBLISHED = Counter("kvscope_collector_events_published", "Envelopes published", ["kind"])
SCRAPE_FAILURES = Counter("kvscope_collector_scrape_failures", "Failed or skipped /metrics scrapes (that "
                          "interval's sample is missing; the next scrape's counter increases cover it): timeout, "
                          "connect, http_status, network, body_size (over KVSCOPE_VLLM_BODY_SIZE_LIMIT: "
                          "dead-lettered), bug, backlog (downstream not acknowledging)",
                          ["pod", "reason"])
PUBLISH_FAILURES = Counter("kvscope_collector_publish_failures", "Publish attempts that failed and were retried",
                           ["source"])
CHECKPOINT_FAILURES = Counter("kvscope_collector_checkpoint_failures", "Acknowledgements whose checkpoint could not "
                              "be written (disk full, state directory gone); the data is stored, and the next "
                              "checkpoint written covers it (a restart before then re-reads it, the store drops the "
                              "copies)", ["source"])
UNPUBLISHED_AT_STOP = Counter("kvscope_collector_unpublished_at_stop", "Envelopes still unpublished when the "
                              "collector stopped (re-read from the checkpoint at the next start)", ["source"])


@dataclass(frozen=True)
class Target:
    """A vLLM pod to scrape: ``pod`` name and its ``/metrics`` URL."""

    pod: str
    metrics_url: str


def parse_target(spec: str) -> Target:
    """``name=http://host:port`` or ``http://host:port`` (name = host:port); ``/metrics`` is appended to a
    URL without a path. Raises ValueError for anything else."""
    name, _, url = spec.rpartition("=") if "=" in spec.split("://", 1)[0] else ("", "", spec)
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"vLLM target {spec!r} must be an http(s) URL, optionally prefixed with NAME=")
    if url.count("/") == 2:
        url += "/metrics"
    if not name:
        name = url.split("://", 1)[1].split("/", 1)[0]
    return Target(name, url)


def parse_targets(specs: list[str]) -> list[Target]:
    """Every spec through :func:`parse_target`, checked with :func:`check_targets`. Raises ValueError."""
    targets = [parse_target(s) for s in specs]
    check_targets(targets)
    return targets


def check_targets(targets: list[Target]) -> None:
    """Refuse two targets with one pod name (their counters would interleave as one series: each scrape of
    the other process reads as a restart) and two names for one URL (every token of that pod counted twice in
    fleet totals). URLs are compared as given after :func:`parse_target`'s normalisation (scheme and host
    case-insensitive); two spellings of one host (localhost and 127.0.0.1) are not detected. Raises
    ValueError naming the duplicates."""
    names: dict[str, str] = {}
    urls: dict[str, str] = {}
    for t in targets:
        scheme, _, rest = t.metrics_url.partition("://")
        host, slash, path = rest.partition("/")
        url = f"{scheme.lower()}://{host.lower()}{slash}{path}"
        if t.pod in names:
            raise ValueError(f"two vLLM targets are named {t.pod!r} ({names[t.pod]} and {t.metrics_url}); "
                             "give each pod its own name: NAME=http://host:port")
        if url in urls:
            raise ValueError(f"vLLM target {t.metrics_url} is given twice, as {urls[url]!r} and {t.pod!r}; "
                             "one pod must have one name (its counters would be counted twice)")
        names[t.pod], urls[url] = t.metrics_url, t.pod


#: A scrape connection idle this long is closed by the collector, below the 5 s after which vLLM's uvicorn closes an
#: idle one (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), as the gateway's pool does (gateway/upstream.py): at the default 5 s
#: interval each scrape then opens its own connection instead of racing the pod's close (a race
#: :func:`collector.vllm_metrics.fetch` also survives, by asking once more).
SCRAPE_KEEPALIVE_SECONDS = 4.0


@dataclass
class Collector:
    """Runs the sources until ``stop`` is set. ``targets``: pods to scrape every ``scrape_interval_seconds``
    (a sample over ``label_limits`` is a dead letter); ``gateway_logs``: JSONL files to tail;
    ``kv_events_endpoint``: ZMQ endpoint to bind (None = off)."""

    publisher: Publisher
    targets: list[Target] = field(default_factory=list)
    gateway_logs: list[str] = field(default_factory=list)
    kv_events_endpoint: str | None = None
    kv_events_replay: dict[str, str] = field(default_factory=dict)
    kv_events_dp_ranks: int = 1
    checkpoints: CheckpointStore = field(default_factory=lambda: CheckpointStore(None))
    #: the scrape journal's own file (its state is large at many pods and rewritten every round); None = the
    #: sources' file
    scrape_checkpoints: CheckpointStore | None = None
    scrape_interval_seconds: float = 5.0
    label_limits: LabelLimits = DEFAULT_LIMITS
    #: bytes of a /metrics body (uncompressed) over which the scrape fails and is dead-lettered; 0 = no limit
    body_size_limit: int = DEFAULT_BODY_SIZE_LIMIT
    log_poll_seconds: float = 0.5
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _publish_lock: threading.Lock = field(default_factory=threading.Lock)
    _failing: set[str] = field(default_factory=set)
    _failing_logs: set[GatewayLogSource] = field(default_factory=set)
    max_unacked_scrapes: int = 0  # 0: 8 rounds' worth; beyond it the scrape loop waits for acks, scraping nothing
    _journal: ScrapeJournal | None = None
    _scrape_pool: ThreadPoolExecutor | None = None
    _inflight: dict[str, Future[tuple[list[Envelope], ScrapeState]]] = field(default_factory=dict)
    _backlogged: bool = False
    _checkpoint_failing: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        check_targets(self.targets)

    def _publish(self, source: str, events: list[Envelope], on_ack: Ack | None = None, *,
                 final: bool = False) -> bool:
        """Publish, retrying with backoff and jitter until it works; ``on_ack`` runs once the events are
        durable downstream. Returns False (events not published, checkpoint not advanced) only if ``stop``
        is set before it works; ``final`` (the drain at stop) tries a few more times first."""
        attempt = 0
        on_ack = self._guarded(source, on_ack)
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

    def _guarded(self, source: str, on_ack: Ack | None) -> Ack | None:
        """``on_ack`` that never raises: a checkpoint it cannot write (``OSError``, or a bug) is logged once per
        outage and counted (``kvscope_collector_checkpoint_failures_total{source}``). It runs on the ingester's
        thread (embedded: an exception there kept the committed messages' bytes in the queue and skipped the
        acks after it) or the source's (Kafka: the source's thread ended); either way the data it covers is
        already stored, and the source's next checkpoint covers it."""
        if on_ack is None:
            return None

        def ack() -> None:
            try:
                on_ack()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                CHECKPOINT_FAILURES.labels(source).inc()
                if source not in self._checkpoint_failing:
                    self._checkpoint_failing.add(source)
                    log.error("cannot write the checkpoint; going on (what it covers is stored, a restart before "
                              "the next checkpoint re-reads it). source=%s error=%r", source, exc)
                return
            if source in self._checkpoint_failing:
                self._checkpoint_failing.discard(source)
                log.info("checkpoint written again. source=%s", source)

        return ack

    def _scrape_journal(self) -> ScrapeJournal:
        """The scrape journal, loaded at first use (:meth:`start`: a foreign checkpoint stops start-up).
        Raises :class:`collector.checkpoint.CheckpointError`."""
        if self._journal is None:
            store = self.scrape_checkpoints or self.checkpoints
            self._journal = ScrapeJournal(store, pods=[t.pod for t in self.targets])
        return self._journal

    def _scrape_one(self, client: httpx.Client, journal: ScrapeJournal, t: Target
                    ) -> tuple[list[Envelope], ScrapeState]:
        try:
            body, scraped_at_ms, duration_ms = fetch(client, t.pod, t.metrics_url, self.body_size_limit)
        except BodyTooLarge as exc:  # bad input: counted, dead-lettered with its first bytes; the state stays
            SCRAPE_FAILURES.labels(t.pod, exc.kind).inc()
            log.warning("scrape failed: %s. pod=%s url=%s", exc.reason, t.pod, t.metrics_url)
            now_ms = int(time.time() * 1000)
            return [dead_letter_event(t.pod, t.metrics_url, now_ms, exc.head, exc.reason)], journal.state(t.pod)
        return advance(journal.state(t.pod), t.pod, t.metrics_url, body, scraped_at_ms, duration_ms,
                       self.label_limits)

    def scrape_all(self, client: httpx.Client, wait_seconds: float | None = None) -> int:
        """One scrape round; returns envelopes published.

        Every target not still in flight is fetched and computed on its own thread (one ``client`` pool); the
        round waits for them up to ``wait_seconds`` (default 0.8 x the interval), then commits every result
        that arrived (one checkpoint write for all pods: :class:`ScrapeJournal`) and publishes them as one
        batch. A slow pod stays in flight (until the client's timeout) and misses only its own rounds; its
        result is committed with a later round. While the downstream leaves more than ``max_unacked_scrapes``
        scrapes unacknowledged, the round scrapes nothing (counted as ``backlog``): the next scrape's
        increases cover the wait."""
        journal = self._scrape_journal()
        recovered, ack = journal.recover()  # the outbox a previous run left, once: before any new scrape
        if recovered:
            log.info("re-publishing scrapes checkpointed before the last stop. envelopes=%d", len(recovered))
            if not self._publish("vllm_metrics", recovered, ack):
                return 0
        if self._scrape_pool is None:
            self._scrape_pool = ThreadPoolExecutor(max(1, min(128, len(self.targets))), "collector-scrape")
        journal.watch([t.pod for t in self.targets], int(time.time() * 1000))  # before any first attempt
        limit = self.max_unacked_scrapes or 8 * max(1, len(self.targets))
        backlogged = journal.pending() > limit
        if backlogged != self._backlogged:
            self._backlogged = backlogged
            if backlogged:
                log.warning("downstream has not acknowledged %d scrapes; scraping paused until it does",
                            journal.pending())
        for t in self.targets:
            if backlogged:
                SCRAPE_FAILURES.labels(t.pod, "backlog").inc()
            elif t.pod not in self._inflight:
                self._inflight[t.pod] = self._scrape_pool.submit(self._scrape_one, client, journal, t)
        timeout = 0.8 * self.scrape_interval_seconds if wait_seconds is None else wait_seconds
        wait(list(self._inflight.values()), timeout=timeout)
        results = [(t.pod, *r) for t in self.targets if (r := self._scrape_result(t)) is not None]
        try:
            events, ack = journal.commit(results)  # also writes the watch starts of pods not answering yet
        except OSError:  # nothing adopted: each pod's next scrape starts from its previous state
            log.exception("cannot write the scrape checkpoint; this round is not published, the next one covers it")
            return 0
        if not events:
            return 0
        return len(events) if self._publish("vllm_metrics", events, ack) else 0

    def _scrape_result(self, t: Target) -> tuple[list[Envelope], ScrapeState] | None:
        """A finished scrape of ``t`` (taken out of flight), or None (still running, or failed: counted)."""
        fut = self._inflight.get(t.pod)
        if fut is None or not fut.done():
            return None
        del self._inflight[t.pod]
        try:
            result = fut.result()
        except ScrapeError as exc:
            SCRAPE_FAILURES.labels(t.pod, exc.kind).inc()
            if t.pod not in self._failing:  # say it once per outage, not every interval
                log.warning("scrape failed; retrying every interval. pod=%s url=%s reason=%s",
                            t.pod, t.metrics_url, exc.reason)
            self._failing.add(t.pod)
            return None
        except Exception:  # a bug on one pod's body must not stop the scrape loop for every pod
            SCRAPE_FAILURES.labels(t.pod, "bug").inc()
            log.exception("scrape of one pod failed unexpectedly; other pods continue. pod=%s", t.pod)
            return None
        if t.pod in self._failing:
            self._failing.discard(t.pod)
            log.info("scrape recovered. pod=%s", t.pod)
        return result

    def close_scrapes(self) -> None:
        """Stop the scrape threads (a scrape in flight is dropped: not committed, so nothing is lost) and write
        the acknowledgements received since the last round."""
        if self._scrape_pool is not None:
            self._scrape_pool.shutdown(wait=False, cancel_futures=True)
            self._scrape_pool = None
        self._inflight.clear()
        if self._journal is not None:
            try:
                self._journal.close()
            except OSError:
                log.exception("cannot write the scrape checkpoint at stop; acknowledged scrapes are re-sent once")

    def _scrape_loop(self) -> None:
        n = max(1, len(self.targets))
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n,
                              keepalive_expiry=SCRAPE_KEEPALIVE_SECONDS)
        try:
            with httpx.Client(timeout=max(1.0, self.scrape_interval_seconds), limits=limits) as client:
                while not self.stop.is_set():
                    t0 = time.monotonic()
                    self.scrape_all(client)
                    self.stop.wait(max(0.0, self.scrape_interval_seconds - (time.monotonic() - t0)))
        finally:
            self.close_scrapes()

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

    #: At stop, at most this many polls of the KV socket (each up to ``max_messages`` batches) are still published.
    KV_FINAL_POLLS = 100

    def _kv_loop(self, sub: KvEventSubscriber) -> None:
        """Poll and publish KV events until ``stop``; then publish the batches already waiting in the socket
        (``final``): received, they are ours to deliver (a replay at the next start cannot bring them back when
        vLLM stopped too). A publish that fails at the stop ends the loop at once: a later poll's ack would move
        the checkpoint past the batches it dropped."""
        try:
            while not self.stop.is_set():
                events, ack = sub.poll(200)
                if (events or ack) and not self._publish("kv_events", events, ack):
                    return
            for _ in range(self.KV_FINAL_POLLS):
                events, ack = sub.poll(0)
                if not (events or ack) or not self._publish("kv_events", events, ack, final=True):
                    return
        finally:
            sub.close()

    def start(self) -> None:
        """Start one thread per source (the KV socket is bound here, so a bad endpoint fails at once)."""
        loops: list[tuple[str, Callable[[], None]]] = []
        if self.targets:
            self._scrape_journal()
            loops.append(("scrape", self._scrape_loop))
        for path in self.gateway_logs:
            source = GatewayLogSource(path, self.checkpoints)
            loops.append((f"tail:{path}", lambda src=source: self._log_loop(src)))
        if self.kv_events_endpoint:
            sub = KvEventSubscriber(self.kv_events_endpoint, checkpoints=self.checkpoints,
                                    replay_endpoints=self.kv_events_replay, dp_ranks=self.kv_events_dp_ranks)
            loops.append(("kv_events", lambda: self._kv_loop(sub)))
        for name, fn in loops:
            th = threading.Thread(target=fn, name=f"collector-{name}", daemon=True)
            th.start()
            self._threads.append(th)

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        for th in self._threads:
            th.join(timeout)
