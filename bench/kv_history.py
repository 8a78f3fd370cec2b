"""Block-level evidence for the generated history (bench/history.py): each request's prompt block chain
(gateway_requests.prompt_block_hashes, precise mode) and the KV events its pod would have published
(kv_block_events → kv_block_log), built column-wise so 10^6 requests take seconds.

Chain model (block size :data:`bench.history.BLOCK`): a request's first ``system_tokens // B`` blocks name its
tenant's system prompt (a drifting tenant's carry the request's own timestamp: nothing shared), the rest name
its conversation's content by position, so a conversation's turns share their common blocks. Events: each
successful request stores the blocks it computed (from ``cached_tokens // B`` to ``prompt_tokens // B``) on its
pod 50 ms after arrival, in one ``BlockStored``; ``evicted_share`` of those stores are removed again by one
``BlockRemoved`` an exponential time (mean ``evict_after_s``) later. Hashes are arbitrary 64-bit values here
(kvscope's chain hash equals vLLM's on a default pod, so ``chain_hashes`` = ``block_hashes``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.history import BLOCK

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mix(*parts: np.ndarray) -> np.ndarray:
    h = np.zeros(len(parts[0]), dtype=np.uint64)
    for p in parts:
        h = (h ^ p.astype(np.uint64)) * _MIX
        h ^= h >> np.uint64(29)
    return h


def _ids(table: pa.Table, column: str) -> np.ndarray:
    """The integer after the dash of ``tenant-17`` / ``c-42`` ids."""
    return np.asarray(pc.cast(pc.utf8_slice_codeunits(table[column], 2 if column == "conversation_id" else 7),
                              pa.int64()).to_numpy(zero_copy_only=False))


def block_chains(table: pa.Table) -> tuple[pa.ListArray, np.ndarray]:
    """``(prompt_block_hashes, blocks per request)`` for ``table`` (gateway_table's rows): a list<uint64> of
    ``prompt_tokens // B`` hashes per request, as :func:`gateway_table`'s model implies them."""
    n = table.num_rows
    prompt = table["prompt_tokens"].to_numpy().astype(np.int64)
    sys_blocks = table["system_tokens"].to_numpy().astype(np.int64) // BLOCK
    drifting = np.asarray(pc.not_equal(table["system_hash"], table["system_norm_hash"]).to_numpy(
        zero_copy_only=False))
    ts = table["ts"].cast(pa.int64()).to_numpy()
    tenant, conv = _ids(table, "tenant_id"), _ids(table, "conversation_id")
    blocks = prompt // BLOCK
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(blocks, out=offsets[1:])
    row = np.repeat(np.arange(n), blocks)
    pos = np.arange(offsets[-1]) - offsets[row]
    in_system = pos < sys_blocks[row]
    values = np.where(in_system, _mix(tenant[row] + 1, np.where(drifting[row], ts[row], 0), pos),
                      _mix(conv[row] + 10**9, pos))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.uint64())), blocks


def kv_events_table(table: pa.Table, chains: pa.ListArray, *, seed: int = 0, evicted_share: float = 0.3,
                    evict_after_s: float = 600.0, id_prefix: str = "kv") -> pa.Table:
    """kv_block_events rows (Arrow, the table's columns plus ``chain_hashes``) for ``table``'s requests: one
    ``BlockStored`` per request that computed at least one full block, and a ``BlockRemoved`` for
    ``evicted_share`` of them; ``seq`` numbers each pod's events in time order."""
    rng = np.random.default_rng(seed)
    ok = table["status"].to_numpy() < 400
    prompt = table["prompt_tokens"].to_numpy().astype(np.int64)
    first = table["cached_tokens"].to_numpy().astype(np.int64) // BLOCK
    last = prompt // BLOCK
    keep = np.flatnonzero(ok & (last > first))
    starts = np.asarray(chains.offsets.to_numpy()[:-1])[keep] + first[keep]
    counts = (last - first)[keep]
    flat = np.asarray(chains.values.to_numpy())
    offsets = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    take = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1])
    stored = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat[take], pa.uint64()))
    parent = np.where(first[keep] > 0, flat[np.maximum(starts - 1, 0)], 0)
    ts = table["ts"].cast(pa.int64()).to_numpy()[keep] + 50
    pods = np.asarray(table["pod"].to_numpy(zero_copy_only=False))[keep]
    evicted = rng.random(len(keep)) < evicted_share
    removed_ts = ts[evicted] + (rng.exponential(evict_after_s, int(evicted.sum())) * 1000).astype(np.int64) + 1
    all_ts = np.concatenate([ts, removed_ts])
    all_pods = np.concatenate([pods, pods[evicted]])
    kinds = np.array(["BlockStored"] * len(keep) + ["BlockRemoved"] * int(evicted.sum()))
    hashes = pa.concat_arrays([stored, stored.filter(pa.array(evicted))])
    parents = pa.array(np.concatenate([parent, np.zeros(int(evicted.sum()), dtype=np.uint64)]), pa.uint64(),
                       mask=np.concatenate([first[keep] == 0, np.ones(int(evicted.sum()), dtype=bool)]))
    tokens = np.concatenate([counts * BLOCK, np.zeros(int(evicted.sum()), dtype=np.int64)])
    order = np.lexsort((all_ts, all_pods))
    seq = np.zeros(len(order), dtype=np.int64)
    sorted_pods = all_pods[order]
    new_pod = np.r_[True, sorted_pods[1:] != sorted_pods[:-1]]
    idx = np.arange(len(order))
    seq[order] = idx - np.maximum.accumulate(np.where(new_pod, idx, 0)) + 1  # seq 0 would read as a restart
    n = len(order)
    return pa.table({
        "event_id": pa.array(np.char.add(f"{id_prefix}-", np.arange(n).astype(str))),
        "ts": pa.array(all_ts, pa.timestamp("ms", tz="UTC")), "pod": pa.array(all_pods),
        "engine": pa.array(["0"] * n), "seq": pa.array(seq, pa.uint64()), "idx": pa.array(np.zeros(n), pa.uint32()),
        "event_type": pa.array(kinds), "block_hashes": hashes, "parent_block_hash": parents,
        "token_count": pa.array(tokens, pa.uint32()), "block_size": pa.array(np.full(n, BLOCK), pa.uint32()),
        "medium": pa.array(["GPU"] * n), "chain_hashes": hashes,
    })
