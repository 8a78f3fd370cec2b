"""Fingerprinting library: segment hashes, their drift-naming variants, token counts, and the log format."""

from __future__ import annotations

import copy
import json
import random
import re
import time
from pathlib import Path

import jsonschema
import pytest

from collector.gateway_record import BadRecord, decode_record
from gateway.fingerprint import (
    FingerprintError,
    PromptFingerprint,
    SegmentBudgetExceeded,
    SegmentCache,
    TokenCounter,
    content_chunks,
    continues_final_message,
    fingerprint_chat,
    fingerprint_completion,
    fingerprint_request,
    hash_parts,
    skips_prefix_cache,
    system_lines,
)
from gateway.log import SCHEMA_PATH, BackgroundLogWriter, GatewayLogWriter, format_ts
from gateway.normalize import VOLATILE_PATTERNS, mask_volatile

EST = TokenCounter()
SYSTEM = "You are the support assistant of Example Corp. Answer briefly and cite the policy."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by id",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]
DOCS = [
    {"title": "Refunds", "text": "Refunds are issued within 14 days."},
    {"title": "Shipping", "text": "We ship worldwide."},
    {"title": "Warranty", "text": "Two years on all devices."},
]


def chat(*messages, **extra):
    return {"model": "tiny", "messages": list(messages), **extra}


def sys(text=SYSTEM):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


# --- normalization: one case per pattern, plus text that must stay ---------------------------------------

PATTERN_CASES = {
    "iso_datetime": [
        ("Now: 2026-11-29T12:00:03.123Z.", "Now: <ts>."),
        ("at 2026-11-29 12:00:03+01:00 sharp", "at <ts> sharp"),
        ("at 2026-11-29T12:00", "at <ts>"),
    ],
    "uuid": [("session 9b2e4c1a-5f3d-4e6a-8b7c-0d1e2f3a4b5c ok", "session <uuid> ok")],
    "request_id": [
        ("id req-8f3a91c2 here", "id <id> here"),
        ("reply to chatcmpl-abc123def456", "reply to <id>"),
        ("tool call_9XbQ2kLm done", "tool <id> done"),
    ],
    "hex_id": [("trace 4bf92f3577b34da6a3ce929d0e0e4736.", "trace <hex>.")],
    "iso_date": [("Today is 2026-11-29.", "Today is <date>.")],
    "numeric_date": [("Date: 11/29/2026 and 29.11.2026", "Date: <date> and <date>")],
    "month_date": [
        ("Today is Sunday, November 29, 2026.", "Today is <date>."),
        ("as of 29 Nov 2026", "as of <date>"),
    ],
    "clock_time": [("It is 09:41:07 now, or 9:41 pm", "It is <time> now, or <time>")],
    "unix_epoch": [("ts=1795950818 and 1795950818123 ms", "ts=<epoch> and <epoch> ms")],
}
UNCHANGED = [
    "Use request-handling rules and run_tools carefully.",
    "Python 3.11 on port 8080, version 2.0.1, ratio 3:1.",
    "Call us at 555 0199; order 12345 of 2026.",
    "The deadbeef id is short.",
]


def test_every_pattern_has_cases():
    assert {p.name for p in VOLATILE_PATTERNS} == set(PATTERN_CASES)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [(name, text, expected) for name, cases in PATTERN_CASES.items() for text, expected in cases],
)
def test_volatile_pattern_is_masked(name, text, expected):
    assert mask_volatile(text) == expected


@pytest.mark.parametrize("pattern", VOLATILE_PATTERNS, ids=lambda p: p.name)
def test_pattern_example_masks_to_its_own_mask(pattern):
    assert mask_volatile(f"x {pattern.example} y") == f"x {pattern.mask} y"


@pytest.mark.parametrize("text", UNCHANGED)
def test_stable_text_is_not_masked(text):
    assert mask_volatile(text) == text


def test_volatile_system_prompt_same_norm_hash_different_raw_hash():
    a = fingerprint_chat(chat(sys(f"Now: 2026-11-29T12:00:03Z. req-11aa22bb. {SYSTEM}"), user("hi")), EST)
    b = fingerprint_chat(chat(sys(f"Now: 2026-11-30T08:15:59Z. req-99ff00ee. {SYSTEM}"), user("hi")), EST)
    c = fingerprint_chat(
        chat(sys(f"Now: 2026-11-30T08:15:59Z. req-99ff00ee. {SYSTEM} Be rude."), user("hi")), EST
    )
    assert a.system_hash != b.system_hash
    assert a.system_norm_hash == b.system_norm_hash
    assert c.system_norm_hash != b.system_norm_hash
    assert a.prompt_fingerprint != b.prompt_fingerprint


# --- hashes ---------------------------------------------------------------------------------------------


def test_hash_format():
    h = hash_parts("a", "b")
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert h != hash_parts("ab") and h != hash_parts("a\x1fb", "")
    assert h == hash_parts("a\x1fb")  # the documented join: parts joined with U+001F


def test_absent_segments_are_empty_with_zero_tokens():
    fp = fingerprint_chat(chat(user("hello there")), EST)
    for seg in ("system", "tools", "retrieval", "history"):
        assert getattr(fp, f"{seg}_tokens") == 0
    for name in (
        "system_hash",
        "system_norm_hash",
        "tools_hash",
        "tools_canonical_hash",
        "retrieval_pack_hash",
        "retrieval_set_hash",
        "history_prefix_hash",
        "prev_history_hash",
        "prompt_fingerprint",
    ):
        assert getattr(fp, name) == "", name
    assert fp.suffix_hash and fp.suffix_tokens == 3  # ceil(11 chars / 4)
    assert fp.token_count_method == "estimate"


def test_reordered_tool_keys_same_canonical_hash_different_raw_hash():
    reordered = json.loads(json.dumps(TOOLS))
    fn = reordered[0]["function"]
    reordered[0]["function"] = {
        "parameters": fn["parameters"],
        "description": fn["description"],
        "name": fn["name"],
    }
    a = fingerprint_chat(chat(sys(), user("q"), tools=TOOLS), EST)
    b = fingerprint_chat(chat(sys(), user("q"), tools=reordered), EST)
    assert a.tools_hash != b.tools_hash
    assert a.tools_canonical_hash == b.tools_canonical_hash
    assert a.tools_tokens == b.tools_tokens > 0
    assert a.prompt_fingerprint != b.prompt_fingerprint
    changed = copy.deepcopy(TOOLS)
    changed[0]["function"]["description"] = "Find an order"
    c = fingerprint_chat(chat(sys(), user("q"), tools=changed), EST)
    assert c.tools_canonical_hash != a.tools_canonical_hash


def test_the_same_tools_in_another_list_order_same_canonical_hash():
    """Found on real pods by a hostile hunt: an MCP client that lists the same tools in another order read
    tools_changed; the canonical form sorts the list too (tools_reordered)."""
    second = {"type": "function", "function": {"name": "read_file", "description": "Read one file",
                                                "parameters": {"type": "object", "properties": {}}}}
    tools = [*TOOLS, second]
    a = fingerprint_chat(chat(sys(), user("q"), tools=tools), EST)
    b = fingerprint_chat(chat(sys(), user("q"), tools=tools[::-1]), EST)
    assert a.tools_hash != b.tools_hash and a.tools_canonical_hash == b.tools_canonical_hash
    c = fingerprint_chat(chat(sys(), user("q"), tools=tools[:1]), EST)
    assert c.tools_canonical_hash != a.tools_canonical_hash


def test_shuffled_documents_same_set_hash_different_pack_hash():
    shuffled = [DOCS[2], DOCS[0], DOCS[1]]
    a = fingerprint_chat(chat(sys(), user("q"), documents=DOCS), EST)
    b = fingerprint_chat(chat(sys(), user("q"), documents=shuffled), EST)
    assert a.retrieval_pack_hash != b.retrieval_pack_hash
    assert a.retrieval_set_hash == b.retrieval_set_hash
    assert a.retrieval_tokens == b.retrieval_tokens > 0
    c = fingerprint_chat(chat(sys(), user("q"), documents=DOCS[:2]), EST)
    assert c.retrieval_set_hash != a.retrieval_set_hash


def test_further_system_messages_are_retrieval():
    body = chat(sys(), {"role": "system", "content": "Doc: refunds in 14 days."}, user("q"))
    fp = fingerprint_chat(body, EST)
    alone = fingerprint_chat(chat(sys(), user("q")), EST)
    assert fp.system_hash == alone.system_hash
    assert fp.retrieval_pack_hash and fp.retrieval_tokens == 6
    assert fp.history_prefix_hash == ""


def test_developer_role_is_system():
    fp = fingerprint_chat(chat({"role": "developer", "content": SYSTEM}, user("q")), EST)
    assert fp.system_hash and fp.system_tokens > 0


def test_text_parts_hash_like_string_content():
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    a = fingerprint_chat(chat(sys(), parts), EST)
    b = fingerprint_chat(chat(sys(), user("a\nb")), EST)
    assert a.suffix_hash == b.suffix_hash and a.suffix_tokens == b.suffix_tokens


def test_message_fields_all_count():
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup_order", "arguments": "{}"}}
    base = chat(sys(), user("q"), {"role": "assistant", "content": None, "tool_calls": [call]}, user("again"))
    other = copy.deepcopy(base)
    other["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"order_id": "1"}'
    a, b = fingerprint_chat(base, EST), fingerprint_chat(other, EST)
    assert a.history_prefix_hash != b.history_prefix_hash
    assert a.history_tokens > 0


# --- history across turns -------------------------------------------------------------------------------


def conversation_turns():
    """Request bodies of a 4-turn conversation, each turn = the previous messages + reply + new message."""
    messages = [sys(), user("Where is my order?")]
    turns = [chat(*messages, tools=TOOLS)]
    for reply, new in [("Which order id?", "It is 1234."), ("Shipped.", "Thanks!"), ("Welcome.", "Bye")]:
        messages = messages + [bot(reply), user(new)]
        turns.append(chat(*messages, tools=TOOLS))
    return turns


def test_prev_history_of_next_turn_equals_history_prefix_of_turn():
    fps = [fingerprint_chat(body, EST) for body in conversation_turns()]
    for prev, cur in zip(fps, fps[1:], strict=False):
        assert cur.prev_history_hash == prev.history_prefix_hash
        assert cur.parent_fingerprint == prev.prompt_fingerprint
        assert cur.prompt_fingerprint != prev.prompt_fingerprint
    assert fps[0].history_prefix_hash == "" and fps[-1].history_prefix_hash != ""


def test_truncated_history_breaks_the_chain():
    turns = conversation_turns()
    fps = [fingerprint_chat(body, EST) for body in turns]
    truncated = copy.deepcopy(turns[3])
    del truncated["messages"][1:3]  # the client dropped the oldest exchange
    fp = fingerprint_chat(truncated, EST)
    assert fp.prev_history_hash != fps[2].history_prefix_hash
    rewritten = copy.deepcopy(turns[3])
    rewritten["messages"][1]["content"] = "Where is my parcel?"
    assert fingerprint_chat(rewritten, EST).prev_history_hash != fps[2].history_prefix_hash


def test_prev_suffix_is_the_previous_turns_final_message_unless_edited():
    """prev_suffix_hash is the previous request's suffix_hash, as this request carries that message: in a plain
    conversation, an agent's tool loop and a turn that adds parallel tool results; it differs when the client
    edited (redacted) the message, where prev_history_hash alone still matches (the history before it is kept)."""
    fps = [fingerprint_chat(body, EST) for body in conversation_turns()]
    assert fps[0].prev_suffix_hash == ""
    for prev, cur in zip(fps, fps[1:], strict=False):
        assert cur.prev_suffix_hash == prev.suffix_hash != ""
    edited = copy.deepcopy(conversation_turns()[3])
    edited["messages"][-3]["content"] = "[REDACTED]"  # turn 3's final message, "Thanks!"
    fp = fingerprint_chat(edited, EST)
    assert fp.prev_history_hash == fps[2].history_prefix_hash
    assert fp.prev_suffix_hash != fps[2].suffix_hash
    call = {"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": "{}"}}
    loop = [sys(), user("Check order 1")]
    for n in range(3):  # each turn: the model calls a tool, the tool's result is the new final message
        loop = loop + [{"role": "assistant", "content": None, "tool_calls": [{**call, "id": f"c{n}"}]},
                       {"role": "tool", "tool_call_id": f"c{n}", "content": f"result {n}"}]
    runs = [fingerprint_chat(chat(*loop[:k]), EST) for k in (2, 4, 6, 8)]
    for prev, cur in zip(runs, runs[1:], strict=False):
        assert cur.prev_suffix_hash == prev.suffix_hash
    first = [sys(), user("Check orders 1 and 2")]
    reply = {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]}
    second = first + [reply, {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                      {"role": "tool", "tool_call_id": "c2", "content": "late"}]
    assert fingerprint_chat(chat(*second), EST).prev_suffix_hash == fingerprint_chat(chat(*first), EST).suffix_hash
    assert fingerprint_completion({"model": "tiny", "prompt": "Once upon a time"}, EST).prev_suffix_hash == ""


def test_next_history_is_the_history_of_a_turn_sent_without_a_reply():
    """next_history_hash is this request's history and final message as one history: the history_prefix_hash of
    a next request that re-sends them with nothing between (a user message sent before the reply came; user-only
    turns), where prev_history_hash, which assumes a reply between, names another history. A next turn after a
    reply carries another history; a completion logs none."""
    first = [sys(), user("Where is my order?"), bot("Which one?"), user("Order 1")]
    for later in (first + [user("Hello?")], first + [user("Still there?"), user("Hello?")]):
        cur, prev = fingerprint_chat(chat(*later), EST), fingerprint_chat(chat(*later[:-1]), EST)
        assert cur.history_prefix_hash == prev.next_history_hash != ""
        assert cur.prev_history_hash != prev.history_prefix_hash  # the rule alone reads a truncated history
    users = [user("a"), user("b"), user("c")]
    assert fingerprint_chat(chat(*users), EST).history_prefix_hash == \
        fingerprint_chat(chat(*users[:2]), EST).next_history_hash
    replied = first + [bot("Shipped."), user("Thanks")]
    assert fingerprint_chat(chat(*replied), EST).history_prefix_hash != \
        fingerprint_chat(chat(*first), EST).next_history_hash
    assert fingerprint_completion({"model": "tiny", "prompt": "Once upon a time"}, EST).next_history_hash == ""


def test_prefill_history_is_the_history_of_an_assistant_prefill_the_reply_completed():
    """An assistant prefill (final message of role assistant, continue_final_message): the next turn carries that
    message completed (prefill + reply), so its prefill_history_hash (the history before its last run of assistant
    messages) is the prefill turn's history_prefix_hash, where prev_history_hash (which drops the user message
    before the reply) and next_history_hash (the prefill as sent) name other histories. A plain reply's next turn
    does not match that way; a history without an assistant message, or with nothing before it, logs none."""
    first = [sys(), user("Where is my order?"), bot("Which one?"), user("Order 1"), bot("Order 1 is")]
    nxt = first[:-1] + [bot("Order 1 is on its way."), user("When?")]
    cur, prev = fingerprint_chat(chat(*nxt), EST), fingerprint_chat(chat(*first), EST)
    assert cur.prefill_history_hash == prev.history_prefix_hash != ""
    assert cur.prefill_parent_fingerprint == prev.prompt_fingerprint != cur.parent_fingerprint  # routing: its pod
    assert cur.prev_history_hash != prev.history_prefix_hash and cur.history_prefix_hash != prev.next_history_hash
    replied = [sys(), user("Where is my order?"), bot("Which one?"), user("Order 1")]
    after = fingerprint_chat(chat(*replied, bot("Shipped."), user("Thanks")), EST)
    assert after.prefill_history_hash != fingerprint_chat(chat(*replied), EST).history_prefix_hash
    assert fingerprint_chat(chat(user("a"), user("b")), EST).prefill_history_hash == ""
    assert fingerprint_chat(chat(user("a"), user("b")), EST).prefill_parent_fingerprint == ""
    assert fingerprint_chat(chat(bot("Hi"), user("b")), EST).prefill_history_hash == ""
    assert continues_final_message({"messages": first, "continue_final_message": True})
    assert continues_final_message({"messages": first, "continue_final_message": "true"})  # pydantic's lax bool
    assert not continues_final_message({"messages": first})
    assert not continues_final_message({"messages": replied, "continue_final_message": True})  # final is a user's
    assert not continues_final_message({"messages": [], "continue_final_message": True})


def test_first_message_names_the_thread():
    """first_message_hash is the same on every turn of one thread (a conversation, an agent's tool loop) and differs
    between two sub-agents of one run given other tasks; a completion logs none."""
    fps = [fingerprint_chat(body, EST) for body in conversation_turns()]
    assert len({fp.first_message_hash for fp in fps}) == 1 and fps[0].first_message_hash == fps[0].suffix_hash
    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    a1, b1 = [sys(), user("task A")], [sys(), user("task B")]
    a2 = a1 + [{"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "found"}]
    a1f, b1f, a2f = (fingerprint_chat(chat(*m), EST) for m in (a1, b1, a2))
    assert a1f.first_message_hash == a2f.first_message_hash != b1f.first_message_hash
    assert fingerprint_completion({"model": "tiny", "prompt": "Once upon a time"}, EST).first_message_hash == ""


@pytest.mark.parametrize(("endpoint", "extra", "skips"), [
    ("chat.completions", {}, False),
    ("chat.completions", {"prompt_logprobs": 0}, True),
    ("chat.completions", {"prompt_logprobs": None}, False),
    ("chat.completions", {"echo": True}, True),  # top_logprobs defaults to 0 (vLLM's ChatCompletionRequest)
    ("chat.completions", {"echo": True, "top_logprobs": None}, True),  # null read as 0 (TopLogprobsParam)
    ("chat.completions", {"echo": "false", "top_logprobs": 1}, False),  # pydantic reads "false" as False
    ("chat.completions", {"echo": "yes"}, True),
    ("chat.completions", {"echo": 0}, False),
    ("chat.completions", {"prompt_logprobs": 1, "use_beam_search": True}, False),  # BeamSearchParams: no skip
    ("completions", {"echo": True, "logprobs": 1, "use_beam_search": "true"}, False),
    ("chat.completions", {"logprobs": True, "top_logprobs": 5}, False),  # sampled tokens' logprobs only
    ("completions", {"prompt_logprobs": 1}, True),
    ("completions", {"echo": True}, False),  # logprobs defaults to null (CompletionRequest)
    ("completions", {"echo": True, "logprobs": 0}, True),
    ("completions", {"logprobs": 3}, False),
])
def test_skips_prefix_cache_follows_vllms_prompt_logprobs_rule(endpoint: str, extra: dict, skips: bool) -> None:
    """vLLM reads no prefix cache for a request whose prompt_logprobs is set (SamplingParams), and its OpenAI
    servers set prompt_logprobs from the body's own field, else under echo from top_logprobs (chat) or logprobs
    (completions); a beam search has none. Bools are read as pydantic reads them (found by a hostile hunt: echo
    "false" flagged, echo with top_logprobs null and beam search misread)."""
    body = {"model": "tiny", **({"messages": [user("hi")]} if endpoint == "chat.completions" else {"prompt": "hi"}),
            **extra}
    assert skips_prefix_cache(body, endpoint) is skips


def test_prev_history_with_parallel_tool_results():
    """An agent turn that adds several tool results still links to the request that asked for them."""
    call = {"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": "{}"}}
    first = [sys(), user("Check orders 1 and 2")]
    reply = {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]}
    second = first + [reply, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    second.append({"role": "tool", "tool_call_id": "c2", "content": "late"})
    third = second + [bot("Both shipped."), user("Thanks")]
    fps = [fingerprint_chat(chat(*m), EST) for m in (first, second, third)]
    assert fps[1].prev_history_hash == fps[0].history_prefix_hash == ""
    assert fps[2].prev_history_hash == fps[1].history_prefix_hash != ""


# --- completions ----------------------------------------------------------------------------------------


def test_completion_prompt_is_suffix():
    fp = fingerprint_completion({"model": "tiny", "prompt": "Once upon a time"}, EST)
    assert fp.system_hash == "" and fp.prompt_fingerprint == ""
    assert fp.suffix_hash == hash_parts("Once upon a time") and fp.suffix_tokens == 4


def test_completion_prefix_chars_split():
    stable = "Policy as of 2026-11-29: be nice. "
    a = fingerprint_completion({"prompt": stable + "Q1", "metadata": {"prefix_chars": len(stable)}}, EST)
    b = fingerprint_completion({"prompt": stable + "Q2", "metadata": {"prefix_chars": len(stable)}}, EST)
    assert a.system_hash == b.system_hash == hash_parts(stable)
    assert a.prompt_fingerprint == b.prompt_fingerprint != ""
    assert a.suffix_hash != b.suffix_hash
    later = "Policy as of 2026-12-01: be nice. "
    c = fingerprint_completion({"prompt": later + "Q1", "metadata": {"prefix_chars": len(later)}}, EST)
    assert c.system_norm_hash == a.system_norm_hash and c.system_hash != a.system_hash


def test_completion_prompt_lists_and_token_ids():
    batch = fingerprint_completion({"prompt": ["ab", "cd"]}, EST)
    assert batch.suffix_hash == hash_parts("ab", "cd") and batch.suffix_tokens == 2
    ids = fingerprint_completion({"prompt": [5, 6, 7]}, EST)
    assert ids.suffix_tokens == 3
    with pytest.raises(FingerprintError):
        fingerprint_completion({"prompt": {"x": 1}}, EST)


def test_fingerprint_request_dispatch_and_errors():
    body = chat(sys(), user("q"))
    assert fingerprint_request(body, "chat.completions", EST) == fingerprint_chat(body, EST)
    with pytest.raises(FingerprintError):
        fingerprint_chat({"messages": "not a list"}, EST)
    with pytest.raises(ValueError):
        fingerprint_request(body, "embeddings", EST)  # type: ignore[arg-type]


# --- token counting -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer.json trained here (same kind as the demo's tiny model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([SYSTEM, *(d["text"] for d in DOCS)] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_token_counter_estimate():
    assert EST.method == "estimate"
    assert [EST.count(t) for t in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]


def test_token_counter_tokenizer(tokenizer_file):
    from tokenizers import Tokenizer

    counter = TokenCounter(tokenizer_file)
    assert counter.method == "tokenizer"
    expected = len(Tokenizer.from_file(str(tokenizer_file)).encode(SYSTEM, add_special_tokens=False).ids)
    assert counter.count(SYSTEM) == expected > 0
    assert TokenCounter(tokenizer_file.parent).count(SYSTEM) == expected  # a model directory works too
    fp = fingerprint_chat(chat(sys(), user("q")), counter)
    assert fp.token_count_method == "tokenizer" and fp.system_tokens == expected


def test_structure_counts_match_one_by_one_counts(tokenizer_file):
    """count_many gives count's numbers; the suffix's chunks and the system prompt's lines carry the tokenizer's
    count of each piece, a one-piece message its whole count (not tokenized again)."""
    counter = TokenCounter(tokenizer_file)
    texts = ["", SYSTEM, "one line\n", "x" * 900 + "\n\n" + "y" * 900]
    assert counter.count_many(texts) == [counter.count(t) for t in texts] and counter.count_many(texts)[1] > 0
    assert EST.count_many(texts) == [EST.count(t) for t in texts]
    docs = "\n\n".join(f"Document {i}: " + "facts about the fleet. " * 20 for i in range(3))
    for body in (chat(sys(), user("a short question")), chat(sys(), user(docs + "\n\nWhich pod?"))):
        fp = fingerprint_chat(body, counter)
        chunks = content_chunks(body["messages"][-1]["content"])
        assert fp.suffix_chunk_tokens == tuple(counter.count(c) for c in chunks)
        lines = system_lines(body["messages"][0]["content"])
        assert fp.system_line_tokens == tuple(counter.count(x) for x in lines)
    assert len(fingerprint_chat(chat(sys(), user(docs + "\n\nWhich pod?")), counter).suffix_chunk_tokens) > 1


# --- the log format -------------------------------------------------------------------------------------


def log_validator() -> jsonschema.Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def assert_valid_log_line(line: str) -> dict:
    """Parse a log line and validate it against the schema and kvscope's reader (shared with the proxy tests)."""
    record = json.loads(line)
    log_validator().validate(record)
    decode_record(line)  # raises BadRecord with the reason if the reader would dead-letter it
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z", record["ts"])
    return record


def base_record(fp: PromptFingerprint, **overrides) -> dict:
    return {
        "request_id": "r1",
        "ts": format_ts(1795950818.1234),
        "tenant_id": "t",
        "conversation_id": "",
        "agent_run_id": "",
        "model": "tiny",
        "pod": "pod-0",
        "endpoint": "chat.completions",
        "stream": False,
        "routing_policy": "round_robin",
        "routing_reason": "round_robin",
        "status": 200,
        "error": "",
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 2,
        "ttft_ms": 1.5,
        "e2e_ms": 2.0,
        "queue_wait_ms": None,
        "tool_latency_ms": None,
        **fp.to_log_fields(),
        **overrides,
    }


def test_format_ts():
    assert format_ts(1795950818.1239) == "2026-11-29T11:13:38.123Z"
    assert format_ts(0.9999) == "1970-01-01T00:00:00.999Z"  # truncated, never rounded into the next second


def test_every_fingerprint_log_line_validates(tmp_path, tokenizer_file):
    bodies = [*conversation_turns(), chat(sys(), user("q"), documents=DOCS), chat(user("x"))]
    rnd = random.Random(7)
    shuffled = chat(sys(), user("q"), documents=rnd.sample(DOCS, 3))
    writer = GatewayLogWriter(tmp_path / "logs" / "gateway.jsonl")
    for counter in (EST, TokenCounter(tokenizer_file)):
        for body in [*bodies, shuffled]:
            writer.write(base_record(fingerprint_chat(body, counter)))
        writer.write(base_record(fingerprint_completion({"prompt": "p"}, counter), endpoint="completions"))
        writer.write(base_record(PromptFingerprint.empty(counter.method), status=502, error="down"))
    writer.close()
    lines = (tmp_path / "logs" / "gateway.jsonl").read_text().splitlines()
    assert len(lines) == 2 * (len(bodies) + 3)
    for line in lines:
        record = assert_valid_log_line(line)
        assert record["log_version"] == 1


def test_log_writer_rejects_missing_fields_and_reopens_after_rotation(tmp_path):
    path = tmp_path / "g.jsonl"
    writer = GatewayLogWriter(path)
    fp = fingerprint_chat(chat(user("x")), EST)
    with pytest.raises(ValueError, match="prompt_tokens"):
        writer.write({k: v for k, v in base_record(fp).items() if k != "prompt_tokens"})
    writer.write(base_record(fp, request_id="a"))
    path.rename(tmp_path / "g.jsonl.1")
    writer.write(base_record(fp, request_id="b"))
    writer.close()
    assert [json.loads(x)["request_id"] for x in path.read_text().splitlines()] == ["b"]
    assert json.loads((tmp_path / "g.jsonl.1").read_text())["request_id"] == "a"


def test_log_writer_concurrent_lines_stay_whole(tmp_path):
    import threading

    writer = GatewayLogWriter(tmp_path / "c.jsonl")
    fp = fingerprint_chat(chat(sys("x" * 5000), user("y")), EST)

    def work(n):
        for i in range(50):
            writer.write(base_record(fp, request_id=f"{n}-{i}", error="e" * 3000))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert len(lines) == 400 and len({json.loads(x)["request_id"] for x in lines}) == 400


# --- the segment cache: identical fingerprints, bounded ---------------------------------------------------

VOLATILE_BITS = [p.example for p in VOLATILE_PATTERNS] + ["", "Ünïcödé ✓ 日本語 🙂", "a\x1fb", '"quoted" \\ \n\t']


def random_chat_body(rnd: random.Random) -> dict:
    """A chat body drawn from a small pool of segments (so segments repeat across bodies, as in production),
    with the shapes the fingerprinter reads: text-part lists, images, tool calls, names, extra system and
    developer messages, documents as dicts/strings/nested values, tools with values that are equal in
    Python but not in JSON (1, 1.0, True)."""

    def text() -> str:
        return " ".join(rnd.choice([SYSTEM, *VOLATILE_BITS, "What now?", "ok"]) for _ in range(rnd.randint(1, 4)))

    def message(role: str) -> dict:
        kind = rnd.randrange(6)
        if kind == 0:
            content = [{"type": "text", "text": text()}, {"type": "text", "text": text()}]
        elif kind == 1:
            content = [{"type": "text", "text": text()}, {"type": "image_url", "image_url": {"url": "data:x"}}]
        elif kind == 2 and role == "assistant":
            call = {"id": "call_9XbQ2kLm", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            return {"role": role, "content": None, "tool_calls": [call]}
        elif kind == 3 and role == "user":
            return {"role": "tool", "tool_call_id": "call_9XbQ2kLm", "content": text()}
        else:
            content = text()
        msg = {"role": role, "content": content}
        if rnd.random() < 0.1:
            msg["name"] = "alice"
        return msg

    messages = []
    if rnd.random() < 0.8:
        messages.append({"role": rnd.choice(["system", "developer"]), "content": rnd.choice(VOLATILE_BITS) + SYSTEM})
        for _ in range(rnd.randint(0, 2)):
            messages.append({"role": "system", "content": text()})
    for i in range(rnd.randint(0, 6)):
        messages.append(message("user" if i % 2 == 0 else "assistant"))
    messages.append(message("user"))
    body = chat(*messages)
    if rnd.random() < 0.5:
        tools = copy.deepcopy(TOOLS)
        tools[0]["function"]["parameters"]["properties"]["order_id"]["default"] = rnd.choice([1, 1.0, True, None])
        if rnd.random() < 0.5:
            tools[0]["function"] = dict(reversed(list(tools[0]["function"].items())))
        body["tools"] = tools
    if rnd.random() < 0.5:
        docs = [*DOCS, "a plain string document", {"title": "Nested", "meta": {"b": [1, 2.5, False], "a": None}}]
        body["documents"] = rnd.sample(docs, rnd.randint(1, len(docs)))
    return body


def random_completion_body(rnd: random.Random) -> dict:
    stable = rnd.choice(VOLATILE_BITS) + SYSTEM
    prompt = rnd.choice([stable + "Q: what now?", ["ab", "", stable], [5, 6, 7], [[1, 2], "x"], ""])
    body = {"model": "tiny", "prompt": prompt}
    if rnd.random() < 0.6:
        body["metadata"] = {"prefix_chars": rnd.choice([len(stable), 3, 0, "7"])}
    return body


def test_cached_fingerprints_are_identical(tokenizer_file):
    """Many requests, fingerprinted through one shared cache (warm, repeated segments), a tiny cache
    (constant eviction) and a budgeted one, against the uncached functions, for both counters."""
    rnd = random.Random(11)
    bodies = [("chat.completions", random_chat_body(rnd)) for _ in range(300)]
    bodies += [("completions", random_completion_body(rnd)) for _ in range(100)]
    for counter in (EST, TokenCounter(tokenizer_file)):
        shared, tiny = SegmentCache(), SegmentCache(max_entries=3, max_bytes=4096)
        for endpoint, body in bodies * 2:
            parsed = json.loads(json.dumps(body))  # as the gateway sees it: parsed afresh per request
            expected = fingerprint_request(body, endpoint, counter)
            assert fingerprint_request(parsed, endpoint, counter, shared) == expected
            assert fingerprint_request(body, endpoint, counter, tiny) == expected
            budgeted = SegmentCache()
            try:
                got = fingerprint_request(parsed, endpoint, counter, budgeted, budget=40)
            except SegmentBudgetExceeded:
                got = fingerprint_request(parsed, endpoint, counter, budgeted)  # resumes from what was cached
            assert got == expected
        assert shared.hits > shared.misses > 0 and tiny.evictions > 0


def test_cache_tells_json_unequal_values_apart():
    """1, 1.0 and True are equal in Python but not in JSON: each keeps its own hashes."""
    cache = SegmentCache()
    variants = []
    for value in (1, 1.0, True):
        tools = copy.deepcopy(TOOLS)
        tools[0]["function"]["parameters"]["default"] = value
        variants.append(chat(sys(), user("q"), tools=tools))
    cached = [fingerprint_chat(b, EST, cache).tools_hash for b in variants * 2]
    assert cached == [fingerprint_chat(b, EST).tools_hash for b in variants * 2]
    assert len(set(cached)) == 3


def test_cache_is_per_counter(tokenizer_file):
    cache = SegmentCache()
    body = chat(sys(), user("q"))
    exact = TokenCounter(tokenizer_file)
    assert fingerprint_chat(body, EST, cache).system_tokens == EST.count(SYSTEM)
    assert fingerprint_chat(body, exact, cache).system_tokens == exact.count(SYSTEM) != EST.count(SYSTEM)


def test_segment_cache_bounds():
    by_entries = SegmentCache(max_entries=5)
    for i in range(20):
        fingerprint_chat(chat(sys(f"{SYSTEM} {i}"), user("q")), EST, by_entries)
    assert len(by_entries) == 5 and by_entries.evictions > 0
    by_bytes = SegmentCache(max_bytes=20_000)
    for i in range(20):
        fingerprint_chat(chat(sys(f"{i} " + "x" * 3000), user("q")), EST, by_bytes)
    assert by_bytes.bytes <= 20_000 and 0 < len(by_bytes) < 20
    assert by_bytes.stats()["bytes"] == by_bytes.bytes
    huge = SegmentCache(max_bytes=20_000)  # a segment over a quarter of the bound is computed, not kept
    assert fingerprint_chat(chat(sys("y" * 10_000)), EST, huge) == fingerprint_chat(chat(sys("y" * 10_000)), EST)
    assert len(huge) == 0


def test_tokenizer_counts_equal_plain_encode(tokenizer_file):
    """The counter's fast batch encode gives exactly `len(encode(text).ids)`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    counter = TokenCounter(tokenizer_file)
    rnd = random.Random(5)
    alphabet = SYSTEM + "".join(VOLATILE_BITS) + "  \n\n\t  ÄÖÜ€𝄞"
    texts = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 400))) for _ in range(300)]
    texts += [SYSTEM * 50, " ", "\n", "🙂" * 30]
    assert [counter.count(t) for t in texts] == [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]


# --- the background log writer ----------------------------------------------------------------------------


def test_background_writer_loses_no_line_under_concurrency_and_rotation(tmp_path):
    import threading

    path = tmp_path / "bg.jsonl"
    writer = BackgroundLogWriter(path, linger_seconds=0.001)
    fp = fingerprint_chat(chat(sys(), user("y")), EST)
    rotated = []
    stop = threading.Event()

    def rotate():
        while not stop.is_set():
            time.sleep(0.01)
            if path.exists():
                target = tmp_path / f"bg.jsonl.{len(rotated)}"
                path.rename(target)
                rotated.append(target)

    def work(n):
        for i in range(400):
            assert writer.submit(base_record(fp, request_id=f"{n}-{i}", error="e" * (i % 7) * 300))
            if i % 5 == 0:
                time.sleep(0.001)  # spread the submissions over several rotations

    rotator = threading.Thread(target=rotate)
    rotator.start()
    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    rotator.join()
    writer.close()
    files = [*rotated, path]
    lines = [line for f in files if f.exists() for line in f.read_text().splitlines()]
    ids = [json.loads(x)["request_id"] for x in lines]  # every line whole JSON
    assert len(ids) == 3200 and len(set(ids)) == 3200
    assert len(rotated) >= 2 and writer.written == 3200 and writer.dropped == 0
    for f in files:
        if f.exists():
            assert f.read_bytes().endswith(b"\n")
    per_file = {f.name: [json.loads(x)["request_id"] for x in f.read_text().splitlines()] for f in files if f.exists()}
    for n in range(8):  # each thread's lines stay in submit order across the files
        seq = [int(r.split("-")[1]) for f in files if f.exists() for r in per_file[f.name] if r.startswith(f"{n}-")]
        assert seq == list(range(400))


def test_background_writer_full_queue_drops_and_counts(tmp_path):
    from prometheus_client import REGISTRY

    def dropped() -> float:
        return REGISTRY.get_sample_value("kvscope_gateway_log_records_dropped_total", {"reason": "queue_full"}) or 0.0

    before = dropped()
    writer = BackgroundLogWriter(tmp_path / "q.jsonl", max_queue=10, linger_seconds=0.5)
    fp = fingerprint_chat(chat(user("x")), EST)
    accepted = [writer.submit(base_record(fp, request_id=str(i))) for i in range(30)]
    assert accepted.count(True) == 10 and accepted[:10] == [True] * 10
    assert dropped() - before == 20 and writer.dropped == 20
    with pytest.raises(ValueError, match="prompt_tokens"):
        writer.submit({k: v for k, v in base_record(fp).items() if k != "prompt_tokens"})
    assert writer.flush(5)
    assert [json.loads(x)["request_id"] for x in (tmp_path / "q.jsonl").read_text().splitlines()] == [
        str(i) for i in range(10)
    ]
    writer.submit(base_record(fp, request_id="queued"))
    writer.close()  # flushes what is queued
    writer.submit(base_record(fp, request_id="late"))  # after close: written synchronously
    writer.close()
    ids = [json.loads(x)["request_id"] for x in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert ids == [*(str(i) for i in range(10)), "queued", "late"]
    assert writer.written == 11  # the late line was written by the caller


def test_background_writer_writes_batches_of_whole_lines(tmp_path):
    """A burst becomes few write(2) calls, each of whole lines."""
    import os

    writes = []
    real_write = os.write

    path = tmp_path / "b.jsonl"
    writer = BackgroundLogWriter(path, linger_seconds=0.2)
    fp = fingerprint_chat(chat(user("x")), EST)

    def spy(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    os.write = spy
    try:
        for i in range(100):
            writer.submit(base_record(fp, request_id=str(i)))
        writer.close()
    finally:
        os.write = real_write
    assert len(writes) < 10 and all(w.endswith(b"\n") for w in writes)
    assert len(path.read_text().splitlines()) == 100


def test_a_cache_salt_salts_the_keys_attribution_and_routing_find_predecessors_on() -> None:
    """vLLM's ``cache_salt`` keys the prompt's first KV block, so a request under another salt can reuse nothing:
    the fingerprint (and the next turn's parent fingerprint), the variant hashes and the system prompt's line
    structure differ between salts and equal within one; the raw segment hashes (compared with the previous
    turn whatever its salt) do not change; the salt itself appears nowhere in the fields."""
    system = {"role": "system", "content": SYSTEM + "\nLine two of the policy.\nLine three."}
    turn_1 = {"model": "m", "messages": [system, {"role": "user", "content": "where is my order?"}],
              "tools": TOOLS, "documents": [{"title": "t", "text": "refunds take 5 days"}]}
    turn_2 = {**turn_1, "messages": [*turn_1["messages"], {"role": "assistant", "content": "which one?"},
                                     {"role": "user", "content": "order 42"}]}
    secret = "user-7-s3cr3t"

    def fp(body: dict, salt: str | None) -> PromptFingerprint:
        return fingerprint_request(body if salt is None else {**body, "cache_salt": salt}, "chat.completions", EST)

    plain, a, a_again, b = fp(turn_1, None), fp(turn_1, secret), fp(turn_1, secret), fp(turn_1, "other")
    assert plain.cache_salt_hash == "" and a.cache_salt_hash == hash_parts("cache_salt", secret) != b.cache_salt_hash
    assert a == a_again
    keys = ("prompt_fingerprint", "system_norm_hash", "tools_canonical_hash", "retrieval_set_hash")
    for key in keys:
        assert len({getattr(plain, key), getattr(a, key), getattr(b, key)}) == 3, key
    assert len(plain.system_line_hashes) == 3
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain.system_line_hashes, a.system_line_hashes,
                                                      b.system_line_hashes, strict=True))
    raw = ("system_hash", "tools_hash", "retrieval_pack_hash", "history_prefix_hash", "suffix_hash")
    assert {k: getattr(a, k) for k in raw} == {k: getattr(plain, k) for k in raw}
    assert fp(turn_2, secret).parent_fingerprint == a.prompt_fingerprint  # routing keeps the conversation's pod
    assert fp(turn_2, "other").parent_fingerprint != a.prompt_fingerprint
    assert fp(turn_2, None).parent_fingerprint == plain.prompt_fingerprint
    fields = a.to_log_fields()
    assert fields["cache_salt_hash"] == a.cache_salt_hash and secret not in json.dumps(fields)
    decode_record(json.dumps({"log_version": 1, "request_id": "r", "ts": "2026-11-29T12:00:00.000Z",
                              "tenant_id": "", "status": 200, "prompt_tokens": 9, "cached_tokens": 0,
                              "ttft_ms": 1.0, "e2e_ms": 2.0, **fields}).encode())
    completion = {"model": "m", "prompt": SYSTEM + " tell me", "metadata": {"prefix_chars": len(SYSTEM)}}
    c_plain, c_salted = (fingerprint_request(completion | extra, "completions", EST)
                         for extra in ({}, {"cache_salt": secret}))
    assert c_plain.prompt_fingerprint != c_salted.prompt_fingerprint != ""
    assert c_salted.cache_salt_hash == a.cache_salt_hash
    for not_a_salt in ("", 7):  # vLLM refuses all but a non-empty string: neither salts the fingerprint
        assert fingerprint_request({**turn_1, "cache_salt": not_a_salt}, "chat.completions", EST) == plain


def test_engine_requests_are_n_times_the_prompts() -> None:
    """gateway.fingerprint.engine_requests: how many engine requests vLLM runs for a body (above 1, the cached count
    is not the prompt's and is logged null)."""
    from gateway.fingerprint import engine_requests

    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert engine_requests(chat_body, "chat.completions") == 1
    assert engine_requests({**chat_body, "n": 1}, "chat.completions") == 1
    assert engine_requests({**chat_body, "n": None}, "chat.completions") == 1
    assert engine_requests({**chat_body, "n": 2}, "chat.completions") == 2
    assert engine_requests({**chat_body, "n": "3"}, "chat.completions") == 3  # pydantic's lax int
    assert engine_requests({**chat_body, "n": "x"}, "chat.completions") == 1  # vLLM refuses it anyway
    assert engine_requests({**chat_body, "n": 0}, "chat.completions") == 1
    assert engine_requests({"prompt": "one"}, "completions") == 1
    assert engine_requests({"prompt": [1, 2, 3]}, "completions") == 1  # one prompt of token ids
    assert engine_requests({"prompt": ["one"]}, "completions") == 1
    assert engine_requests({"prompt": []}, "completions") == 1
    assert engine_requests({"prompt": ["one", "two"]}, "completions") == 2
    assert engine_requests({"prompt": [[1, 2], [3, 4], [5]]}, "completions") == 3
    assert engine_requests({"prompt": ["one", "two"], "n": 2}, "completions") == 4
    assert engine_requests({"prompt": ["one", "two"]}, "chat.completions") == 1  # chat reads messages
    # more than the log contract holds (found by a review: the line was refused, the request lost): its cap
    assert engine_requests({"prompt": ["p"] * 300, "n": 300}, "completions") == 65535
    assert engine_requests({**chat_body, "n": 70_000}, "chat.completions") == 65535
    line = {"log_version": 1, "request_id": "r", "ts": "2026-11-29T12:00:00.000Z", "tenant_id": "", "status": 200,
            "prompt_tokens": 9, "cached_tokens": None, "ttft_ms": 1.0, "e2e_ms": 2.0}
    assert decode_record(json.dumps({**line, "engine_requests": 65535}).encode()).engine_requests == 65535
    for refused in (0, 65536, -1, "2", True):
        with pytest.raises(BadRecord):
            decode_record(json.dumps({**line, "engine_requests": refused}).encode())
