"""Collector benchmark (issue "Fleet scale"): can one core keep up with 64 vLLM pods scraped every second, and
how much does a scrape weigh on the wire? Every figure is printed beside its goal or its alternative, all
measured in this run on the real vLLM 0.32 captures of tests/samples.

- bodies/s on one core (process CPU time, one thread) for (a) the new path: collector/prom_text.py parse with
  the allowlist, counter increases (collector/vllm_metrics.py ``advance``) and the envelope encoded as
  published; (b) prometheus_client's parser alone; (c) a bare ``str.splitlines()`` + ``split``; and (d) the
  path before this change (prometheus_client, every sample, one JSON envelope), for reference. "Active" is
  the second real capture after the first (124 series moved); "idle" a body after itself (gauges only).
- bytes per scrape on the wire, JSON as published (and gzip, as the Kafka producer sends it): before (every
  sample with its labels) and after (kept series that moved), and the same per pod-day at a 5 s interval.
- 64 pods x 1 s: (sim) 64 ``advance`` calls, one checkpoint write (ScrapeJournal, fsync'd) and the batch
  encoding per round, CPU time per round = share of one core; (http) the real Collector.scrape_all against a
  local HTTP server (its own process) serving 64 pods, the in-process queue drained, CPU of this process per
  second of wall time.

Usage: ``python bench/collector.py [--rounds 20] [--seconds 1.0] [--no-http] [--json]``; ``main(argv) -> dict``.
"""

from __future__ import annotations

import argparse
import gzip
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
# this file is named like the `collector` package it measures: its own folder must not be on the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import httpx  # noqa: E402
import msgspec  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from collector.checkpoint import CheckpointStore  # noqa: E402
from collector.events import encode_batch, envelope  # noqa: E402
from collector.publish import MemoryQueue, QueuePublisher, to_messages  # noqa: E402
from collector.service import Collector, Target  # noqa: E402
from collector.vllm_metrics import ScrapeJournal, ScrapeState, advance  # noqa: E402

SAMPLES = _ROOT / "tests" / "samples"
GOALS = {
    "new_bodies_per_s": 500.0,  # per core (issue "Fleet scale"; measured there: 163/s before, 178/s parser)
    "core_share_64_pods_1s": 1.0,  # 64 scrapes per second must fit in one core
    "store_mb_per_pod_day": 20.0,  # the store's goal; the wire figure here is what the ingester receives
}
SCRAPES_PER_DAY_5S = 86400 // 5


class _OldSample(msgspec.Struct, frozen=True):  # the contract before this change (MetricsScrape), for the wire
    name: str
    labels: dict[str, str]
    value: float


class _OldScrape(msgspec.Struct, frozen=True, tag="metrics_scrape"):
    target: str
    scraped_at_ms: int
    duration_ms: float
    samples: list[_OldSample]
    family_types: dict[str, str] = {}


def _old_path(body: str) -> bytes:
    samples, types = [], {}
    for fam in text_string_to_metric_families(body):
        types[fam.name] = fam.type
        samples.extend(_OldSample(s.name, dict(s.labels), float(s.value)) for s in fam.samples)
    scrape = _OldScrape("http://pod-0:8000/metrics", 1, 5.0, samples, types)
    return _enc.encode([envelope(scrape, pod="pod-0", natural_key=(1,), observed_at_ms=1)])  # type: ignore[arg-type]


_enc = msgspec.json.Encoder()


def _rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per CPU second of this process (one thread: one core)."""
    fn()
    n, t0 = 0, time.process_time()
    while True:
        fn()
        n += 1
        dt = time.process_time() - t0
        if dt >= seconds:
            return n / dt


def bench_rates(seconds: float) -> dict[str, Any]:
    b1 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    b2 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text()
    url = "http://pod-0:8000/metrics"
    _, s1 = advance(ScrapeState(), "pod-0", url, b1, 1_000, 5.0)

    def new(body: str) -> Callable[[], bytes]:
        return lambda: encode_batch(advance(s1, "pod-0", url, body, 6_000, 5.0)[0])

    return {
        "new_active": _rate(new(b2), seconds),
        "new_idle": _rate(new(b1), seconds),
        "prometheus_client_parser": _rate(lambda: [s for f in text_string_to_metric_families(b2) for s in f.samples],
                                          seconds),
        "bare_split": _rate(lambda: [line.split(" ") for line in b2.splitlines()], seconds),
        "before_path": _rate(lambda: _old_path(b2), seconds),
        "lines_per_body": b2.count("\n"),
    }


def bench_wire() -> dict[str, Any]:
    b1 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    b2 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text()
    url = "http://pod-0:8000/metrics"
    _, s1 = advance(ScrapeState(), "pod-0", url, b1, 1_000, 5.0)
    active, _ = advance(s1, "pod-0", url, b2, 6_000, 5.0)
    idle, _ = advance(s1, "pod-0", url, b1, 6_000, 5.0)
    before = _old_path(b2)
    out: dict[str, Any] = {}
    for name, data, rows in [("before", before, len([1 for f in text_string_to_metric_families(b2)
                                                      for _ in f.samples])),
                             ("after_active", encode_batch(active), len(active[0].payload.samples)),
                             ("after_idle", encode_batch(idle), len(idle[0].payload.samples))]:
        out[name] = {"bytes": len(data), "gzip_bytes": len(gzip.compress(data)), "rows": rows,
                     "mb_per_pod_day_5s": len(data) * SCRAPES_PER_DAY_5S / 1e6,
                     "rows_per_pod_day_5s": rows * SCRAPES_PER_DAY_5S}
    return out


def bench_sim(pods: int, rounds: int) -> dict[str, Any]:
    """64 pods' scrapes computed, checkpointed and encoded per round, without HTTP."""
    bodies = [(SAMPLES / f"vllm_0.32.0_cpu_real_metrics_{i}.txt").read_text() for i in (1, 2)]
    names = [f"pod-{i}" for i in range(pods)]
    with tempfile.TemporaryDirectory() as d:
        journal = ScrapeJournal(CheckpointStore(Path(d) / "checkpoints.json"))
        cpu: list[float] = []
        wall: list[float] = []
        write_wall: list[float] = []
        for r in range(rounds + 1):
            c0, w0 = time.process_time(), time.perf_counter()
            at = 1_000 * (r + 1)
            results = [(p, *advance(journal.state(p), p, f"http://{p}:8000/metrics", bodies[r % 2], at, 5.0))
                       for p in names]
            w1 = time.perf_counter()
            events, ack = journal.commit(results)
            write_wall.append(time.perf_counter() - w1)
            to_messages(events)
            if ack:
                ack()
            if r:  # the first round is the baselines
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        size = (Path(d) / "checkpoints.json").stat().st_size
    return {"pods": pods, "rounds": rounds, "cpu_s_per_round": sum(cpu) / len(cpu),
            "wall_s_per_round": sum(wall) / len(wall), "checkpoint_write_s": sum(write_wall) / len(write_wall),
            "checkpoint_bytes": size}


def _serve(port_file: str) -> None:
    """--role server: every /metrics/<pod> answers the two real captures in turn (counters move each time)."""
    bodies = [(SAMPLES / f"vllm_0.32.0_cpu_real_metrics_{i}.txt").read_bytes() for i in (1, 2)]
    turns: dict[str, int] = {}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            n = turns[self.path] = turns.get(self.path, -1) + 1
            body = bodies[n % 2]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256  # 64 pods connect at once

    srv = Server(("127.0.0.1", 0), H)
    Path(port_file).write_text(str(srv.server_port))
    srv.serve_forever()


def bench_http(pods: int, seconds: float, rounds: int) -> dict[str, Any]:
    """The real collector against a local server: CPU of this process per second of scraping 64 pods at 1 s."""
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "port"
        proc = subprocess.Popen([sys.executable, __file__, "--role", "server", str(port_file)])
        try:
            deadline = time.time() + 20
            while not port_file.exists() or not port_file.read_text():
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the benchmark's HTTP server did not start")
                time.sleep(0.05)
            base = f"http://127.0.0.1:{port_file.read_text()}/metrics"
            q = MemoryQueue()
            stop = threading.Event()

            def drain() -> None:  # the ingester's part: take, acknowledge, release (no store)
                while not stop.is_set():
                    for m in (msgs := q.take(100, 0.1)):
                        if m.on_commit:
                            m.on_commit()
                    q.release(msgs)

            threading.Thread(target=drain, daemon=True).start()
            c = Collector(publisher=QueuePublisher(q), checkpoints=CheckpointStore(Path(d) / "checkpoints.json"),
                          targets=[Target(f"pod-{i}", f"{base}/pod-{i}") for i in range(pods)],
                          scrape_interval_seconds=seconds)
            limits = httpx.Limits(max_connections=pods, max_keepalive_connections=pods)
            published = 0
            with httpx.Client(timeout=max(1.0, seconds), limits=limits) as client:
                c.scrape_all(client)  # baselines, connections opened
                c0, w0 = time.process_time(), time.perf_counter()
                busy = 0.0
                for _ in range(rounds):
                    t = time.perf_counter()
                    published += c.scrape_all(client)
                    busy += time.perf_counter() - t
                    time.sleep(max(0.0, seconds - (time.perf_counter() - t)))
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            c.close_scrapes()
            stop.set()
        finally:
            proc.terminate()
            proc.wait(10)
    return {"pods": pods, "rounds": rounds, "interval_s": seconds, "cpu_share": cpu / wall,
            "round_wall_s": busy / rounds, "envelopes_published": published}


def report(r: dict[str, Any]) -> str:
    rates, wire, sim = r["rates"], r["wire"], r["sim"]
    ref = rates["prometheus_client_parser"]
    g = r["goals"]
    lines = [
        f"bodies/s on one core (real vLLM 0.32 /metrics, {rates['lines_per_body']} lines, 447 samples):",
        f"  new path, active scrape (parse + allowlist + increases + encode) {rates['new_active']:8.0f}/s"
        f"   goal >= {g['new_bodies_per_s']:.0f}/s; {rates['new_active'] / ref:.1f}x prometheus_client's parser",
        f"  new path, idle scrape                                            {rates['new_idle']:8.0f}/s",
        f"  prometheus_client parser alone                                   {ref:8.0f}/s   (alternative)",
        f"  bare splitlines() + split                                        {rates['bare_split']:8.0f}/s"
        "   (floor: no parsing at all)",
        f"  path before (prometheus_client, every sample, JSON envelope)     {rates['before_path']:8.0f}/s",
        "bytes per scrape on the wire (JSON as published; gzip as the Kafka producer sends):",
    ]
    for k in ("before", "after_active", "after_idle"):
        w = wire[k]
        lines.append(f"  {k:13s} {w['rows']:4d} rows {w['bytes']:7d} B (gzip {w['gzip_bytes']:6d} B)  per pod-day "
                     f"at 5 s: {w['mb_per_pod_day_5s']:6.1f} MB, {w['rows_per_pod_day_5s'] / 1e6:.2f}M rows")
    lines.append(f"  (store goal <= {g['store_mb_per_pod_day']:.0f} MB/pod-day; before: 187 MB measured in the store)")
    lines.append(f"{sim['pods']} pods x 1 s, no HTTP: {sim['cpu_s_per_round'] * 1000:.1f} ms CPU per round = "
                 f"{sim['cpu_s_per_round']:.1%} of one core (goal < {g['core_share_64_pods_1s']:.0%}); checkpoint "
                 f"write {sim['checkpoint_write_s'] * 1000:.1f} ms, {sim['checkpoint_bytes'] / 1e3:.0f} kB")
    if "http" in r:
        h = r["http"]
        lines.append(f"{h['pods']} pods x {h['interval_s']:g} s, real HTTP + collector: {h['cpu_share']:.1%} of one "
                     f"core (goal < {g['core_share_64_pods_1s']:.0%}); a round takes {h['round_wall_s'] * 1000:.0f} "
                     f"ms of the {h['interval_s'] * 1000:.0f} ms interval")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the figures beside their goals, return them as a dict."""
    parser = argparse.ArgumentParser(prog="bench/collector.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per rate measurement")
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the 64-pod simulations")
    parser.add_argument("--no-http", action="store_true", help="skip the real-HTTP simulation")
    parser.add_argument("--json", action="store_true", help="print the dict as JSON after the report")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        _serve(args.role[1])
        return {}
    result: dict[str, Any] = {"goals": GOALS, "rates": bench_rates(args.seconds), "wire": bench_wire(),
                              "sim": bench_sim(args.pods, args.rounds)}
    if not args.no_http:
        result["http"] = bench_http(args.pods, 1.0, args.rounds)
    print(report(result))
    if args.json:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
