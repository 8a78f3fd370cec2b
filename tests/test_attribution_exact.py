"""Each miss cause alone in a minimal scenario, with its exact expected token counts at the pod's block size
(docs/miss-causes.md), then the cases where two causes share one request (split by position), prompts
shorter than one block at large block sizes, and predecessors beyond the horizon.

Segment token counts here sum to prompt_tokens, so segment boundaries are exact (no scaling) and every
count below follows from the block size by hand: L = floor((P − 1)/B)·B is the most vLLM can hit."""

from __future__ import annotations

from typing import Any

import pytest
from test_attribution import req, split

from ingest import attribution as a

B = 64
SIZES = {"pod-a": B, "pod-b": B}
HOUR = 3600.0


def causes_of(*requests: dict[str, Any], rid: str = "r2", sizes: dict[str, int] | None = None,
              **kw: Any) -> list[tuple[str, str, int]]:
    rows = a.attribute(list(requests), block_size_by_pod=sizes or SIZES, **kw)
    return split(rows, rid)


def base(rid: str, **kw: Any) -> dict[str, Any]:
    """A 340-token prompt: a 300-token system prompt and a 40-token question (L = 320 at B = 64)."""
    args: dict[str, Any] = dict(system="Policy", system_tokens=300, prompt=340, suffix=f"q-{rid}", suffix_tokens=40)
    args.update(kw)
    return req(rid, **args)


def next_turn(rid: str, **kw: Any) -> dict[str, Any]:
    """The next turn of conversation c1 after ``base("r1", conv="c1")``: its question and reply (60 tokens) are
    now history, then a new 40-token question: 400 tokens, 340 of them turn 1's whole prompt."""
    args: dict[str, Any] = dict(conv="c1", prompt=400, history="q-r1|reply", prev_history="",
                                history_tokens=60)
    args.update(kw)
    return base(rid, **args)


# -- each cause alone ------------------------------------------------------------------------------------------
def test_cold_alone():
    # no predecessor: the stable prefix's full blocks (256 of 300) are cold; the rest of the prompt is new
    assert causes_of(base("r1"), rid="r1") == [("cold", "", 256), ("unavoidable", "", 84)]


def test_a_full_hit_leaves_only_the_unavoidable_tail():
    # hit L = 320: the last partial block (19 tokens) and the last token stay missed
    assert causes_of(base("r1"), base("r2", at=5, suffix="q-r1", cached=320)) == [("unavoidable", "", 20)]


def test_routed_away_alone():
    assert causes_of(base("r1"), base("r2", at=5, pod="pod-b")) == [("routed_away", "", 256),
                                                                    ("unavoidable", "", 84)]


def test_evicted_alone():
    assert causes_of(base("r1"), base("r2", at=5)) == [("evicted", "", 256), ("unavoidable", "", 84)]


def test_evicted_before_next_turn_alone():
    # turn 1's whole prompt (340) is reusable: 320 in full blocks
    assert causes_of(base("r1", conv="c1"), next_turn("r2", at=30)) == [
        ("evicted", "evicted_before_next_turn", 320), ("unavoidable", "", 80)]


def test_beyond_horizon_alone():
    rows = a.attribute([base("r1"), base("r2", at=2 * HOUR)], block_size_by_pod=SIZES)
    assert split(rows, "r2") == [("beyond_horizon", "", 256), ("unavoidable", "", 84)]
    r2 = [r for r in rows if r.request_id == "r2"][0]
    assert (r2.predecessor_request_id, r2.gap_ms) == ("r1", 2 * HOUR * 1000 - 400)
    verdict = a.judge(base("r2", at=2 * HOUR), a.PredecessorIndex([base("r1")]).find(base("r2", at=2 * HOUR)), B)
    assert verdict.predecessor_kind == "fingerprint_beyond_horizon"


@pytest.mark.parametrize(("system_norm", "sub"), [("Policy <v>", "volatile_system"), (None, "system_changed")])
def test_prefix_drift_in_the_first_segment_alone(system_norm, sub):
    # the change is at token 0: nothing before it is shared, so the drift takes all the reusable blocks
    t1 = base("r1", conv="c1", system="Policy v1", system_norm=system_norm)
    t2 = next_turn("r2", at=5, system="Policy v2", system_norm=system_norm)
    assert causes_of(t1, t2) == [("prefix_drift", sub, 320), ("unavoidable", "", 80)]


def test_prefix_drift_after_a_hit_alone():
    # tools reordered after a 128-token system prompt the pod still held (hit 128): the drift breaks the tools
    kw: dict[str, Any] = dict(system_tokens=128, tools_tokens=172, tools_canonical="tools{lookup}")
    r1 = base("r1", tools='{"a": 1, "b": 2}', **kw)
    r2 = base("r2", at=5, tools='{"b": 2, "a": 1}', cached=128, **kw)
    assert causes_of(r1, r2) == [("prefix_drift", "tools_reordered", 128), ("unavoidable", "", 84)]


def test_below_block_shared_part_alone():
    # 30 shared tokens: less than one block, so nothing of it could be cached
    r1 = base("r1", system_tokens=30, suffix_tokens=310)
    assert causes_of(r1, base("r2", at=5, system_tokens=30, suffix_tokens=310)) == [
        ("below_block", "", 30), ("unavoidable", "", 310)]


def test_unknown_alone():
    assert causes_of(base("r1", cached=330), rid="r1") == [("unknown", "", 10)]  # 330 > L = 320
    no_counts = base("r1", system_tokens=0, suffix_tokens=0)
    assert causes_of(no_counts, rid="r1") == [("unknown", "", 320), ("unavoidable", "", 20)]


def test_not_reported_alone():
    assert causes_of(base("r1"), base("r2", at=5, cached=None)) == [("not_reported", "", 340)]


# -- prompts shorter than one block ----------------------------------------------------------------------------
@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("prompt_of", [lambda b: b - 10, lambda b: b])
def test_a_prompt_shorter_than_one_block_is_below_block_but_its_last_token(block, prompt_of):
    """P − 1 < B: vLLM can never hit any of it (L = 0), whatever came before; the last token is recomputed
    anyway. Without system message or history (the whole prompt is the new message), first or repeated."""
    p = prompt_of(block)
    sizes = {"pod-a": block}
    short = dict(system="", system_tokens=0, prompt=p, suffix="hi", suffix_tokens=p)
    want = [("below_block", "", p - 1), ("unavoidable", "", 1)]
    assert causes_of(req("r1", **short), rid="r1", sizes=sizes) == want
    assert causes_of(req("r1", **short), req("r2", at=1, **short), sizes=sizes) == want
    # with a system prompt and a predecessor on another pod, or without segment counts: the same
    with_system = dict(system="Be brief.", system_tokens=p // 2, prompt=p, suffix_tokens=p - p // 2)
    assert causes_of(req("r1", **with_system), req("r2", at=1, pod="pod-b", **with_system),
                     sizes={"pod-a": block, "pod-b": block}) == want
    assert causes_of(req("r1", system_tokens=0, suffix_tokens=0, prompt=p), rid="r1", sizes=sizes) == want


def test_one_token_more_than_a_block_can_hit_again():
    # P = B + 1: L = B, so the short-prompt rule no longer applies; a new message without a stable prefix is new
    p = B + 1
    assert causes_of(req("r1", system="", system_tokens=0, prompt=p, suffix_tokens=p), rid="r1") == [
        ("unavoidable", "", p)]


def test_a_cached_count_above_zero_on_a_short_prompt_is_unknown():
    assert causes_of(req("r1", system="", system_tokens=0, prompt=40, cached=32, suffix_tokens=40), rid="r1") == [
        ("unknown", "", 8)]


def test_a_stable_prefix_shorter_than_a_block_without_predecessor_is_below_block():
    # a first request: its 20-token system prompt could never be cached at B = 64; the 300-token question is new
    r = req("r1", system="Be brief.", system_tokens=20, prompt=320, suffix_tokens=300)
    assert causes_of(r, rid="r1") == [("below_block", "", 20), ("unavoidable", "", 300)]


# -- two causes in one request: split by position --------------------------------------------------------------
# A 750-token prompt: system 150, tools 100, retrieval 200, history 250, question 50; segment starts 0, 150,
# 250, 450, 700. The part before the changed segment, in full blocks, is the reusable cause's; from there to the
# end of what would have been shared without the change (700 → 640 in full blocks), the drift's; the rest new.
LAYOUT = dict(system="Policy", system_tokens=150, tools="T", tools_tokens=100, rag="D", rag_tokens=200,
              history="H", history_tokens=250, prompt=750, suffix_tokens=50)
DRIFTS = {  # sub_cause: (changes in the second request, reusable tokens in full blocks of 64, drift tokens)
    "tools_changed": (dict(tools="T2", tools_canonical="T2"), 128, 512),
    "tools_reordered": (dict(tools="T2", tools_canonical="T"), 128, 512),
    "rag_changed": (dict(rag="D2", rag_set="D2"), 192, 448),
    "rag_reordered": (dict(rag="D2", rag_set="D"), 192, 448),
    "history_truncated": (dict(history="H2", prev_history="H0"), 448, 192),
}
REUSE = {  # reusable cause: (second request's pod, its arrival in seconds, sub_cause)
    "routed_away": ("pod-b", 5.0, ""),
    "evicted": ("pod-a", 5.0, "evicted_before_next_turn"),
    "beyond_horizon": ("pod-a", 2 * HOUR, ""),
}


@pytest.mark.parametrize("reuse", sorted(REUSE))
@pytest.mark.parametrize("sub", sorted(DRIFTS))
def test_a_reusable_prefix_and_a_drift_split_by_position(reuse, sub):
    changes, reusable, drifted = DRIFTS[sub]
    pod, at, reuse_sub = REUSE[reuse]
    t1 = req("r1", conv="c1", **LAYOUT)
    t2 = req("r2", at=at, conv="c1", pod=pod, **{**LAYOUT, "suffix": "q2", **changes})
    assert causes_of(t1, t2) == [(reuse, reuse_sub, reusable), ("prefix_drift", sub, drifted),
                                 ("unavoidable", "", 110)]


@pytest.mark.parametrize("sub", ["tools_changed", "rag_reordered"])
def test_evicted_without_a_previous_turn_and_a_drift_split_by_position(sub):
    # found by the normalized system prompt (a variant): evicted without the next-turn flag
    changes, reusable, drifted = DRIFTS[sub]
    r2 = req("r2", at=5, **{**LAYOUT, "suffix": "q2", **changes})
    assert causes_of(req("r1", **LAYOUT), r2) == [("evicted", "", reusable), ("prefix_drift", sub, drifted),
                                                  ("unavoidable", "", 110)]


def test_a_partial_hit_before_the_drift_leaves_the_evicted_rest_to_evicted():
    # the pod still held the first block: [64, 192) evicted, the drift from the retrieval on
    changes, _, drifted = DRIFTS["rag_changed"]
    r2 = req("r2", at=5, cached=64, **{**LAYOUT, "suffix": "q2", **changes})
    assert causes_of(req("r1", **LAYOUT), r2) == [("evicted", "", 128), ("prefix_drift", "rag_changed", drifted),
                                                  ("unavoidable", "", 110)]


def test_one_shared_block_before_the_drift_on_another_pod_is_routed_away_not_the_edge():
    """Before: the one-block 'edge of sharing' tolerance also fired without any hit (C = 0), so a single shared
    block before the drift went to the drift (224 tokens prefix_drift). A hit that did not happen has no edge."""
    kw: dict[str, Any] = dict(system="S", system_tokens=40, tools_tokens=200, prompt=260, suffix_tokens=20)
    r2 = req("r2", at=5, pod="pod-b", tools="T2", suffix="q2", **kw)
    assert causes_of(req("r1", tools="T1", **kw), r2, sizes={"pod-a": 32, "pod-b": 32}) == [
        ("routed_away", "", 32), ("prefix_drift", "tools_changed", 192), ("unavoidable", "", 36)]


def test_a_change_in_the_first_segment_leaves_nothing_to_the_reusable_cause():
    # the system prompt is where the change is: no block comes before it, all of it is the drift's
    t1 = req("r1", conv="c1", **LAYOUT)
    t2 = req("r2", at=5, conv="c1", pod="pod-b", **{**LAYOUT, "system": "Policy v2", "suffix": "q2"})
    assert causes_of(t1, t2) == [("prefix_drift", "system_changed", 640), ("unavoidable", "", 110)]


# -- beyond the horizon ------------------------------------------------------------------------------------------
def test_beyond_the_lookback_is_cold():
    assert causes_of(base("r1"), base("r2", at=8 * 24 * HOUR))[0] == ("cold", "", 256)
    assert causes_of(base("r1"), base("r2", at=2 * HOUR), lookback_seconds=HOUR)[0] == ("cold", "", 256)


def test_beyond_the_horizon_on_another_pod_is_still_beyond_horizon():
    # nothing is expected to hold a prefix that long, on any pod: not routed_away
    assert causes_of(base("r1"), base("r2", at=2 * HOUR, pod="pod-b"))[0] == ("beyond_horizon", "", 256)


def test_a_predecessor_within_the_horizon_wins_over_an_older_previous_turn():
    # the conversation's previous turn is 2 h old; another request with the same fingerprint came 1 min ago
    t1 = base("t1", conv="c1")
    recent = base("recent", at=2 * HOUR - 60, tenant="globex", pod="pod-b")
    t2 = base("r2", at=2 * HOUR, conv="c1")
    rows = a.attribute([t1, recent, t2], block_size_by_pod=SIZES)
    assert split(rows, "r2") == [("routed_away", "", 256), ("unavoidable", "", 84)]
    assert [r.predecessor_request_id for r in rows if r.request_id == "r2"][0] == "recent"
    # without it, the old turn is the predecessor, beyond the horizon
    assert causes_of(t1, t2)[0] == ("beyond_horizon", "", 256)
