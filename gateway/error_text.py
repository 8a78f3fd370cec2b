"""What the fingerprint log's ``error`` field says (gateway → log line): the error type, the HTTP status and a
scrubbed message, never the pod's own text.

vLLM's error messages can quote the request: a pydantic validation error repeats each offending value under
``input`` (``vllm/entrypoints/serve/exception_handling/handlers/validation.py``, up to 200 characters of it),
and other messages interpolate request values (``The model `<model>` does not exist.``). Prompt text must
not reach the log, so the rule is an allow-list, not a blacklist: a pod's message is reduced to a fixed phrase
per known vLLM 0.32 form, keeping only numbers (a context length, a token count), and a message of any other
form is dropped, leaving the type and status. Every value is at most :data:`ERROR_MAX_CHARS` characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

#: The longest ``error`` the gateway writes, in characters (readers cap at the same length:
#: ``collector/gateway_record.py``).
ERROR_MAX_CHARS = 1024
# An error type as vLLM writes it (an exception class name or an HTTP reason phrase); anything else is dropped.
_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9 _.-]{0,63}")
_N = r"(\d{1,12})"


def _context_length(m: re.Match[str]) -> str:
    unit = "characters" if m.group(3) == "characters" else "input tokens"
    return f"prompt longer than the model's maximum context length ({m.group(1)} tokens; {m.group(2)} {unit})"


# (pattern searched in the pod's message, phrase built from the match): vLLM 0.32 forms, source file named.
_FORMS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    # renderers/params.py _token_len_check / _text_len_check
    (re.compile(r"maximum context length is " + _N + r" tokens\. However, your prompt contains (?:at least )?"
                + _N + r" (input tokens|characters)"), _context_length),
    # renderers/params.py: max_tokens / truncate_prompt_tokens above the model's limit
    (re.compile(r"^(max_tokens|max_completion_tokens|max_output_tokens)=" + _N + r" cannot be greater than \w+="
                + _N), lambda m: f"{m.group(1)} {m.group(2)} greater than the model's limit {m.group(3)}"),
    (re.compile(r"^truncate_prompt_tokens=" + _N + r" cannot be greater than"),
     lambda m: f"truncate_prompt_tokens {m.group(1)} greater than the model's limit"),
    # entrypoints/serve/exception_handling/handlers/validation.py: pydantic errors (which echo the input)
    (re.compile(r"^" + _N + r" validation errors?:"), lambda m: f"request failed validation ({m.group(1)} errors)"),
    # entrypoints/serve/engine/serving.py, entrypoints/openai/models/serving.py
    (re.compile(r"^The model `.*` does not exist\.", re.DOTALL), lambda m: "model does not exist"),
    # renderers/base.py
    (re.compile(r"^Token id " + _N + r" is out of vocabulary"), lambda m: f"token id {m.group(1)} out of vocabulary"),
    # renderers/chat_utils.py
    (re.compile(r"^Unsupported chat content part type"), lambda m: "unsupported chat content part type"),
)


def cap(text: str) -> str:
    """``text`` cut to :data:`ERROR_MAX_CHARS` characters (the gateway's own messages are short; this bounds
    a pod name or a library message that is not)."""
    return text[:ERROR_MAX_CHARS]


def gateway_error(status: int, message: str) -> str:
    """The ``error`` of an answer the gateway gives itself: ``"<status> GatewayError: <message>"``.
    ``message`` must be the gateway's own words (pod names, exception class names), never request content."""
    return cap(f"{status} GatewayError: {message}")


def scrubbed_phrase(message: str) -> str:
    """The fixed phrase for a pod's error ``message`` of a known form (numbers kept), else ''."""
    for pattern, phrase in _FORMS:
        m = pattern.search(message)
        if m:
            return phrase(m)
    return ""


def pod_error(content: bytes | str, status: int) -> str:
    """The ``error`` of a pod's error answer or stream error event ``content`` (an OpenAI/vLLM error object,
    ``{"error": {"message", "type", "code"}}``): ``"<code> <type>: <phrase>"``, the phrase only for a known
    message form (:func:`scrubbed_phrase`). ``code`` is the body's ``error.code`` when it is an HTTP status,
    else ``status``; a body that is not such an object gives ``"<status> error: non-JSON error body (N bytes)"``
    or ``"<status> error"``."""
    try:
        err = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError, IndexError):
        size = len(content.encode("utf-8") if isinstance(content, str) else content)
        return f"{status} error: non-JSON error body ({size} bytes)"
    if not isinstance(err, Mapping):
        return f"{status} error"
    code = err.get("code")
    if not (isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599):
        code = status
    kind = err.get("type")
    kind = kind if isinstance(kind, str) and _TYPE.fullmatch(kind) else "error"
    message = err.get("message")
    phrase = scrubbed_phrase(message) if isinstance(message, str) else ""
    return cap(f"{code} {kind}: {phrase}" if phrase else f"{code} {kind}")
