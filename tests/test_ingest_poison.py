"""A batch the store keeps refusing with an error that is not one of its data errors (ingest/store.py
DATA_ERROR_CODES), through the real ingester into real chDB: the ingester retried it forever, so its partition never
moved again. Now, after ``max_poison_attempts`` failures in a row while the store answers, the batch is written
envelope by envelope, the failing envelope is a dead letter with the error and the rest lands and is committed;
a store that is away, or an error of load (a memory limit), is still retried until it passes, nothing
dead-lettered."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from test_kv_envelope_hostile import batch, gateway_line, reasons, stored_event

from collector.publish import to_messages
from ingest.errors import StoreUnavailable
from ingest.ingester import Ingester
from ingest.store import Store
from kvscope.importer import _NoSource


class FlakyStore:
    """The real store, but an insert of data rows holding ``poison`` fails as ClickHouse's BAD_ARGUMENTS (code 36, not a
    data error: StoreUnavailable), and for its first ``down_inserts`` calls the store is away or loaded: each insert
    fails with ``down_error``, and each query (the dedup check, ``SELECT 1``) too unless ``answers_when_down``."""

    def __init__(self, store: Store, poison: str = "", down_inserts: int = 0, down_error: str = "",
                 answers_when_down: bool = False) -> None:
        self._store, self.poison = store, poison
        self.down_left = down_inserts
        self.down_error, self.answers_when_down = down_error, answers_when_down
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _down(self) -> bool:
        return self.down_left > 0

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        if self._down():
            self.down_left -= 1
            self.failures += 1
            raise StoreUnavailable(f"insert into {table}: {self.down_error}")
        if self.poison and table != "dead_letters" and any(self.poison in str(v) for r in rows for v in r):
            self.failures += 1
            raise StoreUnavailable(f"insert into {table}: Code: 36. DB::Exception: BAD_ARGUMENTS: bad value")
        self._store.insert(table, rows, column_names)

    def query_rows(self, statement: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        if self._down() and not self.answers_when_down:
            self.down_left -= 1
            self.failures += 1
            raise StoreUnavailable("Connection refused")
        return self._store.query_rows(statement, parameters)


def handle(store: Any, envs: list[Any], timeout: float = 15.0) -> tuple[bool, dict[str, int], Ingester]:
    ing = Ingester(store, _NoSource(), max_backoff_seconds=0.05, max_poison_attempts=3)
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    try:
        return ing.handle(to_messages(envs), stop), dict(ing.rows_written), ing
    finally:
        timer.cancel()


def test_a_batch_the_store_always_refuses_with_a_non_data_error_is_dead_lettered_and_the_rest_lands(
    store: Store,
) -> None:
    """Before: the batch was retried until the test stopped it (15 s), nothing committed, nothing after it landed."""
    envs = [gateway_line("ok-1"), gateway_line("poison-1"), gateway_line("ok-2"),
            batch("pod-g", 1, [stored_event([5])])]
    flaky = FlakyStore(store, poison="poison-1")
    committed, written, ing = handle(flaky, envs)
    assert committed, f"the batch was not committed: {flaky.failures} failed inserts"
    assert written == {"gateway_requests": 2, "kv_block_events": 1, "dead_letters": 1}
    assert ing.poisoned == 1
    [why] = reasons(store, "gateway")
    assert "BAD_ARGUMENTS" in why and "while the store answered" in why
    assert sorted(r for (r,) in store.query_rows("SELECT request_id FROM gateway_requests")) == ["ok-1", "ok-2"]
    committed, written, _ = handle(flaky, envs)  # redelivered: nothing more, the dead letter once
    assert committed and written == {}


def test_a_store_away_is_retried_until_it_is_back_and_nothing_is_dead_lettered(store: Store) -> None:
    """The store does not answer for 10 calls (far more failures than max_poison_attempts): the batch waits."""
    envs = [gateway_line("ok-1"), gateway_line("ok-2")]
    flaky = FlakyStore(store, down_inserts=10, down_error="Connection refused")
    committed, written, ing = handle(flaky, envs)
    assert committed and flaky.failures == 10
    assert written == {"gateway_requests": 2} and ing.poisoned == 0


def test_an_error_of_load_while_the_store_answers_is_retried_and_nothing_is_dead_lettered(store: Store) -> None:
    """A memory limit (code 241) for 10 inserts while ``SELECT 1`` answers: load, not the data; retried until it
    passes."""
    envs = [gateway_line("ok-1"), gateway_line("ok-2")]
    flaky = FlakyStore(store, down_inserts=10, answers_when_down=True,
                       down_error="Code: 241. DB::Exception: Memory limit (total) exceeded")
    committed, written, ing = handle(flaky, envs)
    assert committed and flaky.failures == 10
    assert written == {"gateway_requests": 2} and ing.poisoned == 0
