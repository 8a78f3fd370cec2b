"""The log's ``error`` field holds the error type, the status and a scrubbed message, never a pod's text: each
vLLM 0.32 error form (messages built as the vLLM source named beside each builds them) carries a canary where
vLLM would quote the request, and the canary must not come out."""

from __future__ import annotations

import json

import pytest

from gateway.error_text import ERROR_MAX_CHARS, gateway_error, pod_error

CANARY = "kvscope-canary-7f3a9c"


def body(message: str, kind: str = "BadRequestError", code: object = 400) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


@pytest.mark.parametrize(("message", "want"), [
    # vllm/entrypoints/serve/exception_handling/handlers/validation.py: pydantic errors echo `input`
    (f"2 validation errors:\n  {{'type': 'string_type', 'loc': ('body', 'prompt', 'str'), 'msg': 'Input should be a "
     f"valid string', 'input': ['{CANARY} secret prompt', 1]}}\n  {{'type': 'int_type', 'loc': ('body', 'prompt', "
     f"'list[int]', 0), 'msg': 'Input should be a valid integer', 'input': '{CANARY} secret prompt'}}",
     "400 BadRequestError: request failed validation (2 errors)"),
    ("1 validation error:\n  {'input': '" + CANARY + "'}", "400 BadRequestError: request failed validation (1 errors)"),
    # vllm/renderers/params.py _token_len_check and _text_len_check
    ("This model's maximum context length is 512 tokens. However, your prompt contains at least 513 input tokens, "
     "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
     "400 BadRequestError: prompt longer than the model's maximum context length (512 tokens; 513 input tokens)"),
    ("This model's maximum context length is 512 tokens. However, your prompt contains 9000 characters (more than "
     "2048 characters, which is the upper bound for 512 input tokens). Please reduce the length of the input prompt.",
     "400 BadRequestError: prompt longer than the model's maximum context length (512 tokens; 9000 characters)"),
    # vllm/renderers/params.py: output tokens above the model's limit
    ("max_tokens=4096 cannot be greater than max_model_len=512. Please request fewer output tokens.",
     "400 BadRequestError: max_tokens 4096 greater than the model's limit 512"),
    # vllm/renderers/base.py
    ("Token id 99999 is out of vocabulary", "400 BadRequestError: token id 99999 out of vocabulary"),
    # vllm/renderers/chat_utils.py
    (f"Unsupported chat content part type: '{CANARY}'. Supported types: text, image_url.",
     "400 BadRequestError: unsupported chat content part type"),
    # any other form: the type and status only
    (f"Found more '{CANARY}' placeholders in input prompt than actual multimodal data items.",
     "400 BadRequestError"),
    (f"{CANARY} " * 500, "400 BadRequestError"),
])
def test_known_forms_keep_a_fixed_phrase_and_numbers_only(message: str, want: str) -> None:
    got = pod_error(body(message), 400)
    assert got == want and CANARY not in got


def test_model_not_found_drops_the_quoted_name() -> None:
    # vllm/entrypoints/serve/engine/serving.py
    got = pod_error(body(f"The model `{CANARY}` does not exist.", "NotFoundError", 404), 404)
    assert got == "404 NotFoundError: model does not exist"


def test_type_code_and_body_shapes() -> None:
    assert pod_error(body("x", f"{CANARY} {'y' * 80}"), 400) == "400 error"  # not an error type's shape
    assert pod_error(body("x", "Bad Request", 418), 400) == "418 Bad Request"
    assert pod_error(body("x", "BadRequestError", True), 400) == "400 BadRequestError"
    assert pod_error(body("x", "BadRequestError", "400"), 502) == "502 BadRequestError"
    # a stream error event, as vLLM sends it on a 200 stream
    event = json.dumps({"error": {"message": f"1 validation error: {CANARY}", "type": "BadRequestError",
                                  "code": 400}})
    assert pod_error(event, 200) == "400 BadRequestError: request failed validation (1 errors)"
    html = f"<html>{CANARY}</html>".encode()
    assert pod_error(html, 502) == f"502 error: non-JSON error body ({len(html)} bytes)"
    assert pod_error(json.dumps({"error": CANARY}).encode(), 500) == "500 error"
    assert pod_error(b"[1]", 500) == "500 error: non-JSON error body (3 bytes)"


def test_gateway_errors_are_capped() -> None:
    assert gateway_error(502, "no pod reachable (tried a)") == "502 GatewayError: no pod reachable (tried a)"
    assert len(gateway_error(502, "p" * 5000)) == ERROR_MAX_CHARS
