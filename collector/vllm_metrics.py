"""Source: vLLM ``/metrics`` → one ``VllmScrape`` per scrape (the kept series, counter increases computed here)
plus one ``DeadLetter`` per bad line.

- :data:`KEEP` is the allowlist: only the series some query or panel reads are sent (names from vLLM's
  ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; older names: docs/environment.md).
- :class:`ScrapeState` (one per pod) holds each kept counter's previous value and ``_created``, so a scrape
  carries *increases* (restart-aware) and the store needs no window functions over raw samples.
- The counter rules (docs/reliability.md, "vLLM targets and counters"): a series first seen is a baseline unless its
  ``_created`` is at or after the time kvscope started watching the pod (then its whole value is counted, as
  Prometheus's created-timestamp zero injection does); a decrease is a reset, flagged when ``_created`` did
  not change; a scrape not later than the pod's previous one is refused.
- :class:`ScrapeJournal` makes the increases exactly once across collector crashes: each round's new states
  and the scrapes computed from them (the *outbox*) are checkpointed in one write before they are published;
  an acknowledged scrape leaves the outbox; a restarted collector re-publishes the outbox first (the ingester
  drops scrapes the store holds: identity (pod, scraped_at_ms)).

Parsing is :func:`collector.prom_text.parse` (fast, checked differentially against prometheus_client).

Exposition rules, one per kind of input, the same for the live scrape (:mod:`collector.service`) and ``kvscope
import metrics`` (:mod:`kvscope.importer`): both call :func:`advance`. Each rejected sample is one dead letter
with its reason (``kvscope query dead_letters``, counted in ``kvscope_dead_letters_total{source="vllm_metrics"}``);
docs/reliability.md, "vLLM /metrics bodies":

- **A series is its full label set**, as in Prometheus (an empty label value is no label). A series twice in
  one body (same name, same labels) keeps its first sample; each later one is a dead letter (:data:`DUPLICATE`),
  whatever its kind (counter, ``_created``, bucket, gauge, ``cache_config_info``). Prometheus' scrape keeps
  the first too: a later sample of a series at the scrape's timestamp is rejected (counted in
  ``prometheus_target_scrapes_sample_duplicate_timestamp_total``).
- **Nothing after ``# EOF``** (the OpenMetrics end marker) is loaded: each sample line after it is a dead
  letter (:data:`collector.prom_text.AFTER_EOF`).
- **Labels kvscope does not read** (an ``instance`` or ``replica`` a proxy adds, a label a newer vLLM adds):
  a *gauge* is never summed; each label set is its own series, its other labels stored in ``label``
  (``replica="b"``; "" for vLLM's own series), and the queries combine a pod's gauge series as they combine
  its engines (requests summed, KV-cache usage averaged: sql/queries/vllm_series.sql, pods.sql). A
  *counter*'s increases are computed per label set and then summed on (name, engine, model_name, label):
  every query reads counters as sums of increases, so the sum is what they mean. ``vllm:cache_config_info``
  is one per engine: a second one of an engine in a body is a dead letter naming the labels that differ.
- **Bounded labels** (:class:`LabelLimits`, Prometheus' ``label_limit``, ``label_name_length_limit`` and
  ``label_value_length_limit``): a sample with more labels, a longer label name or a longer label value than
  the limits is a dead letter naming the label and the setting; the rest of the body is loaded. Prometheus
  fails the whole scrape instead.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx
import msgspec
from prometheus_client import Counter

from collector.checkpoint import CheckpointError, CheckpointStore
from collector.events import DeadLetter, Envelope, SeriesSample, VllmScrape, envelope
from collector.prom_text import Sample, parse

MAX_RAW = 64 * 1024
#: The reason of each later sample of a series already in the scrape (the exposition rules, module docstring).
DUPLICATE = "the same series twice in one scrape: the first is kept (Prometheus rejects the later ones)"


@dataclass(frozen=True)
class LabelLimits:
    """Bounds on one sample's labels, each 0 = none; a sample over one is a dead letter (:func:`advance`).

    After Prometheus' scrape config ``label_limit``, ``label_name_length_limit`` and ``label_value_length_limit``
    (https://prometheus.io/docs/prometheus/latest/configuration/configuration/#scrape_config; lengths in
    UTF-8 bytes, as Go's ``len``), with two differences: a sample over a limit costs only itself (Prometheus
    fails the whole scrape), and ``labels`` counts the labels as exposed, every one written (also one with an
    empty value), the metric name not counted (Prometheus counts ``__name__`` and the target's ``job`` and
    ``instance`` too, and not a label with an empty value). Settings ``KVSCOPE_VLLM_LABEL_LIMIT``,
    ``KVSCOPE_VLLM_LABEL_NAME_LENGTH_LIMIT``, ``KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT`` (kvscope/config.py).
    The default count leaves room for vLLM's ``vllm:cache_config_info``: 37 labels in vLLM 0.32.
    """

    labels: int = 64
    name_bytes: int = 128
    value_bytes: int = 1024

    def problem(self, labels: Mapping[str, str]) -> str:
        """Why a sample with ``labels`` (name → value, as parsed) breaks a limit (the dead letter's reason, one
        sentence naming the label, at most 50 characters of its name, and the setting), or "" when it does not."""
        if not labels:
            return ""
        if self.labels and len(labels) > self.labels:
            return (f"more labels than KVSCOPE_VLLM_LABEL_LIMIT={self.labels} (Prometheus' label_limit): the "
                    "sample is not stored")
        # a character is at most 4 UTF-8 bytes: most samples pass on their lengths in characters, counted in C
        if ((not self.name_bytes or 4 * max(map(len, labels)) <= self.name_bytes)
                and (not self.value_bytes or 4 * max(map(len, labels.values())) <= self.value_bytes)):
            return ""
        for k, v in labels.items():
            shown = k if len(k) <= 50 else k[:50] + "..."
            if self.name_bytes and _utf8_len(k) > self.name_bytes:
                return (f"label name {shown!r} is longer than "
                        f"KVSCOPE_VLLM_LABEL_NAME_LENGTH_LIMIT={self.name_bytes} bytes (Prometheus' "
                        "label_name_length_limit): the sample is not stored")
            if self.value_bytes and _utf8_len(v) > self.value_bytes:
                return (f"the value of label {shown!r} is longer than KVSCOPE_VLLM_LABEL_VALUE_LENGTH_LIMIT="
                        f"{self.value_bytes} bytes (Prometheus' label_value_length_limit): the sample is not stored")
        return ""


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counted as its 3 bytes, never an error)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


SCRAPE_ANOMALIES = Counter("kvscope_collector_scrape_anomalies", "Counter series and scrapes that break a counter "
                           "rule (also in a dead letter): decrease_without_restart (series that went down while "
                           "their _created did not change: taken as a reset), not_after_previous (scrapes not later "
                           "than the pod's previous one: refused)", ["pod", "kind"])

#: family → (kind, the label telling its series apart or "", who reads it). Counters are exposed as
#: ``<family>_total`` (+ ``<family>_created``, read for restarts, not sent); histograms as ``_bucket`` (label
#: ``le``), ``_sum``, ``_count`` (+ ``_created``); ``info`` goes to ``VllmScrape.cache_config``.
KEEP: dict[str, tuple[str, str, str]] = {
    "vllm:prefix_cache_queries": ("counter", "", "hit rate denominator, tokens queried: hit_rate, hit_rate_total, "
                                  "pods queries; Overview hit-rate panel"),
    "vllm:prefix_cache_hits": ("counter", "", "hit rate numerator, tokens hit: hit_rate, hit_rate_total, pods"),
    "vllm:gpu_prefix_cache_queries": ("counter", "", "hit rate denominator on vLLM <= 0.11 (older name): same queries"),
    "vllm:gpu_prefix_cache_hits": ("counter", "", "hit rate numerator on vLLM <= 0.11 (older name): same queries"),
    "vllm:external_prefix_cache_queries": ("counter", "", "data quality: tokens looked up in a KV connector's "
                                           "cross-instance cache (not the local prefix cache)"),
    "vllm:external_prefix_cache_hits": ("counter", "", "data quality: hits served by a KV connector, which the "
                                        "local hit rate does not include"),
    "vllm:prompt_tokens": ("counter", "", "tokens query: prefill tokens per bucket (throughput)"),
    "vllm:generation_tokens": ("counter", "", "tokens query: decode tokens per bucket (throughput)"),
    "vllm:request_success": ("counter", "finished_reason", "request and error rates (stop, length, abort, error)"),
    "vllm:num_preemptions": ("counter", "", "preemptions: KV-cache pressure evicting running requests"),
    "vllm:time_to_first_token_seconds": ("histogram", "le", "latency query: vLLM TTFT p50/p95/p99"),
    "vllm:request_queue_time_seconds": ("histogram", "le", "latency query: vLLM queue wait p50/p95/p99"),
    "vllm:e2e_request_latency_seconds": ("histogram", "le", "end-to-end request latency quantiles"),
    "vllm:inter_token_latency_seconds": ("histogram", "le", "decode speed: inter-token latency quantiles"),
    "vllm:request_prefill_time_seconds": ("histogram", "le", "prefill time: what a missed prefix costs"),
    "vllm:num_requests_running": ("gauge", "", "pods query (running requests), dimensions query (pods seen)"),
    "vllm:num_requests_waiting": ("gauge", "", "queue depth beside the queue-wait latency"),
    "vllm:kv_cache_usage_perc": ("gauge", "", "pods query: KV-cache usage (fraction); dimensions"),
    "vllm:gpu_cache_usage_perc": ("gauge", "", "pods query: KV-cache usage on vLLM <= 0.10 (older name)"),
    "vllm:cache_config_info": ("info", "", "block size for miss attribution, bytes per token: vllm_cache_config"),
}

#: older family → the family that replaced it (vLLM PR #18354, 0.10: both are exposed with equal values, the
#: older with "DEPRECATED" in its HELP; docs/environment.md). A scrape that has the newer family drops the older,
#: so the store holds one generation per scrape and queries may sum both names.
SUPERSEDED_BY: dict[str, str] = {
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
}

_COUNTER, _GAUGE, _CREATED, _INFO = 0, 1, 2, 3


def _specs(keep: Mapping[str, tuple[str, str, str]]) -> dict[str, tuple[int, str, str, bool]]:
    """Exposed sample name → (kind, family, label name, whether the family's ``_created`` carries that label)."""
    out: dict[str, tuple[int, str, str, bool]] = {}
    for fam, (kind, label, _) in keep.items():
        if kind == "counter":
            out[fam + "_total"] = (_COUNTER, fam, label, True)
            out[fam + "_created"] = (_CREATED, fam, label, True)
        elif kind == "histogram":
            out[fam + "_bucket"] = (_COUNTER, fam, "le", False)
            out[fam + "_sum"] = (_COUNTER, fam, "", False)
            out[fam + "_count"] = (_COUNTER, fam, "", False)
            out[fam + "_created"] = (_CREATED, fam, "", False)
        elif kind == "gauge":
            if label:  # a gauge's series are told apart by every label but engine and model_name (advance)
                raise ValueError(f"KEEP[{fam!r}]: a gauge has no label of its own, got {label!r}")
            out[fam] = (_GAUGE, fam, "", False)
        elif kind == "info":
            out[fam] = (_INFO, fam, "", False)
        else:
            raise ValueError(f"KEEP[{fam!r}]: unknown kind {kind!r}")
    return out


SPECS = _specs(KEEP)
KEPT_NAMES = frozenset(SPECS)


def _drop_superseded(samples: list[Sample]) -> list[Sample]:
    """``samples`` without those of an older family whose newer family (:data:`SUPERSEDED_BY`) is present."""
    families = {SPECS[name][1] for name, _, _ in samples}
    gone = {old for old, new in SUPERSEDED_BY.items() if old in families and new in families}
    return [s for s in samples if SPECS[s[0]][1] not in gone] if gone else samples

SeriesKey = tuple[str, str, str, str, str]  # (sample name | family, engine, model_name, label value, extra labels)


@dataclass(frozen=True)
class ScrapeState:
    """What the collector remembers of one pod between scrapes (replaced, never mutated, by each scrape).

    ``scraped_at_ms`` (unix ms of the last scrape that had kept series; 0 = none), ``watching_since_ms`` (unix
    ms, collector clock, of the collector's first scrape attempt of the pod, checkpointed with the state; 0 =
    unknown, e.g. ``kvscope import``: no series is then counted from 0), ``values`` (counter series
    key → its last value; key = (sample name, engine, model_name, label value, the other labels as
    ``k="v",...``, sorted: "" unless a proxy or vLLM adds labels kvscope does not read)), ``created`` ((family, engine,
    model_name, label value or "" for histograms, extra) → ``_created``, unix seconds), ``cache_config``
    (engine → labels of ``vllm:cache_config_info`` last seen), ``config_sent`` (this process already sent the
    cache config; not persisted, so a restarted collector sends it once more).
    """

    scraped_at_ms: int = 0
    watching_since_ms: int = 0
    values: dict[SeriesKey, float] = field(default_factory=dict)
    created: dict[SeriesKey, float] = field(default_factory=dict)
    cache_config: dict[str, dict[str, str]] = field(default_factory=dict)
    config_sent: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON-able form for the checkpoint, computed once per state: ``{"at": ms, "since": ms, "values":
        [[name, engine, model_name, extra, {label value: value}], ...], "created": [[family, engine, model_name,
        label, extra, created], ...], "cache_config": {...}}`` (series grouped: a histogram's buckets share one
        entry)."""
        return self._json

    @cached_property
    def _json(self) -> dict[str, Any]:
        groups: dict[tuple[str, str, str, str], dict[str, float]] = {}
        for (name, engine, model, label, extra), v in self.values.items():
            groups.setdefault((name, engine, model, extra), {})[label] = v
        return {"at": self.scraped_at_ms, "since": self.watching_since_ms,
                "values": [[*k, g] for k, g in groups.items()], "created": [[*k, v] for k, v in self.created.items()],
                "cache_config": self.cache_config}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ScrapeState:
        """Inverse of :meth:`to_json`; raises ValueError/TypeError/KeyError/AttributeError on a foreign shape. A
        checkpoint written before ``since`` existed watches from its last scrape (a later ``_created`` is then
        surely a series born after that scrape); one written before the other labels were escaped (``k=v,...``)
        has them rewritten (``k="v",...``), so its series continue instead of restarting as baselines."""
        values = {(str(name), str(engine), str(model), str(label), _escaped(str(extra))): float(v)
                  for name, engine, model, extra, group in obj["values"] for label, v in group.items()}
        created = {(str(r[0]), str(r[1]), str(r[2]), str(r[3]), _escaped(str(r[4]))): float(r[5])
                   for r in obj["created"]}
        config = {str(e): {str(k): str(v) for k, v in lab.items()} for e, lab in obj["cache_config"].items()}
        at = int(obj["at"])
        return cls(at, int(obj.get("since", at)), values, created, config)


def _extra(labels: Mapping[str, str], label: str) -> str:
    """The labels other than engine, model_name and ``label``, sorted, as written in an exposition
    (``instance="a:1",replica="b"``); an empty value is no label (as in Prometheus)."""
    return _label_text((k, v) for k, v in sorted(labels.items()) if v and k not in ("engine", "model_name", label))


def _escaped(extra: str) -> str:
    """A checkpoint's ``extra`` in :func:`_extra`'s form; one written unescaped (``k=v,...``, before the
    exposition rules) is rewritten (a value holding "," or "=" was ambiguous there and may stay unmatched)."""
    if not extra or extra.endswith('"'):
        return extra
    return _label_text((k, v) for k, _, v in (p.partition("=") for p in extra.split(",")))


_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})


def _label_text(pairs: Iterable[tuple[str, str]]) -> str:
    """``k="v",...`` with the exposition format's escapes (``\\``, ``\"``, ``\n``): one text per label set."""
    return ",".join(f'{k}="{v.translate(_ESCAPES)}"' for k, v in pairs)


#: The limits :func:`advance` applies when given none (the settings' defaults).
DEFAULT_LIMITS = LabelLimits()


#: The largest counter value kept: 2^53, past which float64 (Prometheus' sample type) no longer counts by one. vLLM's
#: counters count tokens, requests and seconds from 0 (a counter is never negative, the Prometheus data model), so a
#: value outside 0..2^53 is not one it exposed: kept, its increases and their sums over series and pods could reach
#: infinity (a JSON null, which the ingester refuses with the rest of its batch; a named query's toUInt64 fails).
MAX_COUNTER = float(2**53)
COUNTER_RANGE = ("counter value outside 0..2^53 (negative, or past float64's exact integers; not a count vLLM "
                 "reaches): not stored, the series keeps its previous value")


def advance(state: ScrapeState, pod: str, url: str, body: str, scraped_at_ms: int,
            duration_ms: float, limits: LabelLimits = DEFAULT_LIMITS) -> tuple[list[Envelope], ScrapeState]:
    """Events for one scrape of ``pod`` and the state after it (``state`` itself is left as it was).

    Events: one ``VllmScrape`` when the body holds any kept series (every gauge; every counter, bucket, sum
    and count whose increase is not 0; ``cache_config`` on this process's first scrape of the pod and when it
    changes; ``restarts``), and one ``DeadLetter`` per bad line, per line after ``# EOF``, per non-finite kept
    value (the JSON contract carries finite floats), per counter value outside 0..:data:`MAX_COUNTER`, per repeated
    series (and second ``cache_config_info`` of
    an engine), per sample over one of ``limits`` (:class:`LabelLimits`; not stored, the other series as if it
    were not in the body), and one listing the counters that went down without a restart; a body without any
    kept series, and an empty, HTML or binary body (:func:`body_problem`), is one dead letter. The exposition
    rules (module docstring) decide duplicates and labels kvscope does not read.
    Counter rules (docs/reliability.md, "vLLM targets and counters"):

    - increase = value − previous;
    - a restart (its family's ``_created`` changed, or the value went down on a pod that exposes no
      ``_created``): increase = value, its engine listed in ``restarts``. A value that went down while
      ``_created`` did not change is also taken as a reset (what Prometheus ``rate()`` does with any
      decrease) but is not listed as a restart: the scrape's dead letter "counter went down without a
      restart" lists those series (one per line of its ``raw``), and each is counted in
      ``kvscope_collector_scrape_anomalies``;
    - a series without a previous value: increase = value when its ``_created`` (unix s, pod clock) is at or
      after ``state.watching_since_ms`` (collector clock; Prometheus's created-timestamp zero injection: the
      series was born while kvscope watched, so all of it happened since), else 0 (a baseline);
    - a series missing from a scrape keeps its previous value for the next one.

    A scrape whose ``scraped_at_ms`` is not after the pod's previous one (two targets sharing a name, a
    clock stepped back) is refused: one dead letter, the state unchanged, so the next scrape's increases
    cover the interval and the store never holds two scrapes of one pod at one instant. An older name whose
    newer name is in the same body (vLLM 0.10 exposes both) is left out: :data:`SUPERSEDED_BY`.
    """
    if state.scraped_at_ms and scraped_at_ms <= state.scraped_at_ms:
        SCRAPE_ANOMALIES.labels(pod, "not_after_previous").inc()
        reason = (f"scrape at {scraped_at_ms} ms is not after this pod's previous scrape at {state.scraped_at_ms} "
                  "ms (two targets with one name? a clock stepped back?): refused, the earlier one is kept")
        return [dead_letter_event(pod, url, scraped_at_ms, body[:MAX_RAW], reason)], state
    problem = body_problem(body)
    if problem:
        return [dead_letter_event(pod, url, scraped_at_ms, body.strip()[:MAX_RAW], problem)], state
    parsed = parse(body, KEPT_NAMES)
    bad = list(parsed.bad_lines)
    counters: list[tuple[str, str, str, str, str, float, SeriesKey]] = []
    gauges: list[SeriesSample] = []
    created: dict[SeriesKey, float] = {}
    config: dict[str, dict[str, str]] = {}
    seen: set[SeriesKey] = set()
    extras = False
    isfinite = math.isfinite
    samples = _drop_superseded(parsed.samples) if "vllm:gpu_" in body else parsed.samples
    for name, labels, value in samples:
        problem = limits.problem(labels)
        if problem:
            bad.append((_render(name, labels, value), problem))
            continue
        kind, family, lname, created_has_label = SPECS[name]
        engine = labels.get("engine")
        model = labels.get("model_name")
        if kind == _INFO:
            first = config.get(engine or "")
            if first is None:
                config[engine or ""] = dict(labels)
            else:
                differ = ", ".join(sorted(k for k in first.keys() | labels.keys()
                                          if first.get(k, "") != labels.get(k, "")))  # "" = no label
                bad.append((_render(name, labels, value), f"a second {name} of engine {engine or ''!r} in one "
                            f"scrape (it differs in {differ}): the first is kept, one cache config per pod and "
                            "engine" if differ else DUPLICATE))
            continue
        lab = labels.get(lname) if lname else None
        extra = ""
        if len(labels) > (engine is not None) + (model is not None) + (lab is not None):
            extra = _extra(labels, lname)
            extras = True
        engine, model, lab = engine or "", model or "", lab or ""
        key = (name, engine, model, lab, extra)
        if key in seen:
            bad.append((_render(name, labels, value), DUPLICATE))
            continue
        seen.add(key)
        if not isfinite(value):
            bad.append((_render(name, labels, value), "non-finite sample value (NaN/Inf) is not stored"))
        elif kind == _COUNTER and not 0 <= value <= MAX_COUNTER:
            bad.append((_render(name, labels, value), COUNTER_RANGE))
        elif kind == _COUNTER:
            counters.append((name, engine, model, lab, extra, value,
                             (family, engine, model, lab if created_has_label else "", extra)))
        elif kind == _GAUGE:  # never summed: each label set is its own series, its other labels in `label`
            gauges.append(SeriesSample(name, engine, model, extra, value, 0.0))
        else:
            created[(family, engine, model, lab if created_has_label else "", extra)] = value

    events: list[Envelope] = []
    new_state = state
    if counters or gauges or config or created:
        inc = _increases(state, counters, created)
        samples = (_merge(inc.samples) if extras else inc.samples) + gauges
        if inc.decreases:
            SCRAPE_ANOMALIES.labels(pod, "decrease_without_restart").inc(len(inc.decreases))
            bad.append(("\n".join(inc.decreases), f"counter went down without a restart (its _created did not "
                        f"change): taken as a reset as Prometheus rate() does; {len(inc.decreases)} series (raw: "
                        "one per line); two processes behind one target?"))
        send_config = bool(config) and (not state.config_sent or config != state.cache_config)
        previous = state.scraped_at_ms if inc.had_previous else state.watching_since_ms if inc.injected else 0
        scrape = VllmScrape(target=url, scraped_at_ms=scraped_at_ms, previous_scraped_at_ms=previous,
                            duration_ms=duration_ms, samples=samples,
                            cache_config=config if send_config else {}, restarts=sorted(inc.restarts))
        events.append(envelope(scrape, pod=pod, natural_key=(scraped_at_ms,), observed_at_ms=scraped_at_ms))
        new_state = ScrapeState(scraped_at_ms, state.watching_since_ms, inc.values, {**state.created, **created},
                                config or state.cache_config, state.config_sent or send_config)
    elif not bad:
        bad.append((body[:MAX_RAW], "no series kvscope keeps (not a vLLM /metrics?)"))
    copies: dict[str, int] = defaultdict(int)  # the same bad line twice in one body is two dead letters
    for line, reason in bad:
        events.append(dead_letter_event(pod, url, scraped_at_ms, line, reason, copies[line]))
        copies[line] += 1
    return events, new_state


def body_problem(body: str) -> str:
    """Why ``body`` cannot be a ``/metrics`` body at all (one sentence, the dead letter's reason), or "" when
    it may be one: empty, an HTML page, binary or compressed bytes (a NUL or U+FFFD in its first 4 KiB)."""
    head = body.lstrip()[:64].lower()
    if not head:
        return "empty /metrics body"
    if head.startswith(("<!doctype html", "<html", "<head", "<body", "<?xml")):
        return "an HTML page, not Prometheus text (an error or login page of a proxy?)"
    if "\ufffd" in body[:4096] or "\x00" in body[:4096]:
        return "not UTF-8 Prometheus text (binary or compressed bytes?)"
    return ""


def dead_letter_event(pod: str, url: str, scraped_at_ms: int, line: str, reason: str, nth: int = 0) -> Envelope:
    """A ``vllm_metrics`` dead letter for ``line`` (cut to :data:`MAX_RAW`) of the scrape of ``pod`` at ``url``;
    ``nth``: how many bad lines of the same text come before it in the body (a series repeated, a bad line copied).
    Its id comes from (url, scrape time, line) and, from the second copy of a line on, ``nth``: each bad line is a
    dead letter of its own, the same body read again at the same time (a re-sent scrape, a re-import) repeats
    every id, and a line's first copy keeps the id it had before ``nth`` was in the key."""
    dl = DeadLetter(source="vllm_metrics", reason=reason, raw=line[:MAX_RAW], location=url)
    key = (url, scraped_at_ms, line) if nth == 0 else (url, scraped_at_ms, line, "copy", nth)
    return envelope(dl, pod=pod, natural_key=key, observed_at_ms=scraped_at_ms)


@dataclass
class _Increases:
    """What :func:`_increases` found: samples of the counters that moved, engines that restarted, the new
    values, whether any series had a previous value, whether any was counted from 0 (created after the
    watch began), and the rendered lines of counters that went down without a restart."""

    samples: list[SeriesSample]
    restarts: set[str]
    values: dict[SeriesKey, float]
    had_previous: bool = False
    injected: bool = False
    decreases: list[str] = field(default_factory=list)


def _increases(state: ScrapeState, counters: list[tuple[str, str, str, str, str, float, SeriesKey]],
               created: dict[SeriesKey, float]) -> _Increases:
    """The counter rules of :func:`advance` applied to one scrape's counters."""
    prev_values, prev_created = state.values, state.created
    since_s = state.watching_since_ms / 1000 if state.watching_since_ms else math.inf
    out = _Increases([], set(), dict(prev_values))
    for name, engine, model, lab, extra, value, ckey in counters:
        key = (name, engine, model, lab, extra)
        prev = prev_values.get(key)
        out.values[key] = value
        c_new = created.get(ckey)
        if prev is None:
            if c_new is None or c_new < since_s:
                continue  # a baseline: born before kvscope watched, or no _created to tell
            out.injected = True
            increase = value
        else:
            out.had_previous = True
            c_old = prev_created.get(ckey)
            known = c_new is not None and c_old is not None
            if known and c_new != c_old:
                out.restarts.add(engine)
                increase = value
            elif value < prev:
                if known:
                    out.decreases.append(f"{name}{{engine={engine!r},label={lab!r}}} {prev!r} -> {value!r}")
                else:
                    out.restarts.add(engine)  # no _created to tell: a restart, as before
                increase = value
            else:
                increase = value - prev
        if increase != 0:
            out.samples.append(SeriesSample(name, engine, model, lab, value, increase))
    return out


def _merge(samples: list[SeriesSample]) -> list[SeriesSample]:
    """Counter samples that differ only by labels kvscope does not read, summed on (name, engine, model_name,
    label): values and increases (every query sums a counter's increases over such series anyway)."""
    acc: dict[tuple[str, str, str, str], list[float]] = {}
    for s in samples:
        a = acc.setdefault((s.name, s.engine, s.model_name, s.label), [0.0, 0.0])
        a[0] += s.value
        a[1] += s.increase
    return [SeriesSample(*k, v, i) for k, (v, i) in acc.items()]


def _render(name: str, labels: Mapping[str, str], value: float) -> str:
    return name + "{" + _label_text(labels.items()) + "} " + repr(value)


def scrape_events(pod: str, url: str, body: str, scraped_at_ms: int, duration_ms: float,
                  state: ScrapeState | None = None, limits: LabelLimits = DEFAULT_LIMITS) -> list[Envelope]:
    """:func:`advance` for callers without a journal (``kvscope import metrics``, tests). Without ``state`` the
    body is a baseline (increases 0: counters not sent; gauges and cache_config kept); with one, the state is
    advanced in place (see :meth:`ScrapeJournal.state` for the collector's way)."""
    events, new = advance(state or ScrapeState(), pod, url, body, scraped_at_ms, duration_ms, limits)
    if state is not None:
        for f in ("scraped_at_ms", "watching_since_ms", "values", "created", "cache_config", "config_sent"):
            object.__setattr__(state, f, getattr(new, f))
        state.__dict__.pop("_json", None)
    return events


def _watching(state: ScrapeState, since_ms: int) -> ScrapeState:
    return ScrapeState(state.scraped_at_ms, since_ms, state.values, state.created, state.cache_config,
                       state.config_sent)


class ScrapeError(Exception):
    """A target did not answer with HTTP 200 (or its body was too long). Carries ``pod``, ``url``, ``reason`` (one
    sentence) and ``kind`` (``timeout`` | ``connect`` | ``http_status`` | ``network`` | ``body_size``: the label
    of the failure metric)."""

    def __init__(self, pod: str, url: str, reason: str, kind: str = "network") -> None:
        super().__init__(f"scrape of {pod} at {url} failed: {reason}")
        self.pod, self.url, self.reason, self.kind = pod, url, reason, kind


#: The default of ``KVSCOPE_VLLM_BODY_SIZE_LIMIT`` (bytes): a real vLLM body is ~10-100 KB (tests/samples), and a
#: 50 MB label value still costs only its sample (:class:`LabelLimits`); a body of gigabytes is not read whole.
DEFAULT_BODY_SIZE_LIMIT = 64 * 1024 * 1024


class BodyTooLarge(ScrapeError):
    """A /metrics body longer than the limit (Prometheus' scrape config ``body_size_limit``: uncompressed bytes;
    the scrape fails). ``head``: its first :data:`MAX_RAW` bytes, decoded, for the dead letter."""

    def __init__(self, pod: str, url: str, limit: int, head: str) -> None:
        super().__init__(pod, url, f"the body is longer than KVSCOPE_VLLM_BODY_SIZE_LIMIT={limit} bytes "
                         "(Prometheus' body_size_limit): the scrape is not stored", "body_size")
        self.head = head


def fetch(client: httpx.Client, pod: str, url: str, body_size_limit: int = DEFAULT_BODY_SIZE_LIMIT
          ) -> tuple[str, int, float]:
    """GET ``url``: (body, unix ms when the response arrived, round trip ms). The body is read as it arrives and
    given up after ``body_size_limit`` bytes once decompressed (0: no limit), as Prometheus' ``body_size_limit``
    (prometheus.io/docs/prometheus/latest/configuration/configuration/#scrape_config), so a gigabyte body (or a
    gzip bomb) costs at most that much memory. Raises :class:`ScrapeError` (:class:`BodyTooLarge` over the
    limit). A pooled connection the pod closed as the request went out (vLLM's
    uvicorn closes an idle one after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s, the default scrape interval: httpx then
    raises ``RemoteProtocolError`` "Server disconnected without sending a response") is tried once more on a new
    connection, as Go's HTTP client retries an idempotent GET for Prometheus; a second failure is the scrape's."""
    try:
        return _fetch(client, pod, url, body_size_limit)
    except _Disconnected:  # the pod closed a kept-alive connection as the request went out: once more, anew
        try:
            return _fetch(client, pod, url, body_size_limit)
        except _Disconnected as exc:
            raise ScrapeError(pod, url, repr(exc.__cause__)) from exc.__cause__


class _Disconnected(Exception):
    """The server closed the connection before any byte of a response (httpx ``RemoteProtocolError``)."""


def _fetch(client: httpx.Client, pod: str, url: str, body_size_limit: int) -> tuple[str, int, float]:
    """One attempt of :func:`fetch`; raises :class:`_Disconnected` when no response came on the connection."""
    t0 = time.monotonic()
    started = False  # a response began: a disconnect after it is the scrape's failure, not a stale connection
    try:
        with client.stream("GET", url) as resp:
            started = True
            if resp.status_code != 200:
                raise ScrapeError(pod, url, f"HTTP {resp.status_code}", "http_status")
            parts, size = [], 0
            for part in resp.iter_bytes():
                size += len(part)
                if body_size_limit and size > body_size_limit:
                    head = b"".join([*parts, part])[:MAX_RAW].decode("utf-8", errors="replace")
                    raise BodyTooLarge(pod, url, body_size_limit, head)
                parts.append(part)
            charset = resp.charset_encoding or "utf-8"
    except httpx.TimeoutException as exc:
        raise ScrapeError(pod, url, repr(exc), "timeout") from exc
    except httpx.ConnectError as exc:
        raise ScrapeError(pod, url, repr(exc), "connect") from exc
    except httpx.RemoteProtocolError as exc:
        if not started:
            raise _Disconnected() from exc
        raise ScrapeError(pod, url, repr(exc)) from exc
    except httpx.HTTPError as exc:
        raise ScrapeError(pod, url, repr(exc)) from exc
    try:
        body = b"".join(parts).decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know: read as UTF-8, as a body that names none
        body = b"".join(parts).decode("utf-8", errors="replace")
    return body, int(time.time() * 1000), (time.monotonic() - t0) * 1000


class ScrapeJournal:
    """Every pod's :class:`ScrapeState` and the outbox of computed, unacknowledged scrapes, checkpointed as one
    value under :data:`KEY` (``{"pods": {pod: state}, "outbox": [[pod, [envelope, ...]], ...]}``).

    One checkpoint write per round, for all pods: :class:`CheckpointStore` rewrites its whole file on every
    ``put``, so per-pod keys would cost one file write per pod. Use from one thread (the scrape loop), except
    the acks, which may come from any thread:

    1. :meth:`recover` once at start: the outbox a previous process left, to publish first.
    2. per round, :meth:`watch` the pods (records each one's first attempt), then for each pod scraped:
       ``advance(journal.state(pod), ...)`` → (events, new state).
    3. :meth:`commit` the round's results: states and outbox written (one ``put``), then publish what it
       returns; its ``ack`` drops those scrapes from the outbox (written by the next commit or :meth:`flush`).

    A crash before the write loses only this round's computation: the next scrape's increases start from the
    previous state and cover it. After the write, the scrapes are re-published at the next start (same
    ``scraped_at_ms``, so the same event ids) until acknowledged. Raises ``OSError`` from the write;
    :class:`collector.checkpoint.CheckpointError` at construction if the value is foreign (not silently reset:
    that would re-baseline, losing one interval per pod).
    """

    KEY = "vllm_metrics"

    def __init__(self, store: CheckpointStore, pods: Iterable[str] | None = None) -> None:
        """Load the journal from ``store``; with ``pods``, the states of other pods are dropped (their outbox
        is still recovered)."""
        self.store = store
        self._lock = threading.Lock()
        self._seq = 0
        self._states: dict[str, ScrapeState] = {}
        self._outbox: dict[int, tuple[str, list[Envelope], list[Any]]] = {}  # seq → (pod, envelopes, JSON form)
        raw = store.get(self.KEY) or {}
        try:
            self._states = {str(p): ScrapeState.from_json(s) for p, s in raw.get("pods", {}).items()}
            for pod, evs in raw.get("outbox", []):
                self._seq += 1
                self._outbox[self._seq] = (pod, msgspec.convert(evs, list[Envelope]), evs)
        except (ValueError, TypeError, KeyError, AttributeError, msgspec.ValidationError) as exc:
            raise CheckpointError(f"checkpoint key {self.KEY!r} of {store.path} is not a scrape journal: {exc}; "
                                  "remove that key to start over (every pod's next scrape is then a baseline)") from exc
        if pods is not None:
            wanted = set(pods)
            self._states = {p: s for p, s in self._states.items() if p in wanted}
        self._recovered = list(self._outbox)
        self._dirty = False
        self._closed = False

    def state(self, pod: str) -> ScrapeState:
        """The committed state of ``pod`` (an empty one for a pod never scraped)."""
        return self._states.get(pod) or ScrapeState()

    def watch(self, pods: Iterable[str], now_ms: int) -> None:
        """Record ``now_ms`` (unix ms) as the time kvscope started watching each of ``pods`` not watched yet (no
        state, or a state without ``watching_since_ms``); written with the next :meth:`commit` or
        :meth:`flush`. Call it before the first scrape attempt of a pod, so a series born after it (its
        ``_created``) is counted from 0 (:func:`advance`). A pod's watch start never moves once recorded, so a
        restarted collector neither recounts a series nor loses one born while it was down."""
        with self._lock:
            for pod in pods:
                st = self._states.get(pod)
                if st is None or not st.watching_since_ms:
                    self._states = {**self._states, pod: _watching(st or ScrapeState(), now_ms)}
                    self._dirty = True

    def pending(self) -> int:
        """Scrapes committed and not yet acknowledged."""
        with self._lock:
            return len(self._outbox)

    def recover(self) -> tuple[list[Envelope], Callable[[], None] | None]:
        """The outbox loaded at start (publish it before any new scrape) and the ack that clears it."""
        seqs, self._recovered = self._recovered, []
        return self._publishable(seqs)

    def commit(self, results: list[tuple[str, list[Envelope], ScrapeState]]) -> tuple[list[Envelope],
                                                                                        Callable[[], None] | None]:
        """Adopt each ``(pod, events, new_state)``, write the checkpoint once, and return (events to publish,
        their ack). On ``OSError`` nothing is adopted (the next scrape of each pod starts from its old state)."""
        with self._lock:
            states = dict(self._states)
            outbox = dict(self._outbox)
            seq = self._seq
            for pod, events, new_state in results:
                states[pod] = new_state
                if events:
                    seq += 1
                    outbox[seq] = (pod, events, msgspec.to_builtins(events))
            new_seqs = list(range(self._seq + 1, seq + 1))
            if results or self._dirty:
                self.store.put(self.KEY, self._snapshot(states, outbox))
            self._states, self._outbox, self._seq, self._dirty = states, outbox, seq, False
        return self._publishable(new_seqs)

    def flush(self) -> None:
        """Write the outbox if acks removed scrapes since the last write."""
        self.commit([])

    def close(self) -> None:
        """At stop: :meth:`flush`, and from now on write each ack as it comes (the downstream may acknowledge
        the last rounds after the scrape loop ended; without this they would be re-sent at the next start)."""
        self._closed = True
        self.flush()

    def _publishable(self, seqs: list[int]) -> tuple[list[Envelope], Callable[[], None] | None]:
        with self._lock:
            events = [ev for s in seqs if s in self._outbox for ev in self._outbox[s][1]]
        return events, ((lambda: self._ack(seqs)) if seqs else None)

    def _ack(self, seqs: list[int]) -> None:
        with self._lock:
            outbox = dict(self._outbox)
            for s in seqs:
                outbox.pop(s, None)
            self._outbox = outbox
            self._dirty = True
        if self._closed:
            self.flush()

    @staticmethod
    def _snapshot(states: dict[str, ScrapeState], outbox: dict[int, tuple[str, list[Envelope], list[Any]]]
                  ) -> dict[str, Any]:
        return {"pods": {p: s.to_json() for p, s in states.items()},
                "outbox": [[pod, js] for pod, _, js in outbox.values()]}
