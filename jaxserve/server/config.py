"""The HTTP server's own settings. Every field is a `jaxserve serve` flag (jaxserve.cli_args), beside the
engine's (EngineConfig)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # TCP port
    api_key: tuple[str, ...] | None = None  # require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize; repeat the flag for several keys (default: $JAXSERVE_API_KEY)
    api_key_file: str | None = None  # a file of API keys, one per line ('#' comments), re-read when it changes: keys rotate without a restart
    served_model_name: tuple[str, ...] | None = None  # names clients may send as `model`, comma-separated; the first is reported (default: the --model directory's base name; its path is accepted too)
    max_queued_requests: int | None = 1024  # requests accepted and not yet scheduled beyond which new requests get 429
    max_prompts_per_request: int = 128  # prompts one completions request may carry (a list of prompts); more get 400
    retry_after: int = 1  # seconds a 429 asks the client to wait (Retry-After)
    max_request_bytes: int = 4 * 2**20  # larger request bodies get 413
    header_timeout: float = 20.0  # seconds a connection may take to send a request's headers before it is closed (0: no limit)
    body_timeout: float = 60.0  # seconds a request may take to send its body before it gets 408 (0: no limit)
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open (uvicorn's)
    drain_timeout: float = 300.0  # on SIGTERM: seconds in-flight requests may take to finish before exit
    engine_step_timeout: float = 60.0  # seconds one engine step may run before the engine is declared hung: its requests fail, /health turns 503, the server exits with status 1 (0: no watchdog)
    engine_restart: int = 0  # times a dead engine (a device error) is rebuilt in place before the server gives up; the default exits with status 1 at once, for the supervisor to restart the process, as vLLM and TGI do
    log_level: str = "info"  # debug | info | warning | error | critical: jaxserve's and uvicorn's lines; other libraries log warnings and worse unless debug
    log_format: str = "text"  # text | json (one JSON object per line, for log shippers)
    access_log: bool = True  # one line per request, with its X-Request-Id
    tool_call_parser: str | None = None  # tool-call syntax parsed for tool_choice auto: hermes | llama3_json | mistral (default: the model family's)
    allow_runtime_lora_updating: bool = False  # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; also $JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING or $VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)

    def __post_init__(self):
        from jaxserve.structured.tools import PARSERS
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}")

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
