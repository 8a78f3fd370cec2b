"""Source: vLLM ``/metrics`` (Prometheus text exposition) → ``MetricsScrape`` events (+ ``DeadLetter`` per bad line).

Parsing uses ``prometheus_client``'s text parser. A body that fails to parse as a whole is parsed again one
sample line at a time (each with its family's ``# TYPE`` line), so one malformed line costs only itself: the
good samples are kept and each bad line becomes a dead letter with the parser's reason.
Name generations (V1 ``vllm:prefix_cache_*``, older ``vllm:gpu_prefix_cache_*``, V0 gauges) are kept as
exposed; queries pick the names (../shared/reference/vllm.md §1, §8).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collector.events import DeadLetter, Envelope, MetricSample, MetricsScrape, envelope

MAX_RAW = 64 * 1024


@dataclass(frozen=True)
class ParseResult:
    """Samples parsed from one body, family → type, and ``(line, reason)`` for each line that failed."""

    samples: list[MetricSample]
    family_types: dict[str, str]
    bad_lines: list[tuple[str, str]]


def _families(text: str) -> tuple[list[MetricSample], dict[str, str]]:
    samples: list[MetricSample] = []
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.append(MetricSample(name=s.name, labels=dict(s.labels), value=float(s.value)))
    return samples, types


def parse_metrics(text: str) -> ParseResult:
    """Parse a Prometheus text body (format 0.0.4, as vLLM serves it with ``prometheus_client``).

    Returns every sample that parses; lines that do not are returned in ``bad_lines`` with the reason.
    Never raises for malformed input.
    """
    try:
        samples, types = _families(text)
        return ParseResult(samples, types, [])
    except (ValueError, IndexError, KeyError, TypeError):
        pass
    samples, types, bad = [], {}, []
    type_line: dict[str, str] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            parts = stripped.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                type_line[parts[2]] = stripped
            continue
        head = stripped.split("{", 1)[0].split(None, 1)
        if not head:
            bad.append((line[:MAX_RAW], "sample line has no metric name"))
            continue
        header = next((type_line[f] for f in _candidate_families(head[0]) if f in type_line), "")
        try:
            s, t = _families(f"{header}\n{line}\n" if header else f"{line}\n")
        except (ValueError, IndexError, KeyError, TypeError) as exc:  # the parser's failures on odd lines
            bad.append((line[:MAX_RAW], f"unparseable sample line: {exc}"))
            continue
        samples.extend(s)
        types.update(t)
    return ParseResult(samples, types, bad)


def _candidate_families(sample_name: str) -> list[str]:
    out = [sample_name]
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum", "_info"):
        if sample_name.endswith(suffix):
            out.append(sample_name[: -len(suffix)])
    return out


def scrape_events(pod: str, url: str, body: str, scraped_at_ms: int, duration_ms: float) -> list[Envelope]:
    """Events for one scrape: one ``MetricsScrape`` (if any sample parsed) and one ``DeadLetter`` per bad line.

    NaN and ±Inf samples are dead-lettered too: the JSON contract carries finite floats only (vLLM's
    counters and histograms are always finite). ``event_id`` of the scrape = (pod, url, scraped_at_ms); of a
    dead letter = (url, scraped_at_ms, line).
    """
    parsed = parse_metrics(body)
    finite = [s for s in parsed.samples if math.isfinite(s.value)]
    if len(finite) < len(parsed.samples):
        bad = [(f"{s.name}{s.labels} {s.value}", "non-finite sample value (NaN/Inf) is not stored")
               for s in parsed.samples if not math.isfinite(s.value)]
        parsed = ParseResult(finite, parsed.family_types, parsed.bad_lines + bad)
    out: list[Envelope] = []
    if parsed.samples:
        scrape = MetricsScrape(target=url, scraped_at_ms=scraped_at_ms, duration_ms=duration_ms,
                               samples=parsed.samples, family_types=parsed.family_types)
        out.append(envelope(scrape, pod=pod, natural_key=(url, scraped_at_ms), observed_at_ms=scraped_at_ms))
    for line, reason in parsed.bad_lines:
        dl = DeadLetter(source="vllm_metrics", reason=reason, raw=line, location=url)
        out.append(envelope(dl, pod=pod, natural_key=(url, scraped_at_ms, line), observed_at_ms=scraped_at_ms))
    if not parsed.samples and not parsed.bad_lines:
        dl = DeadLetter(source="vllm_metrics", reason="empty /metrics body", raw=body[:MAX_RAW], location=url)
        out.append(envelope(dl, pod=pod, natural_key=(url, scraped_at_ms, "empty"), observed_at_ms=scraped_at_ms))
    return out


class ScrapeError(Exception):
    """A target did not answer with HTTP 200. Carries ``pod``, ``url``, ``reason`` (one sentence) and
    ``kind`` (``timeout`` | ``connect`` | ``http_status`` | ``network``: the label of the failure metric)."""

    def __init__(self, pod: str, url: str, reason: str, kind: str = "network") -> None:
        super().__init__(f"scrape of {pod} at {url} failed: {reason}")
        self.pod, self.url, self.reason, self.kind = pod, url, reason, kind


def scrape(client: httpx.Client, pod: str, url: str) -> list[Envelope]:
    """GET ``url`` and turn the body into events. Raises :class:`ScrapeError` on network or HTTP errors."""
    t0 = time.monotonic()
    try:
        resp = client.get(url)
    except httpx.TimeoutException as exc:
        raise ScrapeError(pod, url, repr(exc), "timeout") from exc
    except httpx.ConnectError as exc:
        raise ScrapeError(pod, url, repr(exc), "connect") from exc
    except httpx.HTTPError as exc:
        raise ScrapeError(pod, url, repr(exc)) from exc
    if resp.status_code != 200:
        raise ScrapeError(pod, url, f"HTTP {resp.status_code}", "http_status")
    duration_ms = (time.monotonic() - t0) * 1000
    return scrape_events(pod, url, resp.text, int(time.time() * 1000), duration_ms)
