"""Direct loading of events into the store without a transport (``kvscope import ...``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from collector.events import Envelope
from ingest.errors import ContractViolation
from ingest.rows import COLUMNS, contract_dead_letter, rows_for
from ingest.store import Store


def import_events(store: Store, events: list[Envelope]) -> dict[str, int]:
    """Map envelopes to rows and insert them table by table; returns rows written per table."""
    tables: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for ev in events:
        try:
            table, rows = rows_for(ev)
        except ContractViolation as exc:
            tables["dead_letters"].append(contract_dead_letter(exc.reason, "import", str(ev.payload), ev.pod))
            continue
        tables[table].extend(rows)
    for table, rows in tables.items():
        store.insert(table, rows, COLUMNS[table])
    return {t: len(r) for t, r in tables.items()}
