"""Data parallelism: M engine replicas, each on its own row of the [data, model] mesh, behind one front.

    front (one admission limit)  --least loaded-->  replica 0: EngineCore on devices 0..tp-1
                                                    replica 1: EngineCore on devices tp..2tp-1   ...

Least loaded = fewest requests routed to it and not finished yet (running + waiting + still in its queue),
counted by the front itself, so a burst of arrivals spreads out before any replica has stepped; ties go to the
lowest index. A request stays on its replica for its whole life.

Two fronts:
    DataParallelCore   the EngineCore interface (add_request / abort_request / finish_sample / step /
                       has_unfinished_requests) over the replicas' cores: LLMEngine drives it for offline use
    ReplicaRouter      the EngineClient interface over one AsyncEngine per replica (each on its own thread):
                       the HTTP server

`build_engine` and `start_async_engine` pick a plain engine when data_parallel_size is 1.
"""

from __future__ import annotations

import os
from typing import AsyncIterator, Sequence as Seq

import jax

from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.async_engine import AsyncEngine, bottleneck_monitor
from jaxserve.engine.client import EngineDeadError, QueueFullError
from jaxserve.engine.engine import EngineCore, LLMEngine
from jaxserve.engine.messages import EngineRequest, SampleDelta, SchedulerStats, StepOutputs
from jaxserve.engine.multihost import follow_if_follower
from jaxserve.lora.adapter import LoraError
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.parallel import MeshError, make_mesh, replica_meshes
from jaxserve.parallel.multihost import initialize
from jaxserve.sampling_params import SamplingParams


def data_parallel_meshes(config: EngineConfig) -> list[jax.sharding.Mesh]:
    """One mesh per replica: the rows of a [data_parallel_size, tensor_parallel_size] mesh."""
    if jax.process_count() > 1:
        raise ConfigError("data_parallel_size > 1 is single-host for now: run one jaxserve per host, or one "
                          "multi-host tensor-parallel model (docs/parallel.md)")
    try:
        return replica_meshes(make_mesh(config.tensor_parallel_size, config.data_parallel_size))
    except MeshError as exc:
        raise ConfigError(str(exc)) from None


def build_replicas(model_dir: str | os.PathLike, config: EngineConfig, show_progress: bool = True
                   ) -> list[EngineCore]:
    """Each replica restores the checkpoint straight into its own devices and compiles its own executables."""
    return [EngineCore.from_model_dir(model_dir, config, show_progress=show_progress, mesh=mesh)
            for mesh in data_parallel_meshes(config)]


def least_loaded(loads: Seq[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class DataParallelCore:
    """EngineCore's interface over replicas, for offline generation. step() steps every replica that has work:
    each dispatches its next step before waiting for its previous one, so the replicas' devices overlap."""

    def __init__(self, replicas: Seq[EngineCore]):
        if not replicas:
            raise ValueError("DataParallelCore needs at least one replica")
        self.replicas = list(replicas)
        self._replica_of: dict[str, EngineCore] = {}

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_config(self):
        return self.replicas[0].model_config

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def limits(self):
        return self.replicas[0].limits

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._replica_of:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        loads = [sum(core is r for core in self._replica_of.values()) for r in self.replicas]
        replica = self.replicas[least_loaded(loads)]
        replica.add_request(request)
        self._replica_of[request.request_id] = replica

    def replica_index(self, request_id: str) -> int | None:
        """Which replica an unfinished request runs on."""
        replica = self._replica_of.get(request_id)
        return self.replicas.index(replica) if replica is not None else None

    def abort_request(self, request_id: str) -> tuple[SampleDelta, ...]:
        replica = self._replica_of.pop(request_id, None)
        return replica.abort_request(request_id) if replica is not None else ()

    def finish_sample(self, request_id: str, index: int, stop: str) -> bool:
        replica = self._replica_of.get(request_id)
        if replica is None or not replica.finish_sample(request_id, index, stop):
            return False
        del self._replica_of[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def lora_infos(self) -> tuple:
        return ()  # EngineCore refuses --enable-lora with data parallelism

    def add_lora(self, name: str, path: str) -> None:
        raise LoraError("LoRA adapters are not served with --data-parallel-size > 1")

    def step(self) -> StepOutputs:
        steps = [replica.step() for replica in self.replicas if replica.has_unfinished_requests()]
        finished = tuple(rid for step in steps for rid in step.finished_requests)
        failed = tuple(f for step in steps for f in step.failed)
        for request_id in finished + tuple(request_id for request_id, _ in failed):
            self._replica_of.pop(request_id, None)
        return StepOutputs(tuple(d for step in steps for d in step.deltas),
                           SchedulerStats.combine([r.stats_snapshot() for r in self.replicas]), finished,
                           max((step.time for step in steps), default=0.0),
                           tuple(r for step in steps for r in step.records), failed)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()


class ReplicaRouter:
    """An EngineClient over several AsyncEngines (`replicas`), one per data-parallel replica; `over(cores)` builds
    them around one shared bottleneck monitor."""

    def __init__(self, replicas: Seq[AsyncEngine], max_queued_requests: int | None = None):
        self.replicas = list(replicas)
        self.info = self.replicas[0].info  # the same model on every replica
        self.max_queued_requests = max_queued_requests
        self._load = [0] * len(self.replicas)  # routed and not finished, per replica
        self._replica_of: dict[str, int] = {}

    @classmethod
    def over(cls, cores: Seq[EngineCore], max_queued_requests: int | None = None, rebuilds: Seq | None = None,
             **supervision) -> "ReplicaRouter":
        """`rebuilds[i]` rebuilds replica i; `supervision`: AsyncEngine's max_restarts and step_timeout."""
        monitor = bottleneck_monitor(cores[0])
        rebuilds = rebuilds or [None] * len(cores)
        return cls([AsyncEngine(core, monitor=monitor, rebuild=rebuild, **supervision)
                    for core, rebuild in zip(cores, rebuilds)], max_queued_requests)

    # ---- the EngineClient interface -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    def stats(self) -> SchedulerStats:
        return SchedulerStats.combine([r.stats() for r in self.replicas])

    def loras(self) -> tuple:
        return ()  # LoRA runs on one engine (EngineCore refuses --enable-lora with data parallelism)

    async def load_lora(self, name: str, path: str) -> None:
        raise LoraError("LoRA adapters are not served with --data-parallel-size > 1")

    async def unload_lora(self, name: str) -> None:
        raise KeyError(name)

    @property
    def monitor(self):
        """The replicas' shared monitor (every replica's step records)."""
        return self.replicas[0].monitor

    @property
    def num_queued(self) -> int:
        return sum(r.num_queued for r in self.replicas)

    @property
    def restarting(self) -> bool:
        return any(getattr(r, "restarting", False) for r in self.replicas)

    def add_fatal_listener(self, callback) -> None:
        """Any replica that stops for good stops the whole front (the server exits for its supervisor)."""
        for replica in self.replicas:
            replica.add_fatal_listener(callback)

    @property
    def loads(self) -> list[int]:
        return list(self._load)

    def start(self) -> "ReplicaRouter":
        for replica in self.replicas:
            replica.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout)

    async def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                          priority: int = 0, prompt_text: str | None = None,
                          kind: OutputKind = OutputKind.DELTA, lora_name: str | None = None) -> "RoutedStream":
        """Routes to the least-loaded replica; raises as AsyncEngine.add_request does (QueueFullError against the
        shared limit: every replica's waiting requests together)."""
        self._admit()
        index = least_loaded(self._load)
        self._load[index] += 1
        self._replica_of[request_id] = index
        try:
            stream = await self.replicas[index].add_request(request_id, prompt, params, priority=priority,
                                                            prompt_text=prompt_text, kind=kind, lora_name=lora_name)
        except BaseException:
            self._release(request_id)
            raise
        return RoutedStream(stream, lambda: self._release(request_id))

    async def generate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                       priority: int = 0, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, priority=priority, prompt_text=prompt_text)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        index = self._replica_of.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting = the requests the replicas accepted and have not scheduled yet (exact: each replica counts
        them at admission, and the router admits and submits with no await in between)."""
        if not self.is_alive:
            raise EngineDeadError(f"a replica is not running: {self.error!r}")
        waiting = self.num_queued
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise QueueFullError(f"{waiting} requests are already waiting, the most this server queues")

    def _release(self, request_id: str) -> None:
        index = self._replica_of.pop(request_id, None)
        if index is not None:
            self._load[index] -= 1


class RoutedStream:
    """A replica's request stream that tells the router when the request is over (finished or closed)."""

    def __init__(self, stream, on_done):
        self.request_id = stream.request_id
        self._stream = stream
        self._on_done = on_done

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def __aiter__(self) -> "RoutedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._stream.__anext__()
        except StopAsyncIteration:
            self._done()
            raise
        if output.finished:
            self._done()
        return output

    def close(self) -> None:
        self._stream.close()
        self._done()

    def _done(self) -> None:
        if self._on_done is not None:
            self._on_done, on_done = None, self._on_done
            on_done()


def build_engine(model_dir: str | os.PathLike, config: EngineConfig, show_progress: bool = True) -> LLMEngine:
    """The offline engine for `config`: over one EngineCore, or over replicas when data_parallel_size > 1."""
    if config.data_parallel_size == 1:
        return LLMEngine.from_model_dir(model_dir, config, show_progress=show_progress)
    initialize(config.coordinator_address, config.num_processes, config.process_id)
    return LLMEngine.from_core(DataParallelCore(build_replicas(model_dir, config, show_progress)))


def start_async_engine(model_dir: str | os.PathLike, config: EngineConfig, max_queued_requests: int | None = None,
                       show_progress: bool = True, *, max_restarts: int = 0, step_timeout: float | None = None
                       ) -> AsyncEngine | ReplicaRouter | None:
    """The server's engine client, started: one AsyncEngine, or a ReplicaRouter over data_parallel_size of them
    sharing `max_queued_requests`. Multi-host: process 0 gets an AsyncEngine that also releases the followers
    when stopped; any other process runs the leader's steps until it stops, then gets None (serve nothing,
    exit). A dead engine is rebuilt from the checkpoint in place at most `max_restarts` times (single-host only:
    followers cannot follow a rebuild); `step_timeout` arms the hang watchdog."""
    if config.data_parallel_size == 1:
        core = EngineCore.from_model_dir(model_dir, config, show_progress=show_progress)
        if follow_if_follower(core) is not None:
            return None
        rebuild = (lambda: EngineCore.from_model_dir(model_dir, config, show_progress=False)
                   ) if jax.process_count() == 1 else None
        return LeaderAsyncEngine(core, max_queued_requests, bottleneck_monitor(core), rebuild=rebuild,
                                 max_restarts=max_restarts, step_timeout=step_timeout).start()
    initialize(config.coordinator_address, config.num_processes, config.process_id)
    meshes = data_parallel_meshes(config)
    cores = [EngineCore.from_model_dir(model_dir, config, show_progress=show_progress, mesh=mesh) for mesh in meshes]
    rebuilds = [lambda mesh=mesh: EngineCore.from_model_dir(model_dir, config, show_progress=False, mesh=mesh)
                for mesh in meshes]
    return ReplicaRouter.over(cores, max_queued_requests, rebuilds, max_restarts=max_restarts,
                              step_timeout=step_timeout).start()


class LeaderAsyncEngine(AsyncEngine):
    """AsyncEngine whose stop() also ends a multi-host run (EngineCore.close: the followers return)."""

    def stop(self, timeout: float | None = 30.0) -> None:
        super().stop(timeout)
        if self._core is not None and not self._abandoned:
            self._core.close()
