"""The HTTP server's own settings. Every field is a `jaxserve serve` flag (jaxserve.cli_args), beside the
engine's (EngineConfig)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # TCP port
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize (default: $JAXSERVE_API_KEY)
    served_model_name: tuple[str, ...] | None = None  # names clients may send as `model`, comma-separated; the first is reported (default: the --model path)
    max_queued_requests: int | None = 1024  # waiting sequences beyond which new requests get 429
    retry_after: int = 1  # seconds a 429 asks the client to wait (Retry-After)
    max_request_bytes: int = 4 * 2**20  # larger request bodies get 413
    drain_timeout: float = 300.0  # on SIGTERM: seconds in-flight requests may take to finish before exit
    log_level: str = "info"  # debug | info | warning | error | critical
    access_log: bool = True  # one line per request, with its X-Request-Id
    allow_runtime_lora_updating: bool = False  # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; also $JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING or $VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
