"""Gateway benchmark: fingerprint time per request, added latency and requests/s of the reference gateway
(issue "Fleet scale"). Every figure is printed beside its goal and measured in the same run.

- fingerprint ms for a ~30k-token chat request (system prompt, tools, documents, history, question), cold
  (empty segment cache) and repeated (every segment seen before), with the estimate and with the tiny demo
  model's tokenizer; also the next turn of the same conversation (only the new messages are new).
- added latency: p50/p95 of one client's sequential requests through the gateway minus the same requests
  sent to the fake upstream directly.
- requests/s: 16 concurrent keep-alive clients for a few seconds, through the gateway and directly.

The fake upstream is a minimal HTTP/1.1 server answering /v1/chat/completions like vLLM (non-streaming,
`usage.prompt_tokens_details.cached_tokens`), and /tokenize (1,024 token ids) and /metrics (block size 16) for
the gateway's precise mode (`--block-chain auto`, the default; each answered request then costs the gateway a
/tokenize call and 64 block hashes, off the client's path); gateway and upstream run in their own processes, the load
generator (raw asyncio sockets, keep-alive, 1k-token bodies with a shared system prompt and a unique
question) in this one. Everything shares the machine's cores, as it would in production on one box.

Usage: `python bench/gateway.py [--seconds 4] [--clients 16] [--counts both|estimate|tokenizer] [--json]`;
`main(argv) -> dict` (keys: goals, fingerprint.{estimate,tokenizer}, proxy.{estimate,tokenizer}). Takes ~1 min.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: this file's folder must not shadow the `gateway` package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
if os.environ.get("KVSCOPE_BENCH_GATEWAY_SRC"):  # measure another copy of the gateway (e.g. a previous one)
    sys.path.insert(0, os.environ["KVSCOPE_BENCH_GATEWAY_SRC"])

GOALS = {
    "fingerprint_repeated_ms": 0.3,
    "gateway_rps": 2000.0,
    "added_p50_ms": 1.0,
}
WORDS = (
    "cache block prefix token pod gateway tenant policy refund order shipping warranty agent tool schema "
    "document history system prompt answer request latency queue decode prefill customer invoice account "
    "password reset delivery address return label carrier tracking"
).split()


def _text(n_chars: int, seed: str) -> str:
    rnd = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < n_chars:
        word = rnd.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)


# --- fingerprint ----------------------------------------------------------------------------------------


def long_request(tokens: int = 30_000, question_seed: str = "q", turns: int = 10) -> dict[str, Any]:
    """A chat body of about `tokens` tokens (chars / 4): a system prompt with a timestamp (25 %), 10 tool
    schemas, 6 documents (30 %), `turns` earlier exchanges, then a question."""
    chars = tokens * 4
    system = {"role": "system", "content": "Now: 2026-11-29T12:00:03Z. req-8f3a91c2. " + _text(chars // 4, "sys")}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _text(400, f"tool{i}"),
                "parameters": {
                    "type": "object",
                    "properties": {f"p{j}": {"type": "string", "description": _text(60, f"{i}.{j}")} for j in range(5)},
                },
            },
        }
        for i in range(10)
    ]
    documents = [{"title": f"Doc {i}", "text": _text(chars * 3 // 10 // 6, f"doc{i}")} for i in range(6)]
    history: list[dict[str, Any]] = []
    for i in range(turns):
        history.append({"role": "user", "content": _text(chars // 50, f"user{i}")})
        history.append({"role": "assistant", "content": _text(chars * 3 // 200, f"bot{i}")})
    question = {"role": "user", "content": _text(4000, question_seed)}
    return {"model": "tiny", "messages": [system, *history, question], "tools": tools, "documents": documents}


def _fingerprint_ms(fpmod: Any, counter: Any, raw_body: str, cache: Any) -> float:
    """ms to fingerprint `raw_body`, parsed afresh (as the gateway does per request) outside the timing."""
    parsed = json.loads(raw_body)
    t0 = time.perf_counter()
    if cache is not None:
        fpmod.fingerprint_request(parsed, "chat.completions", counter, cache=cache)
    else:  # a gateway without the segment cache (e.g. measuring the previous version)
        fpmod.fingerprint_request(parsed, "chat.completions", counter)
    return (time.perf_counter() - t0) * 1000


def bench_fingerprint(tokenizer_path: Path | None, repeats: int = 15) -> dict[str, Any]:
    """Fingerprint ms (median of `repeats`) of a ~30k-token request: cold (empty cache), repeated (the
    same request again), next turn (the following request of the conversation: two new messages)."""
    from gateway import fingerprint as fpmod

    def new_cache() -> Any:
        return fpmod.SegmentCache() if hasattr(fpmod, "SegmentCache") else None

    body = long_request()
    raw = json.dumps(body)
    following = long_request(turns=11, question_seed="q2")  # the question answered, a new one asked
    following["messages"][-3] = body["messages"][-1]
    raw_next = json.dumps(following)
    counters: list[tuple[str, Any]] = [("estimate", fpmod.TokenCounter())]
    if tokenizer_path is not None:
        counters.append(("tokenizer", fpmod.TokenCounter(tokenizer_path)))
    out: dict[str, Any] = {"request_chars": len(raw), "request_tokens_estimate": len(raw) // 4}
    for name, counter in counters:
        cold = [_fingerprint_ms(fpmod, counter, raw, new_cache()) for _ in range(repeats)]
        cache = new_cache()
        _fingerprint_ms(fpmod, counter, raw, cache)
        repeated = [_fingerprint_ms(fpmod, counter, raw, cache) for _ in range(repeats)]
        next_turn = []
        for _ in range(repeats):
            warm = new_cache()
            _fingerprint_ms(fpmod, counter, raw, warm)
            next_turn.append(_fingerprint_ms(fpmod, counter, raw_next, warm))
        out[name] = {
            "cold_ms": round(statistics.median(cold), 3),
            "repeated_ms": round(statistics.median(repeated), 3),
            "next_turn_ms": round(statistics.median(next_turn), 3),
        }
    return out


# --- fake upstream and gateway processes ----------------------------------------------------------------

_UPSTREAM_BODY = {
    "object": "chat.completion",
    "created": 1795950818,
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok, done.", "tool_calls": []},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 1024,
        "total_tokens": 1028,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 768},
    },
    "metrics": {"queue_time_ms": 0.1},
}
_TOKENIZE_BODY = json.dumps({"count": 1024, "max_model_len": 4096, "tokens": list(range(1000, 2024)),
                             "token_strs": None}).encode()
_METRICS_BODY = b'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n'


class _UpstreamProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive server: POST .../chat/completions → a vLLM-like completion with usage;
    GET .../models → the model list. Reads Content-Length bodies only (what the gateway and this load
    generator send)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            rid = headers.get("x-request-id") or "local"
            if head[0].startswith("GET /metrics "):
                body = _METRICS_BODY
            elif " /v1/models " in head[0] or head[0].startswith("GET"):
                body = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
            elif head[0].startswith("POST /tokenize "):
                body = _TOKENIZE_BODY
            else:
                body = json.dumps({"id": f"chatcmpl-{rid}", **_UPSTREAM_BODY}).encode()
            self.transport.write(  # type: ignore[attr-defined]
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )


def _fast_loop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def _run(coro):
    """asyncio.run on uvloop when installed, without changing the caller's event loop policy."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _serve_upstream(port: int) -> None:
    _fast_loop()

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(_UpstreamProtocol, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def _serve_gateway(port: int, upstream: str, log_path: str, tokenizer: str, block_chain: str) -> None:
    """The gateway as `kvscope gateway` runs it (`gateway.proxy.serve`: one uvicorn process)."""
    import uvicorn

    from gateway import proxy

    tok = Path(tokenizer) if tokenizer else None
    app = proxy.make_app([("pod-0", upstream)], Path(log_path), policy="prefix_affinity", tokenizer_path=tok,
                         block_chain=block_chain)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--role", *args],
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


# --- load generator -------------------------------------------------------------------------------------


class _Bodies:
    """1k-token chat bodies (~4,100 chars): one of 4 tenants' system prompts (shared, ~3,000 chars) and a
    unique ~1,000-char question, so the gateway tokenizes something new on every request."""

    def __init__(self) -> None:
        self.systems = [_text(3000, f"tenant{i}") for i in range(4)]
        self.question = _text(1000, "question")
        self.nonce = os.urandom(4).hex()  # no question repeats across load phases either
        self.n = 0

    def next(self) -> bytes:
        self.n += 1
        body = {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [
                {"role": "system", "content": self.systems[self.n % 4]},
                {"role": "user", "content": f"#{self.nonce}-{self.n} {self.question}"},
            ],
            "metadata": {"tenant_id": f"tenant-{self.n % 4}"},
        }
        return json.dumps(body).encode()


async def _client(port: int, bodies: _Bodies, until: float, latencies: list[float], max_requests: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        done = 0
        while time.perf_counter() < until and done < max_requests:
            body = bodies.next()
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = None
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length is None:
                raise RuntimeError(f"response without content-length: {head[:200]!r}")
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"status {head[:40]!r}: {payload[:300]!r}")
            done += 1
    finally:
        writer.close()


async def _load(port: int, clients: int, seconds: float, max_requests: int = 10**9) -> list[float]:
    bodies = _Bodies()
    latencies: list[float] = []
    until = time.perf_counter() + seconds
    await asyncio.gather(*(_client(port, bodies, until, latencies, max_requests) for _ in range(clients)))
    return latencies


def _measure(port: int, clients: int, seconds: float) -> dict[str, float]:
    warm = _run(_load(port, clients, min(1.0, seconds / 3)))  # warm-up: connections, tokenizer cache
    t0 = time.perf_counter()
    latencies = _run(_load(port, clients, seconds))
    elapsed = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return {
        "sent": len(warm) + len(latencies),
        "requests": len(latencies),
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p95_ms": round(q[94] * 1000, 3),
    }


def bench_proxy(tokenizer_path: Path | None, seconds: float, clients: int, block_chain: str = "auto"
                ) -> dict[str, Any]:
    """Added latency at 1 client and requests/s at `clients`, gateway vs direct, with a fake upstream."""
    procs: list[subprocess.Popen] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvscope-bench-")
    try:
        from demo.fleet import free_port

        up_port, gw_port = free_port(), free_port()
        procs.append(_spawn("upstream", str(up_port)))
        _wait_port(up_port, procs[-1])
        log_path = Path(tmp.name) / "gateway.jsonl"
        procs.append(
            _spawn(
                "gateway", str(gw_port), f"http://127.0.0.1:{up_port}", str(log_path), str(tokenizer_path or ""),
                block_chain,
            )
        )
        _wait_port(gw_port, procs[-1])
        direct1 = _measure(up_port, 1, seconds)
        gw1 = _measure(gw_port, 1, seconds)
        direct_n = _measure(up_port, clients, seconds)
        gw_n = _measure(gw_port, clients, seconds)
        procs[-1].terminate()  # a graceful stop flushes the log writer
        procs[-1].wait(30)
        lines = chained = 0
        if log_path.exists():
            for line in log_path.open("rb"):
                lines += 1
                chained += b'"prompt_block_hashes":[]' not in line
        return {
            "token_count_method": "tokenizer" if tokenizer_path else "estimate",
            "one_client": {"direct": direct1, "gateway": gw1},
            "added_p50_ms": round(gw1["p50_ms"] - direct1["p50_ms"], 3),
            "added_p95_ms": round(gw1["p95_ms"] - direct1["p95_ms"], 3),
            "clients": clients,
            "direct_rps": direct_n["rps"],
            "gateway_rps": gw_n["rps"],
            "gateway_vs_direct": round(gw_n["rps"] / direct_n["rps"], 3),
            "concurrent": {"direct": direct_n, "gateway": gw_n},
            "log_lines": lines,
            "block_chain": block_chain,
            "chained_lines": chained,
            "log_lines_expected": gw1["sent"] + gw_n["sent"],
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()


# --- entry point ----------------------------------------------------------------------------------------


def _tokenizer(estimate_only: bool) -> Path | None:
    if estimate_only:
        return None
    from demo.model import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir()) / "tokenizer.json"


def _verdict(value: float, goal: float, higher_is_better: bool) -> str:
    ok = value >= goal if higher_is_better else value <= goal
    return "meets" if ok else "MISSES"


def report(result: dict[str, Any]) -> str:
    fp = result["fingerprint"]
    lines = [f"fingerprint, ~{fp['request_tokens_estimate']:,}-token chat request (median ms):"]
    goal = GOALS["fingerprint_repeated_ms"]
    for method in ("estimate", "tokenizer"):
        if method in fp:
            m = fp[method]
            lines.append(
                f"  {method:9s}  cold {m['cold_ms']:8.3f}   repeated {m['repeated_ms']:7.3f}"
                f" (goal <= {goal}: {_verdict(m['repeated_ms'], goal, False)})   next turn {m['next_turn_ms']:7.3f}"
            )
    for px in result.get("proxy", {}).values():
        lines += _proxy_report(px)
    return "\n".join(lines)


def _proxy_report(px: dict[str, Any]) -> list[str]:
    one = px["one_client"]
    return [
        f"gateway (1 process) vs fake upstream, 1k-token bodies, segment tokens by {px['token_count_method']}:",
        f"  1 client   direct p50 {one['direct']['p50_ms']:.3f} p95 {one['direct']['p95_ms']:.3f} ms;"
        f" gateway p50 {one['gateway']['p50_ms']:.3f} p95 {one['gateway']['p95_ms']:.3f} ms",
        f"  added      p50 {px['added_p50_ms']:.3f} ms (goal <= {GOALS['added_p50_ms']}:"
        f" {_verdict(px['added_p50_ms'], GOALS['added_p50_ms'], False)}), p95 {px['added_p95_ms']:.3f} ms",
        f"  {px['clients']} clients requests/s: gateway {px['gateway_rps']:,.0f} (goal >= {GOALS['gateway_rps']:,.0f}:"
        f" {_verdict(px['gateway_rps'], GOALS['gateway_rps'], True)}), direct {px['direct_rps']:,.0f}"
        f" ({px['gateway_vs_direct']:.2f}x)",
        f"  log lines written {px['log_lines']:,} of {px['log_lines_expected']:,} requests;"
        f" with a block chain {px.get('chained_lines', 0):,} (block chain {px.get('block_chain', 'off')})",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the figures beside their goals, return them as a dict."""
    parser = argparse.ArgumentParser(prog="bench/gateway.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="duration of each load phase")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--counts", choices=["both", "estimate", "tokenizer"], default="both",
        help="how the gateway counts segment tokens during the load phases",
    )
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--block-chain", choices=["auto", "off"], default="auto",
                        help="the gateway's precise mode during the load phases")
    parser.add_argument("--json", action="store_true", help="print the dict as JSON after the report")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        role, *rest = args.role
        if role == "upstream":
            _serve_upstream(int(rest[0]))
        elif role == "gateway":
            _serve_gateway(int(rest[0]), rest[1], rest[2], rest[3], rest[4])
        return {}
    tokenizer = _tokenizer(False)
    result: dict[str, Any] = {"goals": GOALS, "fingerprint": bench_fingerprint(tokenizer)}
    if not args.skip_proxy:
        methods = ["estimate", "tokenizer"] if args.counts == "both" else [args.counts]
        result["proxy"] = {
            m: bench_proxy(tokenizer if m == "tokenizer" else None, args.seconds, args.clients, args.block_chain)
            for m in methods
        }
    print(report(result))
    if args.json:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
