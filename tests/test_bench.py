"""`make bench` at CI size: it runs end to end and prints every figure (the figures themselves are measured and
read by people, never asserted: timing depends on the machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_and_prints_every_figure(tmp_path: Path) -> None:
    # its chDB directory (kept for ``--reuse``) goes under tmp_path, not /tmp: ~90 MB per run otherwise left behind
    out = subprocess.run([sys.executable, "-m", "bench.run", "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=1500, env={**os.environ, "TMPDIR": str(tmp_path)})
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stderr[-4000:]
    for figure in ("raw insert", "insert through gateway_requests", "attribution, 20,000 requests: rate",
                   "memory grown", "stored bytes per request", "named-query cases over 300 ms", "page overview",
                   "page miss_causes", "import gateway-log", "vLLM series per pod-day", "bodies/s on one core",
                   "64 pods x 1 s", "bench/collector.py", "bench/gateway.py",
                   "attribution with KV evidence, 20,000 requests: rate (requests/s, wall)",
                   "attribution with KV evidence, 20,000 requests: rate (requests per CPU second)",
                   "attribution with KV evidence, 20,000 requests: peak memory grown (MB)",
                   "attribution KV evidence off, 20,000 requests: rate (requests/s, wall)",
                   "attribution KV evidence off, 20,000 requests: rate (requests per CPU second)",
                   "attribution KV evidence off, 20,000 requests: peak memory grown (MB)",
                   "attribution with KV evidence, 20,000 requests: kv_block_log rows read per request",
                   "query kv_evictions over", "query kv_resident_at over",
                   "live run after the backlog (first of the loop): 250 requests with KV evidence",
                   "live run after the backlog (next of the loop): 250 requests with KV evidence"):
        assert figure in out.stdout, f"`{figure}` missing from the bench output"
    assert "FAILED" not in out.stdout and "ERRORS" not in out.stdout
