"""``kvscope``: one command fronting every stage. ``kvscope --help`` lists the subcommands."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import click

from dashboard.untrusted import OneLineFormatter
from kvscope.config import ConfigError, build_config, settings_table

STORE_OPTIONS = [
    click.option("--data-dir", default=None, help="chDB data directory [KVSCOPE_DATA_DIR]."),
    click.option(
        "--clickhouse-url", default=None, help="ClickHouse server URL instead of chDB [KVSCOPE_CLICKHOUSE_URL]."
    ),
    click.option("--database", default=None, help="Database name [KVSCOPE_DATABASE]."),
]
KAFKA_OPTION = click.option(
    "--kafka-bootstrap",
    default=None,
    help="Kafka bootstrap servers instead of the in-process queue [KVSCOPE_KAFKA_BOOTSTRAP].",
)
FORMAT_OPTION = click.option(
    "--format", "fmt", type=click.Choice(["table", "markdown", "json", "csv"]), default="table", show_default=True,
    help="table: fits the terminal ($COLUMNS, else 120 when not a terminal), long cells cut with an ellipsis; "
    "markdown: a GitHub-flavoured table, nothing cut.",
)


def store_options(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(STORE_OPTIONS):
        fn = opt(fn)
    return fn


def _config(**overrides: Any):  # type: ignore[no-untyped-def]
    try:
        cfg = build_config({k: v for k, v in overrides.items() if v not in (None, ())})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=cfg.log_level, handlers=[handler])
    for noisy in ("httpx", "kafka"):  # one line per request or per reconnect drowns the pipeline's own log
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    return cfg


_STOP = threading.Event()


def _stop_on_signals() -> threading.Event:
    """The event SIGINT (Ctrl-C) and SIGTERM set. Call it when the command starts (a signal during start-up is
    then remembered, not a traceback) and again once the store is open: chDB replaces the SIGINT handler when
    it starts, so without the second call Ctrl-C would never reach Python."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _STOP.set())
    return _STOP


def _wait(stop: threading.Event) -> None:
    # wait in short slices: the main thread must return to the interpreter for the signal handler to run
    while not stop.wait(0.5):
        pass


def _run_until_interrupted(pipe) -> None:  # type: ignore[no-untyped-def]
    """Start a pipeline and run it until Ctrl-C or SIGTERM, then close it in data-flow order (the collector
    publishes what it read, the ingester drains, attribution runs once more)."""
    pipe.start()
    stop = _stop_on_signals()
    try:
        _wait(stop)
    finally:
        click.echo("kvscope: stopping (draining the pipeline)", err=True)
        pipe.close()


def _serve_self_metrics(cfg) -> None:  # type: ignore[no-untyped-def]
    """kvscope's own Prometheus metrics (rows written, dead letters, scrape failures) on KVSCOPE_METRICS_PORT."""
    if cfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.dashboard_address)
        click.echo(f"self-metrics: http://{cfg.dashboard_address}:{cfg.metrics_port}/metrics")


def _store(cfg, *, must_exist: bool = False, writer: bool = False):  # type: ignore[no-untyped-def]
    """The store the settings name, migrated (:func:`kvscope.pipeline.open_store`); ``writer``: this command
    writes it, so the retention settings are set on its tables. Every failure is click's one-line error:
    ``must_exist`` (a read-only command) and no chDB directory or no such database there, a data directory that
    cannot be one (a file on the path, permissions), the store unreachable or in use."""
    from ingest.errors import KvscopeError
    from kvscope.pipeline import open_store

    if must_exist and not cfg.clickhouse_url and not Path(cfg.data_dir).expanduser().is_dir():
        raise click.ClickException(
            f"no kvscope data at {cfg.data_dir}; give --data-dir (the demo keeps its data in .kvscope/demo/data)")
    try:
        return open_store(cfg, writer=writer, create=not must_exist)
    except OSError as exc:  # Store.open creates the chDB directory
        raise _path_error(f"--data-dir / KVSCOPE_DATA_DIR {cfg.data_dir}: cannot be the chDB data directory",
                          exc) from exc
    except KvscopeError as exc:
        msg = str(exc)
        if "Cannot lock file" in msg or "EmbeddedServer" in msg:
            msg = (
                f"the chDB data directory {cfg.data_dir} is in use by another kvscope process (chDB allows one "
                "process per directory); stop it, or query through its dashboard's SQL page"
            )
        raise click.ClickException(msg) from exc


def _path_error(what: str, exc: OSError) -> click.UsageError:
    """A directory kvscope could not create (a file on the path, permissions) as one line: ``what``, why, the
    path that failed."""
    why = ("a file is there" if isinstance(exc, FileExistsError) else "a part of the path is a file"
           if isinstance(exc, NotADirectoryError) else (exc.strerror or str(exc)).lower())
    return click.UsageError(f"{what}: {why} ({exc.filename})")


def _store_error(exc: Exception) -> click.ClickException:
    """A store error (refused, bad SQL, a limit, the store unreachable) as click's one-line ``Error: ...``, exit
    code 1, no traceback."""
    from ingest.adhoc import error_line

    return click.ClickException(error_line(str(exc)))


def _emit(df, fmt: str) -> None:  # type: ignore[no-untyped-def]
    import polars as pl

    from kvscope.tables import json_text, render_json, writable

    if fmt == "json":
        click.echo(render_json(df))
    elif fmt == "csv":  # CSV has no nested values: arrays, maps and tuples go out as JSON text
        nested = [c for c, t in df.schema.items() if t.is_nested()]
        flat = writable(df).with_columns(pl.col(c).map_elements(json_text, return_dtype=pl.String) for c in nested)
        click.echo(flat.write_csv(), nl=False)
    elif fmt == "markdown":
        from kvscope.tables import render_markdown

        click.echo(render_markdown(df), nl=False)
    else:
        from kvscope.tables import render_table, terminal_width

        tty = _stdout_is_terminal()
        click.echo(render_table(df, terminal_width(tty), styled=tty), nl=False)


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvscope")
def main() -> None:
    """kvscope: how many prompt tokens does the KV cache save, and why did the rest miss?"""


def _run_context(cfg: Any, store: Any, config: Any = None, step: Any = None) -> Any:
    """What this process watches, for the dashboard's start-up state and freshness (dashboard/status.py)."""
    from datetime import UTC

    from dashboard.status import RunContext

    return RunContext(started_at=datetime.now(UTC), config=config or (lambda: cfg), step=step or (lambda: ""),
                      store=f"{store.dsn}, database {cfg.database}")


@main.command()
@click.option("--vllm", "vllm", multiple=True, help="vLLM pod: NAME=http://host:port or http://host:port (repeat).")
@click.option("--gateway-log", multiple=True, help="Gateway fingerprint log (JSONL) to tail (repeat).")
@click.option(
    "--kv-events-endpoint", default=None, help="ZMQ endpoint to bind for KV events, e.g. tcp://127.0.0.1:5557."
)
@store_options
@KAFKA_OPTION
@click.option("--port", "dashboard_port", type=int, default=None, help="Dashboard port [KVSCOPE_DASHBOARD_PORT].")
@click.option("--address", "dashboard_address", default=None, help="Dashboard address [KVSCOPE_DASHBOARD_ADDRESS].")
@click.option("--no-dashboard", is_flag=True, help="Run the pipeline only (until Ctrl-C).")
@click.option("--digest-every", default=None,
              help="Email the miss-cause digest of the last interval this often, e.g. 24h [KVSCOPE_DIGEST_EVERY].")
def up(no_dashboard: bool, **opts: Any) -> None:
    """Observe an existing fleet in one process: collect, ingest, attribute, and serve the dashboard."""
    import streamlit  # noqa: F401  (import before threads start; docs/environment.md)

    from kvscope.pipeline import Pipeline, run_dashboard_inprocess, watch_logs

    _stop_on_signals()
    cfg = _config(**opts)
    alerts = _alert_setup(cfg)  # a bad rules file stops start-up before anything starts
    _check_digest_schedule(cfg)
    try:
        watch_logs(cfg)  # before the store opens (seconds): lines written meanwhile survive a rotation and a kill
    except OSError as exc:
        raise _path_error("the collector's checkpoints (KVSCOPE_STATE_DIR, else beside --data-dir) cannot be "
                          "written", exc) from exc
    store = _store(cfg, writer=True)
    _stop_on_signals()  # again: chDB took SIGINT when it opened
    _serve_self_metrics(cfg)  # once it answers, the store is open and Ctrl-C is ours
    pipe = Pipeline(cfg, store=store, alerts=alerts, digest=True)
    click.echo(
        f"kvscope up: store={store.dsn} database={cfg.database} pods={cfg.list('vllm')} logs={cfg.list('gateway_log')}"
    )
    if no_dashboard or _STOP.is_set():
        _run_until_interrupted(pipe)
        return
    context = _run_context(cfg, store)
    pipe.start()
    try:
        click.echo(f"dashboard: http://{cfg.dashboard_address}:{cfg.dashboard_port}")
        run_dashboard_inprocess(store, cfg.dashboard_address, cfg.dashboard_port, context)  # Streamlit handles signals
    except KeyboardInterrupt:
        pass
    finally:
        pipe.close()


def _check_digest_schedule(cfg) -> None:  # type: ignore[no-untyped-def]
    """Refuse at start a KVSCOPE_DIGEST_EVERY that could never send (bad duration, no recipient, no server)."""
    from kvscope.schedule import check_schedule

    try:
        every = check_schedule(cfg)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if every is not None:
        click.echo(f"digest: every {cfg.digest_every} to {', '.join(cfg.list('digest_to'))}")


@main.command()
@click.option("--pods", type=int, default=2, show_default=True, help="vLLM CPU servers to start.")
@click.option("--scale", type=float, default=1.0, show_default=True, help="Workload size multiplier per round.")
@click.option("--routing-policy", type=click.Choice(["round_robin", "prefix_affinity"]), default=None,
              help="How the demo's gateway picks a pod [KVSCOPE_ROUTING_POLICY].")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=Path(".kvscope/demo"),
    show_default=True,
    help="Where the demo writes server logs, the gateway log and workload labels.",
)
@store_options
@click.option("--port", "dashboard_port", type=int, default=None, help="Dashboard port [KVSCOPE_DASHBOARD_PORT].")
@click.option("--address", "dashboard_address", default=None, help="Dashboard address [KVSCOPE_DASHBOARD_ADDRESS].")
@click.option("--rounds", type=int, default=0,
              help="Send the workload this many times (new conversations each), then keep serving; 0 = until Ctrl-C.")
def demo(pods: int, scale: float, workdir: Path, rounds: int, **opts: Any) -> None:
    """Demo fleet of real vLLM CPU servers + gateway + workload + `kvscope up`; prints the dashboard URL."""
    import os

    import streamlit  # noqa: F401

    from demo.run import DemoRun
    from kvscope.pipeline import run_dashboard_inprocess

    chosen = ("data_dir", "clickhouse_url")
    if all(opts.get(k) is None and not os.environ.get(f"KVSCOPE_{k.upper()}") for k in chosen):
        opts["data_dir"] = str(workdir / "data")  # the demo's own store unless one was chosen
    cfg = _config(**opts)
    alerts = _alert_setup(cfg)
    _serve_self_metrics(cfg)
    store = _store(cfg, writer=True)
    run = DemoRun(cfg, store, workdir=workdir, pods=pods, scale=scale, rounds=rounds, alerts=alerts)
    context = _run_context(cfg, store, config=lambda: run.pipeline.cfg if run.pipeline else cfg,
                           step=lambda: run.status)
    run.start_background()
    click.echo(
        f"dashboard: http://{cfg.dashboard_address}:{cfg.dashboard_port}  (vLLM servers start in ~2 min; "
        f"numbers appear as the workload runs; logs in {workdir})"
    )
    try:
        run_dashboard_inprocess(store, cfg.dashboard_address, cfg.dashboard_port, context)
    except KeyboardInterrupt:
        pass
    finally:
        run.close()


@main.command()
@click.option("--vllm", "vllm", multiple=True, help="vLLM pod: NAME=http://host:port (repeat).")
@click.option("--gateway-log", multiple=True, help="Gateway log (JSONL) to tail (repeat).")
@click.option("--kv-events-endpoint", default=None, help="ZMQ endpoint to bind for KV events.")
@KAFKA_OPTION
def collect(**opts: Any) -> None:
    """Run the collector only, publishing to Kafka (distributed mode)."""
    from kvscope.pipeline import Pipeline

    _stop_on_signals()
    cfg = _config(**opts)
    _serve_self_metrics(cfg)
    if not cfg.kafka_bootstrap:
        raise click.UsageError("kvscope collect publishes to Kafka: give --kafka-bootstrap (or use kvscope up)")
    _run_until_interrupted(Pipeline(cfg, collect=True, ingest=False, attribute=False))


@main.command()
@store_options
@KAFKA_OPTION
@click.option("--consumer-group", default=None, help="Kafka consumer group [KVSCOPE_CONSUMER_GROUP].")
@click.option(
    "--attribution/--no-attribution",
    default=False,
    show_default=True,
    help="Also run the miss-cause attribution job. It must run in ONE process per database: use it on a "
    "single replica, or run `kvscope attribute` as its own service.",
)
def ingest(attribution: bool, **opts: Any) -> None:
    """Run an ingester: Kafka consumer group → ClickHouse (migrations applied at start)."""
    from kvscope.pipeline import Pipeline

    _stop_on_signals()
    cfg = _config(**opts)
    _serve_self_metrics(cfg)
    if not cfg.kafka_bootstrap:
        raise click.UsageError("kvscope ingest consumes Kafka: give --kafka-bootstrap (or use kvscope up)")
    _run_until_interrupted(Pipeline(cfg, store=_store(cfg, writer=True), collect=False, ingest=True,
                                    attribute=attribution))


@main.command()
@store_options
@click.option("--once", is_flag=True, help="One run, then exit (e.g. from cron); default: every interval.")
@click.option("--kv-evidence/--no-kv-evidence", default=True, show_default=True,
              help="Precise mode: judge requests that logged a block chain against the pods' KV events; "
                   "--no-kv-evidence attributes from fingerprints alone (to compare).")
def attribute(once: bool, kv_evidence: bool, **opts: Any) -> None:
    """Run the miss-cause attribution job alone (distributed mode: exactly one per database)."""
    from ingest.attribution_job import attribution_loop, run_attribution
    from kvscope.pipeline import attribution_kwargs

    cfg = _config(**opts)
    _serve_self_metrics(cfg)
    store = _store(cfg, writer=True)
    kwargs = {**attribution_kwargs(cfg), "kv_evidence": kv_evidence}
    if once:
        stats = run_attribution(store, **kwargs)
        click.echo(f"attribution: {stats.arrivals} new answers, {stats.changed} changed")
        return
    stop = _stop_on_signals()
    thread = threading.Thread(target=attribution_loop, args=(store, stop, cfg.attribution_interval_seconds),
                              kwargs=kwargs, daemon=True)
    thread.start()
    _wait(stop)
    thread.join(30)


@main.command()
@store_options
@click.option("--port", "dashboard_port", type=int, default=None, help="Dashboard port [KVSCOPE_DASHBOARD_PORT].")
@click.option("--address", "dashboard_address", default=None, help="Dashboard address [KVSCOPE_DASHBOARD_ADDRESS].")
def dashboard(**opts: Any) -> None:
    """Serve the dashboard alone (reads a ClickHouse server, or a chDB directory no other process holds)."""
    from kvscope.pipeline import run_dashboard_inprocess

    cfg = _config(**opts)
    run_dashboard_inprocess(_store(cfg), cfg.dashboard_address, cfg.dashboard_port)


@main.command()
@click.option("--pod", "pods", multiple=True, required=True, help="NAME=http://host:port of a vLLM pod (repeat).")
@click.option("--log", "log_path", type=click.Path(path_type=Path), required=True, help="Fingerprint log to append to.")
@click.option("--policy", "routing_policy", type=click.Choice(["round_robin", "prefix_affinity"]), default=None,
              help="Routing policy [KVSCOPE_ROUTING_POLICY].")
@click.option("--tokenizer", default=None, help="HF tokenizer.json for segment token counts [KVSCOPE_TOKENIZER].")
@click.option("--port", "gateway_port", type=int, default=None, help="Listen port [KVSCOPE_GATEWAY_PORT].")
@click.option("--block-chain", "gateway_block_chain", type=click.Choice(["auto", "off"]), default=None,
              help="Log each prompt's KV block chain (precise mode) [KVSCOPE_GATEWAY_BLOCK_CHAIN].")
@click.option("--block-size", "gateway_block_size", type=int, default=None,
              help="KV block size for the chains; 0 = each pod's /metrics [KVSCOPE_GATEWAY_BLOCK_SIZE].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
def gateway(pods: tuple[str, ...], log_path: Path, host: str, **opts: Any) -> None:
    """The reference gateway: OpenAI-compatible proxy that routes and writes the fingerprint log."""
    from gateway.proxy import make_app, serve

    cfg = _config(**opts)
    parsed = []
    for spec in pods:
        name, sep, url = spec.partition("=")
        if not sep:
            raise click.UsageError(f"--pod {spec!r}: expected NAME=http://host:port")
        parsed.append((_not_blank("--pod", name, "give NAME=http://host:port"), url.rstrip("/")))
    app = make_app(
        parsed, log_path, policy=cfg.routing_policy, tokenizer_path=Path(cfg.tokenizer) if cfg.tokenizer else None,
        block_chain=cfg.gateway_block_chain, block_size=cfg.gateway_block_size,
    )
    serve(app, host, cfg.gateway_port)


@main.group(name="import")
def import_() -> None:
    """Load files into the store (gateway logs, /metrics snapshots, workload labels)."""


#: Exit code of an import stopped by Ctrl-C (SIGINT) or SIGTERM: 128 + SIGINT, as a shell reports it.
INTERRUPTED_EXIT = 130


@contextlib.contextmanager
def _interruptible() -> Iterator[threading.Event]:
    """An event Ctrl-C (SIGINT) and SIGTERM set while the block runs, for a command that stops between units of
    work it writes whole (an import's chunks or files). Enter it after the store is open (chDB replaces the
    SIGINT handler when it starts: Ctrl-C was swallowed and the import ran to its end). The handlers are restored
    after."""
    import signal

    stop = threading.Event()
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = [signal.getsignal(sig) for sig in sigs]
    for sig in sigs:
        signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in zip(sigs, before, strict=True):
            signal.signal(sig, handler)


def _interrupted(done: str, then: str = "run the same import again to load the rest (what is stored is skipped, "
                                        "nothing is counted twice)") -> NoReturn:
    """Report an import stopped by a signal (``done``: what it wrote; ``then``: what finishes it) and exit with
    :data:`INTERRUPTED_EXIT`."""
    click.echo(f"kvscope: interrupted: {done}; {then}", err=True)
    sys.exit(INTERRUPTED_EXIT)


def _unreadable(file: str, exc: OSError) -> click.ClickException:
    """A file that passed click's checks but cannot be read (removed since, a permission, a device) as one line."""
    from kvscope.importer import utf8_text

    return click.ClickException(f"{utf8_text(file)}: cannot be read: {(exc.strerror or str(exc)).lower()}")


@import_.command("gateway-log")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@store_options
def import_gateway_log(files: tuple[str, ...], **opts: Any) -> None:
    """Load gateway fingerprint log JSONL files (streamed, any size; a pipe such as <(zcat log.gz) too); bad
    lines go to dead_letters with their reason; lines already in the store are skipped. Ctrl-C stops after the
    chunk being written (exit code 130): run the same import again to load the rest."""
    from ingest.attribution_job import run_attribution
    from ingest.bulk import load_gateway_log
    from ingest.errors import KvscopeError
    from kvscope.importer import CompressedFile, utf8_text
    from kvscope.pipeline import attribution_kwargs

    cfg = _config(**opts)
    store = _store(cfg, writer=True)

    def progress(name: str):  # type: ignore[no-untyped-def]
        return lambda stats: click.echo(f"  {name}: {stats.lines:,} lines read, {stats.rows:,} requests loaded",
                                        err=True)

    with _interruptible() as stop:
        try:
            for i, f in enumerate(files):
                name = utf8_text(f)  # a file name is bytes: not all of them print
                try:
                    stats = load_gateway_log(store, f, stop=stop, progress=progress(name))
                except OSError as exc:
                    raise _unreadable(f, exc) from exc
                click.echo(f"{name}: {stats.rows} requests, {stats.duplicates} already stored, "
                           f"{stats.dead_letters} dead letters")
                if stats.expired:
                    click.echo(f"  {stats.expired} lines not loaded: older than the retention of gateway_requests, "
                               "which ClickHouse would drop at insert (kvscope query dead_letters names them)",
                               err=True)
                if stats.conflicts:
                    click.echo(f"  {stats.conflicts} lines not loaded: the store holds their (request_id, ts) with "
                               "other values (the stored rows are kept; kvscope query dead_letters names the "
                               "columns)", err=True)
                if stats.interrupted:
                    later = len(files) - i - 1
                    _interrupted(f"{name} loaded up to line {stats.lines:,}" + (
                        f", {later} files after it not read" if later else "") + ", the attribution not run")
            answers = run_attribution(store, **{**attribution_kwargs(cfg), "settle_seconds": 0.0}, stop=stop)
            if stop.is_set():  # the run stops between its chunks, leaving its watermark: a later run resumes
                _interrupted(f"every file loaded, the attribution interrupted after {answers.arrivals} new answers",
                             "kvscope attribute --once (or the next import) answers any left")
        except KvscopeError as exc:  # lines already loaded stay; a rerun skips them
            raise _store_error(exc) from exc
        except CompressedFile as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"attribution: {answers.arrivals} new answers, {answers.changed} changed")


@import_.command("labels")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--run-id", default=None,
              callback=lambda _ctx, _param, v: None if v is None else _name_option("--run-id", v),
              help="Run id of the lines that carry none (default: the file's name without its extension).")
@store_options
def import_labels(files: tuple[str, ...], run_id: str | None, **opts: Any) -> None:
    """Load workload label JSONL files (the ground truth of a labelled run, e.g. .kvscope/demo/labels-*.jsonl)
    into workload_labels, each request once (a label already stored is skipped); bad lines go to dead_letters
    with their reason. Streamed in chunks of 50,000 lines (any size; a pipe such as <(zcat labels.gz) too).
    Compare with attribution: `kvscope query attribution_agreement`. Exits 1 when no line of any file could be
    used; Ctrl-C stops after the chunk being written (exit code 130): run the same import again to load the
    rest."""
    from ingest.errors import KvscopeError
    from ingest.labels import load_labels
    from kvscope.importer import CompressedFile, utf8_text

    cfg = _config(**opts)
    store = _store(cfg, writer=True)
    usable = 0

    def progress(name: str):  # type: ignore[no-untyped-def]
        return lambda stats: click.echo(f"  {name}: {stats.lines:,} lines read, {stats.rows:,} labels loaded",
                                        err=True)

    with _interruptible() as stop:
        for i, f in enumerate(files):
            name = utf8_text(f)
            if stop.is_set():
                _interrupted(f"{i} of {len(files)} files loaded, from {name} on not read")
            try:
                stats = load_labels(store, f, run_id=run_id or utf8_text(Path(f).stem), stop=stop,
                                    progress=progress(name))
            except KvscopeError as exc:
                raise _store_error(exc) from exc
            except CompressedFile as exc:
                raise click.ClickException(str(exc)) from exc
            except OSError as exc:
                raise _unreadable(f, exc) from exc
            usable += stats.rows + stats.duplicates
            click.echo(f"{name}: {stats.rows} labels, {stats.duplicates} already stored, {stats.reasons.total()} bad "
                       f"lines ({stats.dead_letters} new dead letters)")
            for reason, count in stats.reasons.most_common(5):
                click.echo(f"  {count} × {reason}", err=True)
            if stats.interrupted:
                later = len(files) - i - 1
                _interrupted(f"{name} loaded up to line {stats.lines:,}" + (
                    f", {later} files after it not read" if later else ""))
    if not usable:
        raise click.ClickException("no label loaded: every line was refused (reasons above; kvscope query "
                                   "dead_letters)")


@import_.command("metrics")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--pod", required=True, callback=lambda _ctx, _param, v: _name_option("--pod", v),
              help="Pod name the snapshot came from.")
@click.option("--at", "at", required=True, help="When it was scraped, ISO 8601 (e.g. 2026-11-29T12:00:00Z).")
@store_options
def import_metrics(file: str, pod: str, at: str, **opts: Any) -> None:
    """Load one /metrics snapshot (Prometheus text) as a scrape of POD at time AT. Exits 1 when nothing was
    loaded (empty, HTML, gzip or non-vLLM body; a scrape of POD at AT already stored): see dead_letters."""
    from kvscope.importer import import_metrics as load
    from kvscope.importer import utf8_text
    from kvscope.pipeline import label_limits

    try:
        ts = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(f"{at!r} is not ISO 8601", param_hint="--at") from exc
    if ts.tzinfo is None:
        raise click.BadParameter("give a time zone (e.g. Z)", param_hint="--at")
    try:
        at_ms = int(ts.astimezone(UTC).timestamp() * 1000)
    except (OverflowError, ValueError) as exc:  # an offset that moves year 1 or 9999 out of the calendar
        raise click.BadParameter(f"{at!r} is outside the years 1..9999 in UTC", param_hint="--at") from exc
    cfg = _config(**opts)
    store = _store(cfg, writer=True)
    try:
        raw = Path(file).read_bytes()
    except OSError as exc:
        raise _unreadable(file, exc) from exc
    result = load(store, pod, Path(file), raw, at_ms, label_limits(cfg))
    name = utf8_text(file)  # a file name is bytes: not all of them print
    if not result.loaded:
        why = "; ".join(dict.fromkeys(result.reasons)) or (
            "the body holds only counters, and a lone snapshot's counters are a baseline (no previous scrape)")
        raise click.ClickException(f"{name}: nothing loaded: {why} ({len(result.reasons)} dead letters)")
    click.echo(f"{name}: {result.series} series, {result.configs} cache configs (a lone snapshot is a baseline: "
               f"gauges and the cache config; counters need a previous scrape), {len(result.reasons)} dead letters")


def _not_blank(option: str, value: str, fix: str = "give a name") -> str:
    """``value`` of ``option``, or click's usage error (one line: the option, the value, ``fix``) when it is
    empty or only whitespace: a pod stored or a pod, tenant or model filter given under a blank name matches
    nothing the user can name."""
    if not value.strip():
        raise click.BadParameter(f"{value!r} is blank; {fix}", param_hint=option)
    return value


def _name_option(option: str, value: str) -> str:
    """``value`` of an option that is stored as a name (a run id, a pod): not blank (:func:`_not_blank`), at most
    :data:`ingest.labels.NAME_MAX_CHARS` characters and valid UTF-8, as the names a file's lines give; else
    click's usage error."""
    from ingest.labels import NAME_MAX_CHARS

    _not_blank(option, value)
    if len(value) > NAME_MAX_CHARS:
        raise click.BadParameter(f"longer than {NAME_MAX_CHARS} characters", param_hint=option)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise click.BadParameter(f"not UTF-8 (byte {exc.start} of the argument)", param_hint=option) from None
    return value


def _params(pairs: tuple[str, ...]) -> dict[str, str]:
    """``--param key=value`` items as a dict. A usage error for an item without ``=``, with a blank value
    (``pod=``, ``tenant=" "``: a parameter left out takes its default, '' = all for the filters), or a key given
    twice (``pod=a --param pod=b`` ran for pod b alone, silently)."""
    out: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep:
            raise click.BadParameter(f"{p!r}: expected key=value", param_hint="--param")
        if k in out:
            raise click.BadParameter(f"{k} is given twice ({out[k]!r} and {v!r}); a query takes one value of each "
                                     "parameter", param_hint=f"--param {k}")
        out[k] = _not_blank(f"--param {k}", v, f"leave --param {k} out for its default (pod, tenant, model ...: all)")
    return out


@main.command()
@click.argument("name", required=False)
@click.option("--param", "params", multiple=True, help="key=value for a query parameter (repeat).")
@FORMAT_OPTION
@click.option("--list", "list_", is_flag=True, help="List the named queries with their parameters and columns.")
@click.option("--show-sql", is_flag=True,
              help="Print the query's SQL with its shared parts (sql/parts/) expanded, to adapt and run elsewhere.")
@store_options
def query(name: str | None, params: tuple[str, ...], fmt: str, list_: bool, show_sql: bool, **opts: Any) -> None:
    """Run a named query from sql/queries/ (see --list)."""
    import sql as sqlfiles
    from ingest.errors import KvscopeError

    if show_sql and name:
        try:
            click.echo(sqlfiles.load_query(name).sql)
        except KeyError as exc:
            raise click.UsageError(str(exc.args[0])) from exc
        except sqlfiles.HeaderError as exc:
            raise click.ClickException(str(exc)) from exc
        return

    if list_ or not name:
        for n in sqlfiles.query_names():
            q = sqlfiles.load_query(n)
            click.echo(f"{n}: {q.description}")
            for p in q.params:
                click.echo(
                    f"    --param {p.name}=<{p.type}>"
                    + (f" (default {p.default})" if p.default is not None else "")
                    + (f"  {p.help}" if p.help else "")
                )
            click.echo("    returns: " + ", ".join(f"{c.name} {c.type}" for c in q.returns))
        return
    values = _params(params)
    cfg = _config(**opts)
    try:
        df = _store(cfg, must_exist=True).named(name, values)
    except KvscopeError as exc:
        raise _store_error(exc) from exc
    _emit(df, fmt)


@main.command(name="sql")
@click.argument("statement")
@FORMAT_OPTION
@store_options
def sql_(statement: str, fmt: str, **opts: Any) -> None:
    """Run one read-only statement (SELECT, WITH, SHOW, DESCRIBE of a table, EXISTS, EXPLAIN) of the database's
    tables (no file(), url() or other table function a read-only ClickHouse user may not call), with the
    database enforcing readonly, max_execution_time, max_memory_usage (KVSCOPE_ADHOC_MAX_MEMORY_BYTES),
    max_result_rows and max_result_bytes. DateTime values print as datetimes (UTC unless the type names a
    zone), inside an Array, Tuple or Map too. A failure is one line on stderr and exit code 1."""
    from ingest.adhoc import ADHOC_MAX_ROWS
    from ingest.errors import KvscopeError

    cfg = _config(**opts)
    try:
        df = _store(cfg, must_exist=True).adhoc(statement)
    except KvscopeError as exc:
        raise _store_error(exc) from exc
    _emit(df, fmt)
    if df.height >= ADHOC_MAX_ROWS:
        click.echo(f"(at most {ADHOC_MAX_ROWS} rows are returned: the result may have more)", err=True)


def _alert_setup(cfg):  # type: ignore[no-untyped-def]
    """The alert rules and notifier the settings name; a bad rules file or mail setting is a usage error."""
    from dashboard.alert_delivery import Notifier
    from dashboard.alert_rules import AlertRulesError, load_rules
    from dashboard.mail import MailError

    try:
        return load_rules(cfg.alert_rules), Notifier.from_config(cfg)
    except (AlertRulesError, MailError) as exc:
        raise click.UsageError(str(exc)) from exc


@main.command()
@store_options
@click.option("--rules", "alert_rules", default=None,
              help="Alert rules file (TOML) [KVSCOPE_ALERT_RULES]; default: the built-in rules (docs/alerts.md).")
@click.option("--every", "alert_every_seconds", type=float, default=None,
              help="Seconds between evaluations [KVSCOPE_ALERT_EVERY_SECONDS].")
@click.option("--once", is_flag=True, help="Evaluate every rule once, print the states, exit 0.")
@FORMAT_OPTION
def alerts(once: bool, fmt: str, **opts: Any) -> None:
    """Evaluate the alert rules on schedule; notify the webhook (KVSCOPE_ALERT_WEBHOOK_URL) and email
    (KVSCOPE_ALERT_TO) when a rule starts or stops firing. `kvscope up` does this too."""
    import polars as pl

    from dashboard.alerts import alert_loop, iso, run_once
    from ingest.errors import KvscopeError

    cfg = _config(**opts)
    rules, notifier = _alert_setup(cfg)
    store = _store(cfg, must_exist=True)  # a mistyped --data-dir would otherwise be a new, empty store: all "ok"
    if once:
        try:
            evs = run_once(store, rules, notifier)
        except KvscopeError as exc:
            raise _store_error(exc) from exc
        _emit(pl.DataFrame([{"rule": e.rule.name, "state": e.state, "since": iso(e.changed_at),
                             "severity": e.rule.severity, "value": e.value, "threshold": e.rule.threshold,
                             "unit": e.rule.unit, "message": e.message} for e in evs],
                           schema_overrides={"value": pl.Float64}), fmt)
        return
    _serve_self_metrics(cfg)
    stop = _stop_on_signals()
    click.echo(f"kvscope alerts: {len(rules)} rules every {cfg.alert_every_seconds:g} s", err=True)
    thread = threading.Thread(target=alert_loop, args=(store, rules, notifier, stop, cfg.alert_every_seconds),
                              daemon=True)
    thread.start()
    _wait(stop)
    thread.join(30)


@main.command()
@click.option("--period", "length", default="24h", show_default=True,
              help="Length of the period (e.g. 1h, 24h, 7d, 1h30m); compared with the period of the same length "
              "before it.")
@click.option("--since", default=None, help="Start of the period, ISO 8601 in UTC unless it has an offset (default: "
              "--until minus --period).")
@click.option("--until", default=None, help="End of the period, ISO 8601 (default: --since plus --period when "
              "--since is given, else now, to the whole minute).")
@click.option("--to", "to", multiple=True, help="Recipient (repeat) [KVSCOPE_DIGEST_TO].")
@click.option("--dry-run", "dry_run", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the message to this .eml file and send nothing.")
@store_options
def digest(length: str, since: str | None, until: str | None, to: tuple[str, ...], dry_run: Path | None,
           **opts: Any) -> None:
    """Email the miss-cause digest: a period against the one before (hit rate, missed tokens by cause, the
    tenants losing most with the fix, drift, cardinality, affinity, hold time, data quality). docs/digest.md."""
    from dashboard import digest as dg
    from dashboard.mail import MailError, MailSettings, check_addresses, send, write_eml
    from ingest.errors import KvscopeError
    from kvscope.schedule import digest_message

    try:
        window = dg.period(dg.parse_duration(length), since=dg.parse_time(since) if since else None,
                           until=dg.parse_time(until) if until else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    cfg = _config(**opts)
    recipients = list(to) or cfg.list("digest_to")
    try:
        check_addresses(recipients, "--to" if to else "KVSCOPE_DIGEST_TO")
        msg = digest_message(_store(cfg, must_exist=True), cfg, *window, recipients)
        if dry_run:
            try:
                written = write_eml(msg, dry_run)
            except OSError as exc:  # a directory that cannot be made, a permission, a full disk
                why = (exc.strerror or str(exc)).lower()
                raise click.ClickException(f"--dry-run {dry_run}: the message cannot be written: {why}") from exc
            click.echo(f"digest written to {written} (nothing sent): {msg['Subject']}")
            return
        send(msg, MailSettings.from_config(cfg))
    except MailError as exc:
        raise click.ClickException(str(exc)) from exc
    except KvscopeError as exc:
        raise _store_error(exc) from exc
    click.echo(f"digest sent to {', '.join(recipients)}: {msg['Subject']}")


@main.command()
@store_options
def migrate(**opts: Any) -> None:
    """Apply the SQL migrations in sql/migrations (also done by every command that opens the store) and set the
    tables' retention to KVSCOPE_RETENTION_DAYS / KVSCOPE_ROLLUP_RETENTION_DAYS (as every command that writes)."""
    cfg = _config(**opts)
    _store(cfg, writer=True)
    click.echo("migrations up to date")


@main.command()
def settings() -> None:
    """Print every KVSCOPE_* setting with its default and meaning."""
    click.echo(settings_table())


if __name__ == "__main__":
    sys.exit(main())
