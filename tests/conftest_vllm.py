"""pytest plugin (loaded by tests/conftest.py via `pytest_plugins`): the tiny demo model and a real two-pod
vLLM CPU fleet, each built or started once per test session.

The fleet takes ~2 min to start on 2 cores and ~3 GB RSS per server. Tests that use it carry
`@pytest.mark.vllm`. When vLLM (or torch/transformers for the model) is missing, the fixtures FAIL: the
`vllm` extra is part of the test environment, and a silent skip would hide the end-to-end tests.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.fleet import FleetError, VllmFleet, free_port
from demo.model import build_tiny_model, default_model_dir

LOG_ROOT = Path(__file__).parent / "artifacts" / "vllm-logs"  # kept after the run for CI to upload
INSTALL_HINT = (
    "install the vllm extra (`pip install -e '.[vllm]'`), then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (see docs/environment.md)"
)


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not importable: {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random Llama (with `tokenizer.json`, `config.json`), built once into
    `$KVSCOPE_DEMO_MODEL_DIR` or `~/.cache/kvscope/tiny-llama` and reused across sessions."""
    _require("torch", "transformers", "tokenizers")
    return build_tiny_model(default_model_dir())


def fleet_fixture(model_dir: Path, name: str, **options: Any) -> Iterator[VllmFleet]:
    """The body of a fleet fixture: start a two-pod :class:`VllmFleet` serving ``model_dir`` (``options``: its
    keyword arguments, e.g. ``num_gpu_blocks_override``, ``extra_env``), logging under LOG_ROOT in a directory
    named by the time and ``name``, yield it, stop it. Fails the test (no skip) when vLLM is missing or a
    server does not start."""
    _require("vllm")
    log_dir = LOG_ROOT / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"  # one per fixture: runs may overlap
    fleet = VllmFleet(model_dir, log_dir, **{"num_pods": 2, "kv_events_port": free_port(), **options})
    try:
        fleet.start()
    except FleetError as exc:
        pytest.fail(f"vLLM fleet did not start: {exc}", pytrace=False)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def vllm_fleet(tiny_model_dir: Path) -> Iterator[VllmFleet]:
    """Two vLLM servers (`pod-0`, `pod-1`) serving the tiny model as `tiny`, block size 32, prefix caching
    and prompt-token details on. Their KV events go to `fleet.kv_events_endpoint`
    (tcp://127.0.0.1:`fleet.kv_events_port`, topic = pod name), which a test's collector binds; vLLM
    connects and reconnects, so binding after start-up is fine, but only one socket can bind at a time."""
    yield from fleet_fixture(tiny_model_dir, str(os.getpid()))
