"""The demo model (demo/model.py): tokenizer, chat template (the prompt layout every cache test relies on),
and the files vLLM and the gateway load."""

from __future__ import annotations

import json
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
    docs = [{"title": "Refunds", "text": "Refund within 30 days."}, {"title": "Returns", "text": "Ship it back."}]
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
