"""The engine: scheduler + model runner + output processing. One `step()` is schedule, run, post-process.

    step():  plan N+1 = schedule()            (host, while the device still runs step N)
             dispatch(plan N+1)               (asynchronous)
             result N = fetch(step N)         (the only wait)
             update scheduler, detokenize, stop strings -> RequestOutputs

Single-threaded and synchronous from the caller's point of view; `AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.memory import KVPlan, plan_kv_cache
from jaxserve.engine.multihost import leader_mirror
from jaxserve.engine.output import RequestState
from jaxserve.engine.placement import (create_on_mesh, engine_mesh, free_memory, kv_cache_shardings, model_sharder,
                                       place_model)
from jaxserve.engine.runner import ModelRunner, PendingStep
from jaxserve.engine.sampler import SamplingFlags, SlotState, slot_row
from jaxserve.engine.stats import EngineStats, StepClock, StepRecord, attention_work
from jaxserve.kv.allocator import PageAllocator
from jaxserve.kv.cache import KVCache
from jaxserve.models.kernels import Kernels
from jaxserve.models.llama import Llama, numpy_dtype
from jaxserve.outputs import RequestOutput
from jaxserve.parallel import multihost
from jaxserve.quant.kv import kv_storage_dtype
from jaxserve.quant.memory import weight_bytes
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import SampledToken, Scheduler, SchedulerConfig, StepPlan

log = logging.getLogger(__name__)


def resolve_dtype(requested: str, checkpoint_dtype: str) -> str:
    """`auto` keeps the checkpoint's dtype on accelerators; on CPU, XLA's float32 matmuls are faster than bf16."""
    if requested != "auto":
        return requested
    return "float32" if jax.default_backend() == "cpu" else checkpoint_dtype


class LLMEngine:
    """`mesh`: the devices this engine runs on (default: the first tensor_parallel_size devices, see
    jaxserve.engine.placement); a data-parallel replica gets its row of the global mesh."""

    def __init__(self, model: Llama, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                 show_progress: bool = True, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.max_model_len = config.resolved_max_model_len(model.cfg)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, model.dtype)
        self.kernels = Kernels.resolve(config.attention, config.matmul, self.kv_dtype)  # chosen once, here
        self.sharder = model_sharder(model.cfg, mesh or engine_mesh(config), model.dtype)
        model = place_model(model, self.sharder)
        self.kv_plan = self._plan_kv(model)
        kv = create_on_mesh(lambda: KVCache.zeros(model.cfg.num_layers, model.cfg.num_kv_heads,
                                                  self.kv_plan.num_pages, config.page_size, model.cfg.head_dim,
                                                  self.kv_dtype), lambda a: kv_cache_shardings(a, self.sharder))
        slots = create_on_mesh(lambda: SlotState.zeros(config.max_num_seqs + 1, self.max_model_len),
                               lambda a: self.sharder.replicated)
        self.buckets = self._buckets()
        options = ({"xla_backend_optimization_level": config.xla_optimization_level}
                   if config.xla_optimization_level is not None else None)
        self.runner = ModelRunner(model, kv, slots, self.buckets, self.kernels, options, self.sharder)
        self.runner.mirror = leader_mirror()
        self.compile_seconds = self.runner.compile_all(_progress("compiling step shapes") if show_progress else None)
        allocator = PageAllocator(self.kv_plan.num_pages, config.page_size, config.enable_prefix_caching)
        eos = model.cfg.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        self.eos_token_ids = tuple(eos)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.page_size), allocator, self.eos_token_ids,
                                   seed=config.seed)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._in_flight: PendingStep | None = None
        self._clocks: dict[int, StepClock] = {}  # step id -> what the host saw of it, while it is in flight
        log.info("engine ready: %s attention, weights %s (%.1f MiB), KV cache %s: %d pages of %d tokens (%.1f MiB), "
                 "%d step shapes compiled in %.1fs, %s", self.kernels.attention_name, self.weights_description,
                 self.weight_bytes / 2**20, self.kv_dtype.name, self.kv_plan.num_pages, config.page_size,
                 self.kv_plan.cache_bytes / 2**20, self.runner.num_executables, self.compile_seconds,
                 self.sharder.describe())

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
                       show_progress: bool = True, mesh: jax.sharding.Mesh | None = None) -> "LLMEngine":
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

    def _plan_kv(self, model: Llama) -> KVPlan:
        """Pages of the KV cache: what fits on the fullest device of the mesh, each holding its share of KV heads."""
        return plan_kv_cache(model.cfg, self.config, self.max_model_len, self.kv_dtype.itemsize,
                             free_memory(self.sharder.mesh), KVCache.scale_bytes(self.kv_dtype),
                             kv_shards=self.sharder.shards("kv_heads"))

    def close(self) -> None:
        """Ends a multi-host run: the followers stop after the steps already published (no-op otherwise)."""
        if self.runner.mirror is not None:
            self.runner.mirror.stop()
            self.runner.mirror = None

    def _buckets(self) -> BucketTable:
        c = self.config
        max_pages = -(-self.max_model_len // c.page_size)
        context = c.context_buckets and tuple(-(-t // c.page_size) for t in c.context_buckets)
        if self.kernels.attention_name == "pallas" and not context:
            context = (max_pages,)  # the kernels read only the pages a sequence has
        return BucketTable.build(c.max_num_seqs, c.max_num_batched_tokens, max_pages,
                                 decode_sizes=c.decode_buckets, token_sizes=c.prefill_token_buckets,
                                 seq_sizes=c.prefill_seq_buckets, context_pages=context)

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    prompt_text: str | None = None, stream: bool = True) -> RequestState:
        """Validates and queues a request. Raises ValueError with a message fit for a 400 response.
        `prompt` is text or token ids; with ids, `prompt_text` is the text they came from (for outputs)."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        text, prompt_ids = self._tokenize(prompt)
        prompt_text = text if prompt_text is None else prompt_text
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if not self.has_unfinished_requests():
            self.stats.work_arrived(time.perf_counter())  # the device's idle time until now was not the host's doing
        seqs = self.scheduler.add_request(request_id, prompt_ids, params, arrival, priority)
        state = RequestState(request_id, prompt_text, prompt_ids, params, seqs, self.tokenizer, arrival, stream)
        self.requests[request_id] = state
        return state

    def _tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        self.scheduler.abort_request(request_id)
        if state is None:
            return None
        return state.finish_all("abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches the next step, then processes the previous one's results (or, without
        async_scheduling, this step's own)."""
        started = time.perf_counter()
        device_idle = self._in_flight is None or self._look_at(self._in_flight, started)
        plan = self.scheduler.schedule()
        pending = self._dispatch(plan) if not plan.is_empty else None
        scheduled_at = time.perf_counter()
        if self.config.async_scheduling:
            previous, self._in_flight = self._in_flight, pending
            if pending is not None and device_idle and self.stats.sample_due(pending.shape):
                pending.sampled.tokens.block_until_ready()  # an exact sample of its device time (engine/stats.py)
                self._clocks[pending.plan.step_id].end = time.perf_counter()
        else:
            previous = pending
        outputs = self._finish_step(previous) if previous is not None else []
        self.stats.host_seconds += scheduled_at - started
        return outputs

    def _dispatch(self, plan: StepPlan) -> PendingStep:
        now = time.monotonic()
        for assignment in plan.new_slots:
            self._note_first_scheduled(assignment.seq_id, now)
            self.runner.assign_slot(assignment.slot, slot_row(
                assignment.token_ids, assignment.num_prompt_tokens, assignment.params, assignment.seed,
                self.eos_token_ids, self.max_model_len))
        flags = SamplingFlags.NONE
        for row in plan.seqs:
            flags |= SamplingFlags.of(self.scheduler.sequences[row.seq_id].params)
        if not any(row.prompt_logprobs for row in plan.seqs):
            flags &= ~SamplingFlags.PROMPT_LOGPROBS
        self._clocks[plan.step_id] = StepClock(time.perf_counter())
        return self.runner.dispatch(plan, flags)

    def _look_at(self, pending: PendingStep, now: float) -> bool:
        """A non-blocking check: has the step in flight finished on the device?"""
        ready = pending.sampled.tokens.is_ready()
        if ready:
            self._clocks[pending.plan.step_id].saw_ready(now)
        return ready

    def _note_first_scheduled(self, seq_id: int, now: float) -> None:
        state = self.requests.get(self.scheduler.sequences[seq_id].request_id)
        if state is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = now

    def _finish_step(self, pending: PendingStep) -> list[RequestOutput]:
        clock = self._clocks.pop(pending.plan.step_id)
        wait_start = time.perf_counter()
        blocked = not pending.sampled.tokens.is_ready()
        sampled = np.asarray(pending.sampled.tokens)
        waited = clock.fetched(wait_start, time.perf_counter(), blocked)
        logprobs = self._fetch_logprobs(pending)
        tokens = [SampledToken(int(sampled[i]), *logprobs[i]) if logprobs else SampledToken(int(sampled[i]))
                  for i in range(len(pending.plan.seqs))]
        touched = self._record_prompt_logprobs(pending)  # before update(), which forgets finished sequences
        updates = self.scheduler.update(pending.plan, tokens)
        now = time.monotonic()
        for update in updates:
            state = self.requests.get(update.seq.request_id)
            if state is None:
                continue
            stop = state.append_token(update.seq, update.token, now)
            if stop is not None:
                self.scheduler.finish(update.seq, "stop", stop)
            touched.add(state.request_id)
        self.stats.record(self._step_record(pending, waited, clock))
        return self._collect(touched, now)

    def _step_record(self, pending: PendingStep, waited: float, clock: StepClock) -> StepRecord:
        rows, window = pending.plan.seqs, self.model_config.sliding_window
        return StepRecord(pending.shape, pending.plan.num_tokens, len(rows), pending.dispatched_at,
                          time.perf_counter(), waited, sampled_tokens=sum(row.sample for row in rows),
                          context_tokens=sum(row.context_len for row in rows),
                          attended_pairs=sum(attention_work(row.context_len, row.num_new_tokens, window)
                                             for row in rows),
                          dispatch_started=clock.dispatch_started, ready_at=clock.ready_at,
                          end_exact=clock.end is not None, page_stall=pending.plan.waiting_for_pages)

    def _fetch_logprobs(self, pending: PendingStep):
        if not pending.flags.logprobs:
            return None
        out = pending.sampled
        chosen, top_ids, top_lp = np.asarray(out.logprobs), np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        rows = []
        for i, row in enumerate(pending.plan.seqs):
            seq = self.scheduler.sequences.get(row.seq_id)
            k = seq.params.logprobs if seq is not None and seq.params.logprobs else 0
            rows.append((float(chosen[i]), tuple(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))))
        return rows

    def _record_prompt_logprobs(self, pending: PendingStep) -> set[str]:
        touched: set[str] = set()
        if pending.prompt_logprobs is None:
            return touched
        lp = pending.prompt_logprobs
        chosen, top_ids, top_lp = np.asarray(lp.chosen), np.asarray(lp.top_ids), np.asarray(lp.top_logprobs)
        start = 0
        for row in pending.plan.seqs:
            seq = self.scheduler.sequences.get(row.seq_id)
            state = self.requests.get(seq.request_id) if seq is not None else None
            if row.prompt_logprobs and state is not None:
                first_pos = row.context_len - row.num_new_tokens
                state.add_prompt_logprobs(first_pos, chosen[start:start + row.num_new_tokens],
                                          top_ids[start:start + row.num_new_tokens],
                                          top_lp[start:start + row.num_new_tokens])
                touched.add(state.request_id)
            start += row.num_new_tokens
        return touched

    def _collect(self, touched: Iterable[str], now: float) -> list[RequestOutput]:
        outputs = []
        for request_id in touched:
            state = self.requests.get(request_id)
            if state is None or not (state.stream or state.finished):
                continue
            outputs.append(state.output(now))
            if state.finished:
                del self.requests[request_id]
        return outputs

    # ---- conveniences ---------------------------------------------------------------------------------------
    def run_until_done(self) -> list[RequestOutput]:
        """Steps until every request has finished; returns the final output of each."""
        finals = []
        while self.has_unfinished_requests():
            finals.extend(o for o in self.step() if o.finished)
        return finals


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
