"""``make bench``: kvscope at fleet scale, every figure printed beside its goal or its alternative, measured in
this run (issue "Fleet scale"; docs/scale.md). Not a test: it asserts nothing.

Store side (this script, one chDB directory, one database per size): generated history (bench/history.py) at
``--requests`` sizes, then, per size: the raw insert rate (no materialized views) beside the insert through
the real tables; the attribution job's rate and its memory; every named query's p50/p95 over windows and
filters; every dashboard page (Streamlit AppTest); stored bytes per request; and once: the gateway-log import
rate beside the raw insert, bytes of vLLM series per pod-day. Then bench/collector.py and bench/gateway.py.

Attribution with KV-event evidence (precise mode, bench/kv_history.py) at ``--kv-requests`` sizes, beside the same
store attributed with the evidence off.

Usage: ``python -m bench.run [--requests 1000000 10000000] [--kv-requests 1000000 [10000000]] [--quick] [--no-collector]
[--no-gateway]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
ROWS: list[tuple[str, str, str]] = []  # (figure, value, goal or alternative)


def report(figure: str, value: str, goal: str = "") -> None:
    ROWS.append((figure, value, goal))
    print(f"  {figure:<62} {value:>22}   {goal}", flush=True)


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class PeakRss:
    """Samples this process's resident memory every 20 ms while in the block: ``peak - start`` bytes."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def grew(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_history(store: Any, n: int) -> float:
    """Insert ``n`` generated requests ending now (10^6 per generated chunk); returns rows/s of the inserts."""
    from bench.history import gateway_table

    spent = 0.0
    chunk = 1_000_000
    end = datetime.now(UTC)
    for k, start in enumerate(range(0, n, chunk)):
        size = min(chunk, n - start)
        # chunks laid back to back in time, the last ending now (500 requests/s)
        chunk_end = end - timedelta(seconds=(n - start - size) / 500.0)
        table = gateway_table(size, seed=k, end=chunk_end, id_prefix=f"b{k}")
        t = time.perf_counter()
        for i in range(0, size, 100_000):
            store.insert_arrow("gateway_requests", table.slice(i, 100_000))
        spent += time.perf_counter() - t
    return n / spent


def bench_insert(store: Any, n: int) -> None:
    from bench.history import gateway_table

    table = gateway_table(min(n, 500_000), seed=99, id_prefix="raw")
    store.command("CREATE TABLE IF NOT EXISTS raw_insert AS gateway_requests")
    t = time.perf_counter()
    for i in range(0, table.num_rows, 100_000):
        store.insert_arrow("raw_insert", table.slice(i, 100_000))
    raw = table.num_rows / (time.perf_counter() - t)
    store.command("DROP TABLE raw_insert")
    report("raw insert, gateway_requests shape, no views (rows/s)", f"{raw:,.0f}", "the store's own rate")
    globals()["RAW_RATE"] = raw


def bench_attribution(store: Any, n: int) -> None:
    from ingest.attribution_job import run_attribution

    with PeakRss() as mem:
        t, c = time.perf_counter(), time.process_time()
        stats = run_attribution(store, settle_seconds=-60)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    report(f"attribution, {n:,} requests: rate (requests/s, wall)", f"{stats.arrivals / wall:,.0f}",
           "goal >= 100,000 on one core (was 10,400)")
    report(f"attribution, {n:,} requests: rate (requests per CPU second)", f"{stats.arrivals / cpu:,.0f}",
           "chDB's queries run in this process too")
    report(f"attribution, {n:,} requests: memory grown (MB)", f"{mem.grew / 1e6:,.0f}",
           "bounded by the chunk (5·10^5 requests without chains), not the history (was 6,600 MB per 10^6)")


def load_kv_history(store: Any, n: int, hold_back: int = 0) -> tuple[int, int, pa.Table | None]:
    """Insert ``n`` generated requests with their block chains and their pods' KV events (bench/kv_history.py),
    ending now, except the gateway rows of the last ``hold_back`` requests (their KV events are inserted);
    returns (requests, KV events) inserted and the rows held back (None when none)."""
    from bench.history import gateway_table
    from bench.kv_history import block_chains, kv_events_table

    chunk, end, events, held = 1_000_000, datetime.now(UTC), 0, None
    for k, start in enumerate(range(0, n, chunk)):
        size = min(chunk, n - start)
        table = gateway_table(size, seed=k, end=end - timedelta(seconds=(n - start - size) / 500.0),
                              id_prefix=f"b{k}")
        chains, _ = block_chains(table)
        table = table.append_column("prompt_block_hashes", chains).append_column(
            "prompt_block_size", pa.array(np.full(size, 32), pa.uint32()))
        kv = kv_events_table(table, chains, seed=k, id_prefix=f"kv{k}")
        if start + size == n and hold_back:  # rows in arrival order: the last ones arrive after the backlog
            table, held = table.slice(0, size - hold_back), table.slice(size - hold_back)
        for i in range(0, table.num_rows, 100_000):
            store.insert_arrow("gateway_requests", table.slice(i, 100_000))
        for i in range(0, kv.num_rows, 100_000):
            store.insert_arrow("kv_block_events", kv.slice(i, 100_000))
        events += kv.num_rows
    return n - (0 if held is None else held.num_rows), events, held


def _rows_read() -> float:
    """kvscope_attribution_kv_log_rows_read_total in this process (ingest.kv_evidence.KV_ROWS_READ)."""
    from prometheus_client import REGISTRY

    import ingest.kv_evidence  # noqa: F401  (registers the counter)

    return REGISTRY.get_sample_value("kvscope_attribution_kv_log_rows_read_total") or 0.0


def bench_attribution_kv(store_factory: Callable[[str], Any], n: int) -> None:
    """Attribution with KV-event evidence (precise mode) on its own store, then the same store attributed again
    with the evidence off: each rate (wall and per CPU second: chDB's queries run in this process too) and its
    peak memory, beside the goal (issue "Benchmark": >= 100,000 requests/s on one core, linear in requests)."""
    from ingest.attribution_job import run_attribution

    label = f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"
    store = store_factory(f"kv_{label}".replace(".", "_"))
    _, events, live = load_kv_history(store, n, hold_back=LIVE_RUN)
    log_rows = store.query_rows("SELECT count() FROM kv_block_log")[0][0]
    print(f"  {n:,} requests, {events:,} KV events, {log_rows:,} kv_block_log rows", flush=True)
    for evidence in (True, False):
        if not evidence:
            store.command("TRUNCATE TABLE request_attribution")
            store.command("TRUNCATE TABLE attribution_watermark")
        read_before = _rows_read()
        with PeakRss() as mem:
            t, c = time.perf_counter(), time.process_time()
            stats = run_attribution(store, settle_seconds=0, kv_evidence=evidence)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
        if evidence and stats.arrivals:
            read = (_rows_read() - read_before) / stats.arrivals
            report(f"attribution with KV evidence, {n:,} requests: kv_block_log rows read per request", f"{read:,.1f}",
                   f"the log holds {log_rows / n:,.1f} per request (each row read once: linear in requests)")
        mode = "with KV evidence" if evidence else "KV evidence off"
        share = store.query_rows("SELECT countIf(evidence = 'kv_events') / count() FROM request_attribution "
                                 "WHERE length(causes) > 0")[0][0]
        goal = "goal >= 100,000 on one core"
        report(f"attribution {mode}, {n:,} requests: rate (requests/s, wall)", f"{stats.arrivals / wall:,.0f}",
               f"{goal}; {share:.0%} of attributed requests judged on KV evidence")
        report(f"attribution {mode}, {n:,} requests: rate (requests per CPU second)", f"{stats.arrivals / cpu:,.0f}",
               goal)
        report(f"attribution {mode}, {n:,} requests: peak memory grown (MB)", f"{mem.grew / 1e6:,.0f}",
               "bounded by the chunk (10^5 requests with chains, 5·10^5 without), not the history")
        if evidence and live is not None:  # after the backlog's figures (it reads the log too)
            bench_live_run(store, live, log_rows)
    # The KV named queries read the residency view (sql/migrations/0017), which pairs every kv_block_log row
    # at read time: measured here, where the store holds KV events (the query stores above hold none).
    for name in ("kv_evictions", "kv_resident_at"):
        t = time.perf_counter()
        store.named(name, {})
        ms = (time.perf_counter() - t) * 1000
        report(f"query {name} over {log_rows:,} kv_block_log rows, whole store (ms, 1 run)", f"{ms:,.0f}",
               "goal p95 <= 300" + (" OVER (reads the whole log through the residency view)" if ms > 300 else ""))


#: Requests that arrive after the backlog, attributed by two runs of their own (the live job's every few seconds).
LIVE_RUN = 500


def bench_live_run(store: Any, rows: pa.Table, log_rows: int) -> None:
    """Two runs of the live job after the backlog, as its loop makes them (one memo kept across its runs): insert
    the first half of ``rows`` (requests whose KV events are already stored) and attribute it alone (no overlap
    window) with KV evidence, then the second half; print each run's CPU seconds. The first run reads the log of
    the blocks they missed back to the lookback, so its cost grows with the log; the next reads its hot blocks'
    rows since the first's cut (docs/scale.md)."""
    from ingest.attribution_job import run_attribution
    from ingest.kv_evidence import MAX_END_MS, KvMemo

    memo = KvMemo(across_runs_lag_ms=MAX_END_MS)
    half = rows.num_rows // 2
    for label, part in (("first", rows.slice(0, half)), ("next", rows.slice(half))):
        store.insert_arrow("gateway_requests", part)
        t, c = time.perf_counter(), time.process_time()
        stats = run_attribution(store, settle_seconds=0, overlap_seconds=0, memo=memo)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        report(f"live run after the backlog ({label} of the loop): {stats.arrivals:,} requests with KV evidence "
               f"over {log_rows:,} kv_block_log rows (CPU-s per run)", f"{cpu:,.2f}",
               f"wall {wall:,.2f} s; the live job runs every 5 s" + (
                   ": reads its blocks' history, grows with the log" if label == "first" else
                   ": its hot blocks' rows since the first run's cut"))


QUERY_CASES: list[tuple[str, dict[str, str]]] = []


def dashboard_bucket(window: timedelta) -> int:
    """The bucket width the dashboard uses for a window (about 100 points, never below a minute)."""
    from dashboard.data import NICE_BUCKETS

    target = window.total_seconds() / 100
    return next((b for b in NICE_BUCKETS if b >= target), NICE_BUCKETS[-1])


def bench_queries(store: Any, label: str, repeat: int) -> None:
    import sql as sqlfiles

    now = datetime.now(UTC)
    first = store.query_rows("SELECT min(ts) FROM gateway_requests")[0][0]
    windows = {"1h": now - timedelta(hours=1), "24h": now - timedelta(hours=24),
               "all": datetime(1970, 1, 1, tzinfo=UTC)}
    tenant = store.query_rows("SELECT tenant_id FROM gateway_requests LIMIT 1")[0][0]
    over = 0
    cases = 0
    for name in sqlfiles.query_names():
        q = sqlfiles.load_query(name)
        names = {p.name for p in q.params}
        for wname, since in windows.items():
            for fname, extra in (("", {}), ("tenant", {"tenant": tenant}), ("pod", {"pod": "pod-1"})):
                if fname and fname not in names:
                    continue
                span = now - max(since, first.replace(tzinfo=UTC) if first.tzinfo is None else first)
                bucket = {"bucket_seconds": str(dashboard_bucket(span))}  # as the dashboard asks
                params = {k: v for k, v in {"since": since.strftime("%Y-%m-%d %H:%M:%S"), **bucket, **extra}.items()
                          if k in names}
                times = timed(lambda name=name, params=params: store.named(name, params), repeat)
                p50, p95 = statistics.median(times) * 1000, pct(times, 0.95) * 1000
                cases += 1
                over += p95 > 300
                report(f"{label} query {name} [{wname}{' ' + fname if fname else ''}] p50 / p95 (ms)",
                       f"{p50:,.0f} / {p95:,.0f}", "goal p95 <= 300" + (" OVER" if p95 > 300 else ""))
    report(f"{label} named-query cases over 300 ms p95", f"{over} of {cases}", "goal 0 (was 36 of 47 at 10M)")


def bench_pages(store: Any, label: str, repeat: int) -> None:
    from streamlit.testing.v1 import AppTest

    from dashboard import data

    data.register_store(store)
    app = str(ROOT / "dashboard" / "app.py")
    for page in ("views/overview.py", "views/tenants.py", "views/miss_causes.py", "views/fingerprints.py",
                 "views/pods.py", "views/vllm.py", "views/ttl.py", "views/data_quality.py"):
        for rng in ("Last 1 h", "Last 24 h"):
            at = AppTest.from_file(app, default_timeout=120)
            at.run()
            at.selectbox(key="time_range").select(rng).run()
            if page != "views/overview.py":
                at.switch_page(page).run()
            times = timed(lambda at=at: at.run(), repeat)
            errors = [e.value for e in at.error]
            report(f"{label} page {page.split('/')[1][:-3]} [{rng}] p50 / p95 (ms)",
                   f"{statistics.median(times) * 1000:,.0f} / {pct(times, 0.95) * 1000:,.0f}",
                   "goal <= 1,000 (Overview was 7,500 at 10M)" + (f" ERRORS {errors}" if errors else ""))
    data.register_store(None)


def bench_bytes(store: Any, label: str, n: int) -> None:
    rows = dict(store.query_rows(
        "SELECT table, sum(data_compressed_bytes) FROM system.parts WHERE database = currentDatabase() AND active "
        "GROUP BY table"))
    raw = sum(rows.get(t, 0) for t in ("gateway_requests", "request_attribution", "request_keys"))
    rollups = sum(v for t, v in rows.items() if t.endswith(("_1m", "_1h")))
    report(f"{label} stored bytes per request (raw + answers + keys)", f"{raw / n:,.0f}", "")
    report(f"{label} stored bytes per request (rollups)", f"{rollups / n:,.1f}", "")


def bench_import(store_factory: Callable[[str], Any], lines: int) -> None:
    from demo.history import gateway_lines
    from ingest.bulk import load_gateway_log

    path = Path(tempfile.mkdtemp()) / "gateway.jsonl"
    with path.open("w") as fh:
        for line in gateway_lines(lines, seed=5, tenants=200, pods=5):
            fh.write(line + "\n")
    store = store_factory("import")
    with PeakRss() as mem:
        t = time.perf_counter()
        stats = load_gateway_log(store, path)
        rate = stats.rows / (time.perf_counter() - t)
    raw = globals().get("RAW_RATE", 0.0)
    report(f"import gateway-log, {lines:,} lines (lines/s)", f"{rate:,.0f}",
           f"goal >= 0.5 x raw insert ({0.5 * raw:,.0f}; was 21,300)")
    report(f"import gateway-log, {lines:,} lines: memory grown (MB)", f"{mem.grew / 1e6:,.0f}",
           "bounded by the chunk (was 10,200 MB per 10^6)")


def bench_metrics_bytes(store_factory: Callable[[str], Any]) -> None:
    from bench.history import vllm_table

    store = store_factory("metrics")
    table = vllm_table(1, seconds=86_400, interval_seconds=5.0)
    for i in range(0, table.num_rows, 100_000):
        store.insert_arrow("vllm_metrics", table.slice(i, 100_000))
    rows = dict(store.query_rows("SELECT table, sum(data_compressed_bytes) FROM system.parts "
                                 "WHERE database = currentDatabase() AND active GROUP BY table"))
    report("vLLM series per pod-day at 5 s, busy pod (MB, raw)", f"{rows['vllm_metrics'] / 1e6:,.1f}",
           "goal <= 20 (was 187)")
    report("vLLM series per pod-day at 5 s, busy pod (MB, rollups)",
           f"{(rows.get('vllm_1m', 0) + rows.get('vllm_1h', 0)) / 1e6:,.1f}", "")
    report("vLLM rows per pod-day (busy pod)", f"{table.num_rows:,}", "was 7.7M (every sample of every scrape)")


def main(argv: list[str] | None = None) -> list[tuple[str, str, str]]:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--kv-requests", type=int, nargs="*", default=[1_000_000],
                        help="sizes for attribution with KV-event evidence (precise mode); 10^7 takes over an hour "
                             "at today's rate: add 10000000 to measure it")
    parser.add_argument("--import-lines", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7, help="runs per query and page (p50/p95 over them)")
    parser.add_argument("--quick", action="store_true", help="CI size: 20,000 requests, 3 runs, short sub-benches")
    parser.add_argument("--no-collector", action="store_true")
    parser.add_argument("--no-gateway", action="store_true")
    parser.add_argument("--reuse", metavar="DIR", help="measure queries, pages and bytes again on the stores a "
                        "previous run left in DIR (its chDB directory), without generating or attributing")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.kv_requests, args.import_lines, args.repeat = [20_000], [20_000], 20_000, 3
    import streamlit  # noqa: F401  (imported before any thread: environment notes)

    from ingest.store import Store

    data_dir = args.reuse or tempfile.mkdtemp(prefix="kvscope-bench-")

    def store_factory(name: str) -> Store:
        s = Store.open(data_dir=data_dir, database=f"bench_{name}")
        s.migrate()
        return s

    print(f"kvscope bench, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores; chDB at {data_dir}")
    for n in args.requests:
        label = f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"
        print(f"\n== {label} requests ==", flush=True)
        store = store_factory(label.replace(".", "_"))
        if not args.reuse:
            if n == args.requests[0]:
                bench_insert(store, n)
            rate = load_history(store, n)
            report(f"{label} insert through gateway_requests + views (rows/s)", f"{rate:,.0f}", "")
            bench_attribution(store, n)
        bench_bytes(store, label, n)
        bench_queries(store, label, args.repeat)
        bench_pages(store, label, max(3, args.repeat // 2))
    if args.reuse:
        return ROWS
    for n in args.kv_requests:
        print(f"\n== attribution with KV evidence, {n:,} requests ==", flush=True)
        bench_attribution_kv(store_factory, n)
    print("\n== import and metrics ==", flush=True)
    bench_import(store_factory, args.import_lines)
    bench_metrics_bytes(store_factory)
    for script, skip, extra in (("collector.py", args.no_collector, ["--no-http"] if args.quick else []),
                                ("gateway.py", args.no_gateway, ["--seconds", "1"] if args.quick else [])):
        if skip:
            continue
        print(f"\n== bench/{script} ==", flush=True)
        done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *extra], cwd=ROOT)
        report(f"bench/{script}", "ran" if done.returncode == 0 else f"FAILED ({done.returncode})", "")
    return ROWS


if __name__ == "__main__":
    main()
