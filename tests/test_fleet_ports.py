"""Listening ports for test and demo servers (demo/fleet.py `free_port`): outside the kernel's ephemeral range,
so no outgoing connection and no TCP self-connect can take them before the server binds. CI once lost the
labelled run to "Address already in use" on an ephemeral KV-event port that vLLM's reconnecting publisher
held."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from demo import fleet
from demo.fleet import ephemeral_range, free_port


def test_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert all(not (low <= p <= high) for p in ports)
    assert len(set(ports)) > 250  # random, so two fixtures rarely pick the same one
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_range_is_read_from_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(fleet, "EPHEMERAL_RANGE_FILE", range_file)
    range_file.write_text("40000\t50000\n")
    assert ephemeral_range() == (40000, 50000)
    assert all(20000 <= free_port() < 40000 for _ in range(100))
    range_file.write_text("1024\t50000\n")  # nothing left below: take ports above the range
    assert all(50000 < free_port() <= 65535 for _ in range(100))
    range_file.write_text("garbage\n")
    assert ephemeral_range() == (32768, 60999)
    monkeypatch.setattr(fleet, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ephemeral_range() == (32768, 60999)


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        picks = iter([port, port, *range(20000, 20200)])

        class Fixed:
            def choice(self, _candidates: range) -> int:
                return next(picks)

        monkeypatch.setattr(fleet.random, "SystemRandom", Fixed)
        assert free_port() != port
