"""The demo model (demo/model.py): tokenizer, chat template (the prompt layout every cache test relies on),
and the files vLLM and the gateway load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from demo.model import MARKER_FILE, build_tiny_model, is_built, recipe_id


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_model_dir_has_what_vllm_and_the_gateway_load(tiny_model_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU rejects head_dim 16
    assert config["num_key_value_heads"] == 1
    assert config["max_position_embeddings"] == 4096
    assert (tiny_model_dir / MARKER_FILE).read_text().strip() == recipe_id()


def test_build_is_idempotent(tiny_model_dir: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert is_built(tiny_model_dir)
    assert not is_built(tiny_model_dir / "nowhere")


def test_tokenizer_json_round_trips_text(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 2000
    text = 'Current time: 2026-11-29T11:42:00.123Z\n{"name": "search_orders", "ünïcode": "✓"}\tdef f(x):'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # it learned merges: fewer tokens than bytes


def _render(hf_tokenizer, **kwargs) -> str:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "QUESTION"}]
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_template_puts_system_then_tools_then_documents_then_messages(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    docs = [
        {"title": "Refunds", "text": "Refund within 30 days."},
        {"title": "Returns", "text": "Ship it back."},
    ]
    text = _render(hf_tokenizer, tools=tools, documents=docs)
    positions = [text.index(s) for s in ("<s><|system|>\nSYSTEM", "<|tools|>", "<|documents|>", "Refunds",
                                         "Returns", "<|user|>\nQUESTION")]  # fmt: skip
    assert positions == sorted(positions)
    assert text.endswith("<|assistant|>\n")
    assert "<|tools|>" not in _render(hf_tokenizer) and "<|documents|>" not in _render(hf_tokenizer)


def test_template_keeps_tool_key_order(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    params_a = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}
    params_b = {"properties": {"alpha": {"type": "integer"}, "zeta": {"type": "string"}}, "type": "object"}
    tool = lambda p: [{"type": "function", "function": {"name": "f", "parameters": p}}]  # noqa: E731
    a, b = _render(hf_tokenizer, tools=tool(params_a)), _render(hf_tokenizer, tools=tool(params_b))
    assert json.dumps(tool(params_a)) in a  # exactly the client's JSON, keys unsorted
    assert a != b
    assert a.index('"zeta"') < a.index('"alpha"') and b.index('"alpha"') < b.index('"zeta"')


def test_template_renders_tool_calls_and_tool_results(hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "find order"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"found": 1}'},
    ]  # fmt: skip
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '<|assistant|>\nok\n<|tool_call|>search {"q": "x"}<|end|>' in text
    assert '<|tool|>\n{"found": 1}<|end|>' in text


def _ask(base_url: str, system: str) -> dict:
    import httpx

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Refund?"}]
    body = {"model": "tiny", "max_tokens": 8, "messages": messages}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def _replay(endpoint: str, from_seq: int) -> list[tuple[bytes, int]]:
    """(topic, seq) of every batch a pod's KV-event replay socket still holds from `from_seq` on."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", from_seq.to_bytes(8, "big")])
        out = []
        while dealer.poll(10_000):
            _, topic, seq, _payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((topic, int.from_bytes(seq, "big")))
        raise AssertionError(f"no end marker from {endpoint}")
    finally:
        dealer.close()


@pytest.mark.vllm
def test_fleet_caches_prefixes_and_publishes_kv_events(vllm_fleet) -> None:  # type: ignore[no-untyped-def]
    """A repeated prompt hits on the same pod (not on the other), per-request metrics come back, the pods' KV
    events reach a SUB socket bound on the fleet's port under the pod's name as topic, and what the SUB
    missed can be replayed from each pod's replay socket."""
    import uuid

    import msgspec
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(vllm_fleet.kv_events_endpoint)
    try:
        pod, other = vllm_fleet.pods
        # ZMQ drops what a pod publishes before its link to this socket is up, and the first batch after
        # (demo/fleet.py): warm up with prompts long enough to make batches until every pod got one through
        live: set[str] = set()
        deadline = time.monotonic() + 30
        while len(live) < 2 and time.monotonic() < deadline:
            for p in (pod, other):
                if p.name not in live:
                    _ask(p.base_url, f"warm-up {uuid.uuid4()} " + "Thank you for waiting. " * 20)
            while sub.poll(1000):
                live.add(sub.recv_multipart()[0].decode())
        assert live == {pod.name, other.name}, (
            f"no KV events from { ({pod.name, other.name} - live) } in 30 s"
        )
        system = f"Ticket {uuid.uuid4()}. " + "Refunds are issued within thirty days of delivery. " * 40
        first, second, elsewhere = (
            _ask(pod.base_url, system),
            _ask(pod.base_url, system),
            _ask(other.base_url, system),
        )
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert prompt_tokens > 300
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 32 * 32
        assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["metrics"]["queue_time_ms"] >= 0  # --enable-per-request-metrics

        full_blocks = prompt_tokens // 32
        stored: dict[str, int] = {}
        seen: set[tuple[bytes, int]] = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and min(stored.get(p.name, 0) for p in (pod, other)) < full_blocks:
            if sub.poll(500):
                topic, seq, payload = sub.recv_multipart()
                seen.add((topic, int.from_bytes(seq, "big")))
                _ts, events, _dp_rank = msgspec.msgpack.decode(payload)
                for event in events:
                    if event["type"] == "BlockStored":
                        stored[topic.decode()] = stored.get(topic.decode(), 0) + len(event["block_hashes"])
        assert stored.get(pod.name, 0) >= full_blocks and stored.get(other.name, 0) >= full_blocks, stored

        for p in (pod, other):
            replayed = _replay(p.kv_replay_endpoint, 0)
            seqs = [seq for _, seq in replayed]
            assert seqs == list(range(len(seqs))) and {t for t, _ in replayed} == {p.name.encode()}
            assert {s for s in seen if s[0] == p.name.encode()} <= set(replayed)
    finally:
        sub.close()
