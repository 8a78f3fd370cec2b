"""The vLLM counter rules (collector/vllm_metrics.py, docs/reliability.md "vLLM targets and counters") on real captures:
created-timestamp zero injection from the watch start (checkpointed), a decrease without a ``_created`` change
flagged, a scrape not after the pod's previous one refused. Right values from tests/samples/README.md."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from collector.checkpoint import CheckpointStore
from collector.events import DeadLetter, Envelope, VllmScrape, decode_batch
from collector.publish import MemoryQueue, QueuePublisher
from collector.service import Collector, Target
from collector.vllm_metrics import COUNTER_RANGE, ScrapeJournal, ScrapeState, advance, scrape_events
from ingest.store import Store
from kvscope.importer import import_events

SAMPLES = Path(__file__).parent / "samples"
BODY1 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()  # 9,818 queried, 4,064 hit, 12 requests
BODY2 = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text()  # 12,909 queried, 5,472 hit, 17 requests
URL = "http://pod-0:8000/metrics"
# every kept _created of the captures lies in [1795949655.355, 1795949655.357] s: the server started then
BORN_MS = 1_795_949_655_355
QUERIES = ("vllm:prefix_cache_queries_total", "0", "")
HITS = ("vllm:prefix_cache_hits_total", "0", "")
LENGTH = ("vllm:request_success_total", "0", "length")


def scrape_of(events: list[Envelope]) -> VllmScrape:
    [p] = [e.payload for e in events if isinstance(e.payload, VllmScrape)]
    return p


def dead(events: list[Envelope]) -> list[DeadLetter]:
    return [e.payload for e in events if isinstance(e.payload, DeadLetter)]


def increases(p: VllmScrape) -> dict[tuple[str, str, str], float]:
    return {(s.name, s.engine, s.label): s.increase for s in p.samples if s.increase}


def anomalies(pod: str, kind: str) -> float:
    return REGISTRY.get_sample_value("kvscope_collector_scrape_anomalies_total", {"pod": pod, "kind": kind}) or 0


def born_at(body: str, created_s: float) -> str:
    """A capture whose every ``_created`` sample says ``created_s`` (unix s): the server started then."""
    out = re.sub(r"^(vllm:\S+_created(?:\{[^}]*\})?) \S+$", lambda m: f"{m.group(1)} {created_s!r}", body,
                 flags=re.MULTILINE)
    assert out != body
    return out


# --- created-timestamp rule -----------------------------------------------------------------------------------

def test_a_server_started_after_the_watch_began_is_counted_from_zero() -> None:
    """kvscope watched from 10 s before the server started; the first scrape that answered already held 12
    requests: all of them are increases (Prometheus's created-timestamp zero injection), not a baseline."""
    state = ScrapeState(watching_since_ms=BORN_MS - 10_000)
    p = scrape_of(scrape_events("pod-0", URL, BODY1, BORN_MS + 30_000, 1.0, state))
    inc = increases(p)
    assert inc[QUERIES] == 9818 and inc[HITS] == 4064 and inc[LENGTH] == 12
    assert inc[("vllm:prompt_tokens_total", "0", "")] == 9818
    assert inc[("vllm:time_to_first_token_seconds_count", "0", "")] == 12
    assert ("vllm:num_preemptions_total", "0", "") not in inc  # 0 from 0: nothing to send
    assert p.previous_scraped_at_ms == BORN_MS - 10_000 and p.restarts == []
    # the next scrape counts from there: 12,909 queried and 5,472 hit since the server started, once
    inc2 = increases(scrape_of(scrape_events("pod-0", URL, BODY2, BORN_MS + 60_000, 1.0, state)))
    assert inc[QUERIES] + inc2[QUERIES] == 12909 and inc[HITS] + inc2[HITS] == 5472


def test_a_server_started_before_the_watch_began_is_a_baseline() -> None:
    state = ScrapeState(watching_since_ms=BORN_MS + 1_000)
    p = scrape_of(scrape_events("pod-0", URL, BODY1, BORN_MS + 30_000, 1.0, state))
    assert increases(p) == {} and p.previous_scraped_at_ms == 0
    # and so is every snapshot when the watch start is unknown (kvscope import metrics)
    assert increases(scrape_of(scrape_events("pod-0", URL, BODY1, BORN_MS + 30_000, 1.0))) == {}


def test_a_series_that_appears_after_the_first_scrape_is_counted_from_zero() -> None:
    """vLLM creates a label value's series at its first use: 2 aborted requests between two scrapes."""
    abort = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0\n'
    created = 'vllm:request_success_created{engine="0",finished_reason="abort",model_name="tiny"} '
    first = BODY1.replace(abort, "")
    first = re.sub(f"^{re.escape(created)}.*\n", "", first, flags=re.MULTILINE)
    assert abort not in first and created not in first
    second = BODY1.replace(abort, abort.replace("0.0", "2.0"))
    second = re.sub(f"^({re.escape(created)}).*$", lambda m: f"{m.group(1)}{(BORN_MS + 20_000) / 1000!r}", second,
                    flags=re.MULTILINE)
    state = ScrapeState(watching_since_ms=BORN_MS + 1_000)  # the server itself is older: a baseline
    assert increases(scrape_of(scrape_events("pod-0", URL, first, BORN_MS + 10_000, 1.0, state))) == {}
    inc = increases(scrape_of(scrape_events("pod-0", URL, second, BORN_MS + 30_000, 1.0, state)))
    assert inc == {("vllm:request_success_total", "0", "abort"): 2}


def test_the_watch_start_is_checkpointed_and_a_restart_does_not_recount(tmp_path: Path) -> None:
    path = tmp_path / "scrapes.json"
    journal = ScrapeJournal(CheckpointStore(path))
    journal.watch(["pod-0"], BORN_MS - 10_000)  # first attempt: the server is not up yet
    journal.commit([])  # a round where nothing answered still writes the watch start
    journal = ScrapeJournal(CheckpointStore(path))  # collector restarted
    journal.watch(["pod-0"], BORN_MS + 5_000)  # does not move a recorded start
    assert journal.state("pod-0").watching_since_ms == BORN_MS - 10_000
    events, new = advance(journal.state("pod-0"), "pod-0", URL, BODY1, BORN_MS + 30_000, 1.0)
    assert increases(scrape_of(events))[QUERIES] == 9818
    journal.commit([("pod-0", events, new)])
    journal = ScrapeJournal(CheckpointStore(path))  # restarted again: the series now have previous values
    events, _ = advance(journal.state("pod-0"), "pod-0", URL, BODY2, BORN_MS + 60_000, 1.0)
    assert increases(scrape_of(events))[QUERIES] == 12909 - 9818  # not 12,909 again
    assert json.loads(path.read_text())["vllm_metrics"]["pods"]["pod-0"]["since"] == BORN_MS - 10_000


def test_a_checkpoint_without_a_watch_start_watches_from_its_last_scrape() -> None:
    old = {"at": BORN_MS + 30_000, "values": [], "created": [], "cache_config": {}}  # written before "since"
    assert ScrapeState.from_json(old).watching_since_ms == BORN_MS + 30_000


class Switchable(http.server.BaseHTTPRequestHandler):
    """A /metrics server whose status and body the test changes between rounds."""

    status = 503
    body = b""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def switchable():  # type: ignore[no-untyped-def]
    handler = type("H", (Switchable,), {})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{srv.server_port}/metrics"
    srv.shutdown()
    srv.server_close()


def test_the_collector_counts_requests_served_before_its_first_answered_scrape(switchable, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The pod answers 503 while it starts; the collector restarts in between; the server's 12 requests
    served before the first answered scrape are counted (before this rule: a baseline, 0)."""
    handler, url = switchable
    path = tmp_path / "c.json"
    q = MemoryQueue()
    first = Collector(publisher=QueuePublisher(q), checkpoints=CheckpointStore(path), targets=[Target("pod-0", url)])
    with httpx.Client(timeout=5.0) as client:
        assert first.scrape_all(client, wait_seconds=5.0) == 0  # 503: nothing scraped, the watch start written
    first.close_scrapes()
    since = json.loads(path.read_text())["vllm_metrics"]["pods"]["pod-0"]["since"]
    handler.status, handler.body = 200, born_at(BODY1, (since + 1_000) / 1000).encode()
    second = Collector(publisher=QueuePublisher(q), checkpoints=CheckpointStore(path), targets=[Target("pod-0", url)])
    with httpx.Client(timeout=5.0) as client:
        assert second.scrape_all(client, wait_seconds=5.0) == 1
    second.close_scrapes()
    [msg] = q.take(10, 0.1)
    [ev] = decode_batch(msg.value)
    inc = increases(ev.payload)
    assert inc[QUERIES] == 9818 and inc[HITS] == 4064 and inc[LENGTH] == 12


# --- a decrease without a restart -----------------------------------------------------------------------------

def test_a_decrease_without_a_created_change_is_flagged_and_taken_as_a_reset(store: Store) -> None:
    """BODY2 then BODY1 from one process (the same _created): every counter series that rose between the
    captures now goes down. Taken as a reset (as Prometheus rate() does), not listed as a restart; one dead
    letter lists them, and each is counted."""
    forward = ScrapeState()
    scrape_events("pod-x", URL, BODY1, 1_000, 1.0, forward)
    rose = increases(scrape_of(scrape_events("pod-x", URL, BODY2, 2_000, 1.0, forward)))
    before = anomalies("pod-dec", "decrease_without_restart")
    now = int(time.time() * 1000)  # dead_letters keeps 30 days
    state = ScrapeState()
    scrape_events("pod-dec", URL, BODY2, now - 5_000, 1.0, state)
    events = scrape_events("pod-dec", URL, BODY1, now, 1.0, state)
    p = scrape_of(events)
    assert p.restarts == []
    assert increases(p)[QUERIES] == 9818 and increases(p)[HITS] == 4064
    [letter] = dead(events)
    assert letter.reason.startswith("counter went down without a restart (its _created did not change): taken as "
                                    f"a reset as Prometheus rate() does; {len(rose)} series")
    lines = letter.raw.split("\n")
    assert len(lines) == len(rose) > 2  # the 2 prefix-cache counters, prompt tokens, buckets, ...
    assert "vllm:prefix_cache_queries_total{engine='0',label=''} 12909.0 -> 9818.0" in lines
    assert "vllm:prefix_cache_hits_total{engine='0',label=''} 5472.0 -> 4064.0" in lines
    assert anomalies("pod-dec", "decrease_without_restart") - before == len(rose)
    assert import_events(store, events)["dead_letters"] == 1
    [(n,)] = store.query_rows("SELECT count() FROM dead_letters WHERE source = 'vllm_metrics' AND pod = 'pod-dec' "
                              "AND startsWith(reason, 'counter went down without a restart')")
    assert n == 1


# --- one scrape per pod and instant ---------------------------------------------------------------------------

def test_a_scrape_not_after_the_previous_one_is_refused_and_nothing_is_lost() -> None:
    before = anomalies("pod-t", "not_after_previous")
    state = ScrapeState()
    scrape_events("pod-t", URL, BODY1, 1_000, 1.0, state)
    for at in (1_000, 999):  # the same instant (two targets with one name), and a clock stepped back
        [refused] = scrape_events("pod-t", URL, BODY2, at, 1.0, state)
        assert isinstance(refused.payload, DeadLetter)
        assert refused.payload.reason.startswith(f"scrape at {at} ms is not after this pod's previous scrape at "
                                                 "1000 ms")
        assert state.scraped_at_ms == 1_000 and state.values[("vllm:prefix_cache_queries_total", "0", "tiny", "",
                                                               "")] == 9818
    assert anomalies("pod-t", "not_after_previous") - before == 2
    inc = increases(scrape_of(scrape_events("pod-t", URL, BODY2, 2_000, 1.0, state)))
    assert inc[QUERIES] == 3091 and inc[HITS] == 1408  # the refused scrapes' increases are not lost


# --- counter values vLLM cannot expose ------------------------------------------------------------------------

def _body(queries: str, running: int = 3, extra: str = "") -> str:
    e = '{engine="0",model_name="tiny"}'
    return (f"vllm:prefix_cache_queries_total{e} {queries}\nvllm:prefix_cache_hits_total{e} 0\n"
            f"vllm:prompt_tokens_total{e} {queries}\n{extra}vllm:num_requests_running{e} {running}\n")


@pytest.mark.parametrize("first,second", [("-1.7e308", "1.7e308"), ("1e308", "1e308"), ("0", "1e308"),
                                          ("0", "1e16")])
def test_a_counter_value_outside_0_to_2_53_is_a_dead_letter_and_the_rest_of_the_scrape_is_stored(
        store: Store, first: str, second: str) -> None:
    """Finite values whose increase (1.7e308 − (−1.7e308)) or sum over two pods (1e308 each) is infinite: before,
    the increase went out as a JSON null and the ingester refused the whole published batch (the gauges and other
    counters of both scrapes with it), and the named queries failed on toUInt64(inf). Now each such sample is one
    dead letter (collector.vllm_metrics.COUNTER_RANGE); the gauge and the counters in range are stored; a later
    scrape in range counts from the last kept value."""
    now = int(time.time() * 1000) - 60_000
    events = []
    for pod in ("pod-big-a", "pod-big-b"):
        state = ScrapeState()
        events += scrape_events(pod, URL, _body(first), now, 1.0, state)
        events += scrape_events(pod, URL, _body(second), now + 10_000, 1.0, state)
        events += scrape_events(pod, URL, _body("700", running=5), now + 20_000, 1.0, state)
    letters = dead(events)
    refused = sum(1 for v in (first, second) if not 0 <= float(v) <= 2**53)
    assert [d.reason for d in letters] == [COUNTER_RANGE] * (2 * 2 * refused), letters  # 2 pods, 2 counters
    counts = import_events(store, events)
    assert counts.get("dead_letters", 0) == len(letters)
    rows = dict(store.query_rows("SELECT name, count() FROM vllm_metrics WHERE pod LIKE 'pod-big-%' GROUP BY name"))
    assert rows["vllm:num_requests_running"] == 6  # every scrape's gauge, on both pods
    [(inc,)] = store.query_rows("SELECT sum(increase) FROM vllm_metrics WHERE pod = 'pod-big-a' "
                                "AND name = 'vllm:prefix_cache_queries_total'")
    kept = [float(v) for v in (first, second) if 0 <= float(v) <= 2**53]
    assert inc == (700 - kept[-1] if kept and kept[-1] <= 700 else 700 if kept else 0), inc
    for query in ("hit_rate_total", "hit_rate", "tokens", "pods"):
        store.named(query)  # no toUInt64(inf)
