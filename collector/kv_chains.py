"""Chain hashes for ``BlockStored`` events (collector side): token ids in, one 64-bit chain hash per block out.

A ``BlockStored`` event carries the token ids of its blocks and its parent's vLLM block hash. kvscope's chain
hash of each block (:func:`kvscope.block_hash.chain_hashes`) chains from the parent's full 32-byte digest, so
:class:`BlockChains` remembers the digest of every block it has hashed, by the vLLM hash the pod published
for it. An event whose parent it never saw (stored before the collector started, or forgotten: the memory is
bounded) gets chain hash 0 for each block, meaning unknown. The digest of a block is a function of its
tokens alone, so a remembered digest never goes stale (a removal or a pod restart does not change it).

The token ids then leave the event: the collector publishes ``token_count`` and ``chain_hashes`` instead
(``collector/events.py`` ``KvBlockEvent``), so a 1,000-token prefix no longer travels as JSON only to be counted.
"""

from __future__ import annotations

import msgspec

from collector.events import Envelope, KvBlockEvent, KvEventBatch
from kvscope.block_hash import block_digests, external

MAX_BLOCKS = 262_144
"""Digests remembered (≈100 bytes each in CPython, ~26 MB): several pods' worth of KV blocks."""


class BlockChains:
    """vLLM block hash (low 64 bits, as published) → kvscope digest of that block, least recently used dropped
    beyond ``max_blocks``. Not thread safe: the KV-event subscriber's poll loop owns it."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._digests: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def event(self, e: KvBlockEvent) -> KvBlockEvent:
        """``e`` with ``token_count`` set and ``token_ids`` moved into ``chain_hashes`` (BlockStored with token
        ids); other events, and events already converted, are returned unchanged. ``chain_hashes`` has one
        entry per ``block_hashes`` entry: 0 when the parent is unknown, when ``block_size`` is 0, or when the token
        ids are not exactly ``block_size`` per block hash (vLLM publishes the token range of every block it
        cached but no hash for a null or masked-out block, ``vllm/v1/core/block_pool.py`` ``cache_full_blocks``:
        which tokens each hash covers is then unknown)."""
        if e.type != "BlockStored" or (not e.token_ids and e.token_count is not None):
            return e
        chains = self._chains(e)
        return msgspec.structs.replace(e, token_ids=[], token_count=len(e.token_ids), chain_hashes=chains)

    def _chains(self, e: KvBlockEvent) -> list[int]:
        n = len(e.block_hashes)
        parent = None
        if e.parent_block_hash is not None:
            parent = self._digests.get(e.parent_block_hash)
            if parent is None:
                return [0] * n
            self._touch(e.parent_block_hash, parent)
        if e.block_size <= 0 or len(e.token_ids) != n * e.block_size:
            return [0] * n
        digests = block_digests(e.token_ids, e.block_size, parent)
        for vllm_hash, digest in zip(e.block_hashes, digests, strict=True):
            self._touch(vllm_hash, digest)
        return [external(d) for d in digests]

    def _touch(self, vllm_hash: int, digest: bytes) -> None:
        self._digests.pop(vllm_hash, None)
        self._digests[vllm_hash] = digest
        if len(self._digests) > self.max_blocks:
            for key in list(self._digests)[: max(1, self.max_blocks // 8)]:  # the oldest eighth
                del self._digests[key]

    def envelope(self, env: Envelope) -> Envelope:
        """``env`` with each event of its ``KvEventBatch`` converted by :meth:`event` (same event id); other
        envelopes unchanged. Call it on a stream's batches in sequence order, so parents come first."""
        b = env.payload
        if not isinstance(b, KvEventBatch):
            return env
        events = [self.event(e) for e in b.events]
        return msgspec.structs.replace(env, payload=msgspec.structs.replace(b, events=events))
