"""Direct loading of events into the store without a transport (``kvscope import ...``), with the live
path's isolation: a refused envelope is dead-lettered with its reason and the rest is written."""

from __future__ import annotations

from collector.events import Envelope
from collector.publish import Message, to_messages
from ingest.ingester import Ingester
from ingest.store import Store


class _NoSource:
    """The ingester's source when the messages are handed to it directly: nothing to poll or commit."""

    def poll(self, timeout_ms: int = 0, max_messages: int = 0) -> list[Message]:
        return []

    def commit(self, messages: list[Message]) -> None:
        pass

    def rewind(self, messages: list[Message]) -> None:
        pass

    def close(self) -> None:
        pass


def import_events(store: Store, events: list[Envelope]) -> dict[str, int]:
    """Insert envelopes as the ingester would; returns the rows actually written per table."""
    ingester = Ingester(store, _NoSource())
    ingester.handle(to_messages(events))
    return dict(ingester.rows_written)
