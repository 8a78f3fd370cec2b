"""``/v1/completions`` prompts with a shared head and a new tail: a few-shot eval harness or text classifier (the
same examples, another input), a code-completion client (the file up to the cursor). Found by a hostile review: a
completions prompt had no structure (no content-defined chunks), so it found a predecessor only when the whole
prompt repeated; the same preamble with another tail on another pod read every token ``unavoidable``. A single
string prompt now carries the chunks a chat's final message carries (gateway/fingerprint.py ``completion``), so key
19 (its first chunk) finds the request that held the preamble and the common chunks are the shared prefix. Every
row is fingerprinted from a real body by the reference gateway and judged by the reference and by the store job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from gateway.fingerprint import TokenCounter, content_chunks, fingerprint_request
from tests.clock import T0
from tests.test_conversation_threads import B, full, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference

SHOTS = "".join(f"Review: the product number {i} was {'great' if i % 2 else 'awful'} and I would "
                f"{'buy it again' if i % 2 else 'never buy it'}.\nSentiment: {'positive' if i % 2 else 'negative'}\n\n"
                for i in range(12))
CODE = "".join(f"def handler_{i}(event, context):\n    return process(event['records'][{i}], retries={i})\n\n"
               for i in range(20))


def crow(rid: str, prompt: Any, *, at: float, pod: str = "pod-a", cached: int | None = 0,
         **body: Any) -> dict[str, Any]:
    """A gateway_requests row for a /v1/completions body, as the reference gateway logs it (prompt tokens: the
    segments' plus one BOS token)."""
    fp = fingerprint_request({"model": "tiny", "prompt": prompt, **body}, "completions", TokenCounter()).to_log_fields()
    del fp["token_count_method"]
    prompt_tokens = sum(fp[k] for k in ("system_tokens", "tools_tokens", "retrieval_tokens", "history_tokens",
                                        "suffix_tokens")) + 1
    return {"request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": "acme", "conversation_id": "",
            "agent_run_id": "", "model": "tiny", "pod": pod, "status": 200, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "e2e_ms": 3000.0, "pods_down": [], "continue_final_message": False,
            "skip_reading_prefix_cache": False, **fp}


def few_shot(pod: str = "pod-b") -> list[dict[str, Any]]:
    return [crow("r1", SHOTS + "Review: arrived broken, support never answered.\nSentiment:", at=0),
            crow("r2", SHOTS + "Review: works as described, fast shipping.\nSentiment:", at=5, pod=pod)]


def code_completion() -> list[dict[str, Any]]:
    return [crow("r1", CODE + "def handler_20(event, con", at=0),
            crow("r2", CODE + "def handler_20(event, context):\n    ret", at=1, pod="pod-b")]


def test_a_string_prompt_carries_its_chunks() -> None:
    """The chunks of the prompt's text, the same as a chat message of that text gets; none for token ids or a
    batch of prompts (no one text to cut)."""
    r = few_shot()[0]
    assert len(r["suffix_chunk_hashes"]) == len(content_chunks(SHOTS + "Review: x")) > 1
    assert abs(sum(r["suffix_chunk_tokens"]) - r["suffix_tokens"]) <= len(r["suffix_chunk_tokens"])  # rounding
    assert crow("t", [1, 2, 3] * 30, at=0)["suffix_chunk_hashes"] == []
    assert crow("b", [SHOTS + "a", SHOTS + "b"], at=0)["suffix_chunk_hashes"] == []


@pytest.mark.parametrize(("pod", "cause"), [("pod-b", ("routed_away", "")),
                                            ("pod-a", ("evicted", ""))])
def test_the_same_examples_with_another_input_share_the_examples(pod: str, cause: tuple[str, str]) -> None:
    """r2 keeps r1's twelve examples and brings another review, nothing cached: the examples' full blocks were
    r1's (on the other pod, or on this one and gone). Before: no predecessor, all unavoidable."""
    rows = few_shot(pod)
    got = verdicts(*rows)["r2"]
    shared = sum(rows[1]["suffix_chunk_tokens"][:-1])  # every chunk but the new review's
    assert got["pred"] == "r1"
    assert got["causes"][cause] == full(shared), got
    assert set(got["causes"]) == {cause, ("unavoidable", "")}
    assert sum(got["causes"].values()) == rows[1]["prompt_tokens"]


def test_a_code_completion_two_keystrokes_later_shares_the_file_head() -> None:
    rows = code_completion()
    got = verdicts(*rows)["r2"]
    assert got["pred"] == "r1"
    assert got["causes"][("routed_away", "")] >= full(len(CODE) // 4) - B, got


def test_a_hit_on_the_examples_leaves_only_the_new_input() -> None:
    """Negative control: the same pod hit the examples' blocks: nothing avoidable was missed."""
    rows = few_shot("pod-a")
    rows[1]["cached_tokens"] = full(sum(rows[1]["suffix_chunk_tokens"][:-1]))
    assert set(verdicts(*rows)["r2"]["causes"]) == {("unavoidable", "")}


def test_another_preamble_is_no_predecessor() -> None:
    """Negative control: another harness's examples (another first chunk) never find r1."""
    other = "".join(f"Question: what is {i} plus {i}?\nAnswer: {2 * i}, since adding a number to itself doubles it.\n\n"
                    for i in range(12))
    rows = [few_shot()[0], crow("r2", other + "Question: what is 7 plus 7?\nAnswer:", at=5, pod="pod-b")]
    assert verdicts(*rows)["r2"]["pred"] == ""


def test_the_store_job_answers_as_the_reference(store) -> None:  # type: ignore[no-untyped-def]
    rows = [{**r, "request_id": f"{k}-{r['request_id']}"} for k, rs in (("shots", few_shot()),
                                                                        ("code", code_completion())) for r in rs]
    assert_store_answers_as_reference(store, rows, 1)
