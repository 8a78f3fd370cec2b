"""One process running every stage (``kvscope up``): collector → queue or Kafka → ingester → ClickHouse/chDB,
the miss-cause attribution job, and (optionally) the Streamlit dashboard in-process.

chDB allows one process per data directory (docs/environment.md), so in embedded mode
everything that touches the store lives here, in threads sharing one :class:`ingest.store.Store`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from collector.checkpoint import CheckpointStore
from collector.publish import KafkaPublisher, MemoryQueue, Publisher, QueuePublisher
from collector.service import Collector, parse_target
from collector.vllm_metrics import LabelLimits
from ingest.attribution_job import attribution_loop, run_attribution
from ingest.errors import KvscopeError
from ingest.ingester import Ingester
from ingest.source import KafkaSource, QueueSource, Source
from ingest.store import Store
from kvscope.config import Config

log = logging.getLogger("kvscope.pipeline")


def open_store(cfg: Config, *, writer: bool, create: bool = True) -> Store:
    """The store the settings name (a server when ``clickhouse_url`` is set, else chDB), migrated.

    ``writer``: the caller writes the store (``kvscope up``, ``demo``, ``ingest``, ``attribute``, ``import ...``,
    ``migrate``): only then are ``retention_days`` / ``rollup_retention_days`` set on the tables' TTLs
    (:meth:`Store.apply_retention`), so a read (``query``, ``sql``, ``digest``, ``alerts``, ``dashboard``) run
    with other settings never shortens, and so deletes, what the writers keep. ``create``: create a missing
    database (False: :class:`~ingest.errors.MissingDatabase`). Raises what :meth:`Store.open` raises.
    """
    store = Store.open(data_dir=cfg.data_dir, clickhouse_url=cfg.clickhouse_url or None, database=cfg.database,
                       cluster=cfg.clickhouse_cluster, adhoc_max_memory_bytes=cfg.adhoc_max_memory_bytes,
                       create=create)
    applied = store.migrate()
    if applied:
        log.info("migrations applied. versions=%s", ",".join(applied))
    if not writer:
        return store
    changed = store.apply_retention(cfg.retention_days, cfg.rollup_retention_days)
    if changed:
        log.info("retention set. raw_days=%d rollup_days=%d tables=%s", cfg.retention_days,
                 cfg.rollup_retention_days, ",".join(changed))
    return store


def checkpoint_path(cfg: Config) -> Path:
    """The collector's checkpoint file: ``<state dir>/checkpoints-<database>-<namespace>.json``, one per
    destination, so two pipelines on one machine that write to different stores never share positions. The
    state dir is ``state_dir``, else ``<data_dir>.state`` beside an embedded store (checkpoints belong with
    the data they describe), else ``~/.kvscope/state``."""
    if cfg.state_dir:
        base = Path(cfg.state_dir).expanduser()
    elif not cfg.clickhouse_url and not cfg.kafka_bootstrap:
        data = Path(cfg.data_dir).expanduser().resolve()
        base = data.with_name(data.name + ".state")
    else:
        base = Path.home() / ".kvscope" / "state"
    return base / f"checkpoints-{cfg.database}-{cfg.topic_namespace}.json"


def watch_logs(cfg: Config) -> None:
    """Checkpoint the start of each gateway log that has no checkpoint yet (:func:`collector.gateway_log.watch`):
    call it first at start-up, before opening the store, so lines written while kvscope starts are never lost to
    a rotation."""
    from collector.gateway_log import watch

    checkpoints = CheckpointStore(checkpoint_path(cfg))
    for p in cfg.list("gateway_log"):
        watch(p, checkpoints)


def parse_replay(specs: list[str]) -> dict[str, str]:
    """``POD=tcp://host:port`` items → {pod: replay endpoint}. Raises ValueError for an item without ``=``."""
    out = {}
    for spec in specs:
        pod, sep, endpoint = spec.partition("=")
        if not sep or not pod or not endpoint.startswith("tcp://"):
            raise ValueError(f"KV-event replay {spec!r} must be POD=tcp://host:port")
        out[pod] = endpoint
    return out


def attribution_kwargs(cfg: Config) -> dict[str, float | int]:
    """The attribution job's settings (:func:`ingest.attribution_job.run_attribution` keywords)."""
    return {"settle_seconds": cfg.attribution_settle_seconds, "overlap_seconds": cfg.attribution_overlap_seconds,
            "horizon_seconds": cfg.attribution_horizon_seconds,
            "lookback_seconds": cfg.attribution_lookback_seconds, "default_block_size": cfg.default_block_size}


def label_limits(cfg: Config) -> LabelLimits:
    """The bounds on a vLLM /metrics sample's labels (``KVSCOPE_VLLM_LABEL_*``), for the scrape and the import."""
    return LabelLimits(cfg.vllm_label_limit, cfg.vllm_label_name_length_limit, cfg.vllm_label_value_length_limit)


@dataclass
class Pipeline:
    """Collector, ingester and attribution threads over one store. ``start()`` returns once all run."""

    cfg: Config
    store: Store | None = None
    collect: bool = True
    ingest: bool = True
    attribute: bool = True
    #: (rules, notifier) to evaluate every ``alert_every_seconds`` (dashboard/alerts.py), or None for no alerts.
    alerts: tuple | None = None
    #: Send the miss-cause digest every KVSCOPE_DIGEST_EVERY from this process (``kvscope up``).
    digest: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    collector: Collector | None = None
    ingester: Ingester | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _closers: list = field(default_factory=list)
    _ingest_stop: threading.Event = field(default_factory=threading.Event)
    _queue: MemoryQueue | None = None

    def _transport(self) -> tuple[Publisher | None, Source | None]:
        if self.cfg.kafka_bootstrap:
            ns = self.cfg.topic_namespace
            pub = KafkaPublisher(self.cfg.kafka_bootstrap, namespace=ns,
                                 max_message_bytes=self.cfg.kafka_max_message_bytes) if self.collect else None
            src = KafkaSource(self.cfg.kafka_bootstrap, self.cfg.consumer_group, namespace=ns) if self.ingest else None
            return pub, src
        self._queue = MemoryQueue(max_bytes=self.cfg.queue_max_bytes)
        return QueuePublisher(self._queue), QueueSource(self._queue)

    def start(self) -> None:
        if self.store is None and (self.ingest or self.attribute):
            self.store = open_store(self.cfg, writer=True)
        publisher, source = self._transport()
        self._closers = [x for x in (publisher, source) if x is not None]
        if self.ingest:
            assert self.store is not None and source is not None
            self.ingester = Ingester(self.store, source)
            self._spawn("ingest", lambda: self.ingester.run(self._ingest_stop))  # type: ignore[union-attr]
        if self.attribute:
            store = self.store
            assert store is not None
            self._spawn("attribution", lambda: attribution_loop(
                store, self._ingest_stop, self.cfg.attribution_interval_seconds, **attribution_kwargs(self.cfg)))
        if self.alerts is not None and self.store is not None:
            from dashboard.alerts import alert_loop

            rules, notifier = self.alerts
            store, every = self.store, self.cfg.alert_every_seconds
            self._spawn("alerts", lambda: alert_loop(store, rules, notifier, self.stop, every, first_delay=every))
        if self.collect:
            assert publisher is not None
            for p in self.cfg.list("gateway_log"):
                Path(p).parent.mkdir(parents=True, exist_ok=True)
            watch_logs(self.cfg)
            self.collector = Collector(
                publisher=publisher, targets=[parse_target(t) for t in self.cfg.list("vllm")],
                gateway_logs=self.cfg.list("gateway_log"), kv_events_endpoint=self.cfg.kv_events_endpoint or None,
                kv_events_dp_ranks=self.cfg.kv_events_dp_ranks,
                kv_events_replay=parse_replay(self.cfg.list("kv_events_replay")),
                checkpoints=CheckpointStore(checkpoint_path(self.cfg)),
                scrape_checkpoints=CheckpointStore(checkpoint_path(self.cfg).with_suffix(".scrapes.json")),
                scrape_interval_seconds=self.cfg.scrape_interval_seconds, label_limits=label_limits(self.cfg),
                body_size_limit=self.cfg.vllm_body_size_limit, stop=self.stop)
            self.collector.start()
        if self.digest and self.cfg.digest_every and self.store is not None:
            self._start_digest(self.store)

    def _start_digest(self, store: Store) -> None:
        """The digest schedule (:class:`kvscope.schedule.DigestSchedule`) as a daemon thread on this store."""
        from kvscope.schedule import DigestSchedule, check_schedule

        every = check_schedule(self.cfg)
        assert every is not None
        state = checkpoint_path(self.cfg).with_name(f"digest-{self.cfg.database}.json")
        schedule = DigestSchedule(store, self.cfg, self.stop, every=every, state_path=state)
        self._spawn("digest", schedule.run)
        log.info("digest scheduled. every=%s to=%s", self.cfg.digest_every, ",".join(self.cfg.list("digest_to")))

    def _spawn(self, name: str, fn) -> None:  # type: ignore[no-untyped-def]
        th = threading.Thread(target=fn, name=f"kvscope-{name}", daemon=True)
        th.start()
        self._threads.append(th)

    def close(self, timeout: float = 15.0) -> None:
        """Stop in data-flow order so nothing already read is dropped: the collector publishes what it has,
        the ingester drains the in-process queue, the attribution job runs once more over the last requests,
        then the transports close (a consumer that leaves its group lets the next member join at once)."""
        self.stop.set()
        if self.collector:
            self.collector.close(timeout)
        deadline = time.monotonic() + timeout
        while self._queue is not None and self.ingest and not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._ingest_stop.set()
        for th in self._threads:
            th.join(timeout)
        if self.attribute and self.store is not None:
            try:
                run_attribution(self.store, **{**attribution_kwargs(self.cfg), "settle_seconds": 0.0})
            except KvscopeError as exc:
                log.warning("final attribution run failed. error=%s", exc)
        for closer in self._closers:
            closer.close()


def run_dashboard_inprocess(store: Store, address: str, port: int, context: object = None) -> None:
    """Serve the Streamlit dashboard from this process, reading ``store`` (blocks until interrupted).
    ``context`` (a :class:`dashboard.status.RunContext`) tells the pages what this process watches, for their
    start-up state and freshness lines.

    Streamlit's config is set before ``bootstrap.run`` (passing port/address only as flag options there does
    not take effect; docs/environment.md).
    """
    from streamlit.web import bootstrap

    import dashboard
    from dashboard.data import register_store
    from dashboard.status import register_context

    register_store(store)
    register_context(context)  # type: ignore[arg-type]
    flags = {"server_port": port, "server_address": address, "server_headless": True,
             "browser_gatherUsageStats": False, "server_fileWatcherType": "none", "server_runOnSave": False}
    bootstrap.load_config_options(flags)
    app = str(Path(dashboard.__file__).parent / "app.py")
    bootstrap.run(app, False, [], flags)
