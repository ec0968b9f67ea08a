"""The engine client: everything a front end (the HTTP server, its metrics) may know of an engine. AsyncEngine
(one engine core on its own thread) and ReplicaRouter (data-parallel replicas) implement it; the server depends
on nothing else of jaxserve.engine. No jax here.

    add_request(id, prompt ids, params)  -> RequestStream of RequestOutputs (frozen), validated on the way in
    loras() / load_lora / unload_lora    the LoRA adapters it serves, changed at run time
    abort(id)                            ends a request (closing its stream does too)
    add_fatal_listener(callback)         told when the engine stops for good (dead, no restart left; or hung)
    stats()                              SchedulerStats: a frozen snapshot, at most one step old
    info                                 what does not change: tokenizer, model config, limits
    monitor                              the bottleneck monitor over the engine's step records
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, Sequence, runtime_checkable

from jaxserve.config import ModelConfig
from jaxserve.engine.messages import SchedulerStats
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import RequestLimits

if TYPE_CHECKING:
    from jaxserve.observability.bottleneck import BottleneckMonitor


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; the message says which."""


class EngineHungError(EngineDeadError):
    """A step ran longer than the step timeout: the engine is stuck, and is given up."""


class QueueFullError(RuntimeError):
    """Admission control: too many requests are already waiting."""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know of the model it talks to; fixed at start-up."""

    tokenizer: object
    model_config: ModelConfig
    max_model_len: int
    compilation_cache_dir: str | None = None  # where the device-ceilings cache lives too
    cache_config: tuple[tuple[str, str], ...] = ()  # the KV cache's settings, as vLLM's cache_config_info labels
    speculative: bool = False  # speculative decoding is on

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len, self.speculative)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


@runtime_checkable
class RequestStream(Protocol):
    """One accepted request's outputs in order; the last has finished=True. close() before then aborts it."""

    request_id: str

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    info: EngineInfo

    @property
    def is_alive(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def monitor(self) -> "BottleneckMonitor": ...

    def stats(self) -> SchedulerStats: ...

    def add_fatal_listener(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` runs once, on an engine thread, when the engine stops for good (dead with no
        restart left, or hung): a server exits non-zero then, for its supervisor to restart it."""
        ...
    def loras(self) -> tuple: ...  # the LoRA adapters loaded now: jaxserve.lora.registry.LoraInfo

    async def load_lora(self, name: str, path: str) -> None: ...  # raises LoraError naming the problem

    async def unload_lora(self, name: str) -> None: ...  # KeyError if unknown; LoraInUseError while in use

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                          priority: int = 0, prompt_text: str | None = None,
                          kind: OutputKind = OutputKind.DELTA, lora_name: str | None = None) -> RequestStream:
        """Validates the request (jaxserve.validation.InvalidRequestError names the bad parameter) and returns
        once the engine accepted it, to run with LoRA adapter `lora_name` (None: the base model). Raises
        QueueFullError when admission refuses it, EngineDeadError when the engine is not running."""
        ...

    def abort(self, request_id: str) -> None: ...

    def start(self) -> "EngineClient": ...

    def stop(self, timeout: float | None = 30.0) -> None: ...
