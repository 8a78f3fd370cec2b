"""The gateway's structural fields (gateway/fingerprint.py): per-line hashes and tokens of the system prompt, and
content-defined chunks of the final message, as logged and as the collector and ingest read them. Token counts
use the estimate counter (ceil(characters / 4)), so every expected count below is derived by hand."""

from __future__ import annotations

import json

from collector.events import GatewayRequest
from collector.gateway_record import decode_record
from gateway.fingerprint import (
    MAX_SUFFIX_CHUNKS,
    MAX_SYSTEM_LINES,
    SegmentCache,
    TokenCounter,
    content_chunks,
    fingerprint_chat,
    fingerprint_completion,
    hash_parts,
    message_chunks,
    system_lines,
)
from ingest.rows import COLUMNS, gateway_row

EST = TokenCounter()
DOC_A = "Doc A: the warranty covers parts and labour for two years after purchase."  # 74 chars
DOC_B = "Doc B: returns are accepted within thirty days when the item is unused and boxed."  # 81
DOC_C = "Doc C: support answers on weekdays between nine and five, central European time."  # 80


def chat(system: str, user: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_system_lines_are_hashed_and_counted_one_by_one():
    lines = ["You are the support agent of Acme.", "trace: 7f3a91c2e0b4", "Answer briefly."]
    fp = fingerprint_chat(chat("\n".join(lines), "hi"), EST, SegmentCache())
    assert fp.system_line_hashes == tuple(hash_parts(x) for x in lines)
    assert fp.system_line_tokens == (9, 5, 4)  # 34, 19 and 15 characters
    other = fingerprint_chat(chat("\n".join([lines[0], "trace: 0b4e2c19a37f", lines[2]]), "hi"), EST)
    # the regex masks miss this form: every whole-prompt hash differs, two of three line hashes stay equal
    assert (other.system_hash != fp.system_hash, other.system_norm_hash != fp.system_norm_hash) == (True, True)
    assert [x == y for x, y in zip(other.system_line_hashes, fp.system_line_hashes, strict=True)] == [
        True, False, True]


def test_a_long_system_prompt_keeps_at_most_the_cap_of_lines():
    """Up to the cap a line an entry; beyond it g consecutive lines an entry, g the smallest power of two that keeps
    the entries within the cap (the last group shorter)."""
    exact = "\n".join(f"rule {i}" for i in range(MAX_SYSTEM_LINES))
    assert fingerprint_chat(chat(exact, "hi"), EST).system_line_hashes == tuple(
        hash_parts(f"rule {i}") for i in range(MAX_SYSTEM_LINES))
    rules = [f"rule {i}" for i in range(MAX_SYSTEM_LINES + 10)]  # 266 lines: groups of 2, 133 entries
    fp = fingerprint_chat(chat("\n".join(rules), "hi"), EST)
    assert len(fp.system_line_hashes) == len(fp.system_line_tokens) == 133
    assert fp.system_line_hashes == tuple(hash_parts(f"{rules[i]}\n{rules[i + 1]}") for i in range(0, 266, 2))
    assert fp.system_line_tokens[:6] == (4, 4, 4, 4, 4, 4)  # "rule 0\nrule 1": 13 characters
    for n, size in ((MAX_SYSTEM_LINES + 1, 2), (512, 2), (513, 4), (1024, 4), (1025, 8), (10_000, 64)):
        got = system_lines("\n".join(f"rule {i}" for i in range(n)))
        assert len(got) == -(-n // size) <= MAX_SYSTEM_LINES and got[0] == "\n".join(f"rule {i}" for i in range(size))
        assert "\n".join(got).count("\n") == n - 1, n
    # a prompt that grows keeps its entries while the group size stays: 600 → 700 lines, groups of 4
    grown = system_lines("\n".join(f"rule {i}" for i in range(700)))
    assert grown[:150] == system_lines("\n".join(f"rule {i}" for i in range(600)))


def agent_prompt(env: list[str], *, rules: int = 396, at: int | None = None, line: str = "") -> str:
    """A coding agent's system prompt: ``rules`` short rule lines (line ``at`` replaced by ``line``), then ``env``."""
    body = [f"- Rule {i}: keep the existing style of files of kind {i % 9} and run the linter." for i in range(rules)]
    if at is not None:
        body[at] = line
    return "\n".join(body + env)


def changed_entries(a: str, b: str) -> list[int]:
    x, y = fingerprint_chat(chat(a, "hi"), EST), fingerprint_chat(chat(b, "hi"), EST)
    assert len(x.system_line_hashes) == len(y.system_line_hashes)
    return [i for i, (p, q) in enumerate(zip(x.system_line_hashes, y.system_line_hashes, strict=True)) if p != q]


def test_a_changed_line_beyond_the_cap_changes_only_its_own_group():
    """A 400-line prompt (groups of 2, 200 entries): an environment block at the end, or one volatile line anywhere,
    changes the entries of its own lines only (before: every line from the 256th on was one entry, so a change
    anywhere there changed entry 255 and was placed at line 256); the same prompt gives the same entries."""
    alice = ["Working directory: /home/alice/src/shop", "Git branch: main", "Platform: linux", "Date: 2026-12-07"]
    bob = ["Working directory: /home/bob/src/shop", "Git branch: feature/tax", "Platform: linux", "Date: 2026-12-08"]
    assert changed_entries(agent_prompt(alice), agent_prompt(bob)) == [198, 199]
    assert changed_entries(agent_prompt(alice), agent_prompt(alice)) == []
    one = agent_prompt(alice, at=301, line="Session trace: 7f3a91c2e0b4")
    other = agent_prompt(alice, at=301, line="Session trace: 0b4e2c19a37f")
    assert changed_entries(one, other) == [150]
    assert fingerprint_chat(chat(one, "hi"), EST).system_line_hashes[150] == hash_parts(
        "- Rule 300: keep the existing style of files of kind 3 and run the linter.\nSession trace: 7f3a91c2e0b4")


def test_documents_in_the_user_message_become_chunks_whatever_their_order():
    question = "Which of these applies to my order?"
    fp1 = fingerprint_chat(chat("S", f"{DOC_A}\n\n{DOC_B}\n\n{DOC_C}\n\n{question}"), EST)
    fp2 = fingerprint_chat(chat("S", f"{DOC_C}\n\n{DOC_A}\n\n{DOC_B}\n\n{question}"), EST)
    assert fp1.suffix_chunk_hashes == tuple(hash_parts(x) for x in (DOC_A, DOC_B, DOC_C, question))
    assert sorted(fp1.suffix_chunk_hashes) == sorted(fp2.suffix_chunk_hashes)
    assert fp1.suffix_hash != fp2.suffix_hash
    # each chunk keeps its "\n\n": 76, 83, 82 characters, then the 35-character question
    assert fp1.suffix_chunk_tokens == (19, 21, 21, 9)


def test_a_chunk_boundary_does_not_move_when_text_before_it_changes():
    """A short title paragraph (< 64 characters) joins the document after it; editing an earlier document (or
    adding text in front) leaves every later chunk, and so its hash, as it was."""
    tail = f"Title\n\n{DOC_B}\n\n{DOC_C}"
    base = content_chunks(f"{DOC_A}\n\n{tail}")
    preface = "A preface paragraph that is new, long enough to end a chunk of its own."
    edited = content_chunks(f"{DOC_A} Extra words changed here.\n\n{preface}\n\n{tail}")
    assert base == [f"{DOC_A}\n\n", f"Title\n\n{DOC_B}\n\n", DOC_C]
    assert edited[-2:] == base[-2:]
    assert edited[:2] == [f"{DOC_A} Extra words changed here.\n\n", f"{preface}\n\n"]


def test_long_paragraphs_are_cut_and_chunks_are_capped():
    para = ("x" * 70 + "\n") * 60  # one paragraph of 4,260 characters: cut at its lines (> 4,096 characters)
    assert content_chunks(para) == ["x" * 70 + "\n"] * 60
    paragraphs = [f"paragraph {i} " + "y" * 64 for i in range(MAX_SUFFIX_CHUNKS + 5)]
    many = "\n\n".join(paragraphs)
    chunks = content_chunks(many)
    assert len(chunks) == MAX_SUFFIX_CHUNKS and "".join(chunks) == many
    # the final chunk stays its own; the one before it holds paragraphs 62 .. 67
    assert chunks[-1] == paragraphs[-1] and chunks[-2] == "\n\n".join(paragraphs[62:-1]) + "\n\n"
    assert chunks[:62] == [p + "\n\n" for p in paragraphs[:62]]
    assert content_chunks("") == []


def test_a_long_document_asked_again_keeps_every_chunk_but_the_question():
    """A document of 160 paragraphs with a question after it, asked again with another question: only the last
    chunk differs (before: the 64th chunk held the rest of the document and the question, so it differed too and
    60% of the document could not be placed); each chunk's tokens are its own text's, as for an uncapped message."""
    doc = "\n\n".join(f"Clause {i}. The supplier shall deliver lot {i} within {i + 3} business days of the order."
                       for i in range(160))
    one = fingerprint_chat(chat("S", f"{doc}\n\nWhat is the credit for a late lot 12?"), EST)
    two = fingerprint_chat(chat("S", f"{doc}\n\nWhich lots have the longest delivery time?"), EST)
    assert len(one.suffix_chunk_hashes) == len(two.suffix_chunk_hashes) == MAX_SUFFIX_CHUNKS
    assert one.suffix_chunk_hashes[:-1] == two.suffix_chunk_hashes[:-1]
    assert one.suffix_chunk_hashes[-1] == hash_parts("What is the credit for a late lot 12?")
    assert two.suffix_chunk_tokens[-1] == 11  # 42 characters
    assert two.suffix_chunk_tokens == tuple(EST.count(c) for c in content_chunks(
        f"{doc}\n\nWhich lots have the longest delivery time?"))
    # parts (one per page) are capped the same way: the final part's last chunk stays its own
    pages = [{"type": "text", "text": p} for p in doc.split("\n\n")] + [{"type": "text", "text": "Which lot is last?"}]
    parts = message_chunks({"role": "user", "content": pages})
    assert len(parts) == MAX_SUFFIX_CHUNKS and parts[-1] == "Which lot is last?"
    assert "".join(parts) == "\n".join(p["text"] for p in pages)


def test_completions_log_the_lines_of_their_stable_prefix():
    fp = fingerprint_completion({"prompt": "Rule one.\nRule two.\nQ?", "metadata": {"prefix_chars": 20}}, EST)
    assert fp.system_line_hashes == (hash_parts("Rule one."), hash_parts("Rule two."), hash_parts(""))
    assert fp.system_line_tokens == (3, 3, 0)
    assert fp.suffix_chunk_hashes == (hash_parts("Q?"),)  # the prompt after its stable prefix, chunked as a message


def test_the_fields_travel_through_the_log_line_to_the_row():
    fp = fingerprint_chat(chat("a\nb\nc", f"{DOC_A}\n\nQ?"), EST)
    line = {"log_version": 1, "request_id": "r1", "ts": "2026-11-29T12:00:00.000Z", "tenant_id": "acme",
            "status": 200, "prompt_tokens": 40, "cached_tokens": 0, "ttft_ms": 1.0, "e2e_ms": 2.0,
            **fp.to_log_fields()}
    rec = decode_record(json.dumps(line))
    assert rec.system_line_hashes == fp.system_line_hashes and rec.suffix_chunk_tokens == (19, 1)
    stored = dict(zip(COLUMNS["gateway_requests"], gateway_row(None, GatewayRequest(record=line)), strict=True))
    assert stored["system_line_hashes"] == [int(x, 16) for x in fp.system_line_hashes]
    assert stored["suffix_chunk_tokens"] == [19, 1]


def test_each_text_part_of_a_message_is_a_chunk_boundary():
    """Found on real pods by a hostile hunt: a client that sends each retrieved document as its own text part (vLLM
    joins the parts with one "\\n", no paragraph break) had one chunk for all of them, so documents reordered between
    parts read `unavoidable`. Each part now ends a chunk; the chunks still concatenate back to the message's text."""
    from gateway.fingerprint import message_text

    question = "Which of these applies to my order?"
    one = {"role": "user", "content": [{"type": "text", "text": d} for d in (DOC_A, DOC_B, DOC_C, question)]}
    other = {"role": "user", "content": [{"type": "text", "text": d} for d in (DOC_A, DOC_C, DOC_B, question)]}
    assert "".join(message_chunks(one)) == message_text(one) == "\n".join((DOC_A, DOC_B, DOC_C, question))
    fp1 = fingerprint_chat({"messages": [{"role": "system", "content": "S"}, one]}, EST)
    fp2 = fingerprint_chat({"messages": [{"role": "system", "content": "S"}, other]}, EST)
    assert fp1.suffix_chunk_hashes == tuple(hash_parts(x) for x in (DOC_A, DOC_B, DOC_C, question))
    assert sorted(fp1.suffix_chunk_hashes) == sorted(fp2.suffix_chunk_hashes) and fp1.suffix_hash != fp2.suffix_hash
    calls = {**one, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert "".join(message_chunks(calls)) == message_text(calls)
    single = {"role": "user", "content": [{"type": "text", "text": f"{DOC_A}\n\n{DOC_B}"}]}
    assert message_chunks(single) == content_chunks(f"{DOC_A}\n\n{DOC_B}")


def test_frame_lines_cut_chunks_that_still_concatenate_back_to_the_text():
    """Rule lines and tag lines alone end chunks (LlamaIndex's "-----" around its context, ``<document>`` blocks
    joined by single newlines); random mixes of such lines, prose, blank lines and tags inside prose always give
    chunks that concatenate back to the text, none of them whitespace alone but the last (what follows the last
    paragraph break)."""
    import random

    rng = random.Random(7)
    kinds = ["---", "=====", "<document index=\"3\">", "</document>", "  <doc>", "</doc>  ", "", "", "x < y > z",
             "<b>bold</b> inline", DOC_A, "short line", "### Heading", "***", "- item"]
    for _ in range(300):
        text = "\n".join(rng.choice(kinds) for _ in range(rng.randint(0, 12))) + rng.choice(["", "\n", "\n\n"])
        chunks = content_chunks(text)
        assert "".join(chunks) == text, text
        assert all(c.strip() for c in chunks[:-1]), (text, chunks)
    chunks = content_chunks(f"Context:\n---\n{DOC_A}\n{DOC_B}\n---\nQuery: q")
    assert chunks == ["Context:\n", "---\n", f"{DOC_A}\n{DOC_B}\n", "---\n", "Query: q"]
    tagged = content_chunks(f"<docs>\n<doc>\n{DOC_A}\n</doc>\n<doc>\n{DOC_B}\n</doc>\n</docs>")
    assert tagged == ["<docs>\n", f"<doc>\n{DOC_A}\n</doc>\n", f"<doc>\n{DOC_B}\n</doc>\n", "</docs>"]
