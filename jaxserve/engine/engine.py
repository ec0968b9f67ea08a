"""The engine core (scheduler + model runner, the only owner of device state) and LLMEngine, the offline front
end that pairs a core with an output processor.

    EngineCore.step():  plan N+1 = schedule()         (host, while the device still runs step N)
                        dispatch(plan N+1)            (asynchronous)
                        result N = fetch(step N)      (the only wait)
                        update the scheduler -> StepOutputs: frozen per-sample deltas + stats
    LLMEngine.step():   core.step() -> OutputProcessor (detokenize, stop strings) -> RequestOutputs

The core is single-threaded; `AsyncEngine` runs it on its own thread with the output processor on the event loop.
Timing and cost accounting sit behind `self.meter` (jaxserve.engine.stats.StepMeter, or NullMeter when off).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.buckets import BucketTable, engine_buckets
from jaxserve.engine.memory import KVPlan, plan_kv_cache, transient_bytes, wanted_pages
from jaxserve.engine.multihost import leader_mirror
from jaxserve.engine.messages import (EngineRequest, PromptLogprobsChunk, SampleDelta, SchedulerStats,
                                     SpecDecodeStats, StepOutputs)
from jaxserve.engine.output import OutputProcessor
from jaxserve.engine.placement import (abstract_on_mesh, create_on_mesh, engine_mesh, free_memory, kv_cache_shardings,
                                       model_sharder, place_model)
from jaxserve.engine.runner import ModelRunner, PendingStep
from jaxserve.engine.sampler import SamplingFlags, SlotState, slot_row
from jaxserve.engine.stats import NullMeter, StepMeter, StepRecord
from jaxserve.kv.allocator import PageAllocator
from jaxserve.kv.cache import KVCache
from jaxserve.models.kernels import Kernels
from jaxserve.models.llama import Llama, numpy_dtype
from jaxserve.outputs import OutputKind, RequestOutput, TokenLogprob
from jaxserve.parallel import multihost
from jaxserve.quant.kv import kv_storage_dtype
from jaxserve.quant.memory import weight_bytes
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec.ngram import NgramProposer
from jaxserve.scheduler.scheduler import (SampledToken, ScheduledSequence, Scheduler, SchedulerConfig,
                                          SequenceUpdate, StepPlan)
from jaxserve.validation import RequestLimits, validate_request

log = logging.getLogger(__name__)


def resolve_dtype(requested: str, checkpoint_dtype: str) -> str:
    """`auto` keeps the checkpoint's dtype on accelerators; on CPU, XLA's float32 matmuls are faster than bf16."""
    if requested != "auto":
        return requested
    return "float32" if jax.default_backend() == "cpu" else checkpoint_dtype


class EngineCore:
    """`mesh`: the devices this engine runs on (default: the first tensor_parallel_size devices, see
    jaxserve.engine.placement); a data-parallel replica gets its row of the global mesh. `tokenizer` is kept for
    the front ends (and gives the EOS ids when the model config has none). `metered=False` switches the step
    accounting off (no metrics, no bottleneck verdict)."""

    def __init__(self, model: Llama, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                 show_progress: bool = True, mesh: jax.sharding.Mesh | None = None, metered: bool = True):
        self.config = config
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.max_model_len = config.resolved_max_model_len(model.cfg)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, model.dtype)
        self.speculation = checked_speculation(config)
        self.kernels = Kernels.resolve(config.attention, config.matmul, self.kv_dtype)  # chosen once, here
        self.buckets = self._buckets()  # a ladder that misses a shape the scheduler can plan fails here
        self.sharder = model_sharder(model.cfg, mesh or engine_mesh(config), model.dtype)
        model = place_model(model, self.sharder)
        slots = create_on_mesh(lambda: SlotState.zeros(config.max_num_seqs + 1, self.max_model_len),
                               lambda a: self.sharder.replicated)
        free = free_memory(self.sharder.mesh)  # after the weights and the slot state, before the cache
        options = ({"xla_backend_optimization_level": config.xla_optimization_level}
                   if config.xla_optimization_level is not None else None)
        started = time.perf_counter()
        largest = self._cache(abstract_on_mesh, wanted_pages(config, self.max_model_len))  # measured against
        self.runner = ModelRunner(model, largest, slots, self.buckets, self.kernels, options, self.sharder)
        self.runner.mirror = leader_mirror()
        self.kv_plan = self._plan_kv(free, self.runner.measure_transients(self.buckets.largest_shapes()))
        self.runner.set_cache(self._cache(abstract_on_mesh, self.kv_plan.num_pages))
        self.runner.compile_all(_progress("compiling step shapes") if show_progress else None)
        self.compile_seconds = time.perf_counter() - started
        self.temporaries = transient_bytes(self.runner.executables.values())  # every shape's, all compiled now
        self.runner.set_cache(self._cache(create_on_mesh, self.kv_plan.num_pages))
        allocator = PageAllocator(self.kv_plan.num_pages, config.page_size, config.enable_prefix_caching)
        eos = model.cfg.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        spec = self.speculation
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.page_size,
                                                   spec.num_tokens if spec else 0,
                                                   spec.disable_batch_size if spec else None),
                                   allocator, eos, seed=config.seed, proposer=make_proposer(spec))
        self.meter = StepMeter(model.cfg.sliding_window) if metered else NullMeter()
        self._in_flight: PendingStep | None = None
        self._log_ready()

    def _log_ready(self) -> None:
        plan = self.kv_plan
        log.info("engine ready: %s attention, weights %s (%.1f MiB), step temporaries %.1f MiB (+%.1f MiB margin), "
                 "KV cache %s: %d pages of %d tokens (%.1f MiB), of %.1f MiB free per device; %d executables "
                 "compiled in %.1fs, %s", self.kernels.attention_name, self.weights_description,
                 self.weight_bytes / 2**20,
                 self.temporaries / 2**20, plan.margin / 2**20, self.kv_dtype.name, plan.num_pages, plan.page_size,
                 plan.cache_bytes / 2**20, plan.free_bytes / 2**20, self.runner.num_executables,
                 self.compile_seconds, self.sharder.describe())
        if self.temporaries > plan.temporaries + plan.margin:
            log.warning("a step shape needs %.1f MiB of temporaries, more than the %.1f MiB (+ margin) the KV cache "
                        "plan reserved from the largest shapes", self.temporaries / 2**20, plan.temporaries / 2**20)

    @property
    def stats(self):
        """The step records and totals (jaxserve.engine.stats.EngineStats) the metrics and benchmarks read."""
        return self.meter.stats

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len)

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model_config, jnp.dtype(self.runner.params["embed"][...].dtype).name)

    @property
    def weights_description(self) -> str:
        cfg = self.model_config
        if cfg.quantization is None and cfg.lm_head_quantization is None:
            return jnp.dtype(self.runner.params["embed"][...].dtype).name
        head = f", LM head {cfg.lm_head_quantization or 'float'}" if not cfg.tie_word_embeddings else ""
        return f"{cfg.quantization or 'float'} ({self.kernels.matmul_name} matmul{head})"

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, config: EngineConfig = EngineConfig(),
                       show_progress: bool = True, mesh: jax.sharding.Mesh | None = None) -> "EngineCore":
        """Loads a checkpoint straight into this engine's shardings. Joins a multi-host run first when
        config.coordinator_address is set."""
        from jaxserve.checkpoint import load_model
        from jaxserve.tokenizer import load_tokenizer
        multihost.initialize(config.coordinator_address, config.num_processes, config.process_id)
        if config.compilation_cache_dir != "":
            enable_compilation_cache(config.compilation_cache_dir)
        model_cfg = ModelConfig.load(model_dir)
        dtype = resolve_dtype(config.dtype, model_cfg.dtype)
        mesh = mesh or engine_mesh(config)
        sharder = model_sharder(model_cfg, mesh, numpy_dtype(dtype))
        model = load_model(model_dir, dtype=dtype, sharding_for=sharder.sharding)
        tokenizer = load_tokenizer(model_dir, model_type=model_cfg.family)
        return cls(model, config, tokenizer, show_progress=show_progress, mesh=mesh)

    def _plan_kv(self, free: int, temporaries: int) -> KVPlan:
        """Pages of the KV cache: what fits on the fullest device of the mesh beside the step executables'
        temporaries, each device holding its share of KV heads (jaxserve.engine.memory)."""
        return plan_kv_cache(self.model_config, self.config, self.max_model_len, self.kv_dtype, free, temporaries,
                             kv_shards=self.sharder.shards("kv_heads"))

    def _cache(self, on_mesh: Callable, num_pages: int) -> KVCache:
        """The cache of `num_pages` pages on the mesh: allocated (create_on_mesh) or abstract (abstract_on_mesh, to
        compile against before it exists)."""
        cfg = self.model_config
        return on_mesh(lambda: KVCache.zeros(cfg.num_layers, cfg.num_kv_heads, num_pages, self.config.page_size,
                                             cfg.head_dim, self.kv_dtype),
                       lambda a: kv_cache_shardings(a, self.sharder))

    def close(self) -> None:
        """Ends a multi-host run: the followers stop after the steps already published (no-op otherwise)."""
        if self.runner.mirror is not None:
            self.runner.mirror.stop()
            self.runner.mirror = None

    def _buckets(self) -> BucketTable:
        return engine_buckets(self.config, self.max_model_len, self.kernels.attention_name)

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request (jaxserve.validation). Raises ValueError for an id already in use."""
        if not self.has_unfinished_requests():
            self.meter.work_arrived()  # the device's idle time until now was not the host's doing
        self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.params,
                                   request.arrival_time, request.priority)

    def abort_request(self, request_id: str) -> tuple[SampleDelta, ...]:
        """Ends every unfinished sample of the request with "abort"; their final deltas (none if unknown)."""
        return tuple(SampleDelta(request_id, index, finish_reason="abort")
                     for index in self.scheduler.abort_request(request_id))

    def finish_sample(self, request_id: str, index: int, stop: str) -> bool:
        """A stop string ended this sample (the output processor saw it): frees its sequence. True if that was
        the request's last unfinished sample. A token already computed for it is dropped when it comes back."""
        return self.scheduler.finish_sample(request_id, index, "stop", stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests or self._in_flight is not None

    def stats_snapshot(self) -> SchedulerStats:
        scheduler = self.scheduler
        prefix = scheduler.allocator.stats
        return SchedulerStats(len(scheduler.running), scheduler.num_waiting, scheduler.allocator.usage,
                              scheduler.num_preemptions, prefix.queries, prefix.hits, self.meter.stats.totals,
                              SpecDecodeStats.of(scheduler.speculation))

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """Schedules and dispatches the next step, then reads back the previous one's results (or, without
        async_scheduling, this step's own) and turns them into deltas."""
        self.meter.step_started(self._in_flight)
        one_ahead = self.config.async_scheduling and not self.scheduler.speculating
        earlier = ((), (), None)
        if self._in_flight is not None and not one_ahead:  # proposals need every sequence's newest token
            earlier, self._in_flight = self._finish_step(self._in_flight), None
        plan = self.scheduler.schedule()
        pending = self._dispatch(plan) if not plan.is_empty else None
        if one_ahead:
            previous, self._in_flight = self._in_flight, pending
        else:
            previous = pending
        deltas, finished, record = self._finish_step(previous) if previous is not None else ((), (), None)
        records = tuple(r for r in (earlier[2], record) if r is not None)
        return StepOutputs(earlier[0] + self._scheduling_deltas(plan) + deltas, self.stats_snapshot(),
                           earlier[1] + finished, time.monotonic(), records)

    def _dispatch(self, plan: StepPlan) -> PendingStep:
        for assignment in plan.new_slots:
            self.runner.assign_slot(assignment.slot, slot_row(
                assignment.token_ids, assignment.num_prompt_tokens, assignment.params, assignment.seed,
                self.scheduler.eos_token_ids, self.max_model_len))
        flags = SamplingFlags.NONE
        for row in plan.seqs:
            flags |= SamplingFlags.of(row.params)
        if not any(row.prompt_logprobs for row in plan.seqs):
            flags &= ~SamplingFlags.PROMPT_LOGPROBS
        self.meter.dispatching(plan)
        pending = self.runner.dispatch(plan, flags)
        self.meter.dispatched(pending, self.config.async_scheduling)
        return pending

    def _scheduling_deltas(self, plan: StepPlan) -> tuple[SampleDelta, ...]:
        if not plan.new_slots:
            return ()
        now = time.monotonic()
        return tuple(SampleDelta(a.request_id, a.index, scheduled_time=now) for a in plan.new_slots)

    def _finish_step(self, pending: PendingStep) -> tuple[tuple[SampleDelta, ...], tuple[str, ...], StepRecord]:
        fetch = self.meter.fetch_started(pending)
        sampled = np.asarray(pending.sampled.tokens)
        self.meter.fetch_done(pending, fetch)
        rows = pending.plan.seqs
        tokens = sampled_tokens(pending, sampled)
        prompt_chunks = prompt_logprobs_chunks(pending)
        updates = {(u.request_id, u.index): u for u in self.scheduler.update(pending.plan, tokens)}
        deltas = tuple(_delta(row, updates.get((row.request_id, row.index)), prompt_chunks.get(i))
                       for i, row in enumerate(rows)
                       if (row.request_id, row.index) in updates or i in prompt_chunks)
        record = self.meter.step_finished(pending, sum(len(t) for t in tokens if t is not None))
        finished = {u.request_id for u in updates.values() if u.finished}
        return deltas, tuple(rid for rid in finished if rid not in self.scheduler.requests), record


class LLMEngine:
    """The offline front end: an engine core (one, or data-parallel replicas) plus an output processor, driven
    synchronously by its caller. Requests are validated here, once (jaxserve.validation)."""

    def __init__(self, model: Llama, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                 show_progress: bool = True, mesh: jax.sharding.Mesh | None = None):
        self._attach(EngineCore(model, config, tokenizer, show_progress=show_progress, mesh=mesh))

    @classmethod
    def from_core(cls, core) -> "LLMEngine":
        """Over an EngineCore, or a DataParallelCore (jaxserve.engine.replicas)."""
        engine = cls.__new__(cls)
        engine._attach(core)
        return engine

    def _attach(self, core) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.processor = OutputProcessor(core.tokenizer)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, config: EngineConfig = EngineConfig(),
                       show_progress: bool = True, mesh: jax.sharding.Mesh | None = None) -> "LLMEngine":
        return cls.from_core(EngineCore.from_model_dir(model_dir, config, show_progress, mesh))

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, prompt_text: str | None = None,
                    kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Validates and queues a request; raises jaxserve.validation.InvalidRequestError (a ValueError) naming
        the parameter. `prompt` is text or token ids; with ids, `prompt_text` is the text they came from."""
        params = params or SamplingParams()
        text, prompt_ids = tokenize(self.tokenizer, prompt)
        validate_request(prompt_ids, params, self.core.limits)
        if request_id in self.processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(EngineRequest(request_id, prompt_ids, params, arrival, priority))
        self.processor.add(request_id, text if prompt_text is None else prompt_text, prompt_ids, params, arrival,
                           kind)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """The request's final output (finish_reason "abort"), or None for an unknown or finished one."""
        deltas = self.core.abort_request(request_id)
        outputs, _ = self.processor.process(StepOutputs(deltas, SchedulerStats(), (), time.monotonic()))
        self.processor.drop(request_id)
        return next((o for o in outputs if o.finished), None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        step = self.core.step()
        outputs, stops = self.processor.process(step)
        for stop in stops:
            self.core.finish_sample(stop.request_id, stop.index)
        return outputs

    def run_until_done(self) -> list[RequestOutput]:
        """Steps until every request has finished; returns the final output of each."""
        finals = []
        while self.has_unfinished_requests():
            finals.extend(o for o in self.step() if o.finished)
        return finals

    def close(self) -> None:
        self.core.close()


def tokenize(tokenizer, prompt: str | Seq[int]) -> tuple[str | None, tuple[int, ...]]:
    """Text -> (text, ids); ids -> (None, ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompts as token ids")
        return prompt, tuple(tokenizer.encode(prompt))
    return None, tuple(int(t) for t in prompt)


def _delta(row: ScheduledSequence, update: SequenceUpdate | None, chunk: PromptLogprobsChunk | None) -> SampleDelta:
    if update is None:
        return SampleDelta(row.request_id, row.index, prompt_logprobs=chunk)
    logprobs = (tuple(TokenLogprob(t.token_id, t.logprob, t.top) for t in update.tokens)
                if row.params.logprobs is not None else None)
    return SampleDelta(row.request_id, row.index, tuple(t.token_id for t in update.tokens), logprobs,
                       update.finish_reason, update.stop_reason, chunk)


def sampled_tokens(pending: PendingStep, sampled: np.ndarray) -> list[tuple[SampledToken, ...] | None]:
    """Each plan row's new tokens (None for rows that did not sample): one, or on a verify step the accepted
    proposals and the target's next token; with their logprobs when the step computed them."""
    verifying = sampled.ndim == 2
    counts = np.asarray(pending.sampled.num_accepted) + 1 if verifying else None
    logprobs = sampled_logprobs(pending)
    out = []
    for i, row in enumerate(pending.plan.seqs):
        if not row.sample:
            out.append(None)
            continue
        ids = sampled[i, :counts[i]].tolist() if verifying else [int(sampled[i])]
        out.append(tuple(SampledToken(t, *logprobs[i][j]) if logprobs else SampledToken(t)
                         for j, t in enumerate(ids)))
    return out


def sampled_logprobs(pending: PendingStep) -> list[list[tuple[float, tuple]]] | None:
    """(logprob, top alternatives) per plan row and sampled position, each row with as many alternatives as its
    request asked for."""
    if not pending.flags.logprobs:
        return None
    out = pending.sampled
    chosen, top_ids, top_lp = np.asarray(out.logprobs), np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    if chosen.ndim == 1:  # one position per row
        chosen, top_ids, top_lp = chosen[:, None], top_ids[:, None], top_lp[:, None]
    rows = []
    for i, row in enumerate(pending.plan.seqs):
        k = row.params.logprobs or 0
        rows.append([(float(chosen[i, j]), tuple(zip(top_ids[i, j, :k].tolist(), top_lp[i, j, :k].tolist())))
                     for j in range(chosen.shape[1])])
    return rows


def prompt_logprobs_chunks(pending: PendingStep) -> dict[int, PromptLogprobsChunk]:
    """Plan row -> the scores of its chunk's tokens: the score at position p is for the prompt token at p + 1."""
    if pending.prompt_logprobs is None:
        return {}
    lp = pending.prompt_logprobs
    chosen, top_ids, top_lp = np.asarray(lp.chosen), np.asarray(lp.top_ids), np.asarray(lp.top_logprobs)
    chunks, start = {}, 0
    for i, row in enumerate(pending.plan.seqs):
        end = start + row.num_new_tokens
        if row.prompt_logprobs:
            k = row.params.prompt_logprobs or 0
            tops = tuple(tuple(zip(ids, lps)) for ids, lps in zip(top_ids[start:end, :k].tolist(),
                                                                   top_lp[start:end, :k].tolist()))
            chunks[i] = PromptLogprobsChunk(row.context_len - row.num_new_tokens + 1,
                                            tuple(chosen[start:end].tolist()), tops)
        start = end
    return chunks


def checked_speculation(config: EngineConfig):
    """The engine's speculative-decoding settings (jaxserve.config.SpeculativeConfig), or None when off."""
    if config.speculative_method == "draft":
        raise ConfigError("--speculative-method draft is not implemented yet; use --speculative-method ngram")
    spec = config.speculation()
    if spec is None:
        return None
    if config.coordinator_address is not None:
        raise ConfigError("speculative decoding is single-host for now: drop --speculative-method or "
                          "--coordinator-address")
    return spec


def make_proposer(spec):
    if spec is None:
        return None
    return NgramProposer(spec.ngram_min, spec.ngram_max)


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache: a restart with the same shapes loads executables instead of compiling."""
    from jaxserve.config import default_compilation_cache_dir
    path = directory or default_compilation_cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _progress(description: str):
    def wrap(items, total=None):
        from tqdm import tqdm
        return tqdm(items, desc=description, total=total, unit="executable", leave=False)
    return wrap
