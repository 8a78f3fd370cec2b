"""The /metrics parser on real vLLM 0.32 captures, and on bodies that are broken in the ways real ones are."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector.vllm_metrics import parse_metrics, scrape_events

SAMPLES = Path(__file__).parent / "samples"


def value(result, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return sum(
        s.value for s in result.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_real_capture_counters_and_cache_config() -> None:
    r1 = parse_metrics((SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text())
    r2 = parse_metrics((SAMPLES / "vllm_0.32.0_cpu_real_metrics_2.txt").read_text())
    assert not r1.bad_lines and not r2.bad_lines
    assert value(r1, "vllm:prefix_cache_queries_total") == 9818
    assert value(r1, "vllm:prefix_cache_hits_total") == 4064
    # the five captured responses: 1,408 cached of 3,091 prompt tokens (samples/README.md)
    assert value(r2, "vllm:prefix_cache_hits_total") - value(r1, "vllm:prefix_cache_hits_total") == 1408
    assert value(r2, "vllm:prefix_cache_queries_total") - value(r1, "vllm:prefix_cache_queries_total") == 3091
    [info] = [s for s in r1.samples if s.name == "vllm:cache_config_info"]
    assert info.labels["block_size"] == "32" and info.labels["engine"] == "0"
    assert r1.family_types["vllm:prefix_cache_hits"] == "counter"
    assert any(s.name.endswith("_created") for s in r1.samples)  # kept: they mark counter resets


def test_data_parallel_engines_are_separate_series() -> None:
    r = parse_metrics((SAMPLES / "vllm_0.32.0_metrics_generated_3_dp2.txt").read_text())
    engines = {s.labels.get("engine") for s in r.samples if s.name == "vllm:prefix_cache_queries_total"}
    assert engines == {"0", "1"}


@pytest.mark.parametrize(
    "junk",
    [
        '{engine="0"} 12',  # no metric name: used to raise IndexError
        'vllm:prefix_cache_hits_total{engine="0" 40x64.0',  # unterminated labels, bad value
        "vllm:prefix_cache_hits_total NaNa",
        "\x00\x01 binary",
    ],
)
def test_one_bad_line_costs_only_itself(junk: str) -> None:
    body = (SAMPLES / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    good = len(parse_metrics(body).samples)
    r = parse_metrics(
        body.replace("# HELP vllm:prefix_cache_queries_total", junk + "\n# HELP vllm:prefix_cache_queries_total")
    )
    assert len(r.samples) == good
    assert [line for line, _ in r.bad_lines] == [junk]


def test_non_metrics_body_is_a_dead_letter_not_an_exception() -> None:
    events = scrape_events("pod-0", "http://p/metrics", "<html>502 Bad Gateway</html>\n{oops}\n", 1, 1.0)
    assert events and all(e.schema == "dead_letter" for e in events)
    assert scrape_events("pod-0", "http://p/metrics", "", 1, 1.0)[0].payload.reason == "empty /metrics body"
