"""Block chain hashes: vLLM's prefix-cache block hash, recomputed from token ids (one definition for kvscope).

vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``) hashes a request's tokens in full blocks of ``block_size``; block
*i*'s hash covers its parent's hash, so it names the whole prefix up to the end of block *i*::

    hash_0 = H((NONE_HASH, tuple(tokens[0:B]), extra_keys_0))
    hash_i = H((hash_{i-1}, tuple(tokens[i*B:(i+1)*B]), extra_keys_i))
    NONE_HASH = H(seed)

``H`` is ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``): ``sha256`` (the default) = SHA-256 of
``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``; ``sha256_cbor`` = SHA-256 of
``cbor2.dumps(obj, canonical=True)``. ``seed`` (``resolve_none_hash_seed``) is ``$PYTHONHASHSEED`` when set,
else the fixed ``"vllm-none-hash"`` for the SHA-256 algorithms, else (``xxhash``, ``xxhash_cbor``) 32 random
bytes per process: those pods' hashes cannot be reproduced. KV events publish each hash's low 64 bits as an
unsigned int (``maybe_convert_block_hash``, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).

kvscope's **chain hash** of a block is exactly this with ``sha256`` and the default seed, and of the extra keys
only the request's ``cache_salt`` (``("cache_salt", salt)`` on the first block, :func:`salt_keys`): on a pod with
vLLM's defaults it equals the block hash in the pod's KV events (checked on a real capture and against vLLM's
``hash_block_tokens`` + ``generate_block_hash_extra_keys``, tests/test_block_hash.py), and on any other pod it
still names the same (salted) token prefix, so the gateway (which knows a prompt's token ids from vLLM's
``/tokenize`` and its salt from the body) and the collector (which reads them from ``BlockStored``) compute the
same value. A prompt served by a LoRA adapter is chained from the adapter's root (:func:`chain_root`) instead of
``NONE_HASH``: kvscope's own hash, apart from the base model's. docs/kv-events.md says when vLLM's own hash is
reproducible.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's ``DEFAULT_NONE_HASH_SEED``: the root seed of the SHA-256 algorithms when PYTHONHASHSEED is unset."""

ALGORITHMS = ("sha256", "sha256_cbor")
"""The ``prefix_caching_hash_algo`` values kvscope reproduces."""

MASK_64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # pragma: no cover - cbor2 comes with vLLM; kvscope does not require it
        raise ValueError("prefix_caching_hash_algo sha256_cbor needs the cbor2 package") from exc
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's hash function named ``algo`` (one of :data:`ALGORITHMS`): object → 32-byte digest.

    Raises ValueError for ``xxhash``/``xxhash_cbor`` (vLLM seeds them with random bytes per process unless
    PYTHONHASHSEED is set, and kvscope does not ship xxhash) and for unknown names."""
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    if algo in ("xxhash", "xxhash_cbor"):
        raise ValueError(f"prefix_caching_hash_algo {algo}: vLLM seeds it randomly per process unless "
                         "PYTHONHASHSEED is set; kvscope reproduces only sha256 and sha256_cbor")
    raise ValueError(f"unknown prefix_caching_hash_algo {algo!r}; expected one of {ALGORITHMS}")


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH`` (the parent of every first block): ``H(seed)``, seed default :data:`DEFAULT_SEED`
    (pass ``$PYTHONHASHSEED`` when the pod sets it). 32 bytes. Raises as :func:`hash_function`."""
    return hash_function(algo)(DEFAULT_SEED if seed is None else seed)


def block_digests(token_ids: Sequence[int], block_size: int, parent: bytes | None = None, *,
                  algo: str = "sha256", seed: str | None = None,
                  extra_keys: Sequence[tuple[Any, ...] | None] | None = None) -> list[bytes]:
    """Full 32-byte digests of each *full* block of ``token_ids`` (a trailing partial block is not hashed, as
    in vLLM), chained from ``parent`` (the digest of the block before ``token_ids[0]``; None = the prompt's
    start, i.e. :func:`none_hash`). ``extra_keys``: vLLM's per-block extra keys (LoRA name, multimodal hashes,
    cache salt) in its hashing form, None = none. Raises ValueError for ``block_size < 1`` or as
    :func:`hash_function`."""
    if block_size < 1:
        raise ValueError(f"block_size {block_size} is not a positive token count")
    fn = hash_function(algo)
    prev = parent if parent else none_hash(algo, seed)
    out: list[bytes] = []
    n = len(token_ids) // block_size
    tokens = list(map(int, token_ids[: n * block_size]))  # plain ints once (numpy ints pickle otherwise): 5x faster
    for i in range(n):
        keys = extra_keys[i] if extra_keys is not None else None
        prev = fn((prev, tuple(tokens[i * block_size:(i + 1) * block_size]), keys))
        out.append(prev)
    return out


def external(digest: bytes) -> int:
    """A digest as KV events publish it: its low 64 bits (last 8 bytes, big-endian) as an unsigned int."""
    return int.from_bytes(digest, "big") & MASK_64


def salt_keys(cache_salt: str | None) -> tuple[tuple[str, str], ...] | None:
    """vLLM's extra keys of a request's *first* block for its ``cache_salt`` (``generate_block_hash_extra_keys``
    in ``vllm/v1/core/kv_cache_utils.py``: ``("cache_salt", salt)`` when ``start_token_idx == 0`` and the salt
    is non-empty; no LoRA, multimodal or prompt-embeds keys): ``(("cache_salt", salt),)``, or None for no salt
    (None or ""). Later blocks never carry the salt: it reaches them through their parent's hash."""
    return (("cache_salt", cache_salt),) if cache_salt else None


@functools.lru_cache(maxsize=4096)
def chain_root(lora_name: str | None = None) -> bytes:
    """The parent digest of a prompt's first block in kvscope's chain: vLLM's ``NONE_HASH`` (:func:`none_hash`,
    sha256 default seed) for the base model; for a LoRA adapter (``lora_name``, vLLM's ``lora_name``: the name it
    is served under) ``sha256(pickle((NONE_HASH, ("lora", lora_name))))``, kvscope's own. vLLM keys the adapter's
    name *and path* into every block (``("lora", name, path)``, ``generate_block_hash_extra_keys``) and
    ``BlockStored`` carries no path, so an adapter's blocks cannot get vLLM's hash; rooting their chain at the
    adapter keeps them apart from the base model's blocks of the same tokens (which vLLM never shares with
    them), and equal between the gateway and the collector. None or "" = the base model."""
    root = none_hash()
    return hash_function("sha256")((root, ("lora", lora_name))) if lora_name else root


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
                 cache_salt: str | None = None, lora_name: str | None = None) -> list[int]:
    """kvscope's chain hash of each full block of ``token_ids``: vLLM's default block hash (sha256, seed
    ``vllm-none-hash``, extra keys only the salt's, :func:`salt_keys`), low 64 bits, as list[int] in block
    order. ``parent``: full digest of the block before ``token_ids[0]`` (None = the prompt's start, i.e.
    :func:`chain_root` of ``lora_name``); ``cache_salt``: the request's ``cache_salt`` (None or "" = none), keyed
    into the prompt's first block only, so it applies only with ``parent`` None (ValueError otherwise);
    ``lora_name``: the LoRA adapter that served the prompt (None = the base model; only with ``parent`` None,
    ValueError otherwise: the parent's digest already holds it). The gateway computes a prompt's chain with this
    function; the collector computes each ``BlockStored`` block's with it (collector/kv_chains.py)."""
    if (cache_salt or lora_name) and parent:
        raise ValueError("cache_salt and lora_name key the prompt's start only: pass them without a parent")
    first = salt_keys(cache_salt)
    keys = [first] + [None] * (len(token_ids) // max(block_size, 1) - 1) if first else None  # one per full block
    start = parent if parent else chain_root(lora_name)
    return [external(d) for d in block_digests(token_ids, block_size, start, extra_keys=keys)]


MAX_PROMPT_BLOCKS = 65_536
"""Most blocks in a gateway log line's ``prompt_block_hashes`` (1M tokens at block size 16; ~1.2 MB of JSON, well
under the log follower's 8 MiB line limit). The gateway logs a longer prompt's first ``MAX_PROMPT_BLOCKS`` blocks;
readers refuse a longer array (collector/gateway_record.py)."""
