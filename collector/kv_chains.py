"""Chain hashes for ``BlockStored`` events (collector side): token ids in, one 64-bit chain hash per block out.

A ``BlockStored`` event carries the token ids of its blocks and its parent's vLLM block hash. kvscope's chain
hash of each block (:func:`kvscope.block_hash.chain_hashes`) chains from the parent's full 32-byte digest, so
:class:`BlockChains` remembers the digest of every block it has hashed, by the vLLM hash the pod published
for it. An event whose parent it never saw (stored before the collector started, or forgotten: the memory is
bounded) gets chain hash 0 for each block, meaning unknown. The digest of a block is a function of its
tokens alone, so a remembered digest never goes stale (a removal or a pod restart does not change it).

Extra keys (vLLM 0.32 ``BlockStored.extra_keys``, ``vllm/distributed/kv_events.py``): one entry per block, None or
the block's keys *untagged* (``to_event_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``), in the order vLLM
hashes them tagged: the LoRA name (when ``lora_name`` is set), ``(mm_identifier, offset)`` pairs, the cache_salt
string (the request's first block only), prompt-embeds digests (bytes). :func:`block_keys` turns an entry back into
the keys kvscope's chain hash uses (:func:`kvscope.block_hash.chain_hashes`: only the salt's,
``("cache_salt", salt)``), so a salted block's chain hash is the gateway's for the salted prompt and, on a default
pod, vLLM's own. The LoRA name is not a key of kvscope's chain: a prompt served by a LoRA adapter is rooted at
the adapter instead (:func:`kvscope.block_hash.chain_root` of the event's ``lora_name``, as the gateway roots it),
so its blocks never share chain hashes with the base model's blocks of the same tokens, which vLLM never shares
with them either (vLLM's tagged LoRA key also holds the adapter path, which events do not carry: an adapter's
blocks cannot get vLLM's own hash). A block whose keys kvscope cannot tag for sure (multimodal items, prompt
embeddings, a string that is not a first block's salt, a malformed entry) gets chain hash 0, unknown, and so does
every block after it in its event and every later event chained from it (their parent is unknown).

The token ids and the extra keys then leave the event: the collector publishes ``token_count`` and
``chain_hashes`` instead (``collector/events.py`` ``KvBlockEvent``), so a 1,000-token prefix no longer travels as
JSON only to be counted, and a salt (which can be a per-user secret) never leaves the collector.
"""

from __future__ import annotations

from typing import Any

import msgspec

from collector.events import Envelope, KvBlockEvent, KvEventBatch
from kvscope.block_hash import block_digests, chain_root, external, salt_keys

UNTAGGABLE = object()
"""What :func:`block_keys` answers for keys kvscope cannot tag for sure (the block's chain hash is then 0)."""


def block_keys(entry: Any, lora_name: str | None, first_block: bool) -> tuple[tuple[str, str], ...] | None | object:
    """The extra keys of kvscope's chain hash for one block's untagged ``BlockStored.extra_keys`` entry: None (no
    keys, or only the LoRA name, which the chain leaves out), ``(("cache_salt", salt),)`` for a salt alone on the
    request's first block (``first_block``: the event has no parent and this is its first block), else
    :data:`UNTAGGABLE` (multimodal pairs, prompt-embeds digests, a string elsewhere or beside another key, an entry
    that is not a list, a LoRA name that is not the first key). ``lora_name``: the event's (None = no LoRA)."""
    if entry is None:
        return None
    if not isinstance(entry, list | tuple):
        return UNTAGGABLE
    items = list(entry)
    if lora_name is not None:
        if not items or items[0] != lora_name:
            return UNTAGGABLE
        items = items[1:]
    if not items:
        return None
    if first_block and len(items) == 1 and isinstance(items[0], str) and items[0]:
        return salt_keys(items[0])
    return UNTAGGABLE


def without_extra_keys(env: Envelope) -> Envelope:
    """``env`` with every event's ``extra_keys`` dropped (for an envelope published without :class:`BlockChains`,
    whose conversion drops them): a cache_salt never leaves the collector."""
    b = env.payload
    if not isinstance(b, KvEventBatch) or not any(e.extra_keys for e in b.events):
        return env
    events = [msgspec.structs.replace(e, extra_keys=None) if e.extra_keys else e for e in b.events]
    return msgspec.structs.replace(env, payload=msgspec.structs.replace(b, events=events))

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
        """``e`` with ``token_count`` set, ``token_ids`` moved into ``chain_hashes`` and ``extra_keys`` dropped
        (BlockStored with token ids); other events, and events already converted, are returned with their
        ``extra_keys`` dropped. ``chain_hashes`` has one entry per ``block_hashes`` entry: 0 when the parent is
        unknown, when the token ids do not fill the blocks, when ``block_size`` is 0, when ``extra_keys`` has not
        one entry per block, and from the first block whose keys :func:`block_keys` cannot tag on; 0 for every block
        when the token ids are not exactly ``block_size`` per block hash (vLLM publishes the token range of every
        block it cached but no hash for a null or masked-out block, ``vllm/v1/core/block_pool.py``
        ``cache_full_blocks``: which tokens each hash covers is then unknown)."""
        if e.type != "BlockStored" or (not e.token_ids and e.token_count is not None):
            return msgspec.structs.replace(e, extra_keys=None) if e.extra_keys else e
        chains = self._chains(e)
        return msgspec.structs.replace(e, token_ids=[], token_count=len(e.token_ids), chain_hashes=chains,
                                       extra_keys=None)

    def _chains(self, e: KvBlockEvent) -> list[int]:
        n = len(e.block_hashes)
        parent = chain_root(e.lora_name)  # a prompt's first block: rooted at its LoRA adapter, if any
        if e.parent_block_hash is not None:
            parent = self._digests.get(e.parent_block_hash)
            if parent is None:
                return [0] * n
            self._touch(e.parent_block_hash, parent)
        if e.block_size <= 0 or len(e.token_ids) != n * e.block_size:
            return [0] * n
        keys: list[Any] = [None] * n
        if e.extra_keys is not None:
            if len(e.extra_keys) != n:
                return [0] * n
            keys = [block_keys(k, e.lora_name, e.parent_block_hash is None and i == 0)
                    for i, k in enumerate(e.extra_keys)]
        known = next((i for i, k in enumerate(keys) if k is UNTAGGABLE), n)
        digests = block_digests(e.token_ids[: known * e.block_size], e.block_size, parent, extra_keys=keys[:known])
        for vllm_hash, digest in zip(e.block_hashes, digests, strict=False):
            self._touch(vllm_hash, digest)
        return [external(d) for d in digests] + [0] * (n - known)

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
