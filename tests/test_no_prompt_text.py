"""No prompt text in the store, on a real vLLM server: a request whose prompt carries a unique canary makes vLLM
answer 400 with a validation error that quotes the prompt; the request goes through the reference gateway,
is ingested, and then every file kvscope wrote (the chDB directory, the gateway log, the checkpoints) is read
byte by byte: the canary is nowhere, while the request's row (status 400, scrubbed error) is there.

A control string sent the same way in a field the store does keep (conversation_id) is found in the chDB files
and the log, so the search would see the canary if it had been stored."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from gateway.proxy import GatewayServer, make_app
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.kill_harness import wait_until

pytestmark = pytest.mark.vllm


def files_holding(roots: list[Path], needle: bytes) -> list[Path]:
    """Every regular file under ``roots`` whose bytes contain ``needle``. A file that vanishes during the walk is
    skipped: chDB removes dropped tables' files in the background, and the chDB directory is shared by the
    session's tests."""
    found = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if needle in data:
                found.append(path)
    return found


def table_files_hold(store, table: str, needle: bytes, tries: int = 5) -> bool:  # type: ignore[no-untyped-def]
    """Whether the files of ``table`` (its data paths in the store's database) hold ``needle``, looked for up to
    ``tries`` times a second apart: a background merge can replace a part between listing and reading it (the
    walk of the whole session's chDB directory is long late in the suite; the control once went unseen there)."""
    [(paths,)] = store.query_rows("SELECT data_paths FROM system.tables WHERE database = {db:String} "
                                  "AND name = {t:String}", {"db": store.database, "t": table})
    for _ in range(tries):
        if files_holding([Path(p) for p in paths], needle):
            return True
        time.sleep(1)
    return False


def literal_marker(prefix: str) -> str:
    """``prefix`` and random hex in which no 4 bytes repeat: ClickHouse compresses columns with LZ4 (minimum match
    4 bytes), which stores such a string as one literal run, so its bytes are found in the part's files. A uuid's
    hex repeats some 4 bytes in about 1 run of 170: the control below was then stored, but not as its bytes."""
    while True:
        marker = f"{prefix}{uuid.uuid4().hex}"
        grams = [marker[i:i + 4] for i in range(len(marker) - 3)]
        if len(set(grams)) == len(grams):
            return marker


def test_a_prompt_quoted_by_a_vllm_400_never_reaches_the_store(vllm_fleet, store, chdb_dir, tmp_path: Path):  # type: ignore[no-untyped-def]
    canary = literal_marker("kvscopecanary")
    control = literal_marker("kvscopecontrol")
    log = tmp_path / "gateway.jsonl"
    state = tmp_path / "state"
    pod = vllm_fleet.pods[0]
    cfg = replace(build_config({}, environ={}), database=store.database, state_dir=str(state),
                  gateway_log=str(log), scrape_interval_seconds=3600, attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store)
    with GatewayServer(make_app([(pod.name, pod.base_url)], log)) as gw:
        pipe.start()
        try:
            with httpx.Client(base_url=gw.url, timeout=60) as client:
                # a prompt list mixing text and a token id: vLLM's pydantic check quotes the text back
                r = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                         "prompt": [f"{canary} the secret prompt", 7]},
                                headers={"X-Request-Id": "canary-1", "X-Conversation-Id": control})
            assert r.status_code == 400, r.text
            assert canary in r.text  # vLLM did quote the prompt: the client gets it, the log must not
            wait_until(lambda: store.query_rows("SELECT count() FROM gateway_requests")[0][0] == 1, 60,
                       "the request's row")
        finally:
            pipe.close()
    [(status, error, conversation)] = store.query_rows(
        "SELECT status, error, conversation_id FROM gateway_requests WHERE request_id = 'canary-1'")
    assert status == 400 and conversation == control
    assert re.fullmatch(r"400 Bad Request: request failed validation \(\d+ errors\)", error), error
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 0
    roots = [chdb_dir, log, state]
    assert files_holding(roots, canary.encode()) == []
    assert log in files_holding([log], control.encode())
    assert table_files_hold(store, "gateway_requests", control.encode())
