"""Sending kvscope's emails (the miss-cause digest, alert notices): SMTP with STARTTLS or SSL, or an .eml file.

Settings come from the config table (``KVSCOPE_SMTP_HOST``, ``_PORT``, ``_SECURITY``, ``_USERNAME``,
``_PASSWORD``, ``KVSCOPE_MAIL_FROM``); the password is read from the environment and never logged. Sending uses
the standard library's :mod:`smtplib` (RFC 5321; STARTTLS per RFC 3207, implicit TLS per RFC 8314).
"""

from __future__ import annotations

import re
import smtplib
import ssl
from dataclasses import dataclass
from email.message import EmailMessage
from email.policy import SMTP
from email.utils import parseaddr
from pathlib import Path
from typing import Any

from dashboard.untrusted import shown
from ingest.errors import KvscopeError

SECURITY = ("starttls", "ssl", "none")
#: An address as kvscope writes it into To and From: ``name@domain``, without spaces, quotes, angle brackets,
#: commas or control characters (a CR/LF would end the header).
_ADDRESS = re.compile(r"[^@\s<>\"',;\x00-\x1f\x7f]+@[^@\s<>\"',;\x00-\x1f\x7f]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class MailError(KvscopeError):
    """The message could not be sent: no server configured, a refused login or recipient, a network error."""


def check_addresses(addresses: list[str], setting: str) -> list[str]:
    """``addresses`` when each is an address (``oncall@example.com``, or with a name: ``kvscope
    <kvscope@example.com>``) without control characters; raises :class:`MailError` naming ``setting`` and the
    first that is not."""
    for address in addresses:
        if _CONTROL.search(address) or not _ADDRESS.fullmatch(parseaddr(address)[1]):
            raise MailError(f"{setting}: {shown(address)!r} is not an email address (name@example.com)")
    return addresses


@dataclass(frozen=True)
class MailSettings:
    """Where and how to send: ``security`` is ``starttls`` | ``ssl`` | ``none``; ``timeout_seconds`` per step."""

    host: str
    port: int = 587
    security: str = "starttls"
    username: str = ""
    password: str = ""
    sender: str = "kvscope@localhost"
    timeout_seconds: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any) -> MailSettings:
        """From a :class:`kvscope.config.Config`. Raises :class:`MailError` on an unknown ``smtp_security`` or a
        ``mail_from`` that is not an address."""
        if cfg.smtp_security not in SECURITY:
            raise MailError(f"KVSCOPE_SMTP_SECURITY={cfg.smtp_security!r}: expected one of {', '.join(SECURITY)}")
        check_addresses([cfg.mail_from], "KVSCOPE_MAIL_FROM")
        return cls(host=cfg.smtp_host, port=cfg.smtp_port, security=cfg.smtp_security,
                   username=cfg.smtp_username, password=cfg.smtp_password, sender=cfg.mail_from)

    def __repr__(self) -> str:  # never print the password
        return (f"MailSettings(host={self.host!r}, port={self.port}, security={self.security!r}, "
                f"username={self.username!r}, sender={self.sender!r})")


def send(message: EmailMessage, settings: MailSettings, *, context: ssl.SSLContext | None = None) -> None:
    """Send ``message`` (its ``To``/``Cc`` headers are the recipients; ``From`` is set from ``settings`` when
    missing). ``context``: the TLS context (default: the system's trust store, hostname checked).

    Raises :class:`MailError` with the server's reply when no host is configured, TLS or login fails, or a
    recipient is refused.
    """
    if not settings.host:
        raise MailError("no SMTP server configured: set KVSCOPE_SMTP_HOST (or write the message with --dry-run)")
    if "From" not in message:
        message["From"] = settings.sender
    if not (message.get_all("To") or message.get_all("Cc")):
        raise MailError("the message has no recipients (KVSCOPE_DIGEST_TO / KVSCOPE_ALERT_TO or --to)")
    context = context or ssl.create_default_context()
    try:
        if settings.security == "ssl":
            client: smtplib.SMTP = smtplib.SMTP_SSL(settings.host, settings.port, timeout=settings.timeout_seconds,
                                                    context=context)
        else:
            client = smtplib.SMTP(settings.host, settings.port, timeout=settings.timeout_seconds)
        with client:
            client.ehlo()
            if settings.security == "starttls":
                client.starttls(context=context)
                client.ehlo()
            if settings.username:
                client.login(settings.username, settings.password)
            refused = client.send_message(message)
    except (smtplib.SMTPException, OSError) as exc:
        raise MailError(f"sending through {settings.host}:{settings.port} ({settings.security}) failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    if refused:
        raise MailError(f"the server refused recipient(s): {', '.join(sorted(refused))}")


def write_eml(message: EmailMessage, path: str | Path) -> Path:
    """Write ``message`` as an RFC 5322 file (``.eml``, CRLF line ends) any mail client opens; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(message.as_bytes(policy=SMTP))
    return out
