"""Direct loading of events into the store without a transport (``kvscope import ...``), with the live
path's isolation: a refused envelope is dead-lettered with its reason and the rest is written."""

from __future__ import annotations

from collections import Counter

from collector.events import Envelope
from collector.publish import to_messages
from ingest.ingester import Ingester
from ingest.rows import rows_for
from ingest.store import Store


class _NoSource:
    def poll(self, timeout_ms: int = 0, max_messages: int = 0) -> list:
        return []

    def commit(self) -> None:
        pass

    def close(self) -> None:
        pass


def import_events(store: Store, events: list[Envelope]) -> dict[str, int]:
    """Insert envelopes as the ingester would; returns the envelopes per target table (dead letters included)."""
    ingester = Ingester(store, _NoSource())
    ingester.handle(to_messages(events))
    counts: Counter[str] = Counter()
    for ev in events:
        try:
            counts[rows_for(ev)[0]] += 1
        except Exception:
            counts["dead_letters"] += 1
    return dict(counts)
