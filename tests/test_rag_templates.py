"""Retrieved documents inside the user message as popular templates frame them (found by a hostile review: each read
``unavoidable`` where the documents were reordered, replaced or reusable). The chunks of the final message
(gateway/fingerprint.py ``content_chunks``) ended only at a paragraph break after 64 characters, so a short header
("Context:") was glued to the first document, LlamaIndex's rule lines glued its header to the first node and the
last node to the query, and ``<document>`` blocks joined by single newlines were one chunk. Every row is
fingerprinted from a real chat body by the reference gateway and judged by the reference and by the store job.
Documents numbered by rank (``[2] …``, ``<document index="2">``) are renumbered by a reorder: a chunk's hash leaves
the digits of such a leading marker out (gateway/fingerprint.py ``chunk_key``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.fingerprint import content_chunks
from tests.test_conversation_threads import B, row, u, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference

SYS = {"role": "system", "content": "You are the documentation assistant of Acme Cloud. Answer only from the "
                                    "context; cite documents by number; say so when the context lacks the answer."}
DOCS = {name: " ".join(f"{name} sentence {i}: the {name.lower()} service stores objects with replication factor {i}."
                       for i in range(6)) for name in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon")}


def header(names: list[str], q: str, head: str = "Context:") -> str:
    return f"{head}\n\n" + "\n\n".join(DOCS[n] for n in names) + f"\n\nQuestion: {q}"


def llamaindex(names: list[str], q: str) -> str:
    """LlamaIndex's default text-QA template (nodes joined by blank lines, rules around the context)."""
    return ("Context information is below.\n---------------------\n" + "\n\n".join(DOCS[n] for n in names)
            + "\n---------------------\nGiven the context information and not prior knowledge, answer the query.\n"
            f"Query: {q}\nAnswer: ")


def xml(names: list[str], q: str) -> str:
    """Documents in XML tags joined by single newlines (as Anthropic's long-context guidance lays them out)."""
    return ("<documents>\n" + "\n".join(f"<document>\n<source>{n.lower()}.md</source>\n{DOCS[n]}\n</document>"
                                        for n in names) + f"\n</documents>\n\n{q}")


def xml_indexed(names: list[str], q: str) -> str:
    """The same with each document's rank as an attribute (``<document index="2">``): a reorder renumbers them."""
    return ("<documents>\n" + "\n".join(f"<document index=\"{i + 1}\">\n<source>{n.lower()}.md</source>\n"
                                        f"<document_content>\n{DOCS[n]}\n</document_content>\n</document>"
                                        for i, n in enumerate(names)) + f"\n</documents>\n\n{q}")


def numbered(names: list[str], q: str) -> str:
    """Citations numbered by rank ("[1] …"): a reorder renumbers every document."""
    return ("Answer using the sources below and cite them as [n].\n\n"
            + "\n\n".join(f"[{i + 1}] {DOCS[n]}" for i, n in enumerate(names)) + f"\n\nQuestion: {q}")


def titled(names: list[str], q: str) -> str:
    """Each document under a short title paragraph, no header (the demo's wayne tenant): the first document's title
    stays with its body, as every other's does, so a reorder moves whole chunks."""
    return "\n\n".join(f"{n} guide\n\n{DOCS[n]}" for n in names) + f"\n\n{q}"


def fenced(names: list[str], q: str) -> str:
    return "Answer using the files below.\n\n" + "\n\n".join(f"```{n.lower()}.md\n{DOCS[n]}\n```" for n in names) \
        + f"\n\n{q}"


TEMPLATES: dict[str, Callable[[list[str], str], str]] = {
    "short header": header, "longer short header": lambda n, q: header(n, q, "Here are the relevant documents:"),
    "llamaindex": llamaindex, "xml": xml, "xml indexed": xml_indexed, "numbered": numbered, "fenced": fenced,
    "titled": titled}
Q1, Q2 = "How is Beta replicated?", "What about Gamma, then?"


def pair(template: str, first: list[str], then: list[str], q2: str = Q1) -> list[dict[str, Any]]:
    """r1 on pod-a, then r2 (``then`` documents, question ``q2``) on pod-b with nothing cached."""
    f = TEMPLATES[template]
    return [row("r1", [SYS, u(f(["Alpha", "Beta", "Gamma", "Delta"] if not first else first, Q1))], at=0),
            row("r2", [SYS, u(f(then, q2))], at=5, pod="pod-b", cached=0)]


def reordered(template: str) -> list[dict[str, Any]]:
    return pair(template, [], ["Beta", "Alpha", "Delta", "Gamma"], Q2)


def replaced(template: str) -> list[dict[str, Any]]:
    return pair(template, [], ["Alpha", "Epsilon", "Gamma", "Delta"])


def other_question(template: str) -> list[dict[str, Any]]:
    return pair(template, [], ["Alpha", "Beta", "Gamma", "Delta"], Q2)


def causes(rows: list[dict[str, Any]]) -> dict[tuple[str, str], int]:
    return verdicts(*rows)["r2"]["causes"]


def drift(rows: list[dict[str, Any]], sub: str) -> int:
    return causes(rows).get(("prefix_drift", sub), 0)


def doc_tokens(rows: list[dict[str, Any]]) -> int:
    """Tokens of r2's documents, by its chunks: all but the first (the header) and the last (the question)."""
    return sum(rows[1]["suffix_chunk_tokens"][1:-1])


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_documents_are_chunks_of_their_own(template: str) -> None:
    """Each document is a chunk of its own (with its tags or fence), and the chunks are the message's text."""
    text = TEMPLATES[template](["Alpha", "Beta", "Gamma"], Q1)
    chunks = content_chunks(text)
    assert "".join(chunks) == text
    for name in ("Alpha", "Beta", "Gamma"):
        holding = [c for c in chunks if DOCS[name] in c]
        assert len(holding) == 1 and not any(DOCS[o] in holding[0] for o in DOCS if o != name), (name, chunks)
        assert Q1 not in holding[0] and not holding[0].startswith(("Context", "Here", "Answer using")), holding


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_reordered_documents_read_rag_reordered(template: str) -> None:
    """Before: r2 all ``unavoidable`` past the system prompt (the reorder moved the chunk glued to the header)."""
    rows = reordered(template)
    assert drift(rows, "rag_reordered") >= doc_tokens(rows) - B, causes(rows)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_one_replaced_document_reads_rag_changed_after_the_shared_one(template: str) -> None:
    """Alpha stayed first: it is shared (routed_away: r1 is on pod-a); from Epsilon on, rag_changed."""
    rows = replaced(template)
    got = causes(rows)
    alpha = rows[1]["suffix_chunk_tokens"][1]
    assert got[("routed_away", "")] >= 32 + alpha - B and drift(rows, "rag_changed") > 0, got


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_same_documents_with_another_question_are_reusable(template: str) -> None:
    """Everything before the question was r1's: routed_away up to the question, no drift. Before, LlamaIndex's last
    node (glued to the query) and the XML documents (one chunk with the question's framing) read unavoidable."""
    rows = other_question(template)
    got = causes(rows)
    before_question = rows[1]["system_tokens"] + sum(rows[1]["suffix_chunk_tokens"][:-1])
    assert not any(c == "prefix_drift" for c, _ in got), got
    assert got[("routed_away", "")] >= before_question - 2 * B, (got, before_question)


@pytest.mark.parametrize("runs", [1, 2])
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_store_job_answers_as_the_reference(store, template, runs):  # type: ignore[no-untyped-def]
    rows = [{**r, "request_id": f"{kind.__name__}-{r['request_id']}", "tenant_id": kind.__name__}
            for kind in (reordered, replaced, other_question) for r in kind(template)]
    assert_store_answers_as_reference(store, rows, runs)
