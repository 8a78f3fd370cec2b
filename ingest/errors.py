"""Errors of the ingest side (Kafka → ClickHouse), drawn once.

    KvscopeError
    ├── RetryableError            back off and keep the batch
    │   └── StoreUnavailable      ClickHouse/chDB could not be reached or timed out
    └── PermanentError            isolate and dead-letter; never retried
        ├── ContractViolation     an envelope that does not decode or map to rows
        ├── RejectedRows          ClickHouse refused the rows (type mismatch, incorrect data)
        ├── TooManyPartitions     an INSERT ... SELECT spans more partitions than the server allows this user
        └── QueryError            a named or ad hoc query is invalid, or was refused (read-only)

Only ``ingest/store.py`` sees clickhouse-connect exceptions; it translates them here.
"""

from __future__ import annotations


class KvscopeError(Exception):
    """Root of kvscope's errors."""


class RetryableError(KvscopeError):
    """Transient: the same operation may succeed later."""


class PermanentError(KvscopeError):
    """The input itself is wrong: retrying cannot help."""


class StoreUnavailable(RetryableError):
    """The store did not answer (network, timeout, too many parts)."""


class ContractViolation(PermanentError):
    """An event that does not follow the contract in collector/events.py."""

    def __init__(self, reason: str, *, location: str = "", raw: bytes | str = b"") -> None:
        super().__init__(reason)
        self.reason = reason
        self.location = location
        self.raw = raw


class RejectedRows(PermanentError):
    """ClickHouse refused rows of one table (code and message kept)."""

    def __init__(self, table: str, message: str, code: int | None = None) -> None:
        super().__init__(f"{table}: {message}")
        self.table = table
        self.code = code


class TooManyPartitions(PermanentError):
    """An INSERT ... SELECT whose rows fall into more partitions than the server lets this user write in one
    block (``max_partitions_per_insert_block``, a setting the user may not change): the same statement fails
    again, so the caller inserts the rows in smaller pieces."""


class QueryError(PermanentError):
    """A query failed: bad SQL, unknown named query, bad parameter, or refused by read-only mode."""


class MissingDatabase(PermanentError):
    """A read-only command named a database the store does not hold (a mistyped ``--database``): answering from a
    new, empty one would report zeros as if they were measured."""
