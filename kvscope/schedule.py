"""Building and sending the miss-cause digest: once (``kvscope digest``) or every ``KVSCOPE_DIGEST_EVERY`` from a
running ``kvscope up`` (:class:`DigestSchedule`, a daemon thread using the pipeline's store: chDB allows one
process per data directory, so a cron job cannot read the store ``kvscope up`` holds).

The schedule remembers when it last sent, and where the period it covered ended, in ``digest-<database>.json``
beside the collector's checkpoints, so a restart neither sends twice nor skips: the first digest goes out one
interval after the first start, and each later one starts where the previous one ended (whole minutes), so check
drift, slow sends, retries and downtime leave no stretch uncovered; a retry covers the same period.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from dashboard import mail
from dashboard.digest import gather, parse_duration, period, whole_minute
from dashboard.digest_render import render
from ingest.errors import KvscopeError

log = logging.getLogger("kvscope.digest")

#: After a failed send, try again after this long (or the interval, when shorter), seconds.
RETRY_SECONDS = 600.0


def digest_message(store: Any, cfg: Any, since: datetime, until: datetime, to: Sequence[str] = ()) -> EmailMessage:
    """The digest email of ``[since, until)`` against the period before, from ``store`` with the settings of
    ``cfg`` (a :class:`kvscope.config.Config`: GPU-hour price, currency, dashboard URL, sender).

    Raises what :meth:`ingest.store.Store.named` raises (``QueryError``, ``StoreUnavailable``)."""
    d = gather(store, since, until, gpu_hour_price=cfg.gpu_hour_price, currency=cfg.currency,
               dashboard_url=cfg.dashboard_url)
    return render(d, to=list(to), sender=cfg.mail_from)


def check_schedule(cfg: Any) -> timedelta | None:
    """The digest interval of ``KVSCOPE_DIGEST_EVERY`` (None when unset), checked with everything sending needs.

    Raises ValueError naming the setting: a bad duration, no recipients, no SMTP host, a bad SMTP security."""
    if not cfg.digest_every:
        return None
    try:
        every = parse_duration(cfg.digest_every)
    except ValueError as exc:
        raise ValueError(f"KVSCOPE_DIGEST_EVERY: {exc}") from exc
    if not cfg.list("digest_to"):
        raise ValueError("KVSCOPE_DIGEST_EVERY is set but KVSCOPE_DIGEST_TO names no recipient")
    if not cfg.smtp_host:
        raise ValueError("KVSCOPE_DIGEST_EVERY is set but KVSCOPE_SMTP_HOST is empty: no server to send through")
    try:
        mail.check_addresses(cfg.list("digest_to"), "KVSCOPE_DIGEST_TO")
        mail.MailSettings.from_config(cfg)
    except mail.MailError as exc:
        raise ValueError(str(exc)) from exc
    return every


class DigestSchedule:
    """Send the digest to ``KVSCOPE_DIGEST_TO`` every ``every`` (:meth:`run` until ``stop`` is set).
    ``state_path``: where the last send time, the end of the period it covered and a period waiting for a retry
    are kept (JSON); ``check_seconds``: how often the clock is looked at.

    Periods are whole minutes and follow each other: each digest covers ``[end of the previous one, now cut to the
    minute)`` and is due ``every`` after that start (so its length is ``every`` when checks are on time, longer
    after downtime: one digest then covers the whole stretch; a period holds at least one whole minute, so an
    interval under a minute sends once a minute at most). The first digest, one interval after the first
    start, covers from the minute of that start; a state file of the previous format (``{"last_sent": ...}``
    only) continues from the minute of its last send, so downtime across the upgrade is not skipped. A failed
    send is logged and retried after :data:`RETRY_SECONDS` (or ``every``, when shorter) for the same period, also
    after a restart (an unreadable pending period is dropped with a warning); it never stops the pipeline."""

    def __init__(self, store: Any, cfg: Any, stop: threading.Event, *, every: timedelta, state_path: Path,
                 check_seconds: float = 30.0) -> None:
        self.store, self.cfg, self.stop, self.every = store, cfg, stop, every
        self.state_path = state_path
        self.check_seconds = min(check_seconds, every.total_seconds())
        self.sent = 0  # digests sent by this process
        self._retry_at = 0.0

    def run(self) -> None:
        """Loop until ``stop``: send when due. Never raises."""
        if self.last_sent() is None:
            self._record(datetime.now(UTC))  # the clock starts at the first start: first digest one interval later
        while not self.stop.wait(self.check_seconds):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug here must not take the pipeline down
                log.exception("digest schedule failed; trying again at the next check")

    def due(self, now: datetime) -> tuple[datetime, datetime] | None:
        """The period ``(since, until)`` (UTC, whole minutes) to send at ``now``, None when none is due: the period
        a failed send left pending (an unreadable one is dropped with a warning); else, once ``every`` has passed
        since the previous period's end, from that end to ``now`` cut to the minute. Without a period's end (no
        digest sent yet, or a state file of the previous format, ``{"last_sent": ...}`` only) the previous period
        ends at the minute of the last send or of the clock's start; with no state at all, the last ``every``
        (:func:`dashboard.digest.period`)."""
        state = self._state()
        if "pending" in state:
            pending = state["pending"]
            times = [_time(x) for x in pending] if isinstance(pending, list) and len(pending) == 2 else []
            if len(times) == 2 and None not in times and times[0] < times[1]:
                return times[0], times[1]
            # unreadable: dropped (a retry of it cannot be sent), the schedule goes on from its last period
            log.warning("digest schedule: dropping an unreadable pending period. pending=%r state=%s", pending,
                        self.state_path)
            state = {k: v for k, v in state.items() if k != "pending"}
            self._write(state)
        end = _time(state.get("until"))
        if end is None:
            # a state file of the previous format ({"last_sent"} only), or the clock's start: the previous period
            # ended at the last send, so the next one continues from its minute (no downtime skipped)
            last = _time(state.get("last_sent"))
            end = whole_minute(last) if last is not None else None
        if end is not None:
            until = whole_minute(now)
            return (end, until) if now - end >= self.every and until > end else None
        return period(self.every, now=now)

    def tick(self, now: datetime | None = None) -> bool:
        """Send if due at ``now`` (default: the clock; aware UTC); returns whether a digest was sent. A failed send
        (``KvscopeError``, ``OSError``) is logged, its period kept for the retry; nothing is raised for it."""
        now = now or datetime.now(UTC)
        if time.monotonic() < self._retry_at:
            return False
        window = self.due(now)
        if window is None:
            return False
        since, until = window
        try:
            msg = digest_message(self.store, self.cfg, since, until, self.cfg.list("digest_to"))
            mail.send(msg, mail.MailSettings.from_config(self.cfg))
        except (KvscopeError, OSError) as exc:
            retry = min(RETRY_SECONDS, self.every.total_seconds())
            self._retry_at = time.monotonic() + retry
            self._write({**self._state(), "pending": [since.isoformat(), until.isoformat()]})
            log.warning("digest not sent; retrying in %.0f s for the same period. error=%s", retry, exc)
            return False
        self._record(now, until)
        self.sent += 1
        log.info("digest sent. to=%s subject=%r", ",".join(self.cfg.list("digest_to")), msg["Subject"])
        return True

    def last_sent(self) -> datetime | None:
        """When the last digest was sent (or the clock started), from ``state_path``; None when never."""
        return _time(self._state().get("last_sent"))

    def covered_until(self) -> datetime | None:
        """Where the last digest's period ended (UTC, a whole minute): the next one starts there; None before the
        first digest (or in a state file written before the schedule kept it)."""
        return _time(self._state().get("until"))

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _record(self, when: datetime, until: datetime | None = None) -> None:
        """Keep ``when`` as the last send (or the clock's start) and, after a send, ``until``, the end of the period
        it covered; a pending retry is cleared."""
        self._write({"last_sent": when.isoformat(), **({"until": until.isoformat()} if until else {})})

    def _write(self, state: dict[str, Any]) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_path)


def _time(text: Any) -> datetime | None:
    """An ISO time of the state file → aware datetime (naive = UTC); None when missing or unreadable."""
    try:
        t = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)
