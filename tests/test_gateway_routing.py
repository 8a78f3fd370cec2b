"""Routing policies: which pod and the logged reason (round_robin, affinity_*, load_guard, pod_down)."""

from __future__ import annotations

import random
import threading

import pytest

from gateway.routing import NoPodAvailable, PrefixAffinity, RoundRobin, Route, make_router

PODS = ["pod-a", "pod-b", "pod-c"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_round_robin_cycles():
    rr = RoundRobin(PODS)
    assert [rr.choose() for _ in range(4)] == [
        Route("pod-a", "round_robin"),
        Route("pod-b", "round_robin"),
        Route("pod-c", "round_robin"),
        Route("pod-a", "round_robin"),
    ]
    assert rr.inflight_snapshot() == {"pod-a": 2, "pod-b": 1, "pod-c": 1}
    rr.release("pod-a")
    assert rr.inflight_snapshot()["pod-a"] == 1


def test_round_robin_retry_after_refused_connection_is_pod_down():
    rr = RoundRobin(PODS)
    first = rr.choose()
    rr.release(first.pod)
    rr.mark_down(first.pod)
    retry = rr.choose(exclude=[first.pod])
    assert retry.reason == "pod_down" and retry.pod != first.pod and retry.down == (first.pod,)
    with pytest.raises(NoPodAvailable):
        rr.choose(exclude=PODS)


def test_round_robin_skips_down_pods_until_they_recover():
    clock = FakeClock()
    rr = RoundRobin(PODS, down_seconds=5, clock=clock)
    rr.mark_down("pod-b")
    assert [rr.choose().pod for _ in range(4)] == ["pod-a", "pod-c", "pod-a", "pod-c"]
    clock.now += 6
    assert {rr.choose().pod for _ in range(3)} == set(PODS)


def test_all_down_still_tries():
    rr = RoundRobin(["only"])
    rr.mark_down("only")
    assert rr.choose() == Route("only", "round_robin")


def test_affinity_new_goes_to_least_loaded_then_hits():
    pa = PrefixAffinity(PODS)
    pa.choose(["other"])  # pod-a busy
    new = pa.choose(["fp1"])
    assert new == Route("pod-b", "affinity_new")
    assert pa.choose(["fp1"]) == Route("pod-b", "affinity_hit")
    assert pa.sticky_pod("fp1") == "pod-b"


def test_affinity_follows_parent_fingerprint():
    """A conversation's next turn (new fingerprint, parent = previous turn's) stays on the same pod."""
    pa = PrefixAffinity(PODS)
    pa.choose(["x"])
    turn1 = pa.choose(["t1"])
    pa.choose(["y"])
    turn2 = pa.choose(["t2", "t1"])
    assert turn2 == Route(turn1.pod, "affinity_hit")
    assert pa.sticky_pod("t2") == turn1.pod


def test_empty_keys_are_never_sticky():
    pa = PrefixAffinity(PODS)
    assert pa.choose(["", ""]).reason == "affinity_new"
    assert pa.choose([""]).reason == "affinity_new"
    assert pa.sticky_pod("") is None


def test_load_guard():
    pa = PrefixAffinity(PODS, max_inflight_per_pod=2)
    assert pa.choose(["fp"]).pod == "pod-a"
    assert pa.choose(["fp"]) == Route("pod-a", "affinity_hit")  # 2 in flight now: at the limit
    guarded = pa.choose(["fp"])
    assert guarded == Route("pod-b", "load_guard")
    assert pa.sticky_pod("fp") == "pod-b"  # the pod that last served it


def test_load_guard_keeps_sticky_pod_when_all_are_as_busy():
    pa = PrefixAffinity(["p1", "p2"], max_inflight_per_pod=1)
    pa.choose(["fp"])  # p1: 1
    pa.choose(["other"])  # p2: 1
    assert pa.choose(["fp"]) == Route("p1", "affinity_hit")


def test_pod_down_when_sticky_pod_refuses_or_is_marked_down():
    pa = PrefixAffinity(PODS)
    first = pa.choose(["fp"])
    pa.release(first.pod)
    pa.mark_down(first.pod)
    retry = pa.choose(["fp"], exclude=[first.pod])
    assert retry.reason == "pod_down" and retry.pod != first.pod
    pa.release(retry.pod)
    # a different fingerprint pinned to the down pod is also moved, without being excluded
    pa2 = PrefixAffinity(PODS)
    pinned = pa2.choose(["fp2"]).pod
    pa2.mark_down(pinned)
    moved = pa2.choose(["fp2"])
    assert moved.reason == "pod_down" and moved.pod != pinned and moved.down == (pinned,)


def test_pods_down_names_the_refused_and_the_marked_pods_but_never_the_chosen_one():
    """Route.down (logged as pods_down): pods excluded for this request and pods still marked down, sorted; a
    marked pod chosen all the same (no other left) is not down for the request; a mark that expired is gone."""
    clock = FakeClock()
    for router in (RoundRobin(PODS, down_seconds=5, clock=clock), PrefixAffinity(PODS, down_seconds=5, clock=clock)):
        clock.now = 100.0
        router.mark_down("pod-c")
        route = router.choose(["fp"], exclude=["pod-a"])
        assert route.pod == "pod-b" and route.down == ("pod-a", "pod-c")
        router.mark_down("pod-b")
        last = router.choose(["fp"], exclude=["pod-a", "pod-c"])  # only a marked pod is left: tried all the same
        assert last.pod == "pod-b" and last.down == ("pod-a", "pod-c")
        clock.now = 106.0
        assert router.choose(["fp"]).down == ()


def test_retry_of_a_new_fingerprint_is_pod_down():
    pa = PrefixAffinity(PODS)
    first = pa.choose(["new"])
    assert first.reason == "affinity_new"
    pa.release(first.pod)
    assert pa.choose(["new"], exclude=[first.pod]).reason == "pod_down"


def test_affinity_map_is_a_bounded_lru():
    pa = PrefixAffinity(PODS, max_entries=3)
    for key in ("k1", "k2", "k3"):
        pa.release(pa.choose([key]).pod)
    pa.release(pa.choose(["k1"]).pod)  # k1 becomes most recent
    pa.release(pa.choose(["k4"]).pod)  # evicts k2
    assert pa.sticky_pod("k2") is None
    assert all(pa.sticky_pod(k) for k in ("k1", "k3", "k4"))


def test_concurrent_choose_release_is_consistent():
    pa = PrefixAffinity(PODS, max_inflight_per_pod=4)
    rr = RoundRobin(PODS)
    errors = []

    def work(router, seed):
        rnd = random.Random(seed)
        try:
            for _ in range(2000):
                route = router.choose([f"fp{rnd.randrange(20)}"])
                assert route.pod in PODS
                router.release(route.pod)
        except Exception as exc:  # noqa: BLE001 - surfaced through the list
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r, s)) for s in range(6) for r in (pa, rr)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pa.inflight_snapshot() == dict.fromkeys(PODS, 0)
    assert rr.inflight_snapshot() == dict.fromkeys(PODS, 0)


def test_make_router_and_validation():
    assert make_router("round_robin", PODS).policy == "round_robin"
    router = make_router("prefix_affinity", PODS, max_inflight_per_pod=3)
    assert router.policy == "prefix_affinity" and router.max_inflight_per_pod == 3
    with pytest.raises(ValueError):
        make_router("random", PODS)
    with pytest.raises(ValueError):
        RoundRobin([])
    with pytest.raises(ValueError):
        PrefixAffinity(["a", "a"])
