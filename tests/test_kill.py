"""Kill tests: `kvscope up` is SIGKILLed at random points while a gateway log grows (and rotates) and a pod is
scraped; after the last restart the store holds exactly the requests written (no loss, no duplicate), every
request has exactly one answer whose tokens equal prompt - cached, and no scrape is stored twice.

CI runs a small replay; the full one by hand: ``KVSCOPE_KILL_LINES=1000000 KVSCOPE_KILL_RATE=5000
.venv/bin/python -m pytest tests/test_kill.py -k kafka -s``.
"""

from __future__ import annotations

import os
import random
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from demo.history import gateway_lines
from tests.kill_harness import LogWriter, MovingMetrics, UpProcess, verify, wait_until

LINES = int(os.environ.get("KVSCOPE_KILL_LINES", "12000"))
RATE = float(os.environ.get("KVSCOPE_KILL_RATE", "400"))  # lines written per second
#: How long the rotation test's writer writes (unpaused seconds): longer than its four rotations take.
ROTATION_WRITE_SECONDS = 35.0
KILLS = int(os.environ.get("KVSCOPE_KILL_TIMES", "5"))


def start_pipeline(tmp: Path, log: Path, metrics: MovingMetrics, kafka: str | None) -> tuple[UpProcess, str]:
    ns = f"kill{uuid.uuid4().hex[:8]}"
    database = f"k_{ns}"
    args = ["--data-dir", str(tmp / "data"), "--database", database, "--gateway-log", str(log),
            "--vllm", f"fake={metrics.url}"]
    if kafka:
        args += ["--kafka-bootstrap", kafka]
    env = {"KVSCOPE_TOPIC_NAMESPACE": ns, "KVSCOPE_CONSUMER_GROUP": f"{ns}-ingest",
           "KVSCOPE_SCRAPE_INTERVAL_SECONDS": "0.5", "KVSCOPE_ATTRIBUTION_INTERVAL_SECONDS": "1",
           "KVSCOPE_STATE_DIR": str(tmp / "state")}
    return UpProcess(args, env, free_port(), tmp / "kvscope-up.log"), database


def caught_up(up: UpProcess, kafka: bool) -> bool:
    """Everything written is read, published and stored (the self-metrics say so)."""
    m = up.metrics()
    if not m:
        return False
    lag = [v for (n, _), v in m.items() if n == "kvscope_collector_log_lag_bytes"]
    backlog = [v for (n, _), v in m.items()
               if n == ("kvscope_ingest_consumer_lag_messages" if kafka else "kvscope_ingest_queue_bytes")]
    return bool(lag) and all(v == 0 for v in lag) and bool(backlog) and all(v == 0 for v in backlog)


def settle_and_stop(up: UpProcess, kafka: bool) -> None:
    """Restart once more, wait until the pipeline has caught up (three checks in a row), stop it cleanly."""
    if not up.alive():
        up.start()
    streak = 0
    deadline = time.monotonic() + 600
    while streak < 3:
        assert time.monotonic() < deadline, f"pipeline never caught up; see {up.log_path}"
        assert up.alive(), f"kvscope up died; see {up.log_path}"
        streak = streak + 1 if caught_up(up, kafka) else 0
        time.sleep(1.0)
    assert up.term(timeout=900) == 0, f"kvscope up did not stop cleanly; see {up.log_path}"


def check_exact(result: dict[str, Any], n: int) -> None:
    print(f"\nkill test result over {n} lines: {result}")
    assert result["rows"] == n and result["distinct"] == n and result["ids_in_range"] == n  # the exact set
    assert result["answers"] == n and result["bad_answers"] == 0  # one answer each, Σ tokens = prompt - cached
    assert result["attributed_total"] == result["missed_total"] > 0
    scrapes, distinct_scrapes = result["scrapes"]
    assert scrapes == distinct_scrapes > 3  # no scrape stored twice
    assert result["vllm_delta"] == result["vllm_span"] > 0  # counter deltas add up to the span: none doubled


def run_with_kills(up: UpProcess, writer: LogWriter, kills: int, rnd: random.Random,
                   during: Any = None) -> int:
    """Start ``up``, SIGKILL it ``kills`` times at random points (1.5–5 s after each start, the first once it
    watches the log: on a loaded machine a process can be killed before it has even imported kvscope) while the
    writer writes; ``during(i)`` runs right before kill i. Returns the kills done."""
    done = 0
    writer.start()
    wait_until(writer.path.exists, 60, "the first log line")
    writer.pause.set()  # held while kvscope starts (the writer's pace does not count the hold)
    up.start()
    wait_until(up.watching, 300, "kvscope up to record where it watches the log from")
    writer.pause.clear()
    while done < kills or not writer.done.is_set():
        time.sleep(rnd.uniform(1.5, 5.0))
        if done < kills:
            if during:
                during(done)
            up.kill()
            done += 1
            up.start()
    return done


@pytest.mark.parametrize("mode", [pytest.param("kafka", marks=pytest.mark.broker), "embedded"])
def test_sigkill_at_random_points_loses_and_doubles_nothing(mode: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    kafka = request.getfixturevalue("kafka_bootstrap") if mode == "kafka" else None
    log = tmp_path / "gateway.jsonl"
    metrics = MovingMetrics(free_port())
    lines = list(gateway_lines(LINES, seed=11, id_prefix="kill", tenants=30, pods=3))
    up, database = start_pipeline(tmp_path, log, metrics, kafka)
    try:
        kills = run_with_kills(up, LogWriter(log, lines, RATE), KILLS, random.Random(5))
        settle_and_stop(up, kafka is not None)
    finally:
        if up.alive():
            up.kill()
        metrics.close()
    assert kills >= 5
    check_exact(verify(tmp_path / "data", database, LINES), LINES)


def test_rotation_both_ways_under_load_with_sigkills(tmp_path: Path) -> None:
    """The log is rotated by rename-and-create and by copytruncate while lines keep coming, with a SIGKILL
    right after each rotation (the restarted collector must find the rotated file by its fingerprint). Every
    rotation must happen while the writer is still writing: the writing lasts ROTATION_WRITE_SECONDS of unpaused
    time, longer than the rotations' at most 4 × 5.55 s, and a rotation that found the writer done fails the
    test instead of being skipped."""
    log = tmp_path / "gateway.jsonl"
    metrics = MovingMetrics(free_port())
    n = max(4000, LINES // 3)
    lines = list(gateway_lines(n, seed=12, id_prefix="kill", tenants=10, pods=2))
    up, database = start_pipeline(tmp_path, log, metrics, None)
    writer = LogWriter(log, lines, n / ROTATION_WRITE_SECONDS)
    rotated: list[tuple[int, str, int]] = []  # (rotation, how, lines written before it)

    def rotate(i: int) -> None:
        assert not writer.done.is_set(), f"rotation {i}: the writer had already written every line"
        # after a rename the writer recreates the path on its next line (gateway/log.py)
        wait_until(log.exists, 30, f"the log recreated before rotation {i}", interval=0.01)
        if i % 2 == 0:  # logrotate's default: rename, the writer reopens the path
            log.rename(tmp_path / f"gateway.jsonl.{i}")
        else:  # copytruncate: pause the writer (logrotate's own copy→truncate window loses lines otherwise)
            writer.pause.set()
            time.sleep(0.05)
            shutil.copyfile(log, tmp_path / f"gateway.jsonl.{i}")
            with open(log, "r+b") as fh:
                fh.truncate(0)
            writer.pause.clear()
        rotated.append((i, "rename" if i % 2 == 0 else "copytruncate", writer.written))
        time.sleep(random.Random(i).uniform(0.0, 0.5))  # kill right after, or a moment later

    try:
        run_with_kills(up, writer, 4, random.Random(9), during=rotate)
        settle_and_stop(up, False)
    finally:
        if up.alive():
            up.kill()
        metrics.close()
    assert [how for _, how, _ in rotated] == ["rename", "copytruncate", "rename", "copytruncate"]
    assert all(0 < written < n for _, _, written in rotated), rotated  # each under load, lines before and after
    assert all(tmp_path.joinpath(f"gateway.jsonl.{i}").stat().st_size > 0 for i in range(4))
    assert writer.written == n
    check_exact(verify(tmp_path / "data", database, n), n)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_drains_and_stops(sig: str, tmp_path: Path) -> None:
    """`kvscope up --no-dashboard` stops on Ctrl-C (SIGINT, which chDB would otherwise swallow) and on SIGTERM:
    it publishes what it read, drains the queue, answers every request, and exits 0."""
    import signal

    log = tmp_path / "gateway.jsonl"
    metrics = MovingMetrics(free_port())
    lines = list(gateway_lines(500, seed=13, id_prefix="kill", tenants=5, pods=2))
    up, database = start_pipeline(tmp_path, log, metrics, None)
    try:
        up.start()
        wait_until(lambda: up.metrics(), 60, "kvscope up to serve its self-metrics")
        log.write_text("".join(line + "\n" for line in lines))
        time.sleep(0.5)
        assert up.proc is not None
        up.proc.send_signal(getattr(signal, sig))
        assert up.proc.wait(60) == 0
    finally:
        if up.alive():
            up.kill()
        metrics.close()
    assert "stopping (draining the pipeline)" in up.log_path.read_text()
    result = verify(tmp_path / "data", database, len(lines))
    assert result["rows"] == result["answers"] == len(lines) and result["bad_answers"] == 0
