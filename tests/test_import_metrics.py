"""``kvscope import metrics``: nothing loaded is an error (exit 1, the reason, a dead letter), and one pod has
one scrape per instant, so a query's answer is the same on every run."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.store import Store
from kvscope.importer import import_metrics

SAMPLES = Path(__file__).parent / "samples"
BODY1 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0'
NOW_MS = (int(time.time()) - 3600) * 1000  # raw vLLM rows are kept 30 days: a recent, whole-second instant


def with_usage(usage: float) -> bytes:
    assert USAGE in BODY1
    return BODY1.replace(USAGE, USAGE.replace("0.0", repr(usage))).encode()


@pytest.mark.parametrize(("raw", "reason"), [
    (b"", "empty /metrics body"),
    (b"  \n\n", "empty /metrics body"),
    (b"<!DOCTYPE html>\n<html><body><h1>502 Bad Gateway</h1></body></html>\n",
     "an HTML page, not Prometheus text"),
    (gzip.compress(BODY1.encode()), "gzip-compressed bytes, not Prometheus text"),
    (b"vllm:num_requests_running 1\xff\n",  # 25 + 2 bytes before it
     "not UTF-8 text (invalid start byte at byte 27)"),
    (b"# HELP up up\n# TYPE up gauge\nup 1\n", "no series kvscope keeps (not a vLLM /metrics?)"),
])
def test_a_body_with_nothing_to_load_is_refused_with_its_reason(store: Store, tmp_path: Path, raw: bytes,
                                                                  reason: str) -> None:
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", raw, NOW_MS)
    assert not result.loaded and result.series == result.configs == 0
    [got] = result.reasons
    assert got.startswith(reason)
    [(n,)] = store.query_rows("SELECT count() FROM dead_letters WHERE source = 'vllm_metrics' AND pod = 'pod-a' "
                              "AND reason = {r:String}", {"r": got})
    assert n == 1


def test_a_real_body_with_a_bom_loads_gauges_and_the_cache_config(store: Store, tmp_path: Path) -> None:
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", b"\xef\xbb\xbf" + with_usage(0.25), NOW_MS)
    # a lone snapshot: num_requests_running, num_requests_waiting, kv_cache_usage_perc; engine 0's cache config
    assert result.loaded and (result.series, result.configs, result.reasons) == (3, 1, [])


def test_a_second_scrape_of_one_pod_at_one_instant_is_refused_and_queries_agree(store: Store,
                                                                                 tmp_path: Path) -> None:
    """Two bodies for pod-a at one --at: KV-cache usage 0.25, then 0.75. The first is kept; the second is a
    dead letter; `pods` answers 0.25 on every run (one scrape per pod and instant: no argMax tie)."""
    first = import_metrics(store, "pod-a", tmp_path / "a.txt", with_usage(0.25), NOW_MS)
    second = import_metrics(store, "pod-a", tmp_path / "b.txt", with_usage(0.75), NOW_MS)
    assert first.loaded and not second.loaded
    assert second.reasons == ["the store already holds a scrape of pod 'pod-a' at this time: a second scrape of one "
                              "pod at one instant is refused (the first is kept); give another --at"]
    # the same file again is refused the same way, and its dead letter is stored once
    assert not import_metrics(store, "pod-a", tmp_path / "b.txt", with_usage(0.75), NOW_MS).loaded
    [(n,)] = store.query_rows("SELECT count() FROM dead_letters FINAL WHERE startsWith(reason, 'the store already')")
    assert n == 1
    answers = {store.named("pods", {"pod": "pod-a"})["kv_cache_usage"].to_list()[0] for _ in range(5)}
    assert answers == {0.25}
    # another pod at the same instant is another scrape
    assert import_metrics(store, "pod-b", tmp_path / "b.txt", with_usage(0.75), NOW_MS).loaded


def run_cli(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")} | settings
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[1], timeout=300)


def test_the_command_exits_1_when_nothing_was_loaded(tmp_path: Path) -> None:
    at = datetime.fromtimestamp(NOW_MS / 1000, UTC).isoformat()
    data = ["--data-dir", str(tmp_path / "data")]
    (tmp_path / "page.html").write_text("<html><body>Sign in</body></html>\n")
    (tmp_path / "m.txt").write_bytes(with_usage(0.25))
    page = run_cli("import", "metrics", str(tmp_path / "page.html"), "--pod", "p", "--at", at, *data)
    assert page.returncode == 1, page.stderr
    assert "nothing loaded: an HTML page, not Prometheus text" in page.stderr and "(1 dead letters)" in page.stderr
    ok = run_cli("import", "metrics", str(tmp_path / "m.txt"), "--pod", "p", "--at", at, *data)
    assert ok.returncode == 0, ok.stderr
    assert "3 series, 1 cache configs" in ok.stdout


@pytest.mark.parametrize("at", ["2150-01-01T00:00:00+00:00", "1999-12-31T23:59:59+00:00"])
def test_a_scrape_time_outside_what_the_store_holds_is_refused(store: Store, tmp_path: Path, at: str) -> None:
    """Past 2106 ClickHouse's DateTime wraps: the TTL would drop the raw rows at insert while the minute rollups
    kept them (at a clamped minute, again on every re-import). Refused whole, its dead letter kept."""
    at_ms = int(datetime.fromisoformat(at).timestamp() * 1000)
    for _ in range(2):
        result = import_metrics(store, "pod-a", tmp_path / "m.txt", with_usage(0.25), at_ms)
        assert (result.series, result.configs) == (0, 0)
        [reason] = result.reasons
        assert reason.startswith(f"scrape time {at} is outside 2000..2100 (UTC)")
    assert store.query_rows("SELECT count() FROM vllm_metrics")[0][0] == 0
    assert store.query_rows("SELECT count() FROM vllm_1m")[0][0] == 0
    assert [r[0] for r in store.query_rows("SELECT reason FROM dead_letters")] == [reason]


def test_the_command_applies_the_label_length_limit_setting(tmp_path: Path) -> None:
    """`KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT` reaches the import: a 100-byte model_name is stored under the
    default (1,024 bytes) and is a dead letter naming the setting under 64; the rest of the body loads."""
    at = datetime.fromtimestamp(NOW_MS / 1000, UTC).isoformat()
    line = f'vllm:num_requests_waiting{{engine="1",model_name="{"m" * 100}"}} 2.0\n'
    (tmp_path / "m.txt").write_bytes(with_usage(0.25) + line.encode())
    for limit, series, dead in [("1024", 4, 0), ("64", 3, 1)]:
        data = ["--data-dir", str(tmp_path / f"data-{limit}")]
        r = run_cli("import", "metrics", str(tmp_path / "m.txt"), "--pod", "p", "--at", at, *data,
                    KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT=limit)
        assert r.returncode == 0, r.stderr
        assert f"{series} series, 1 cache configs" in r.stdout and f"{dead} dead letters" in r.stdout
