"""The exposition rules of collector/vllm_metrics.py (its module docstring; docs/reliability.md "vLLM /metrics
bodies") on real vLLM 0.32 captures made hostile as a proxy or a broken exporter makes them: a proxy's own
label on every series, the same series twice in one body, samples after ``# EOF``. The live scrape (a real
HTTP server, the real Collector) and ``kvscope import metrics`` (real chDB) give the same rows and dead letters;
the named queries read a proxied pod's gauges without summing them."""

from __future__ import annotations

import http.server
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, VllmScrape, decode_batch, make_event_id
from collector.prom_text import AFTER_EOF
from collector.publish import MemoryQueue, QueuePublisher
from collector.service import Collector, Target
from collector.vllm_metrics import DUPLICATE, KEPT_NAMES, ScrapeState, scrape_events
from ingest.store import Store
from kvscope.importer import import_events, import_metrics, source_path

SAMPLES = Path(__file__).parent / "samples"
BODY1 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
BODY2 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text()
SERIES = '{engine="0",model_name="tiny"}'
USAGE, RUNNING = f"vllm:kv_cache_usage_perc{SERIES}", f"vllm:num_requests_running{SERIES}"
PROMPT = f"vllm:prompt_tokens_total{SERIES}"
CONFIG = next(line for line in BODY1.splitlines() if line.startswith("vllm:cache_config_info{"))
MINUTE_MS = (int(time.time()) // 3600 - 1) * 3600 * 1000  # the start of a recent whole hour (raw rows: 30 days)
Row = tuple[str, str, str, float]  # (name, engine, label, value)


def gauges(body: str, usage: float, running: float) -> str:
    """A real capture with its KV-cache usage and running requests set."""
    out = body.replace(f"{USAGE} 0.0", f"{USAGE} {usage!r}").replace(f"{RUNNING} 0.0", f"{RUNNING} {running!r}")
    assert out.count(repr(usage)) and out != body
    return out


def proxied(body: str, **labels: str) -> str:
    """``body``'s sample lines with ``labels`` added, as a proxy adds its own (``instance``, ``replica``)."""
    extra = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "\n".join(line if not line or line[0] == "#" else
                     re.sub(r"^([^{ ]+)(?:\{(.*?)\})? ", lambda m: f"{m[1]}{{{m[2] + ',' if m[2] else ''}{extra}}} ",
                            line, count=1)
                     for line in body.splitlines()) + "\n"


def kept_lines(body: str) -> list[str]:
    """The sample lines of ``body`` whose name kvscope keeps (what a scrape would load)."""
    return [line for line in body.splitlines() if line and line[0] != "#" and re.split(r"[{ ]", line)[0] in KEPT_NAMES]


# --- live scrape and import: one code path -------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def live(body: str, tmp_path: Path) -> list[Envelope]:
    """One scrape of ``body`` by the real Collector from a real HTTP server; the envelopes it published."""
    handler = type("H", (_Handler,), {"body": body.encode()})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    q = MemoryQueue()
    c = Collector(publisher=QueuePublisher(q), checkpoints=CheckpointStore(tmp_path / "c.json"),
                  targets=[Target("pod-a", f"http://127.0.0.1:{srv.server_port}/metrics")])
    try:
        with httpx.Client(timeout=10.0) as client:
            assert c.scrape_all(client, wait_seconds=10.0) > 0
    finally:
        c.close_scrapes()
        srv.shutdown()
        srv.server_close()
    out: list[Envelope] = []
    while msgs := q.take(100, 0.05):
        for m in msgs:
            out.extend(decode_batch(m.value))
        q.release(msgs)
    return out


def loaded(events: list[Envelope]) -> tuple[list[Row], dict[str, str], list[tuple[str, str]]]:
    """(sorted samples, engine 0's cache config, sorted dead letters (raw, reason)) of a scrape's envelopes."""
    [scrape] = [e.payload for e in events if isinstance(e.payload, VllmScrape)]
    rows = sorted((s.name, s.engine, s.label, s.value) for s in scrape.samples)
    dead = sorted((e.payload.raw, e.payload.reason) for e in events if isinstance(e.payload, DeadLetter))
    return rows, scrape.cache_config.get("0", {}), dead


def stored(store: Store) -> tuple[list[Row], dict[str, str], list[tuple[str, str]]]:
    """The same, read back from the store after ``kvscope import metrics``."""
    rows = sorted((n, e, lab, v) for n, e, lab, v in store.query_rows(
        "SELECT name, engine, label, value FROM vllm_metrics WHERE pod = 'pod-a'"))
    [(config,)] = store.query_rows("SELECT labels FROM vllm_cache_config WHERE pod = 'pod-a' AND engine = '0'")
    dead = sorted((raw, reason) for raw, reason in store.query_rows(
        "SELECT raw, reason FROM dead_letters WHERE source = 'vllm_metrics' AND pod = 'pod-a'"))
    return rows, dict(config), dead


DUPLICATES = [  # each a second sample of a series BODY1 has (labels reordered, an empty label: the same set)
    f"{USAGE} 0.9",
    'vllm:num_requests_running{model_name="tiny",engine="0"} 5.0',
    'vllm:num_requests_waiting{engine="0",model_name="tiny",replica=""} 7.0',
    f"{PROMPT} 1.0",
    'vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.9e+09',
    'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 99.0',
    CONFIG,
    CONFIG.replace("} 1.0", ',replica=""} 1.0'),
    CONFIG.replace('block_size="32"', 'block_size="16"', 1),
]
HOSTILE = {
    "duplicates": BODY1 + "\n".join(DUPLICATES) + "\n",
    "after_eof": BODY1 + "# EOF\n" + gauges(BODY2, 0.75, 3.0),
    "proxy_label": proxied(gauges(BODY1, 0.6, 2.0), replica="a") + proxied(gauges(BODY1, 0.5, 1.0), replica="b"),
    # the same bad line more than once: a repeated series twice, an unparseable line twice, after the first copies
    "repeated": BODY1 + (DUPLICATES[1] + "\n") * 2 + (f"{RUNNING.replace('running', 'waiting')} oops\n") * 2,
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_the_live_scrape_and_the_import_load_the_same(store: Store, tmp_path: Path, kind: str) -> None:
    body = HOSTILE[kind]
    counted = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "vllm_metrics"}) or 0.0
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", body.encode(), MINUTE_MS)
    assert result.loaded and result.reasons
    rows, config, dead = loaded(live(body, tmp_path))
    assert stored(store) == (rows, config, dead)
    assert sorted(result.reasons) == sorted(reason for _, reason in dead)
    counted = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "vllm_metrics"}) - counted
    assert counted == len(dead)  # each one in kvscope's own metrics too


def test_each_copy_of_a_bad_line_is_a_dead_letter_of_its_own_stored_once(store: Store, tmp_path: Path) -> None:
    """Identical bad lines of one body (a series repeated, an unparseable line copied) shared one dead-letter id
    (url, scrape time, line), so the store kept one for several rejected lines. Each is stored, live and imported;
    the same body imported again at the same time, or the live scrape's envelopes sent again, adds none; the first
    copy of a line keeps the id it had before (a re-send across an upgrade finds it)."""
    body = HOSTILE["repeated"]
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", body.encode(), MINUTE_MS)
    assert sorted(result.reasons) == sorted([DUPLICATE] * 2 + ["unparseable sample line: could not convert string "
                                                                "to float: 'oops'"] * 2)
    assert sorted(reason for _, reason in stored(store)[2]) == sorted(result.reasons)
    url = f"file://{source_path(tmp_path / 'm.txt')}"
    dead = [e for e in scrape_events("pod-a", url, body, MINUTE_MS, 1.0) if isinstance(e.payload, DeadLetter)]
    assert len({e.event_id for e in dead}) == 4
    assert import_events(store, dead) == {}  # the import's dead letters made again: stored already
    first = next(e for e in dead if e.payload.raw == DUPLICATES[1])
    assert first.event_id == make_event_id("dead_letter", "pod-a", url, MINUTE_MS, DUPLICATES[1])
    live_events = live(body, tmp_path)
    for _ in range(2):  # the live scrape's envelopes, and the same ones re-sent
        import_events(store, [e for e in live_events if isinstance(e.payload, DeadLetter)])
        assert store.query_rows("SELECT count() FROM dead_letters WHERE startsWith(location, 'http')") == [(4,)]


def test_a_series_twice_in_one_body_keeps_its_first_sample() -> None:
    """Every kind (gauge, counter, _created, bucket, cache_config_info): the first sample is kept, each later one
    is one dead letter with the reason; a second cache_config_info of engine 0 names the label that differs."""
    state = ScrapeState()
    base = loaded(scrape_events("pod-a", "u", BODY1, 1_000, 1.0, state))
    first = loaded(scrape_events("pod-a", "u", HOSTILE["duplicates"], 1_000, 1.0))
    assert first[:2] == base[:2]  # gauges 0.0 and block_size 32: the first ones
    assert first[0] and first[1]["block_size"] == "32"
    reasons = dict(first[2])
    assert len(first[2]) == len(DUPLICATES) == len(reasons)
    assert reasons.pop(DUPLICATES[-1]) == (
        "a second vllm:cache_config_info of engine '0' in one scrape (it differs in block_size): the first is "
        "kept, one cache config per pod and engine")
    assert set(reasons.values()) == {DUPLICATE}
    # a counter's later sample changes nothing: the increase is the first sample's
    second = scrape_events("pod-a", "u", BODY2 + "\n".join(DUPLICATES[3:5]) + "\n", 2_000, 1.0, state)
    [scrape] = [e.payload for e in second if isinstance(e.payload, VllmScrape)]
    assert {s.name: s.increase for s in scrape.samples}["vllm:prompt_tokens_total"] == 12909.0 - 9818.0
    assert sum(isinstance(e.payload, DeadLetter) for e in second) == 2


def test_nothing_after_eof_is_loaded() -> None:
    """An OpenMetrics body followed by another one: the scrape is the first body's, each kept sample line after
    # EOF is one dead letter."""
    rows, config, dead = loaded(scrape_events("pod-a", "u", HOSTILE["after_eof"], 1_000, 1.0))
    assert (rows, config) == loaded(scrape_events("pod-a", "u", BODY1, 1_000, 1.0))[:2]
    after = kept_lines(gauges(BODY2, 0.75, 3.0))
    assert len(after) > 100 and sorted(after) == [raw for raw, _ in dead]
    assert {reason for _, reason in dead} == {AFTER_EOF}
    # a `# EOF` at the end of a body (OpenMetrics as served) costs nothing
    assert loaded(scrape_events("pod-a", "u", BODY1 + "# EOF\n", 1_000, 1.0))[2] == []


# --- labels kvscope does not read -------------------------------------------------------------------------


def test_a_gauge_behind_a_proxy_is_never_summed_and_the_queries_read_each_replica(store: Store) -> None:
    """Two replicas behind one target, told apart by the proxy's `replica` label. Each gauge sample is its own
    series (usage 0.6 and 0.5, never 1.1); counters are summed (their increases are what every query sums).
    Queries: `pods` averages the latest usage over the pod's series, `vllm_series` sums running requests over
    them and averages usage; the token rate is both replicas' increases."""
    state = ScrapeState()
    scrapes = [(MINUTE_MS + 10_000, {"a": (0.6, 2.0, BODY1), "b": (0.5, 1.0, BODY1)}),
               (MINUTE_MS + 40_000, {"a": (0.7, 4.0, BODY2), "b": (0.2, 0.0, BODY2)})]
    dead: list[str] = []
    for at_ms, replicas in scrapes:
        body = "".join(proxied(gauges(b, u, r), replica=k) for k, (u, r, b) in replicas.items())
        events = scrape_events("pod-a", "u", body, at_ms, 1.0, state)
        dead += [e.payload.reason for e in events if isinstance(e.payload, DeadLetter)]
        import_events(store, events)
    # the second cache_config_info of engine 0 (replica b's) is the only dead letter, once: config sent once
    assert dead == ["a second vllm:cache_config_info of engine '0' in one scrape (it differs in replica): the "
                    "first is kept, one cache config per pod and engine"] * 2
    usage = store.query_rows("SELECT toUnixTimestamp64Milli(ts), label, value FROM vllm_metrics "
                             "WHERE name = 'vllm:kv_cache_usage_perc' ORDER BY ts, label")
    assert usage == [(MINUTE_MS + 10_000, 'replica="a"', 0.6), (MINUTE_MS + 10_000, 'replica="b"', 0.5),
                     (MINUTE_MS + 40_000, 'replica="a"', 0.7), (MINUTE_MS + 40_000, 'replica="b"', 0.2)]
    prompt = store.query_rows("SELECT label, increase FROM vllm_metrics WHERE name = 'vllm:prompt_tokens_total'")
    assert prompt == [("", 2 * (12909.0 - 9818.0))]  # counters: one row, both replicas' increases
    [p] = store.named("pods", {}).to_dicts()
    assert p["kv_cache_usage"] == pytest.approx((0.7 + 0.2) / 2)
    [s] = store.named("vllm_series", {}).to_dicts()
    assert s["kv_cache_usage"] == pytest.approx(((0.6 + 0.7) / 2 + (0.5 + 0.2) / 2) / 2)
    assert s["running"] == pytest.approx((2.0 + 4.0) / 2 + (1.0 + 0.0) / 2)
    assert s["prompt_tokens_per_s"] == pytest.approx(2 * (12909.0 - 9818.0) / 60)


def test_label_sets_that_would_render_alike_are_two_series() -> None:
    """A series key holds the labels kvscope does not read as written in an exposition (escaped): `x="1,y=2"` and
    `x="1",y="2"` are two series (joined unescaped they were one, and the second a false duplicate)."""
    body = ('vllm:num_requests_running{engine="0",model_name="tiny",x="1,y=2"} 1.0\n'
            'vllm:num_requests_running{engine="0",model_name="tiny",x="1",y="2"} 2.0\n'
            'vllm:num_requests_running{engine="0",model_name="tiny",x="a\\"b"} 3.0\n')
    rows, _, dead = loaded(scrape_events("pod-a", "u", body, 1_000, 1.0))
    assert dead == []
    assert [(label, v) for _, _, label, v in rows] == [('x="1",y="2"', 2.0), ('x="1,y=2"', 1.0), ('x="a\\"b"', 3.0)]


def test_a_checkpoint_from_before_the_escaped_keys_continues_its_counters() -> None:
    """A scrape state saved when the other labels were keyed unescaped (`replica=a`) still gives the increase
    of a proxied counter at the next scrape (not a baseline: that interval's tokens would be lost)."""
    state = ScrapeState()
    scrape_events("pod-a", "u", proxied(BODY1, replica="a"), 1_000, 1.0, state)
    old = state.to_json()
    for row in old["values"]:
        row[3] = row[3].replace('"', "")
    for row in old["created"]:
        row[4] = row[4].replace('"', "")
    assert any(row[3] == "replica=a" for row in old["values"])
    restored = ScrapeState.from_json(old)
    assert restored.values == state.values and restored.created == state.created
    [scrape] = [e.payload for e in scrape_events("pod-a", "u", proxied(BODY2, replica="a"), 2_000, 1.0, restored)
                if isinstance(e.payload, VllmScrape)]
    assert {s.name: s.increase for s in scrape.samples}["vllm:prompt_tokens_total"] == 12909.0 - 9818.0


# --- bounded labels ----------------------------------------------------------------------------------------

VALUE_REASON = ("the value of label {!r} is longer than KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT=1024 bytes "
                "(Prometheus' label_value_length_limit): the sample is not stored")
COUNT_REASON = ("more labels than KVSCOPE_VLLM_LABEL_LIMIT=64 (Prometheus' label_limit): the sample is not stored")
NAME_REASON = ("label name {!r} is longer than KVSCOPE_VLLM_LABEL_NAME_LENGTH_LIMIT=128 bytes (Prometheus' "
               "label_name_length_limit): the sample is not stored")
MANY = ",".join(f'l{i:05}="{"v" * 100}{i}"' for i in range(10_000))  # 10,000 distinct long labels, 1 MB
OVER_LIMITS = [  # (sample line, its dead letter's reason): each a new series beside BODY1's, over one bound
    (f'vllm:num_requests_running{{engine="0",model_name="tiny",instance="{"i" * 50_000_000}"}} 5.0',
     VALUE_REASON.format("instance")),
    (f'vllm:kv_cache_usage_perc{{engine="0",model_name="{"m" * 1025}"}} 0.5', VALUE_REASON.format("model_name")),
    (f'vllm:num_requests_waiting{{engine="{"€" * 342}",model_name="tiny"}} 2.0',  # 342 characters, 1,026 bytes
     VALUE_REASON.format("engine")),
    (f'vllm:prompt_tokens_total{{engine="0",model_name="tiny",{MANY}}} 7.0', COUNT_REASON),
    (f'vllm:num_requests_running{{engine="0",model_name="tiny",{"n" * 129}="x"}} 1.0',
     NAME_REASON.format("n" * 50 + "...")),
]
WITHIN_LIMITS = [  # at the bounds: stored
    f'vllm:num_requests_running{{engine="0",model_name="tiny",instance="{"€" * 341}"}} 3.0',  # 1,023 bytes
    f'vllm:num_requests_running{{engine="0",model_name="tiny",{"n" * 128}="{"x" * 1024}"}} 4.0',
]


def test_a_sample_over_a_label_bound_costs_only_itself_live_and_imported(store: Store, tmp_path: Path) -> None:
    """A 50 MB `instance`, a long `model_name`, an `engine` of 1,026 UTF-8 bytes in 342 characters, a sample with
    10,000 long labels, a 129-byte label name: each is one dead letter naming the label and the setting, the same
    from the live scrape (a real HTTP server, the real Collector) and from `kvscope import metrics` (real chDB);
    everything else of the body is stored as without them, samples at the bounds too. Before: each was stored
    as a series of its own (the 50 MB value in vllm_metrics.label, in the Kafka message, in every GROUP BY)."""
    body = BODY1 + "\n".join([line for line, _ in OVER_LIMITS] + WITHIN_LIMITS) + "\n"
    counted = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "vllm_metrics"}) or 0.0
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", body.encode(), MINUTE_MS)
    rows, config, dead = loaded(live(body, tmp_path))
    assert stored(store) == (rows, config, dead)
    assert result.reasons == [reason for _, reason in OVER_LIMITS]
    assert sorted(reason for _, reason in dead) == sorted(reason for _, reason in OVER_LIMITS)
    assert sorted(raw for raw, _ in dead) == sorted(line[:64 * 1024] for line, _ in OVER_LIMITS)
    base_rows, base_config, _ = loaded(scrape_events("pod-a", "u", BODY1, 1_000, 1.0))
    at_bounds = [("vllm:num_requests_running", "0", f'instance="{"€" * 341}"', 3.0),
                 ("vllm:num_requests_running", "0", f'{"n" * 128}="{"x" * 1024}"', 4.0)]
    assert (rows, config) == (sorted(base_rows + at_bounds), base_config)
    assert max(len(label) for _, _, label, _ in rows) < 2000
    counted = REGISTRY.get_sample_value("kvscope_dead_letters_total", {"source": "vllm_metrics"}) - counted
    assert counted == len(dead)  # each one in kvscope's own metrics too


def test_a_counter_over_a_label_bound_leaves_every_other_counter_as_it_was(tmp_path: Path) -> None:
    """Two live scrapes (real HTTP server, the Collector's checkpointed journal between them) of the real
    captures with counters over a bound added: a huge `model_name`, a huge proxy `instance` on a counter the
    body has (it was summed into that counter's increase), a `_created` with a long label. The increases and
    the journal's state are those of the captures alone; each such sample is a dead letter in each scrape."""
    def hostile(body: str, value: float) -> str:
        big = "x" * 2_000_000
        return body + "\n".join([
            f'vllm:prompt_tokens_total{{engine="0",model_name="{big}"}} {value}',
            f'vllm:prompt_tokens_total{{engine="0",model_name="tiny",instance="{big}"}} {value}',
            f'vllm:generation_tokens_created{{engine="0",model_name="tiny",{"n" * 200}="a"}} 1.9e+09',
        ]) + "\n"

    def scrapes(body1: str, body2: str, path: Path) -> tuple[list[tuple[str, str, str, float, float]], int, dict]:
        path.mkdir()
        live(body1, path)
        events = live(body2, path)
        scrape = max((e.payload for e in events if isinstance(e.payload, VllmScrape)), key=lambda s: s.scraped_at_ms)
        state = CheckpointStore(path / "c.json").get("vllm_metrics")["pods"]["pod-a"]
        del state["at"], state["since"]
        return (sorted((s.name, s.engine, s.label, s.value, s.increase) for s in scrape.samples),
                sum(isinstance(e.payload, DeadLetter) and e.observed_at_ms == scrape.scraped_at_ms for e in events),
                state)

    plain, no_dead, plain_state = scrapes(BODY1, BODY2, tmp_path / "plain")
    got, dead, got_state = scrapes(hostile(BODY1, 5.0), hostile(BODY2, 1e6), tmp_path / "hostile")
    assert got == plain and got_state == plain_state
    assert no_dead == 0 and dead == 3
    assert ("vllm:prompt_tokens_total", "0", "", 12909.0, 12909.0 - 9818.0) in got



def scrapes(served: list[tuple[bytes, bool]], tmp_path: Path, limit: int) -> list[list[Envelope]]:
    """Each round's envelopes of the real Collector (``body_size_limit`` ``limit``) scraping a real HTTP server
    that serves ``served`` in turn: (body, gzipped)."""
    import gzip

    served = list(served)

    class Handler(_Handler):
        def do_GET(self) -> None:  # noqa: N802
            body, gz = served.pop(0)
            data = gzip.compress(body) if gz else body
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            if gz:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    q = MemoryQueue()
    c = Collector(publisher=QueuePublisher(q), checkpoints=CheckpointStore(tmp_path / "c.json"),
                  targets=[Target("pod-a", f"http://127.0.0.1:{srv.server_port}/metrics")], body_size_limit=limit)
    rounds: list[list[Envelope]] = []
    try:
        with httpx.Client(timeout=10.0) as client:
            while served:
                assert c.scrape_all(client, wait_seconds=10.0) > 0
                out: list[Envelope] = []
                while msgs := q.take(100, 0.05):
                    for m in msgs:
                        out.extend(decode_batch(m.value))
                    q.release(msgs)
                rounds.append(out)
    finally:
        c.close_scrapes()
        srv.shutdown()
        srv.server_close()
    return rounds


def test_a_body_over_the_size_limit_is_one_dead_letter_and_the_next_scrape_goes_on(tmp_path: Path) -> None:
    """A /metrics body longer than KVSCOPE_VLLM_BODY_SIZE_LIMIT (Prometheus' body_size_limit), plain or gzipped (its
    decompressed bytes count), from a real HTTP server to the real Collector: the scrape is one dead letter naming
    the setting, with the body's first 64 KiB, and no sample; the pod's next scrape within the limit is loaded as
    if the failed ones had not happened (its counter state is kept across them)."""
    small, later = BODY1.encode(), BODY2.encode()
    big = (BODY1 + "# padding\n" * 20_000).encode()
    assert max(len(small), len(later)) < 150_000 < len(big)
    failed = scrapes([(small, False), (big, False), (big, True), (later, False)], tmp_path / "a", 150_000)
    control = scrapes([(small, False), (later, False)], tmp_path / "b", 150_000)
    before = REGISTRY.get_sample_value("kvscope_collector_scrape_failures_total",
                                       {"pod": "pod-a", "reason": "body_size"}) or 0
    for over in failed[1:3]:
        [dead] = [e.payload for e in over]
        assert isinstance(dead, DeadLetter) and dead.source == "vllm_metrics"
        assert "KVSCOPE_VLLM_BODY_SIZE_LIMIT=150000" in dead.reason and dead.location.endswith("/metrics")
        assert dead.raw == big.decode()[:64 * 1024]
    assert before >= 2

    def samples(events: list[Envelope]) -> list[tuple[str, str, str, float]]:
        assert not [e for e in events if isinstance(e.payload, DeadLetter)]
        [scrape] = [e.payload for e in events if isinstance(e.payload, VllmScrape)]
        return sorted((x.name, x.engine, x.label, x.value) for x in scrape.samples)

    assert samples(failed[3]) == samples(control[1]) and samples(control[1])
    assert samples(failed[0]) == samples(control[0])
    # no limit: the big body is loaded
    [unlimited] = scrapes([(big, True)], tmp_path / "c", 0)
    assert samples(unlimited) == samples(control[0])
