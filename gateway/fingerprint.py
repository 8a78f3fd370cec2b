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
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
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


class TokenCounter:
    """Counts tokens of prompt text: the model's tokenizer if given, else an estimate.

    `tokenizer_path`: a Hugging Face `tokenizer.json`; counts are
    `len(Tokenizer.encode(text, add_special_tokens=False).ids)` and `method` is "tokenizer".
    Without it, count = ceil(len(text) / 4) characters and `method` is "estimate".
    Raises whatever `tokenizers` raises for an unreadable file. Safe to share between threads.
    """

    def __init__(self, tokenizer_path: Path | str | None = None) -> None:
        self._tokenizer = None
        self.method: Literal["tokenizer", "estimate"] = "estimate"
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            self._tokenizer = Tokenizer.from_file(str(path))
            self.method = "tokenizer"

    def count(self, text: str) -> int:
        """Tokens in `text` (no special tokens); 0 for ""."""
        if not text:
            return 0
        if self._tokenizer is None:
            return math.ceil(len(text) / 4)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


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

    @property
    def parent_fingerprint(self) -> str:
        """The previous turn's `prompt_fingerprint` if nothing but the history's growth changed:
        H(system_hash, tools_hash, retrieval_pack_hash, prev_history_hash). Routing uses it to keep a
        conversation on the pod that served its previous turn. Not a log field."""
        return _fingerprint(
            self.system_hash, self.tools_hash, self.retrieval_pack_hash, self.prev_history_hash
        )

    def to_log_fields(self) -> dict[str, str | int]:
        """The 16 fingerprint fields of a log line, keyed by their schema names."""
        return dataclasses.asdict(self)

    @classmethod
    def empty(cls, method: Literal["tokenizer", "estimate"]) -> PromptFingerprint:
        """All segments absent: for requests whose body could not be read."""
        return cls("", "", 0, "", "", 0, "", "", 0, "", "", 0, "", 0, "", method)


def _fingerprint(system_hash: str, tools_hash: str, pack_hash: str, history_hash: str) -> str:
    """prompt_fingerprint = H(system, tools, retrieval pack, history prefix); "" if all four are absent."""
    parts = (system_hash, tools_hash, pack_hash, history_hash)
    return hash_parts(*parts) if any(parts) else ""


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


def _previous_request_history(history: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The history the previous turn's request carried.

    The previous request was the messages before the assistant reply that answered it (the last run of
    assistant messages in `history`), and its history was those minus its own final message (its suffix).
    This equals "history without its last two messages" for the plain user/assistant alternation, and stays
    right when the new turn adds several messages (parallel tool results). Without an assistant message
    the last two are dropped."""
    last = max((i for i, m in enumerate(history) if m.get("role") == "assistant"), default=None)
    if last is None:
        return history[:-2]
    start = last
    while start > 0 and history[start - 1].get("role") == "assistant":
        start -= 1
    return history[: max(start - 1, 0)]


# --- segments -----------------------------------------------------------------------------------------


def _document_text(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, Mapping):
        return "\n".join(v if isinstance(v, str) else _json(v, sort_keys=False) for v in doc.values())
    return _json(doc, sort_keys=False)


def _retrieval(documents: Sequence[Any], extra_system: Sequence[Mapping[str, Any]], counter: TokenCounter):
    """(pack_hash, set_hash, tokens) over `documents` (as sent) then further system messages."""
    pack = [hash_parts(_json(d, sort_keys=False)) for d in documents]
    items = [hash_parts(_json(d, sort_keys=True)) for d in documents]
    msg_hashes = [message_hash(m) for m in extra_system]
    pack += msg_hashes
    items += msg_hashes
    tokens = sum(counter.count(_document_text(d)) for d in documents)
    tokens += sum(counter.count(message_text(m)) for m in extra_system)
    return _segment_hash(pack), _segment_hash(sorted(items)), tokens


def _tools(tools: Any, counter: TokenCounter) -> tuple[str, str, int]:
    """(raw_hash, canonical_hash, tokens) of the body's `tools` (absent when missing or empty)."""
    if not tools:
        return "", "", 0
    raw = _json(tools, sort_keys=False)
    return hash_parts(raw), hash_parts(_json(tools, sort_keys=True)), counter.count(raw)


def fingerprint_chat(body: Mapping[str, Any], counter: TokenCounter) -> PromptFingerprint:
    """Fingerprint of a `/v1/chat/completions` body.

    Segments: system = the first message when its role is system/developer; tools = body `tools`;
    retrieval = body `documents` (vLLM's `ChatCompletionRequest.documents`, list of dicts, in order) plus
    the further system/developer messages that directly follow the first; history = the remaining
    messages but the final one; suffix = the final message. Raises FingerprintError on unreadable shapes.
    """
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

    system_hash = message_hash(system) if system else ""
    tools_hash, tools_canonical, tools_tokens = _tools(body.get("tools"), counter)
    pack_hash, set_hash, retrieval_tokens = _retrieval(documents, extra_system, counter)
    history_hash = _segment_hash([message_hash(m) for m in history])
    return PromptFingerprint(
        system_hash=system_hash,
        system_norm_hash=message_hash(system, mask=True) if system else "",
        system_tokens=counter.count(message_text(system)) if system else 0,
        tools_hash=tools_hash,
        tools_canonical_hash=tools_canonical,
        tools_tokens=tools_tokens,
        retrieval_pack_hash=pack_hash,
        retrieval_set_hash=set_hash,
        retrieval_tokens=retrieval_tokens,
        history_prefix_hash=history_hash,
        prev_history_hash=_segment_hash([message_hash(m) for m in _previous_request_history(history)]),
        history_tokens=sum(counter.count(message_text(m)) for m in history),
        suffix_hash=_segment_hash([message_hash(m) for m in suffix]),
        suffix_tokens=sum(counter.count(message_text(m)) for m in suffix),
        prompt_fingerprint=_fingerprint(system_hash, tools_hash, pack_hash, history_hash),
        token_count_method=counter.method,
    )


def _prompt_items(prompt: Any) -> list[str | list[int]]:
    """`/v1/completions` prompt as a list of prompts: strings or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    raise FingerprintError("prompt is neither a string, a list of strings nor token ids")


def fingerprint_completion(body: Mapping[str, Any], counter: TokenCounter) -> PromptFingerprint:
    """Fingerprint of a `/v1/completions` body.

    The prompt is the suffix, unless `metadata.prefix_chars` (int) says its first N characters are a stable
    prefix: those become the system segment (hash, normalized hash, tokens). The split applies to a
    single string prompt only. Token-id prompts count their ids exactly (whatever the counter's method);
    several prompts (a batch) hash as one suffix H(p1, p2, ...). Raises FingerprintError on other shapes.
    """
    items = _prompt_items(body.get("prompt", ""))
    metadata = body.get("metadata")
    prefix_chars = metadata.get("prefix_chars") if isinstance(metadata, Mapping) else None
    system_text = ""
    if isinstance(prefix_chars, int) and prefix_chars > 0 and len(items) == 1 and isinstance(items[0], str):
        system_text, items = items[0][:prefix_chars], [items[0][prefix_chars:]]
    suffix_parts = [i if isinstance(i, str) else _json(i, sort_keys=False) for i in items if i]
    suffix_tokens = sum(counter.count(i) if isinstance(i, str) else len(i) for i in items)
    system_hash = hash_parts(system_text) if system_text else ""
    return PromptFingerprint(
        system_hash=system_hash,
        system_norm_hash=hash_parts(mask_volatile(system_text)) if system_text else "",
        system_tokens=counter.count(system_text),
        tools_hash="",
        tools_canonical_hash="",
        tools_tokens=0,
        retrieval_pack_hash="",
        retrieval_set_hash="",
        retrieval_tokens=0,
        history_prefix_hash="",
        prev_history_hash="",
        history_tokens=0,
        suffix_hash=_segment_hash(suffix_parts),
        suffix_tokens=suffix_tokens,
        prompt_fingerprint=_fingerprint(system_hash, "", "", ""),
        token_count_method=counter.method,
    )


def fingerprint_request(
    body: Mapping[str, Any], endpoint: Endpoint, counter: TokenCounter
) -> PromptFingerprint:
    """Fingerprint of an OpenAI request body sent to `endpoint` ("chat.completions" or "completions")."""
    if endpoint == "chat.completions":
        return fingerprint_chat(body, counter)
    if endpoint == "completions":
        return fingerprint_completion(body, counter)
    raise ValueError(f"unknown endpoint {endpoint!r}")
