"""Prompt fingerprints: per-segment hashes and token counts of one OpenAI request (gateway → fingerprint log).

Pure functions, no I/O except loading a tokenizer file once. The prompt is cut into segments in prompt
order (system, tools, retrieval, history, suffix) and each is hashed; variants of some hashes (normalized
system, canonical tools, retrieval as a set, the previous turn's history) let attribution name *which*
segment drifted when vLLM's prefix cache missed. Field meanings: `gateway/gateway_log.v1.schema.json`.

Hash format: H(p1, p2, ...) = first 16 hex chars (64 bits) of SHA-256 over the UTF-8 of the parts joined
with U+001F; an absent segment is "" with 0 tokens. Any gateway that hashes the same way can be compared.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import pickle
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gateway.normalize import mask_volatile

SEPARATOR = "\x1f"
SYSTEM_ROLES = frozenset({"system", "developer"})
Endpoint = Literal["chat.completions", "completions"]


class FingerprintError(ValueError):
    """The request body has a shape the fingerprinter cannot read (e.g. `messages` is not a list)."""


def hash_parts(*parts: str) -> str:
    """H(parts): first 16 lowercase hex chars of SHA-256 of the UTF-8 parts joined with U+001F."""
    return hashlib.sha256(SEPARATOR.join(parts).encode("utf-8")).hexdigest()[:16]


def _segment_hash(parts: Sequence[str]) -> str:
    """H(parts), or "" when the segment has no parts (absent)."""
    return hash_parts(*parts) if parts else ""


def _json(value: Any, *, sort_keys: bool) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys)


_COUNTER_IDS = itertools.count(1)


class TokenCounter:
    """Counts tokens of prompt text: the model's tokenizer if given, else an estimate.

    `tokenizer_path`: a Hugging Face `tokenizer.json`; counts are
    `len(Tokenizer.encode(text, add_special_tokens=False).ids)` and `method` is "tokenizer" (computed with
    `encode_batch_fast` where `tokenizers` has it: the same ids without character offsets, ~2x faster).
    Without it, count = ceil(len(text) / 4) characters and `method` is "estimate".
    Raises whatever `tokenizers` raises for an unreadable file. Safe to share between threads.
    """

    def __init__(self, tokenizer_path: Path | str | None = None) -> None:
        self._tokenizer = None
        self._encode_batch = None
        self.method: Literal["tokenizer", "estimate"] = "estimate"
        self.cache_id = next(_COUNTER_IDS)  # tells this counter's entries apart in a shared SegmentCache
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            self._tokenizer = Tokenizer.from_file(str(path))
            self._encode_batch = getattr(self._tokenizer, "encode_batch_fast", None)
            self.method = "tokenizer"

    def count(self, text: str) -> int:
        """Tokens in `text` (no special tokens); 0 for ""."""
        if not text:
            return 0
        if self._tokenizer is None:
            return math.ceil(len(text) / 4)
        if self._encode_batch is not None:
            return len(self._encode_batch([text], add_special_tokens=False)[0].ids)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """:meth:`count` of each text, in one tokenizer batch call (the same numbers)."""
        if self._tokenizer is None or not any(texts):
            return [self.count(t) for t in texts]
        encode = self._encode_batch or self._tokenizer.encode_batch
        return [len(e.ids) if t else 0 for t, e in zip(texts, encode(list(texts), add_special_tokens=False),
                                                       strict=True)]


class SegmentBudgetExceeded(Exception):
    """A cached fingerprint would have to compute more uncached segment text than its `budget` allowed.

    Entries computed so far stay cached, so calling again (e.g. on a worker thread, without a budget)
    redoes none of that work."""


class SegmentCache:
    """Bounded LRU of per-segment results, keyed by the segment's exact content.

    System prompts, tool schemas and documents repeat across requests; their hashes (raw, masked,
    canonical, as set member) and token counts are computed once per distinct content and counter. The
    key is the counter's `cache_id`, the segment kind and the segment itself: a text as is, any other value
    as its pickle (protocol 5), an exact and type-preserving serialization (True is not 1, a float keeps
    its bits, dict order is kept) ~20x cheaper than json.dumps. The dict hashes the key (SipHash) and
    compares it whole on a hit, so two different segments can never share an entry. Bounded by `max_entries`
    and by `max_bytes` of keys (their `sys.getsizeof`); a segment larger than a quarter of `max_bytes` is
    not cached. Thread safe. `hits`, `misses` and `evictions` count lookups since creation.
    """

    ENTRY_OVERHEAD = 256  # bytes per entry besides its key: the OrderedDict node, tuple key and value

    def __init__(self, max_entries: int = 50_000, max_bytes: int = 256 * 2**20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, str, Any], tuple[list[Any], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, str, Any]) -> list[Any] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, key: tuple[int, str, Any], value: list[Any]) -> None:
        size = sys.getsizeof(key[2]) + self.ENTRY_OVERHEAD
        if size > self.max_bytes // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
                self.evictions += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self.bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
            }


@dataclass(frozen=True)
class PromptFingerprint:
    """Hashes (16 hex chars or "") and token counts (tokens) of one request's prompt segments.

    Field meanings and the log column of the same name: `gateway/gateway_log.v1.schema.json`.
    """

    system_hash: str
    system_norm_hash: str
    system_tokens: int
    tools_hash: str
    tools_canonical_hash: str
    tools_tokens: int
    retrieval_pack_hash: str
    retrieval_set_hash: str
    retrieval_tokens: int
    history_prefix_hash: str
    prev_history_hash: str
    history_tokens: int
    suffix_hash: str
    suffix_tokens: int
    prompt_fingerprint: str
    token_count_method: Literal["tokenizer", "estimate"]
    system_line_hashes: tuple[str, ...] = ()
    system_line_tokens: tuple[int, ...] = ()
    suffix_chunk_hashes: tuple[str, ...] = ()
    suffix_chunk_tokens: tuple[int, ...] = ()
    cache_salt_hash: str = ""
    prev_suffix_hash: str = ""
    next_history_hash: str = ""
    first_message_hash: str = ""
    prefill_history_hash: str = ""

    @property
    def segment_tokens(self) -> int:
        """Sum of the five segments' token counts (tokens): the prompt's length without the chat template's
        own tokens. Not a log field."""
        return self.system_tokens + self.tools_tokens + self.retrieval_tokens + self.history_tokens + self.suffix_tokens

    @property
    def parent_fingerprint(self) -> str:
        """The previous turn's `prompt_fingerprint` if nothing but the history's growth changed:
        H(system_hash, tools_hash, retrieval_pack_hash, prev_history_hash). Routing uses it to keep a
        conversation on the pod that served its previous turn (salted as :func:`salted`: a turn under another
        cache_salt shares no KV blocks with it). Not a log field."""
        return _fingerprint(
            self.system_hash, self.tools_hash, self.retrieval_pack_hash, self.prev_history_hash, self.cache_salt_hash
        )

    @property
    def prefill_parent_fingerprint(self) -> str:
        """The `prompt_fingerprint` the previous request had if it was an assistant prefill this turn carries
        completed: H(system_hash, tools_hash, retrieval_pack_hash, prefill_history_hash), salted alike; "" without a
        `prefill_history_hash`. Routing tries it after `parent_fingerprint`, so the turn after a prefill goes to the
        pod that prefilled it (`parent_fingerprint` names the history before the user message the prefill
        answered). Not a log field."""
        if not self.prefill_history_hash:
            return ""
        return _fingerprint(self.system_hash, self.tools_hash, self.retrieval_pack_hash, self.prefill_history_hash,
                            self.cache_salt_hash)

    def to_log_fields(self) -> dict[str, str | int | list]:
        """The 24 fingerprint fields of a log line, keyed by their schema names (the four structural arrays as
        JSON lists; ``cache_salt_hash``, ``prev_suffix_hash``, ``next_history_hash``, ``first_message_hash`` and
        ``prefill_history_hash`` included)."""
        fields = {name: getattr(self, name) for name in _FIELD_NAMES}
        for name in _TUPLE_FIELDS:
            fields[name] = list(fields[name])
        return fields

    @classmethod
    def empty(cls, method: Literal["tokenizer", "estimate"]) -> PromptFingerprint:
        """All segments absent: for requests whose body could not be read."""
        return cls("", "", 0, "", "", 0, "", "", 0, "", "", 0, "", 0, "", method)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(PromptFingerprint))
_TUPLE_FIELDS = tuple(f.name for f in dataclasses.fields(PromptFingerprint) if f.type.startswith("tuple"))


def _fingerprint(system_hash: str, tools_hash: str, pack_hash: str, history_hash: str, salt_hash: str = "") -> str:
    """prompt_fingerprint = H(system, tools, retrieval pack, history prefix), or H(system, tools, retrieval pack,
    history prefix, cache_salt_hash) for a salted request; "" if the four segments are all absent."""
    parts = (system_hash, tools_hash, pack_hash, history_hash)
    if not any(parts):
        return ""
    return hash_parts(*parts, salt_hash) if salt_hash else hash_parts(*parts)


def cache_salt_hash(body: Mapping[str, Any]) -> str:
    """The log's ``cache_salt_hash`` of a chat or completion body: H("cache_salt", salt) for vLLM's ``cache_salt``
    request field when it is a non-empty string, else "" (no salt; vLLM refuses any other value with a 400).
    The salt itself is never logged: it can be a per-user secret."""
    salt = body.get("cache_salt")
    return hash_parts("cache_salt", salt) if isinstance(salt, str) and salt else ""


def _salt(salt_hash: str, value: str) -> str:
    return hash_parts(salt_hash, value) if value else ""


@functools.lru_cache(maxsize=4096)
def _salted_lines(salt_hash: str, lines: tuple[str, ...]) -> tuple[str, ...]:
    """H(salt_hash, h) of each system line hash, memoized: a tenant's salt and system prompt repeat (40 lines cost
    ~40 µs to hash, a hit ~1 µs)."""
    return tuple(hash_parts(salt_hash, h) for h in lines)


def salted(fp: PromptFingerprint, salt_hash: str) -> PromptFingerprint:
    """``fp`` of a request sent with a ``cache_salt`` (``salt_hash`` from :func:`cache_salt_hash`; "" returns
    ``fp`` unchanged). vLLM keys the salt into the prompt's first KV block (``generate_block_hash_extra_keys``
    in ``vllm/v1/core/kv_cache_utils.py``), so requests under different salts share no cached block. The hashes
    on which attribution and routing find an earlier request to reuse from then include the salt, so a request
    under another salt is never found on them: ``prompt_fingerprint`` (and ``parent_fingerprint``) = H(…,
    salt_hash); the variant hashes ``system_norm_hash``, ``tools_canonical_hash``, ``retrieval_set_hash`` and
    each ``system_line_hashes`` entry (the first segment's structure) = H(salt_hash, unsalted hash). The raw
    segment hashes stay unsalted: they compare a turn with the previous turn of its conversation, which
    attribution finds whatever the salt (a changed salt is then a drift, ``cache_salt_changed``)."""
    if not salt_hash:
        return fp
    return dataclasses.replace(
        fp,
        cache_salt_hash=salt_hash,
        prompt_fingerprint=_fingerprint(fp.system_hash, fp.tools_hash, fp.retrieval_pack_hash,
                                        fp.history_prefix_hash, salt_hash),
        system_norm_hash=_salt(salt_hash, fp.system_norm_hash),
        tools_canonical_hash=_salt(salt_hash, fp.tools_canonical_hash),
        retrieval_set_hash=_salt(salt_hash, fp.retrieval_set_hash),
        system_line_hashes=_salted_lines(salt_hash, fp.system_line_hashes),
    )


# --- structure: lines of the system prompt, content-defined chunks of the suffix ----------------------------

#: At most this many system line entries; a longer prompt's lines are grouped evenly, a power of two of consecutive
#: lines an entry (:func:`system_lines`), so a changed line is placed within its own group wherever it sits.
MAX_SYSTEM_LINES = 256
#: At most this many suffix chunks; beyond it the final chunk (the question) stays its own entry and the chunks
#: before it from the 63rd on are joined into one (:func:`_capped`).
MAX_SUFFIX_CHUNKS = 64
#: A paragraph shorter than this (characters, whitespace stripped) ends no chunk: it joins the next one (a
#: document's title line stays with its body, a short greeting with what follows).
MIN_CHUNK_CHARS = 64
#: A chunk longer than this (characters) is cut at line breaks after lines of at least MIN_CHUNK_CHARS, then
#: every MAX_CHUNK_CHARS characters from its start.
MAX_CHUNK_CHARS = 4096


def system_lines(text: str) -> list[str]:
    """The lines of a system prompt's text (split at "\n"), at most :data:`MAX_SYSTEM_LINES` entries: a prompt of
    n > MAX_SYSTEM_LINES lines is cut into groups of g consecutive lines (the last group may be shorter), g the
    smallest power of two with ceil(n / g) ≤ MAX_SYSTEM_LINES (2 up to 512 lines, 4 up to 1,024, ...), each entry
    its group's lines joined by "\n". Every line's group depends only on g and its position, so two prompts of as
    many lines differ in the groups of their changed lines alone (an environment block at the end of a long agent
    prompt drifts at its own group, not at a catch-all last entry), and a prompt that grows keeps its entries
    until its line count crosses a power of two times MAX_SYSTEM_LINES (a power of two rather than
    ceil(n / MAX_SYSTEM_LINES): the group size changes at 512 and 1,024 lines, not at every multiple of 256).
    "" → []."""
    if not text:
        return []
    lines = text.split("\n")
    if len(lines) > MAX_SYSTEM_LINES:
        size = 1 << (-(-len(lines) // MAX_SYSTEM_LINES) - 1).bit_length()
        lines = ["\n".join(lines[i:i + size]) for i in range(0, len(lines), size)]
    return lines


#: The last character of a first paragraph that introduces what follows, rather than titles it.
_SENTENCE_ENDS = frozenset(":.?!")


def _cut(text: str, separator: str, first_ends: bool = False) -> list[str]:
    """``text`` cut after each ``separator`` whose preceding piece (since the previous separator) holds at least
    MIN_CHUNK_CHARS non-blank characters, or (``first_ends``) is the text's first non-blank piece and ends a sentence
    (":", ".", "?" or "!": "Context:", "Answer using the files below."; not a title such as "Refund guide 1", which
    stays with the document it heads, wherever that document sits); separators stay with the piece before them."""
    out, start, piece_start, first = [], 0, 0, first_ends
    while True:
        at = text.find(separator, piece_start)
        if at < 0:
            break
        end = at + len(separator)
        piece = text[piece_start:at].strip()
        if len(piece) >= MIN_CHUNK_CHARS or (first and piece[-1:] in _SENTENCE_ENDS):
            out.append(text[start:end])
            start = end
        first = first and not piece
        piece_start = end
    if start < len(text):
        out.append(text[start:])
    return out


#: A line that only separates (three or more of one of - = * _ ~ #, as LlamaIndex's "-----" around its context).
_RULE_CHARS = frozenset("-=*_~#")
_RULE_LINE = re.compile(r"[ \t]*([-=*_~#])\1{2,}[ \t]*\r?\n?")
#: A line that is one XML-style tag alone: an opening one (``<document index="2">``) or a closing one.
_OPEN_TAG_LINE = re.compile(r"[ \t]*<[A-Za-z][\w:.-]*(\s[^<>]*)?>[ \t]*\r?\n?")
_CLOSE_TAG_LINE = re.compile(r"[ \t]*</[A-Za-z][\w:.-]*[ \t]*>[ \t]*\r?\n?")
#: How one of those lines starts: a text with no line that starts so is not cut line by line (one scan for "\n").
_FRAME_MARKS = ("<", "---", "===", "***", "___", "~~~", "###")
_FRAME_HINT = re.compile(r"\n[ \t]*(?:<|---|===|\*\*\*|___|~~~|###)")


def _structural_cut(text: str) -> list[str]:
    """``text`` also cut at the lines that frame documents: before and after a rule line (:data:`_RULE_LINE`),
    before a line that is an opening tag alone and after a line that is a closing tag alone (documents joined by
    single newlines in ``<document>`` tags or between rules). A boundary depends only on its own line; a piece of
    whitespace alone joins the piece before it. The pieces concatenate back to ``text``."""
    if _FRAME_HINT.search(text) is None and not text[:64].lstrip(" \t").startswith(_FRAME_MARKS):
        return [text]
    out: list[str] = []
    start = at = 0
    for line in text.splitlines(keepends=True):
        body = line.strip()
        end = at + len(line)
        first = body[:1]
        rule = first in _RULE_CHARS and _RULE_LINE.fullmatch(line) is not None
        tag = first == "<" and body[-1] == ">" and body.count("<") == 1
        opens = tag and body[1:2] != "/" and _OPEN_TAG_LINE.fullmatch(line) is not None
        closes = tag and body[1:2] == "/" and _CLOSE_TAG_LINE.fullmatch(line) is not None
        if (rule or opens) and text[start:at].strip():
            out.append(text[start:at])
            start = at
        if (rule or closes) and text[start:end].strip():
            out.append(text[start:end])
            start = end
        at = end
    if start < len(text):
        if text[start:].strip() or not out:
            out.append(text[start:])
        else:
            out[-1] += text[start:]
    return out


def content_chunks(text: str) -> list[str]:
    """Content-defined chunks of a message's text, in order, concatenating back to ``text``.

    A chunk ends at a paragraph break ("\n\n") that follows a paragraph of at least :data:`MIN_CHUNK_CHARS`
    non-blank characters, or the text's first paragraph when it ends a sentence (a short header such as "Context:"
    introduces the documents; it is not part of the first one; a title stays with its document). Whether a break
    ends a chunk depends only on the paragraph right before it, so a boundary never moves when text before that
    paragraph changes (retrieved documents keep their chunks whatever precedes them). Within a paragraph a chunk
    also ends at the lines that frame documents (:func:`_structural_cut`: rule lines, tag lines). A chunk longer
    than :data:`MAX_CHUNK_CHARS` is cut the same way at line breaks, then every MAX_CHUNK_CHARS characters from its
    start (a boundary inside it moves only with its own text). At most :data:`MAX_SUFFIX_CHUNKS` chunks: the final
    chunk stays its own, the one before it holds the rest (:func:`_capped`). "" → []."""
    if not text:
        return []
    chunks = []
    for para in (piece for p in _cut(text, "\n\n", first_ends=True) for piece in _structural_cut(p)):
        if len(para) <= MAX_CHUNK_CHARS:
            chunks.append(para)
            continue
        for piece in _cut(para, "\n"):
            chunks.extend(piece[i:i + MAX_CHUNK_CHARS] for i in range(0, len(piece), MAX_CHUNK_CHARS))
    return _capped(chunks)


def _capped(chunks: list[str]) -> list[str]:
    """At most :data:`MAX_SUFFIX_CHUNKS` chunks: beyond it the first MAX_SUFFIX_CHUNKS − 2 stay, the ones after them
    up to the final chunk are joined into one, and the final chunk (the question, which attribution never counts as
    a document) stays its own, so a long document asked about again with another question keeps every chunk but
    the last equal. The chunks still concatenate back to the text."""
    if len(chunks) > MAX_SUFFIX_CHUNKS:
        chunks = [*chunks[: MAX_SUFFIX_CHUNKS - 2], "".join(chunks[MAX_SUFFIX_CHUNKS - 2:-1]), chunks[-1]]
    return chunks


def message_chunks(msg: Mapping[str, Any]) -> list[str]:
    """:func:`content_chunks` of :func:`message_text` (they concatenate back to it), with a chunk boundary at each
    text part of a content-part list as well: a client that sends each retrieved document as its own part (vLLM
    joins the parts with one "\n", no paragraph break) keeps one chunk per document at least, so documents
    reordered or replaced between parts are seen whatever their text holds. A message with a part that is not
    text (an image, audio) has no chunks: its media's tokens sit among the texts', where no chunk can place them."""
    text = message_text(msg)
    content = msg.get("content")
    parts = _text_parts(content) if isinstance(content, list) else None
    if isinstance(content, list) and parts is None:
        return []  # an image or other media part: its tokens sit among the texts', which chunks cannot place
    if not parts or len(parts) < 2:
        return content_chunks(text)
    pieces = [p + "\n" for p in parts[:-1]] + [text[len("\n".join(parts[:-1])) + 1:]]
    return _capped([c for piece in pieces for c in content_chunks(piece)])


#: A rank a retrieval template puts before each document: a citation "[2]", a word and a number ("Document 2:",
#: "Source #2 -", "Passage 2."), or the rank attribute of an opening tag alone on the chunk's first line
#: (``<document index="2">``: :data:`_RANK_ATTRIBUTE`). Documents reordered by rank are renumbered, which changed
#: every chunk's hash. Not a list's "2." or "(2)" (a user's own numbered steps), nor any other number in a tag
#: (an id, a score, a date: those tell documents apart).
_RANK_MARKER = re.compile(r"(\[\d{1,4}\]|(?i:document|doc|source|passage|context|chunk|result|reference|ref)\s*#?\s*"
                          r"\d{1,4}\s*[:.)\]-]?(?=\s)|<[A-Za-z][\w:.-]*\s[^<>\n]*>(?=\n))")
_RANK_ATTRIBUTE = re.compile(r"""(?i)(\b(?:index|idx|rank|position)\s*=\s*["']?)\d{1,4}(?=["'\s>])""")
_DIGITS = re.compile(r"\d{1,4}")


def chunk_key(piece: str) -> str:
    """What a message chunk's hash covers: its text with surrounding whitespace stripped and the digits of a
    leading rank marker (:data:`_RANK_MARKER`) replaced by "#", so a document keeps its hash when a reorder
    renumbers it. Only the hash's text: token counts are the chunk's as sent, and the prompt's own hashes
    (``suffix_hash``) see every character."""
    text = piece.strip()
    m = _RANK_MARKER.match(text)
    if m is None:
        return text
    marker = m.group(0)
    masked = _RANK_ATTRIBUTE.sub(r"\1#", marker) if marker.startswith("<") else _DIGITS.sub("#", marker, count=1)
    return masked + text[m.end():]


def structure(pieces: Sequence[str], counter: TokenCounter, whole_tokens: int | None = None,
              key: Callable[[str], str] = str.strip) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(H(key(piece)) of each piece (``key``: surrounding whitespace stripped by default; :func:`chunk_key` for a
    message's chunks), tokens of each piece as is). With one piece, ``whole_tokens`` (the tokens of the text it
    was cut from, already counted) is its count: the text is not tokenized again."""
    hashes = tuple(hash_parts(key(p)) for p in pieces)
    if len(pieces) == 1 and whole_tokens is not None:
        return hashes, (whole_tokens,)
    return hashes, tuple(counter.count_many(pieces))


# --- messages ------------------------------------------------------------------------------------------


def _text_parts(content: list[Any]) -> list[str] | None:
    """The texts of an all-text content-part list, else None."""
    texts = []
    for part in content:
        if not (
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ):
            return None
        texts.append(part["text"])
    return texts


def _canonical_content(content: Any, mask: bool) -> Any:
    """String content as is; a list of text parts as their texts joined by "\\n" (what vLLM renders for
    string-format chat templates, `entrypoints/chat_utils.py`); any other list as is (e.g. images)."""
    if isinstance(content, str):
        return mask_volatile(content) if mask else content
    if isinstance(content, list):
        texts = _text_parts(content)
        if texts is not None:
            joined = "\n".join(texts)
            return mask_volatile(joined) if mask else joined
        if mask:
            return [
                {**p, "text": mask_volatile(p["text"])}
                if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                else p
                for p in content
            ]
    return content


def _message(msg: Any) -> Mapping[str, Any]:
    if not isinstance(msg, Mapping):
        raise FingerprintError(f"message is a {type(msg).__name__}, not an object")
    return msg


def message_hash(msg: Mapping[str, Any], *, mask: bool = False) -> str:
    """H(canonical JSON of [role, content, name, tool_calls, tool_call_id]); keys inside sorted.

    `mask=True` masks volatile values in the text (`gateway.normalize`), for system_norm_hash."""
    canonical = [
        msg.get("role"),
        _canonical_content(msg.get("content"), mask),
        msg.get("name"),
        msg.get("tool_calls"),
        msg.get("tool_call_id"),
    ]
    return hash_parts(_json(canonical, sort_keys=True))


def message_text(msg: Mapping[str, Any]) -> str:
    """The text of a message that the template renders: text content (parts joined by "\\n") plus the
    tool calls' JSON. Used for token counts only."""
    content = msg.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    else:
        text = ""
    if msg.get("tool_calls"):
        calls = _json(msg["tool_calls"], sort_keys=False)
        text = f"{text}\n{calls}" if text else calls
    return text


def _last_assistant_run(history: Sequence[Mapping[str, Any]]) -> int | None:
    """Where the last run of assistant messages in ``history`` starts (None: no assistant message)."""
    last = max((i for i, m in enumerate(history) if m.get("role") == "assistant"), default=None)
    if last is None:
        return None
    while last > 0 and history[last - 1].get("role") == "assistant":
        last -= 1
    return last


def continues_final_message(body: Mapping[str, Any]) -> bool:
    """True when vLLM continues the body's final message instead of opening a new assistant turn: chat
    ``continue_final_message`` (``vllm/entrypoints/openai/chat_completion/protocol.py``; read as pydantic reads a
    bool) with a final message of role assistant (an assistant prefill: the reply extends that message, so the
    next turn carries it, completed, as one assistant message)."""
    messages = body.get("messages")
    if not _lax_true(body.get("continue_final_message")) or not isinstance(messages, list) or not messages:
        return False
    final = messages[-1]
    return isinstance(final, Mapping) and final.get("role") == "assistant"


def _previous_request_history(history: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The history the previous turn's request carried.

    The previous request was the messages before the assistant reply that answered it (the last run of
    assistant messages in `history`), and its history was those minus its own final message (its suffix).
    This equals "history without its last two messages" for the plain user/assistant alternation, and stays
    right when the new turn adds several messages (parallel tool results). Without an assistant message
    the last two are dropped."""
    start = _last_assistant_run(history)
    if start is None:
        return history[:-2]
    return history[: max(start - 1, 0)]


# --- segments -----------------------------------------------------------------------------------------


def _document_text(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, Mapping):
        return "\n".join(v if isinstance(v, str) else _json(v, sort_keys=False) for v in doc.values())
    return _json(doc, sort_keys=False)


def _tools(tools: Any, counter: TokenCounter) -> tuple[str, str, int]:
    """(raw_hash, canonical_hash, tokens) of the body's `tools` (absent when missing or empty). The canonical form
    sorts each schema's keys and the list itself (by each tool's canonical JSON): the same tools sent in another
    order, or with their keys in another order, are ``tools_reordered``, not ``tools_changed``."""
    if not tools:
        return "", "", 0
    raw = _json(tools, sort_keys=False)
    listed = sorted(tools, key=lambda t: _json(t, sort_keys=True)) if isinstance(tools, list) else tools
    return hash_parts(raw), hash_parts(_json(listed, sort_keys=True)), counter.count(raw)


def _split_chat(body: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, list, list, list, list]:
    """(system, extra_system, history, suffix, documents) of a chat body; FingerprintError on bad shapes."""
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise FingerprintError("messages is not a list")
    messages = [_message(m) for m in messages]
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in SYSTEM_ROLES:
        lead += 1
    system = messages[0] if lead else None
    extra_system = messages[1:lead]
    rest = messages[lead:]
    history, suffix = rest[:-1], rest[-1:]
    documents = body.get("documents") or []
    if not isinstance(documents, list):
        raise FingerprintError("documents is not a list")
    return system, extra_system, history, suffix, documents


def fingerprint_chat(
    body: Mapping[str, Any],
    counter: TokenCounter,
    cache: SegmentCache | None = None,
    *,
    budget: int | None = None,
) -> PromptFingerprint:
    """Fingerprint of a `/v1/chat/completions` body.

    Segments: system = the first message when its role is system/developer; tools = body `tools`;
    retrieval = body `documents` (vLLM's `ChatCompletionRequest.documents`, list of dicts, in order) plus
    the further system/developer messages that directly follow the first; history = the remaining
    messages but the final one; suffix = the final message. Raises FingerprintError on unreadable shapes.
    With a `cache`, per-segment results are memoized (identical output); `budget` then caps the size
    (characters / pickle bytes) of uncached segments this call may compute, else SegmentBudgetExceeded.
    """
    return _Segments(cache, counter, budget).chat(body)


def _prompt_items(prompt: Any) -> list[str | list[int]]:
    """`/v1/completions` prompt as a list of prompts: strings or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    raise FingerprintError("prompt is neither a string, a list of strings nor token ids")


def _split_completion(body: Mapping[str, Any]) -> tuple[str, list[str | list[int]]]:
    """(system_text, prompt items) of a completions body: the stable prefix named by
    `metadata.prefix_chars` (single string prompt only), else ""."""
    items = _prompt_items(body.get("prompt", ""))
    metadata = body.get("metadata")
    prefix_chars = metadata.get("prefix_chars") if isinstance(metadata, Mapping) else None
    system_text = ""
    if isinstance(prefix_chars, int) and prefix_chars > 0 and len(items) == 1 and isinstance(items[0], str):
        system_text, items = items[0][:prefix_chars], [items[0][prefix_chars:]]
    return system_text, items


def _completion_fingerprint(
    system_hash: str, system_norm_hash: str, system_tokens: int, suffix_hash: str, suffix_tokens: int, method
) -> PromptFingerprint:
    return PromptFingerprint(
        system_hash=system_hash,
        system_norm_hash=system_norm_hash,
        system_tokens=system_tokens,
        tools_hash="",
        tools_canonical_hash="",
        tools_tokens=0,
        retrieval_pack_hash="",
        retrieval_set_hash="",
        retrieval_tokens=0,
        history_prefix_hash="",
        prev_history_hash="",
        history_tokens=0,
        suffix_hash=suffix_hash,
        suffix_tokens=suffix_tokens,
        prompt_fingerprint=_fingerprint(system_hash, "", "", ""),
        token_count_method=method,
    )


def fingerprint_completion(
    body: Mapping[str, Any],
    counter: TokenCounter,
    cache: SegmentCache | None = None,
    *,
    budget: int | None = None,
) -> PromptFingerprint:
    """Fingerprint of a `/v1/completions` body.

    The prompt is the suffix, unless `metadata.prefix_chars` (int) says its first N characters are a stable
    prefix: those become the system segment (hash, normalized hash, tokens). The split applies to a
    single string prompt only. Token-id prompts count their ids exactly (whatever the counter's method);
    several prompts (a batch) hash as one suffix H(p1, p2, ...). A single string prompt also gets its suffix
    structure (:func:`content_chunks` of the text after the stable prefix: ``suffix_chunk_hashes`` /
    ``suffix_chunk_tokens``), as a chat's final message does. Raises FingerprintError on other shapes.
    `cache` and `budget`: as for `fingerprint_chat`.
    """
    return _Segments(cache, counter, budget).completion(body)


def prefilled_as_written(body: Mapping[str, Any]) -> bool:
    """False when vLLM prefills something other than the prompt the body holds: ``truncate_prompt_tokens`` (only the
    prompt's last N tokens) or ``prompt_embeds`` (no token ids); neither its segments nor its /tokenize ids then
    describe what the pod cached."""
    return body.get("truncate_prompt_tokens") is None and body.get("prompt_embeds") is None


#: The strings pydantic's lax mode reads as True for a ``bool`` field (case-insensitive; numbers 1 / 1.0 too):
#: https://docs.pydantic.dev/latest/api/standard_library_types/#booleans
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _lax_true(value: Any) -> bool:
    """``value`` as vLLM's pydantic request models read a ``bool`` field: True for true, 1, 1.0 and the strings of
    :data:`_TRUE_STRINGS`; False otherwise (a value pydantic refuses makes vLLM answer 400 anyway)."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_STRINGS
    return value is True or (isinstance(value, int | float) and value == 1)


def skips_prefix_cache(body: Mapping[str, Any], endpoint: Endpoint) -> bool:
    """True when vLLM will not read the prefix cache for this body: it asks for prompt logprobs, which vLLM sets as
    ``SamplingParams.skip_reading_prefix_cache`` (``vllm/sampling_params.py``: ``prompt_logprobs is not None``).
    The OpenAI servers derive ``prompt_logprobs`` from the body (``to_sampling_params`` in
    ``vllm/entrypoints/openai/{chat_completion,completion}/protocol.py``): the body's ``prompt_logprobs`` when not
    null, else, with ``echo`` true, ``top_logprobs`` (chat: an int, null read as 0 by ``TopLogprobsParam``, so
    ``echo`` alone is enough) or ``logprobs`` (completions; default null). A beam search (``use_beam_search``)
    builds ``BeamSearchParams`` instead, without prompt logprobs: it reads the cache. ``echo`` and
    ``use_beam_search`` are read as pydantic reads a bool (``"false"`` is false). Such a request counts in neither
    ``vllm:prefix_cache_queries`` nor ``vllm:prefix_cache_hits``; its prefill recomputes every prompt token."""
    if _lax_true(body.get("use_beam_search")):
        return False
    if body.get("prompt_logprobs") is not None:
        return True
    if not _lax_true(body.get("echo")):
        return False
    return endpoint == "chat.completions" or body.get("logprobs") is not None


def _lax_int(value: Any) -> int | None:
    """``value`` as vLLM's pydantic request models read an ``int`` field in lax mode: an int or bool, a float or a
    numeric string with no fractional part ("2", "2.0"); None otherwise (a value pydantic refuses makes vLLM answer
    400 anyway)."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


#: The most engine requests a log line says (the contract's cap, gateway_requests.engine_requests UInt16): a body
#: asking for more is logged as this many, still more than one.
MAX_ENGINE_REQUESTS = 2**16 - 1


def engine_requests(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many engine requests vLLM runs for this body, 1 .. :data:`MAX_ENGINE_REQUESTS`: ``n`` (parallel
    samples, read as pydantic reads an int; a value it refuses counts 1, vLLM answers 400 anyway) times the number
    of prompts (on ``/v1/completions``, a ``prompt`` list of strings or of token-id lists holds several; a list of
    ints is one prompt of token ids), capped.

    vLLM counts each engine request on its own: one in ``vllm:request_success_total`` and one prefix-cache lookup
    of the whole prompt in ``vllm:prefix_cache_queries_total`` (``vllm/v1/metrics/stats.py``, tracked per engine
    ``Request``, "so ``n > 1`` yields one per child"). For more than one, the response's
    ``usage.prompt_tokens_details.cached_tokens`` is not the prompt's prefix-cache hit count:

    - with ``n`` > 1 vLLM fans the request out into ``n`` child requests and reports one prompt; the cached count is
      one child's, which may have hit the blocks a sibling had just computed (a never-seen 267-token prompt with
      ``n`` = 2 reported 256 cached on a real CPU pod, where vLLM's own counters show 534 tokens queried);
    - a list of several prompts: ``usage.prompt_tokens`` sums them but ``cached_tokens`` is the last prompt's alone
      (``vllm/entrypoints/openai/completion/serving.py``, ``last_final_res.num_cached_tokens``).

    The gateway logs the count (``engine_requests``) and, above 1, the cached count as unknown (``null``): the
    request's missed tokens are ``not_reported``, and the data-quality check compares vLLM's finished requests with
    the engine requests logged (docs/gateway-log.md)."""
    samples = _lax_int(body.get("n"))
    samples = samples if samples is not None and samples > 1 else 1
    prompt = body.get("prompt")
    prompts = (len(prompt) if endpoint == "completions" and isinstance(prompt, list) and prompt
               and not all(isinstance(x, int) for x in prompt) else 1)
    return min(samples * prompts, MAX_ENGINE_REQUESTS)


def fingerprint_request(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    counter: TokenCounter,
    cache: SegmentCache | None = None,
    *,
    budget: int | None = None,
) -> PromptFingerprint:
    """Fingerprint of an OpenAI request body sent to `endpoint` ("chat.completions" or "completions"), salted
    by the body's `cache_salt` (:func:`salted`).

    `cache` and `budget`: as for `fingerprint_chat`. Raises :class:`FingerprintError` for a body whose prompt vLLM
    does not prefill as written: ``truncate_prompt_tokens`` (vLLM keeps only the prompt's last N tokens, so the
    segments of the body, counted from its start, would place a system prompt where none was prefilled and name
    a reuse that never existed) or ``prompt_embeds``; the line then has no segments (its causes: ``unknown``)."""
    if not prefilled_as_written(body):
        raise FingerprintError("the prompt vLLM prefills is not the body's (truncate_prompt_tokens or prompt_embeds)")
    if endpoint == "chat.completions":
        fp = fingerprint_chat(body, counter, cache, budget=budget)
    elif endpoint == "completions":
        fp = fingerprint_completion(body, counter, cache, budget=budget)
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    return salted(fp, cache_salt_hash(body))


# --- segments, memoized or not ------------------------------------------------------------------------

_MESSAGE, _DOCUMENT, _TOOLS, _TEXT = "message", "document", "tools", "text"


class _Segments:
    """One fingerprint's segment computations, through a SegmentCache when there is one (else each entry is
    computed directly, and `budget` does not apply), so both paths give identical fingerprints. Entries:
    message → [message_hash(m), count(message_text(m)), message_hash(m, mask=True) once needed, then, for a
    system message, its line structure (hashes, tokens) once needed];
    document → [H(json as sent), H(json sorted), count(document text)];
    tools → [H(json as sent), H(json sorted), count(json as sent)];
    text (completions) → [H(text), count(text), H(mask_volatile(text)) once needed, line structure once needed].
    The suffix's chunk structure is not cached (a suffix is rarely repeated)."""

    def __init__(self, cache: SegmentCache | None, counter: TokenCounter, budget: int | None) -> None:
        self.cache = cache
        self.counter = counter
        self.budget = budget

    def _entry(self, kind: str, value: Any, compute) -> list[Any]:
        if self.cache is None:
            return compute(value)
        if isinstance(value, str):
            raw: Any = value
        else:
            try:
                raw = pickle.dumps(value, protocol=5)
            except Exception:  # not picklable (not from JSON): compute without the cache
                return compute(value)
        key = (self.counter.cache_id, kind, raw)
        entry = self.cache.get(key)
        if entry is None:
            if self.budget is not None:
                self.budget -= len(raw)
                if self.budget < 0:
                    raise SegmentBudgetExceeded(kind)
            entry = compute(value)
            self.cache.put(key, entry)
        return entry

    def _message(self, msg: Mapping[str, Any]) -> list[Any]:
        return self._entry(_MESSAGE, msg, lambda m: [message_hash(m), self.counter.count(message_text(m)), None])

    def _text(self, text: str) -> list[Any]:
        return self._entry(_TEXT, text, lambda t: [hash_parts(t), self.counter.count(t), None])

    def _document(self, doc: Any) -> list[Any]:
        return self._entry(
            _DOCUMENT,
            doc,
            lambda d: [
                hash_parts(_json(d, sort_keys=False)),
                hash_parts(_json(d, sort_keys=True)),
                self.counter.count(_document_text(d)),
            ],
        )

    def _tools(self, tools: Any) -> tuple[str, str, int]:
        if not tools:
            return "", "", 0
        return tuple(self._entry(_TOOLS, tools, lambda t: list(_tools(t, self.counter))))  # type: ignore[return-value]

    def chat(self, body: Mapping[str, Any]) -> PromptFingerprint:
        system, extra_system, history, suffix, documents = _split_chat(body)
        system_entry = self._message(system) if system else None
        system_hash = system_entry[0] if system_entry else ""
        tools_hash, tools_canonical, tools_tokens = self._tools(body.get("tools"))
        docs = [self._document(d) for d in documents]
        extra = [self._message(m) for m in extra_system]
        pack_hash = _segment_hash([d[0] for d in docs] + [e[0] for e in extra])
        set_hash = _segment_hash(sorted([d[1] for d in docs] + [e[0] for e in extra]))
        retrieval_tokens = sum(d[2] for d in docs) + sum(e[1] for e in extra)
        hist = [self._message(m) for m in history]
        history_hash = _segment_hash([h[0] for h in hist])
        previous = len(_previous_request_history(history))
        prefill = _last_assistant_run(history)
        tail = [self._message(m) for m in suffix]
        if system_entry is not None and system_entry[2] is None:
            system_entry[2] = message_hash(system, mask=True)  # type: ignore[arg-type]
        if system_entry is not None and len(system_entry) < 4:
            system_entry.append(structure(system_lines(message_text(system)), self.counter,  # type: ignore[arg-type]
                                          system_entry[1]))
        lines = system_entry[3] if system_entry is not None else ((), ())
        chunks = (structure(message_chunks(suffix[0]), self.counter, tail[0][1], chunk_key) if suffix
                  else ((), ()))
        return PromptFingerprint(
            system_hash=system_hash,
            system_norm_hash=system_entry[2] if system_entry else "",
            system_tokens=system_entry[1] if system_entry else 0,
            tools_hash=tools_hash,
            tools_canonical_hash=tools_canonical,
            tools_tokens=tools_tokens,
            retrieval_pack_hash=pack_hash,
            retrieval_set_hash=set_hash,
            retrieval_tokens=retrieval_tokens,
            history_prefix_hash=history_hash,
            prev_history_hash=_segment_hash([h[0] for h in hist[:previous]]),
            # the previous request's final message as this one carries it: its suffix_hash unless edited
            prev_suffix_hash=_segment_hash([hist[previous][0]]) if previous < len(hist) else "",
            # this request's history and final message as one history: the history_prefix_hash of a next request
            # that re-sends them with no reply between (a message sent before the reply came, user-only turns)
            next_history_hash=_segment_hash([h[0] for h in hist] + [t[0] for t in tail]),
            # the thread's first message (a sub-agent's task): an agent run's parallel threads keep their own turns
            first_message_hash=_segment_hash([(hist or tail)[0][0]]) if hist or tail else "",
            # the history the previous request carried had it continued its final assistant message (a prefill the
            # reply completed, continue_final_message): the messages before the last run of assistant messages
            prefill_history_hash=_segment_hash([h[0] for h in hist[:prefill]]) if prefill else "",
            history_tokens=sum(h[1] for h in hist),
            suffix_hash=_segment_hash([t[0] for t in tail]),
            suffix_tokens=sum(t[1] for t in tail),
            prompt_fingerprint=_fingerprint(system_hash, tools_hash, pack_hash, history_hash),
            token_count_method=self.counter.method,
            system_line_hashes=lines[0],
            system_line_tokens=lines[1],
            suffix_chunk_hashes=chunks[0],
            suffix_chunk_tokens=chunks[1],
        )

    def completion(self, body: Mapping[str, Any]) -> PromptFingerprint:
        system_text, items = _split_completion(body)
        suffix_parts = [i if isinstance(i, str) else _json(i, sort_keys=False) for i in items if i]
        texts = {i: self._text(i) for i in items if isinstance(i, str) and i}
        suffix_tokens = sum((texts[i][1] if i else 0) if isinstance(i, str) else len(i) for i in items)
        chunks: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())
        if len(suffix_parts) == 1 and isinstance(suffix_parts[0], str) and suffix_parts[0] in texts:
            suffix_hash = texts[suffix_parts[0]][0]  # H(p) of the one prompt, as _segment_hash would give
            # one text prompt: its content-defined chunks, as a chat's final message has (a shared few-shot
            # preamble or file head before a new tail is then seen, and found on the first chunk's key)
            chunks = structure(content_chunks(suffix_parts[0]), self.counter, suffix_tokens, chunk_key)
        else:
            suffix_hash = _segment_hash(suffix_parts)
        if not system_text:
            fp = _completion_fingerprint("", "", 0, suffix_hash, suffix_tokens, self.counter.method)
            return dataclasses.replace(fp, suffix_chunk_hashes=chunks[0], suffix_chunk_tokens=chunks[1])
        entry = self._text(system_text)
        if entry[2] is None:
            entry[2] = hash_parts(mask_volatile(system_text))
        if len(entry) < 4:
            entry.append(structure(system_lines(system_text), self.counter))
        fp = _completion_fingerprint(entry[0], entry[2], entry[1], suffix_hash, suffix_tokens, self.counter.method)
        return dataclasses.replace(fp, system_line_hashes=entry[3][0], system_line_tokens=entry[3][1],
                                   suffix_chunk_hashes=chunks[0], suffix_chunk_tokens=chunks[1])
