"""Pieces of the kill tests (tests/test_kill.py): a `kvscope up` process to start and SIGKILL, a gateway-log
writer thread, a /metrics server with moving counters, and the verification of a stopped store.

chDB allows one data directory per process and the test process already holds the session's, so the
verification runs in a child process (``python -m tests.kill_harness verify DIR DB``) and prints JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = (Path(__file__).parent / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()


# -- a vLLM /metrics stand-in whose prefix-cache counters move ---------------------------------------------
class MovingMetrics:
    """Serves the real vLLM 0.32 capture with ``vllm:prefix_cache_{queries,hits}_total`` replaced by values
    that grow by ``per_request`` on every GET (so each scrape differs). ``url`` is its /metrics URL."""

    def __init__(self, port: int, per_request: tuple[int, int] = (1000, 400)) -> None:
        self.queries, self.hits = 50_000, 20_000
        self.per_request = per_request
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = outer.body().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def body(self) -> str:
        with self.lock:
            self.queries += self.per_request[0]
            self.hits += self.per_request[1]
            q, h = self.queries, self.hits
        lines = []
        for line in CAPTURE.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total{"):
                line = line.rsplit(" ", 1)[0] + f" {q}.0"
            elif line.startswith("vllm:prefix_cache_hits_total{"):
                line = line.rsplit(" ", 1)[0] + f" {h}.0"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()


# -- the gateway log writer ----------------------------------------------------------------------------------
@dataclass
class LogWriter:
    """Appends ``lines`` to ``path`` with the gateway's own writer (gateway/log.py), ``rate`` lines/s, in a
    thread. ``pause`` (an Event, set = paused) lets a test rotate with copytruncate without logrotate's own
    loss window; time paused does not count (no burst to catch up after it), so the writing lasts
    ``len(lines) / rate`` seconds of unpaused time whatever a slow start held it for; ``done`` is set when every
    line is written."""

    path: Path
    lines: list[str]
    rate: float
    pause: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    written: int = 0

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from gateway.log import GatewayLogWriter

        writer = GatewayLogWriter(self.path)
        t0 = time.monotonic()
        try:
            for i, line in enumerate(self.lines):
                if self.pause.is_set():
                    held = time.monotonic()
                    while self.pause.is_set():
                        time.sleep(0.005)
                    t0 += time.monotonic() - held
                ahead = i / self.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
                rec = json.loads(line)
                rec.pop("log_version", None)
                writer.write(rec)
                self.written = i + 1
        finally:
            writer.close()
            self.done.set()


# -- the pipeline process ------------------------------------------------------------------------------------
class UpProcess:
    """``kvscope up --no-dashboard`` in its own process (its own chDB directory), started, killed with SIGKILL
    and restarted at will; ``metrics()`` reads its self-metrics endpoint."""

    def __init__(self, args: list[str], env: dict[str, str], metrics_port: int, log_path: Path) -> None:
        self.args = [sys.executable, "-m", "kvscope.cli", "up", "--no-dashboard", *args]
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}, **env,
                    "KVSCOPE_METRICS_PORT": str(metrics_port)}
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        logf = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it; closed with the process
        logf.write(f"\n===== start {self.starts} =====\n".encode())
        logf.flush()
        self.proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        logf.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def term(self, timeout: float = 120) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def watching(self) -> bool:
        """Whether kvscope has recorded where it watches the gateway log from (the first thing `kvscope up` does,
        :func:`kvscope.pipeline.watch_logs`): from then on nothing written to the log, rotated or not, may be
        lost. Before it, a process killed while still importing has not seen the log at all."""
        state = Path(self.env["KVSCOPE_STATE_DIR"])
        return any("gateway_log:" in f.read_text() for f in state.glob("checkpoints-*.json")) if state.is_dir() \
            else False

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The process's own Prometheus samples: {(name, sorted labels): value}; {} while it is not up."""
        try:
            body = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
        except httpx.HTTPError:
            return {}
        out = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def sample(self, name: str) -> list[float]:
        return [v for (n, _), v in self.metrics().items() if n == name]


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# -- verification (child process) ----------------------------------------------------------------------------
CHECKS = {
    "rows": "SELECT count() FROM gateway_requests",
    "distinct": "SELECT uniqExact(request_id) FROM gateway_requests",
    "ids_in_range": "SELECT countIf(match(request_id, '^kill-[0-9]{9}$') "
                    "AND toUInt64(substring(request_id, 6)) < {n:UInt64}) FROM gateway_requests",
    "answers": "SELECT count() FROM (SELECT request_id, ts FROM request_attribution GROUP BY request_id, ts "
               "HAVING sum(sign) = 1)",
    "bad_answers": """
        SELECT count() FROM gateway_requests AS g
        LEFT JOIN (SELECT request_id, ts, sum(sign) AS answers, sum(toInt64(arraySum(missed_tokens)) * sign) AS missed
                   FROM request_attribution GROUP BY request_id, ts) AS a
            ON g.request_id = a.request_id AND g.ts = a.ts
        WHERE a.answers != 1
           OR a.missed != if(g.status < 400, toInt64(g.prompt_tokens) - toInt64(g.cached_tokens), 0)""",
    "missed_total": "SELECT sum(if(status < 400, toInt64(prompt_tokens) - toInt64(cached_tokens), 0)) "
                    "FROM gateway_requests",
    "attributed_total": "SELECT sum(toInt64(tokens) * sign) FROM request_attribution "
                        "ARRAY JOIN missed_tokens AS tokens",
    # a gauge is sent with every scrape: one row per scrape, so duplicates would show
    "scrapes": "SELECT count(), uniqExact(ts) FROM vllm_metrics WHERE name = 'vllm:num_requests_running'",
    # the collector's increases add up to the counter's span since the value before its first stored increase
    "vllm_delta": "SELECT sum(increase) FROM vllm_metrics WHERE name = 'vllm:prefix_cache_queries_total'",
    "vllm_span": "SELECT max(value) - argMin(value - increase, ts) FROM vllm_metrics "
                 "WHERE name = 'vllm:prefix_cache_queries_total'",
}


def verify(data_dir: Path, database: str, n: int) -> dict[str, Any]:
    """Run :data:`CHECKS` on a stopped pipeline's store (in a child process); returns {check: value}."""
    out = subprocess.run([sys.executable, "-m", "tests.kill_harness", "verify", str(data_dir), database, str(n)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _verify_main(data_dir: str, database: str, n: str) -> None:
    from ingest.store import Store

    store = Store.open(data_dir=data_dir, database=database)
    result: dict[str, Any] = {}
    for name, sql in CHECKS.items():
        row = store.query_rows(sql, {"n": int(n)})[0]
        result[name] = list(row) if len(row) > 1 else row[0]
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "verify":
        _verify_main(*sys.argv[2:])
    else:
        sys.exit("usage: python -m tests.kill_harness verify DATA_DIR DATABASE N")
