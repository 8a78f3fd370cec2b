"""kvscope's fingerprinting library and reference gateway (writes the gateway fingerprint log).

- `gateway.fingerprint`: per-segment prompt hashes and token counts of one OpenAI request.
- `gateway.normalize`: masking of volatile values (timestamps, ids) for the normalized system hash.
- `gateway.routing`: round-robin and prefix-affinity pod choice with a logged reason.
- `gateway.proxy`: the Starlette reverse proxy in front of vLLM pods (`make_app`, `GatewayServer`).
- `gateway.upstream`: the proxy's keep-alive HTTP/1.1 client to the pods.
- `gateway.log`: the JSONL writers (synchronous and background); the format is `gateway_log.v1.schema.json`
  beside this file.
"""

from gateway.fingerprint import PromptFingerprint, TokenCounter, fingerprint_request

__all__ = ["PromptFingerprint", "TokenCounter", "fingerprint_request"]
