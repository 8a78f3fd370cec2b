"""Routing policies of the reference gateway: which vLLM pod serves a request, and why (gateway → pods).

Each policy returns a `Route(pod, reason, down)`; the reason is logged as `routing_reason` (values fixed by
`gateway/gateway_log.v1.schema.json`): round_robin, affinity_hit, affinity_new, load_guard, pod_down; `down` as
`pods_down` (the pods found down when the request was routed).
A chosen pod counts one request in flight until `release(pod)`. Pods that refused a connection are
skipped for `down_seconds` (`mark_down`). All methods are safe from threads and from asyncio tasks
(they never await and hold one lock briefly).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

#: The most pods a route lists as down (``pods_down``; collector.gateway_record.MAX_PODS_DOWN, the log schema's
#: maxItems): a line with more would be refused whole.
MAX_PODS_DOWN = 256
ROUND_ROBIN = "round_robin"
PREFIX_AFFINITY = "prefix_affinity"
POLICIES = (ROUND_ROBIN, PREFIX_AFFINITY)


class NoPodAvailable(RuntimeError):
    """Every pod is excluded (already tried for this request)."""


class Route(NamedTuple):
    """The chosen pod's name, why it was chosen (a `routing_reason` value) and the other pods found down when it
    was chosen (`pods_down`, sorted: pods that refused this request's connection, and pods marked down after
    refusing an earlier one; a marked pod chosen all the same, when no other was left, is not among them)."""

    pod: str
    reason: str
    down: tuple[str, ...] = ()


class _PodPool:
    """In-flight counts and down marks of a fixed list of pods; callers hold `_lock`."""

    def __init__(self, pods: Sequence[str], down_seconds: float, clock: Callable[[], float]) -> None:
        if not pods:
            raise ValueError("at least one pod is needed")
        if len(set(pods)) != len(pods):
            raise ValueError(f"pod names must be unique: {list(pods)}")
        self.pods = list(pods)
        self.inflight = dict.fromkeys(self.pods, 0)
        self._down_until: dict[str, float] = {}
        self._down_seconds = down_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._down: list[str] = []  # the pods the latest candidates() found down or excluded (under _lock)

    def is_up(self, pod: str, now: float | None = None) -> bool:
        return self._down_until.get(pod, 0.0) <= (self._clock() if now is None else now)

    def candidates(self, exclude: Collection[str]) -> list[str]:
        """Pods not excluded, those not marked down first; raises NoPodAvailable if none is left.

        When every remaining pod is marked down they are all returned: a down mark is a hint, and trying a
        pod again beats refusing the request."""
        left = [p for p in self.pods if p not in exclude]
        if not left:
            raise NoPodAvailable("no pod left to try")
        now = self._clock()  # one reading: the pods skipped as down are the pods take() logs as down
        up = [p for p in left if self.is_up(p, now)]
        self._down = [p for p in self.pods if p in exclude or not self.is_up(p, now)]
        return up or left

    def least_loaded(self, pods: Sequence[str]) -> str:
        """The pod with the fewest requests in flight; ties go to the first in configured order."""
        return min(pods, key=lambda p: self.inflight[p])

    def take(self, route: Route) -> Route:
        """Count ``route`` in flight; returns it with the pods found down (:class:`Route`) by the
        :meth:`candidates` call it was chosen from filled in, the first :data:`MAX_PODS_DOWN` by name (what a log
        line may hold)."""
        self.inflight[route.pod] += 1
        return route._replace(down=tuple(sorted(p for p in self._down if p != route.pod))[:MAX_PODS_DOWN])

    def release(self, pod: str) -> None:
        """One request on `pod` finished (call once per chosen Route)."""
        with self._lock:
            self.inflight[pod] = max(self.inflight[pod] - 1, 0)

    def mark_down(self, pod: str) -> None:
        """`pod` refused a connection: avoid it for `down_seconds`."""
        with self._lock:
            self._down_until[pod] = self._clock() + self._down_seconds

    def inflight_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.inflight)


class RoundRobin(_PodPool):
    """Pods in turn, skipping pods marked down; reason "round_robin", or "pod_down" on a retry.

    `choose(keys, exclude)`: `keys` is ignored; `exclude` holds pods already tried for this request
    (a retry after a refused connection). Raises NoPodAvailable when every pod is excluded.
    """

    policy = ROUND_ROBIN

    def __init__(self, pods: Sequence[str], *, down_seconds: float = 5.0, clock=time.monotonic) -> None:
        super().__init__(pods, down_seconds, clock)
        self._next = 0

    def choose(self, keys: Sequence[str] = (), exclude: Collection[str] = ()) -> Route:
        with self._lock:
            candidates = set(self.candidates(exclude))
            for _ in range(len(self.pods)):
                pod = self.pods[self._next % len(self.pods)]
                self._next += 1
                if pod in candidates:
                    return self.take(Route(pod, "pod_down" if exclude else "round_robin"))
            raise AssertionError("unreachable: candidates is a non-empty subset of pods")


class PrefixAffinity(_PodPool):
    """Sticky routing on the prompt's stable prefix, so the pod that holds its KV blocks serves it again.

    `choose(keys, exclude)`: `keys` are prefix fingerprints, most specific first (the request's
    `prompt_fingerprint`, then its `parent_fingerprint`, i.e. the previous turn's, then its
    `prefill_parent_fingerprint`, the previous turn's when that was an assistant prefill); "" keys are ignored.
    - the first key found in the map (an LRU of at most `max_entries` fingerprints → the pod that last
      served it) names the sticky pod → "affinity_hit";
    - no key known → least-loaded pod (fewest in flight) → "affinity_new";
    - the sticky pod already has `max_inflight_per_pod` requests in flight and another pod has fewer
      → least-loaded pod → "load_guard";
    - the sticky pod is excluded (refused a connection for this request) or marked down → least-loaded
      other pod → "pod_down".
    The chosen pod is then recorded for every key. Raises NoPodAvailable when every pod is excluded.
    """

    policy = PREFIX_AFFINITY

    def __init__(
        self,
        pods: Sequence[str],
        *,
        max_inflight_per_pod: int = 8,
        max_entries: int = 100_000,
        down_seconds: float = 5.0,
        clock=time.monotonic,
    ) -> None:
        super().__init__(pods, down_seconds, clock)
        if max_inflight_per_pod < 1 or max_entries < 1:
            raise ValueError("max_inflight_per_pod and max_entries must be >= 1")
        self.max_inflight_per_pod = max_inflight_per_pod
        self.max_entries = max_entries
        self._sticky: OrderedDict[str, str] = OrderedDict()

    def choose(self, keys: Sequence[str] = (), exclude: Collection[str] = ()) -> Route:
        keys = list(dict.fromkeys(k for k in keys if k))
        with self._lock:
            candidates = self.candidates(exclude)
            sticky = next((self._sticky[k] for k in keys if k in self._sticky), None)
            if sticky is None:
                route = Route(self.least_loaded(candidates), "affinity_new")
            elif sticky not in candidates:  # excluded, or marked down while another pod is up
                others = [p for p in candidates if p != sticky] or candidates
                route = Route(self.least_loaded(others), "pod_down")
            else:
                route = Route(sticky, "affinity_hit")
                if self.inflight[sticky] >= self.max_inflight_per_pod:
                    other = self.least_loaded([p for p in candidates if p != sticky] or candidates)
                    if self.inflight[other] < self.inflight[sticky]:
                        route = Route(other, "load_guard")
            for key in keys:
                self._remember(key, route.pod)
            return self.take(route)

    def _remember(self, key: str, pod: str) -> None:
        self._sticky[key] = pod
        self._sticky.move_to_end(key)
        while len(self._sticky) > self.max_entries:
            self._sticky.popitem(last=False)

    def sticky_pod(self, key: str) -> str | None:
        """The pod `key` is pinned to, if any (does not touch the LRU order)."""
        with self._lock:
            return self._sticky.get(key)


Router = RoundRobin | PrefixAffinity


def make_router(
    policy: str, pods: Sequence[str], *, max_inflight_per_pod: int = 8, down_seconds: float = 5.0
) -> Router:
    """Router for `policy` ("round_robin" or "prefix_affinity"); raises ValueError for another name."""
    if policy == ROUND_ROBIN:
        return RoundRobin(pods, down_seconds=down_seconds)
    if policy == PREFIX_AFFINITY:
        return PrefixAffinity(pods, max_inflight_per_pod=max_inflight_per_pod, down_seconds=down_seconds)
    raise ValueError(f"unknown routing policy {policy!r}; expected one of {POLICIES}")
