"""What every handler needs, built once per app and kept on `app.state.server` (no module globals)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping

from starlette.requests import Request

from jaxserve.engine.client import EngineClient
from jaxserve.server.config import ServerConfig
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.logprobs import TokenText
from jaxserve.server.metrics import ServerMetrics


@dataclasses.dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    model_names: tuple[str, ...]  # the first is the one reported in responses
    root: str  # the model directory
    metrics: ServerMetrics
    lifecycle: Lifecycle
    token_text: TokenText
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # config.sampling_defaults

    @classmethod
    def build(cls, engine: EngineClient, config: ServerConfig, model_dir: str,
              sampling_defaults: Mapping[str, Any] | None = None) -> "ServerState":
        names = tuple(config.served_model_name or default_served_names(str(model_dir)))
        return cls(engine, config, names, str(model_dir), ServerMetrics(engine, names[0]), Lifecycle(),
                   TokenText(engine.info.tokenizer), sampling_defaults=dict(sampling_defaults or {}))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size


def default_served_names(model_dir: str) -> tuple[str, ...]:
    """Without --served-model-name: the directory's base name, then the path as given (when it differs); both
    are accepted as `model`, the first is reported."""
    base = Path(model_dir).resolve().name or str(model_dir)
    return (base,) if base == str(model_dir) else (base, str(model_dir))


def server_of(request: Request) -> ServerState:
    return request.app.state.server
