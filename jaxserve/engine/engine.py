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

import concurrent.futures
import dataclasses
import logging
import operator
import os
import time
from pathlib import Path
from typing import Callable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import host_memory
from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.buckets import BucketTable, engine_buckets
from jaxserve.engine.memory import KVPlan, plan_kv_cache, transient_bytes, wanted_pages
from jaxserve.engine.multihost import leader_mirror
from jaxserve.engine.messages import (EngineRequest, PromptLogprobsChunk, SampleDelta, SchedulerStats,
                                     SpecDecodeStats, StepOutputs)
from jaxserve.engine.output import OutputProcessor
from jaxserve.engine.placement import (abstract_on_mesh, create_on_mesh, engine_mesh, free_memory, kept_weights,
                                       kv_cache_shardings, model_sharder, place_model)
from jaxserve.engine.runner import ModelRunner, PendingForward, PendingStep
from jaxserve.engine.sampler import SamplingFlags, SlotState, slot_row
from jaxserve.engine.stats import NullMeter, StepMeter, StepRecord
from jaxserve.kv.allocator import PageAllocator
from jaxserve.kv.cache import KVCache
from jaxserve.lora import LoRARequest
from jaxserve.lora import weights as lora_weights
from jaxserve.lora.adapter import LoraError, read_adapter
from jaxserve.lora.registry import AdapterRegistry, LoraInfo, LoraInUseError, parse_lora_module
from jaxserve.lora.slots import AdapterSlots
from jaxserve.models.kernels import Kernels
from jaxserve.models.llama import Llama, numpy_dtype, pack_weights, stored_dtypes
from jaxserve.outputs import OutputKind, RequestOutput, TokenLogprob
from jaxserve.parallel import multihost
from jaxserve.quant.kv import kv_storage_dtype
from jaxserve.quant.memory import weight_bytes
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec.draft import DeviceProposals, check_draft_config, load_draft
from jaxserve.spec.ngram import NgramProposer
from jaxserve.scheduler.scheduler import (SampledToken, ScheduledSequence, Scheduler, SchedulerConfig,
                                          SequenceUpdate, StepPlan)
from jaxserve.structured.grammar import GrammarCompiler
from jaxserve.structured.matchers import StructuredOutputs
from jaxserve.validation import InvalidRequestError, RequestLimits, check_text, validate_request

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
                 show_progress: bool = True, mesh: jax.sharding.Mesh | None = None, metered: bool = True,
                 draft: Llama | None = None, owns_model: bool = False):
        """`draft`: the draft model of --speculative-method draft, when the caller has it in memory (otherwise
        read from config.speculative_model). `owns_model`: the caller hands `model` over and will not use it again
        (from_model_dir): the engine may then store the weights its kernels read in their own layout, freeing each
        original as it goes (pack_weights: the CPU matmul's panels). A model the caller keeps is used as it is, so
        its weights are never in memory twice."""
        self.config = config
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.max_model_len = config.resolved_max_model_len(model.cfg)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, model.dtype)
        self.speculation = checked_speculation(config)
        self.kernels = Kernels.resolve(config.attention, config.matmul, self.kv_dtype,  # chosen once, here
                                       config.tensor_parallel_size)
        self.buckets = self._buckets()  # a ladder that misses a shape the scheduler can plan fails here
        self.sharder = model_sharder(model.cfg, mesh or engine_mesh(config), model.dtype)
        model = place_model(self._with_adapters(model), self.sharder)
        self.stored_dtypes = stored_dtypes(model)
        model.cfg = model.cfg.for_context(self.max_model_len)  # LongRoPE picks its factors once, for this length
        loads_draft = draft is None
        draft = self._draft(model, draft, tokenizer)
        # the kernels' layout for the weights they read every step (owned ones), before free memory is measured
        model = pack_weights(model, self.kernels) if owns_model else model
        draft = pack_weights(draft, self.kernels) if draft is not None and loads_draft else draft
        slots = create_on_mesh(lambda: SlotState.zeros(config.max_num_seqs + 1, self.max_model_len),
                               lambda a: self.sharder.replicated)
        free = free_memory(self.sharder.mesh)  # after the weights and the slot state, before the cache
        options = ({"xla_backend_optimization_level": config.xla_optimization_level}
                   if config.xla_optimization_level is not None else None)
        started = time.perf_counter()
        largest = wanted_pages(config, self.max_model_len)  # the cache the largest shapes are measured against
        self.runner = ModelRunner(model, self._cache(abstract_on_mesh, largest), slots, self.buckets, self.kernels,
                                  options, self.sharder, draft, self._draft_cache(abstract_on_mesh, largest))
        self.runner.mirror = leader_mirror()
        self.kv_plan = self._plan_kv(free, self.runner.measure_transients(self.buckets.largest_shapes()))
        self.runner.set_cache(self._cache(abstract_on_mesh, self.kv_plan.num_pages),
                              self._draft_cache(abstract_on_mesh, self.kv_plan.num_pages))
        self.runner.compile_all(_progress("compiling step shapes") if show_progress else None)
        self.compile_seconds = time.perf_counter() - started
        self.temporaries = transient_bytes(self.runner.all_executables())  # every shape's, all compiled now
        self.runner.set_cache(self._cache(create_on_mesh, self.kv_plan.num_pages),
                              self._draft_cache(create_on_mesh, self.kv_plan.num_pages))
        allocator = PageAllocator(self.kv_plan.num_pages, config.page_size, config.enable_prefix_caching)
        eos = model.cfg.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        spec = self.speculation
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.page_size,
                                                   spec.num_tokens if spec else 0,
                                                   spec.disable_batch_size if spec else None,
                                                   decode_burst=self.buckets.burst_tokens,
                                                   decode_burst_max_batch=self.buckets.burst_batch),
                                   allocator, eos, seed=config.seed, proposer=make_proposer(spec, draft),
                                   adapter_slots=self._adapter_slots)
        for item in config.lora_modules if not config.merge_lora else ():
            self.add_lora(*parse_lora_module(item))
        window = model.cfg.sliding_window if model.cfg.layer_types is None else None  # mixed layers: count all
        self.meter = StepMeter(window) if metered else NullMeter()
        # grammar matchers of constrained samples (jaxserve.structured); the compiler is shared with front ends
        self.structured = StructuredOutputs(GrammarCompiler(tokenizer, model.cfg.vocab_size, eos))
        # late masks (constrained rows one step ahead, jaxserve.structured.matchers): the split decode executables
        # compile in the background from the first constrained request; a multi-host run's followers replay
        # fused steps only, and without async scheduling nothing is ahead
        self._split_decode: concurrent.futures.Future | None = None
        self._late_masks_possible = config.async_scheduling and self.runner.mirror is None and draft is None
        self._in_flight: PendingStep | None = None
        host_memory.release()  # loading's and compiling's host buffers; the steps' stay resident from here on
        huge = host_memory.huge_pages(self.runner.resident_arrays())  # what every step streams, in 2 MB pages
        if huge:
            log.info("weights and KV cache: %.0f MB in huge pages", huge / 2**20)
        self._log_ready()

    def _with_adapters(self, model: Llama) -> Llama:
        """With --enable-lora: the model with empty adapter slots, an adapter registry and the slot manager.
        With --merge-lora: the model with its one adapter merged into the weights."""
        config = self.config
        self.adapters = AdapterRegistry(config.max_lora_rank) if config.enable_lora else None
        self._adapter_slots = AdapterSlots(config.max_loras) if config.enable_lora else None
        self.merged_adapter: LoraInfo | None = None
        if config.merge_lora:
            return self._merge_adapter(model)
        if not config.enable_lora:
            if config.lora_modules:
                raise ConfigError("--lora-modules needs --enable-lora")
            return model
        if config.data_parallel_size > 1 or jax.process_count() > 1:
            raise ConfigError("LoRA adapters are served by one engine on one host for now: --enable-lora does not "
                              "combine with --data-parallel-size > 1 or multi-host runs")
        if config.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be at least 1, not {config.max_lora_rank}")
        if config.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, not {config.max_loras}")
        return lora_weights.attach(model, config.max_loras, config.max_lora_rank)

    def _merge_adapter(self, model: Llama) -> Llama:
        config = self.config
        if config.enable_lora or len(config.lora_modules) != 1:
            raise ConfigError("--merge-lora merges exactly one adapter: give one --lora-modules NAME=DIR, without "
                              "--enable-lora (which serves adapters side by side instead)")
        if model.cfg.quantization is not None:
            raise ConfigError("--merge-lora needs float base weights; this checkpoint's projections are "
                              f"{model.cfg.quantization}: serve the adapter with --enable-lora instead")
        name, path = parse_lora_module(config.lora_modules[0])
        adapter = read_adapter(path, model.cfg)
        self.merged_adapter = LoraInfo(name, 0, str(path), adapter.rank, adapter.target_weights)
        log.info("LoRA adapter %s (rank %d) merged into the base weights", name, adapter.rank)
        return lora_weights.merge(model, adapter)

    def _draft(self, model: Llama, draft: Llama | None, tokenizer) -> Llama | None:
        """The draft model of --speculative-method draft, checked against the target and placed on the mesh (its
        cache is planned with the target's: jaxserve.spec.draft); None for other methods."""
        spec = self.speculation
        self._draft_config = None
        if spec is None or spec.method != "draft":
            if draft is not None:
                raise ConfigError("a draft model was given, but --speculative-method is not draft")
            return None
        if draft is None:  # loaded on the default device, then placed (one device: checked_speculation)
            draft = load_draft(spec.draft_model, model.cfg, tokenizer, jnp.dtype(model.dtype).name,
                               self.max_model_len)
        else:
            check_draft_config(draft.cfg, model.cfg, self.max_model_len)
        draft = place_model(draft, model_sharder(draft.cfg, self.sharder.mesh, draft.dtype))
        draft.cfg = self._draft_config = draft.cfg.for_context(self.max_model_len)
        log.info("speculative decoding with draft model %s: %d layers, %.1fM parameters, K = %d",
                 spec.draft_model or "(given in memory)", draft.cfg.num_layers, draft.cfg.num_params() / 1e6,
                 spec.num_tokens)
        return draft

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
    def draft_config(self) -> ModelConfig | None:
        """The draft model's config (--speculative-method draft), else None."""
        return self._draft_config

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len, self.speculation is not None)

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model_config, jnp.dtype(self.runner.params["embed"][...].dtype).name,
                            self.stored_dtypes)

    @property
    def weights_description(self) -> str:
        cfg = self.model_config
        if cfg.quantization is None and cfg.lm_head_quantization is None:
            dtype = jnp.dtype(self.runner.params["embed"][...].dtype).name
            kept = sorted(set(self.stored_dtypes.values()))
            return f"{dtype} (projections stored {', '.join(kept)})" if kept else dtype
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
        model = load_model(model_dir, dtype=dtype, sharding_for=sharder.sharding,
                           keep_stored=kept_weights(model_cfg, config, dtype))
        tokenizer = load_tokenizer(model_dir, model_type=model_cfg.family)
        return cls(model, config, tokenizer, show_progress=show_progress, mesh=mesh, owns_model=True)

    def _plan_kv(self, free: int, temporaries: int) -> KVPlan:
        """Pages of the KV cache: what fits on the fullest device of the mesh beside the step executables'
        temporaries, each device holding its share of KV heads (jaxserve.engine.memory); with a draft model, a
        page is the target's and the draft's."""
        return plan_kv_cache(self.model_config, self.config, self.max_model_len, self.kv_dtype, free, temporaries,
                             kv_shards=self.sharder.shards("kv_heads"), draft=self._draft_config)

    def _cache(self, on_mesh: Callable, num_pages: int) -> KVCache:
        """The cache of `num_pages` pages on the mesh: allocated (create_on_mesh) or abstract (abstract_on_mesh, to
        compile against before it exists)."""
        cfg = self.model_config
        return on_mesh(lambda: KVCache.zeros(cfg.num_layers, cfg.num_kv_heads, num_pages, self.config.page_size,
                                             cfg.head_dim, self.kv_dtype),
                       lambda a: kv_cache_shardings(a, self.sharder))

    def _draft_cache(self, on_mesh: Callable, num_pages: int) -> KVCache | None:
        """The draft model's cache: as many pages as the target's, of the draft's layers and heads."""
        cfg = self._draft_config
        if cfg is None:
            return None
        return on_mesh(lambda: KVCache.zeros(cfg.num_layers, cfg.num_kv_heads, num_pages, self.config.page_size,
                                             cfg.head_dim, self.kv_dtype),
                       lambda a: kv_cache_shardings(a, self.sharder))

    def close(self) -> None:
        """Ends a multi-host run: the followers stop after the steps already published (no-op otherwise)."""
        if self.runner.mirror is not None:
            self.runner.mirror.stop()
            self.runner.mirror = None

    def _buckets(self) -> BucketTable:
        config = self.config
        if jax.process_count() > 1:  # the followers replay plain steps (jaxserve.engine.multihost)
            config = config.replace(decode_burst=1)
        return engine_buckets(config, self.max_model_len, self.kernels.attention_name)

    # ---- LoRA adapters --------------------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Reads a PEFT adapter directory and registers it as `name` (raises LoraError naming the problem). It
        takes a device slot when a request first runs with it."""
        if self.adapters is None:
            raise LoraError("LoRA adapters need an engine started with --enable-lora (enable_lora=True)")
        if name in self.adapters:
            raise LoraError(f"the LoRA adapter {name!r} has already been loaded")
        adapter = read_adapter(path, self.model_config, self.config.max_lora_rank)
        adapter_id = self.adapters.add(name, adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank,
                 ", ".join(adapter.target_weights))
        return next(info for info in self.adapters.infos() if info.id == adapter_id)

    def remove_lora(self, name: str) -> None:
        """Forgets an adapter. Refused (LoraInUseError) while requests run or wait with it; KeyError if unknown."""
        adapter_id = self.adapters.id_of(name) if self.adapters is not None else None
        if adapter_id is None:
            raise KeyError(name)
        users = self.scheduler.num_sequences_with_adapter(adapter_id)
        if users:
            raise LoraInUseError(f"the LoRA adapter {name!r} is in use by {users} unfinished sequences; unload it "
                                 f"when they have finished")
        self._adapter_slots.forget(adapter_id)
        self.adapters.remove(name)
        log.info("LoRA adapter %s unloaded", name)

    def lora_infos(self) -> tuple[LoraInfo, ...]:
        if self.merged_adapter is not None:
            return (self.merged_adapter,)
        return self.adapters.infos() if self.adapters is not None else ()

    def _adapter_id(self, name: str | None) -> int:
        if name is None or (self.merged_adapter is not None and name == self.merged_adapter.name):
            return 0  # the base model, or the adapter merged into it
        adapter_id = self.adapters.id_of(name) if self.adapters is not None else None
        if adapter_id is None:
            raise LoraError(f"the LoRA adapter {name!r} is not loaded")
        return adapter_id

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request (jaxserve.validation). Raises ValueError for an id already in use, LoraError
        (a ValueError) for an adapter not loaded."""
        adapter_id = self._adapter_id(request.lora_name)
        if request.params.structured_outputs is not None:  # compiled (or found cached) before anything is queued
            if request.request_id in self.scheduler.requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self.structured.add(request.request_id, request.params)
            self.prepare_late_masks()
        if not self.has_unfinished_requests():
            self.meter.work_arrived()  # the device's idle time until now was not the host's doing
        self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.params,
                                   request.arrival_time, request.priority, lora_id=adapter_id)

    def prepare_late_masks(self, wait: bool = False) -> bool:
        """Starts compiling the split decode executables that let constrained rows run one step ahead (once; the
        first constrained request calls it), and with `wait`, waits for them and puts them to use. True once
        they are in use."""
        if self._late_masks_possible and self._split_decode is None:
            self._split_decode = self.runner.start_split_decode()
        if wait and self._split_decode is not None:
            concurrent.futures.wait([self._split_decode])
        self._use_late_masks()
        return self.scheduler.config.late_masks

    def _use_late_masks(self) -> None:
        """Engine thread: the split executables are compiled: constrained rows run one step ahead from now."""
        future = self._split_decode
        if future is None or not future.done() or not self._late_masks_possible:
            return
        self._late_masks_possible = False  # decided, either way
        try:
            seconds, executables, most = future.result()
        except Exception:  # noqa: BLE001 - the feature is lost, not the engine
            log.exception("compiling the split decode executables failed: constrained rows keep waiting for their "
                          "last token")
            return
        if most > self.temporaries:
            log.warning("the split decode executables need %.1f MiB beyond their arguments where the memory plan "
                        "left %.1f MiB: not used; constrained rows keep waiting for their last token",
                        most / 2**20, self.temporaries / 2**20)
            return
        self.runner.use_split_decode(executables)
        self.scheduler.config = dataclasses.replace(self.scheduler.config, late_masks=True)
        log.info("structured output: split decode executables ready (%d compiled in %.1f s in the background); "
                 "constrained rows now run one step ahead", len(executables[0]) + len(executables[1]), seconds)

    def abort_request(self, request_id: str) -> tuple[SampleDelta, ...]:
        """Ends every unfinished sample of the request with "abort"; their final deltas (none if unknown)."""
        self.structured.drop(request_id)
        return tuple(SampleDelta(request_id, index, finish_reason="abort")
                     for index in self.scheduler.abort_request(request_id))

    def finish_sample(self, request_id: str, index: int, stop: str) -> bool:
        """A stop string ended this sample (the output processor saw it): frees its sequence. True if that was
        the request's last unfinished sample. A token already computed for it is dropped when it comes back."""
        self.structured.drop(request_id, index)
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
        async_scheduling, this step's own) and turns them into deltas.

        A host-side error fails only the requests it concerns (StepOutputs.failed): one request's slot row, or
        every request of the step it broke. A device error, or one that leaves the device state unusable,
        raises: the engine is dead."""
        if self._split_decode is not None and self._late_masks_possible:
            self._use_late_masks()
        self.meter.step_started(self._in_flight)
        one_ahead = self.config.async_scheduling and not self.scheduler.speculating
        earlier = ((), (), None)
        if self._in_flight is not None and not one_ahead:  # proposals need every sequence's newest token
            pending, self._in_flight = self._in_flight, None
            try:
                earlier = self._finish_step(pending)
            except Exception as exc:
                return self._failed_step(exc, (), pending.plan)
        plan = self.scheduler.schedule()
        plan, failed = self._assign_slots(plan)
        try:
            pending = self._dispatch(plan) if not plan.is_empty else None
        except Exception as exc:
            return _after(earlier, self._failed_step(exc, failed, plan))
        if one_ahead:
            previous, self._in_flight = self._in_flight, pending
        else:
            previous = pending
        try:
            deltas, finished, record = self._finish_step(previous) if previous is not None else ((), (), None)
        except Exception as exc:
            self._in_flight = None  # its rows are failed with the step's
            return _after(earlier, self._failed_step(exc, failed, previous.plan, plan))
        if isinstance(self._in_flight, PendingForward):  # its masks needed the tokens just read
            forward, self._in_flight = self._in_flight, None
            try:
                self._in_flight = self._dispatch_sampling(forward)
            except Exception as exc:  # the rows read back stand; this plan's rows fail
                return _after(earlier, _after((deltas, finished, record), self._failed_step(exc, failed, plan)))
        records = tuple(r for r in (earlier[2], record) if r is not None)
        return StepOutputs(earlier[0] + self._scheduling_deltas(plan) + deltas, self.stats_snapshot(),
                           earlier[1] + finished, time.monotonic(), records, failed)

    def _assign_slots(self, plan: StepPlan) -> tuple[StepPlan, tuple[tuple[str, str], ...]]:
        """Writes the slot rows of the plan's new sequences. A request whose row cannot be built fails alone: its
        rows leave the plan (the scheduler forgets it), the others run."""
        failed: dict[str, str] = {}
        for assignment in plan.new_slots:
            if assignment.request_id in failed:
                continue
            try:
                row = slot_row(assignment.token_ids, assignment.num_prompt_tokens, assignment.params,
                               assignment.seed, self.scheduler.eos_token_ids, self.max_model_len)
            except Exception as exc:  # noqa: BLE001 - the request's own values; the engine goes on
                log.exception("request %s: its slot row could not be built", assignment.request_id)
                failed[assignment.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            self.runner.assign_slot(assignment.slot, row)
        if not failed:
            return plan, ()
        for request_id in failed:
            self.scheduler.fail_request(request_id)
        seqs = tuple(row for row in plan.seqs if row.request_id not in failed)
        plan = dataclasses.replace(plan, seqs=seqs, num_tokens=sum(row.num_new_tokens for row in seqs),
                                   new_slots=tuple(a for a in plan.new_slots if a.request_id not in failed))
        return plan, tuple(failed.items())

    def _failed_step(self, exc: Exception, failed: tuple[tuple[str, str], ...], *plans: StepPlan | None
                     ) -> StepOutputs:
        """A step raised: unless the device is at fault, its requests fail and the engine goes on."""
        if self._device_failed(exc):
            raise exc
        log.exception("a step failed; its requests fail, the engine goes on")
        message = f"{type(exc).__name__}: {exc}"
        request_ids = dict.fromkeys(row.request_id for plan in plans if plan is not None for row in plan.seqs)
        for request_id in request_ids:
            self.scheduler.fail_request(request_id)
        return StepOutputs((), self.stats_snapshot(), (), time.monotonic(),
                           failed=failed + tuple((request_id, message) for request_id in request_ids))

    def _device_failed(self, exc: Exception) -> bool:
        """Errors no request can be blamed for: the runtime's, lost device buffers (donated to a call that
        failed), or any step error in a multi-host run (the followers may have run what the leader did not)."""
        if isinstance(exc, (jax.errors.JaxRuntimeError, MemoryError)) or self.runner.mirror is not None:
            return True
        return any(leaf.is_deleted() for leaf in jax.tree.leaves((self.runner.kv, self.runner.slots,
                                                                  self.runner.draft_kv)))

    def _dispatch(self, plan: StepPlan) -> PendingStep | PendingForward:
        for slot, adapter_id in plan.lora_loads:
            self.runner.load_adapter(slot, lora_weights.slot_values(self.adapters.adapter(adapter_id),
                                                                    self.model_config, self.config.max_lora_rank))
        flags = SamplingFlags.NONE
        for row in plan.seqs:
            flags |= SamplingFlags.of(row.params)
        if not any(row.prompt_logprobs for row in plan.seqs):
            flags &= ~SamplingFlags.PROMPT_LOGPROBS
        if plan.draft_pass:
            flags |= SamplingFlags.DRAFT_PASS
        self.meter.dispatching(plan)
        if plan.late_mask:  # the forward half now, the sampling half once the previous step is read (step())
            return self.runner.dispatch_forward(plan, flags)
        disallowed = (self.structured.disallowed([(r.request_id, r.index, r.sample) for r in plan.seqs],
                                                 self.model_config.vocab_size) if len(self.structured) else None)
        # (the mask only when there is one: dispatch(plan, flags) is what unconstrained steps call)
        pending = (self.runner.dispatch(plan, flags) if disallowed is None
                   else self.runner.dispatch(plan, flags, disallowed))
        self.meter.dispatched(pending, self.config.async_scheduling)
        return pending

    def _dispatch_sampling(self, forward: PendingForward) -> PendingStep:
        """The sampling half of a late-mask step, with the masks of its rows' grammars as they are now."""
        rows = [(r.request_id, r.index, r.sample) for r in forward.plan.seqs]
        disallowed = self.structured.disallowed(rows, self.model_config.vocab_size) if len(self.structured) else None
        pending = self.runner.dispatch_sampling(forward, disallowed)
        self.meter.dispatched(pending, True)
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
        if len(self.structured):
            self._advance_matchers(updates.values())
        deltas = tuple(_delta(row, updates.get((row.request_id, row.index)), prompt_chunks.get(i))
                       for i, row in enumerate(rows)
                       if (row.request_id, row.index) in updates or i in prompt_chunks)
        record = self.meter.step_finished(pending, sum(len(t) for t in tokens if t is not None))
        finished = {u.request_id for u in updates.values() if u.finished}
        return deltas, tuple(rid for rid in finished if rid not in self.scheduler.requests), record

    def _advance_matchers(self, updates) -> None:
        """Constrained samples' matchers take the tokens just read; finished samples' are dropped."""
        for u in updates:
            if u.finished:
                self.structured.drop(u.request_id, u.index)
            else:
                for token in u.tokens:  # one (constrained samples do not speculate)
                    self.structured.accept(u.request_id, u.index, token.token_id)


class LLMEngine:
    """The offline front end: an engine core (one, or data-parallel replicas) plus an output processor, driven
    synchronously by its caller. Requests are validated here, once (jaxserve.validation)."""

    def __init__(self, model: Llama, config: EngineConfig = EngineConfig(), tokenizer=None, *,
                 show_progress: bool = True, mesh: jax.sharding.Mesh | None = None, draft: Llama | None = None,
                 owns_model: bool = False):
        """`owns_model`: as EngineCore's (the engine may re-lay out and free `model`'s weights)."""
        self._attach(EngineCore(model, config, tokenizer, show_progress=show_progress, mesh=mesh, draft=draft,
                                owns_model=owns_model))

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
                    kind: OutputKind = OutputKind.CUMULATIVE, lora_request: LoRARequest | None = None) -> None:
        """Validates and queues a request; raises jaxserve.validation.InvalidRequestError (a ValueError) naming
        the parameter. `prompt` is text or token ids; with ids, `prompt_text` is the text they came from.
        `lora_request` runs it with that adapter, read from its path the first time its name is seen."""
        params = params or SamplingParams()
        text, prompt_ids = tokenize(self.tokenizer, prompt)
        validate_request(prompt_ids, params, self.core.limits)
        if request_id in self.processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_name = self._adapter(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(EngineRequest(request_id, prompt_ids, params, arrival, priority, lora_name))
        self.processor.add(request_id, text if prompt_text is None else prompt_text, prompt_ids, params, arrival,
                           kind)

    def _adapter(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        known = {info.name: info for info in self.core.lora_infos()}
        if lora_request.lora_name not in known and not lora_request.lora_path:
            raise LoraError(f"the LoRA adapter {lora_request.lora_name!r} is not loaded: give its lora_path")
        if lora_request.lora_name not in known:
            self.core.add_lora(lora_request.lora_name, lora_request.lora_path)
        elif lora_request.lora_path and Path(known[lora_request.lora_name].path) != Path(lora_request.lora_path):
            raise LoraError(f"the LoRA adapter {lora_request.lora_name!r} was loaded from "
                            f"{known[lora_request.lora_name].path}, not {lora_request.lora_path}")
        return lora_request.lora_name

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
            self.core.finish_sample(stop.request_id, stop.index, stop.stop)
        for request_id, error in step.failed:
            outputs.extend(self.processor.fail((request_id,), error, step.time))
        while self.processor.failed:  # their outputs could not be processed: the engine stops them
            self.core.abort_request(self.processor.failed.pop())
        return outputs

    def run_until_done(self) -> list[RequestOutput]:
        """Steps until every request has finished; returns the final output of each."""
        finals = []
        while self.has_unfinished_requests():
            finals.extend(o for o in self.step() if o.finished)
        return finals

    def close(self) -> None:
        self.core.close()


def _after(earlier: tuple, outputs: StepOutputs) -> StepOutputs:
    """A failed step's outputs behind the deltas of the step read back before it (speculation reads the previous
    step back before scheduling the next)."""
    deltas, finished, record = earlier
    return dataclasses.replace(outputs, deltas=deltas + outputs.deltas,
                               finished_requests=finished + outputs.finished_requests,
                               records=((record,) if record is not None else ()) + outputs.records)


def tokenize(tokenizer, prompt: str | Seq[int]) -> tuple[str | None, tuple[int, ...]]:
    """Text -> (text, ids); ids -> (None, ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompts as token ids")
        check_text("prompt", prompt)
        return prompt, tuple(tokenizer.encode(prompt))
    try:
        return None, tuple(operator.index(t) for t in prompt)
    except TypeError:
        raise InvalidRequestError("{prompt} must be text or a sequence of integer token ids", "prompt") from None


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
    spec = config.speculation()
    if spec is None:
        return None
    if config.coordinator_address is not None:
        raise ConfigError("speculative decoding is single-host for now: drop --speculative-method or "
                          "--coordinator-address")
    if spec.method == "draft" and config.tensor_parallel_size > 1:
        raise ConfigError("--speculative-method draft runs on one device per engine for now: drop "
                          "--tensor-parallel-size, or use --speculative-method ngram")
    return spec


def make_proposer(spec, draft: Llama | None):
    """The scheduler's proposer: n-gram lookups on the host, or placeholders the draft model fills on device."""
    if spec is None:
        return None
    if draft is not None:
        return DeviceProposals()
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
    """A bar on a terminal, log lines elsewhere (jaxserve.logs.progress)."""
    def wrap(items, total=None):
        from jaxserve.logs import progress
        return progress(items, description, total=total, unit="executable")
    return wrap
