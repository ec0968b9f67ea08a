"""The model runner: the only owner of device state and the one place that compiles.

    device state   params (read-only), KVCache (donated), SlotState (donated)
    executables    one per StepShape in the BucketTable, compiled ahead of time; plus assign_slot

A step is `(params, kv, slots, inputs) -> (kv, slots, outputs)`. Inputs are a handful of small int32 arrays per
step (block tables, context lengths, query starts, row slots, sample mask, flags); tokens are read on device from
the slot token buffer, and only the sampled ids (and, when asked, logprobs) come back.

On a mesh (jaxserve.parallel, tensor parallelism): params and the KV cache arrive placed on it (engine/placement),
every executable is traced under the mesh and pins its outputs (the cache keeps its sharding, everything else is
replicated), so GSPMD partitions the XLA ops and the attention runs under shard_map over KV heads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.buckets import BucketError, BucketTable, StepShape
from jaxserve.engine.memory import transient_bytes
from jaxserve.engine.sampler import SampleOutput, SamplingFlags, SlotState, assign_slot, sample
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.models.llama import Llama
from jaxserve.parallel import RULES, Sharder, single_device_mesh
from jaxserve.sampling_params import MAX_TOP_LOGPROBS
from jaxserve.scheduler.scheduler import StepPlan

log = logging.getLogger(__name__)
PROMPT_LOGPROB_CHUNK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    block_tables: jax.Array  # [S, P] int32
    context_lens: jax.Array  # [S] int32 (0 = padding row)
    query_start: jax.Array  # [S + 1] int32
    row_slots: jax.Array  # [S] int32 (0 = null slot)
    sample_mask: jax.Array  # [S] bool: write the sampled token into the slot's history
    flags: jax.Array  # [6] bool, see SamplingFlags


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutputs:
    logits: jax.Array  # [S, vocab] float32 at each sequence's last new token
    hidden: jax.Array  # [T, hidden] final hidden states (read only when prompt logprobs are wanted)
    token_slots: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    chosen: jax.Array  # [T] float32: log p(prompt token at position + 1 | prefix)
    top_ids: jax.Array  # [T, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_TOP_LOGPROBS] float32


def model_step(graphdef, params, kv: KVCache, token_buffer: jax.Array, inputs: StepInputs, *, shape: StepShape,
               page_size: int, attention_impl: str, matmul_impl: str = "xla") -> tuple[KVCache, ModelOutputs]:
    """The forward pass of one step (compiled per StepShape, kv donated). Input tokens come from the slots'
    token buffer on device."""
    model: Llama = nnx.merge(graphdef, params)
    num_seqs, num_tokens = shape.seqs, shape.tokens
    is_decode = shape.kind == "decode"
    query_start = jnp.arange(num_seqs + 1, dtype=jnp.int32) if is_decode else inputs.query_start
    meta = AttentionMetadata.build(inputs.block_tables, inputs.context_lens, query_start, num_tokens, page_size,
                                   is_decode=is_decode)
    valid = meta.seq_ids < num_seqs
    token_slots = jnp.where(valid, inputs.row_slots[jnp.minimum(meta.seq_ids, num_seqs - 1)], 0)
    hidden, kv = model(token_buffer[token_slots, meta.positions], kv, meta, attention_impl, matmul_impl)
    last = jnp.clip(query_start[1:] - 1, 0, num_tokens - 1)
    return kv, ModelOutputs(model.logits(hidden[last], matmul_impl), hidden, token_slots, meta.positions)


def sample_step(logits: jax.Array, slots: SlotState, row_slots: jax.Array, context_lens: jax.Array,
                sample_mask: jax.Array, flags: jax.Array) -> tuple[SlotState, SampleOutput]:
    """Sampling (compiled per sequence count S, slots donated): draws each row's token and appends it to the
    row's token history when the row samples."""
    out = sample(logits, slots, row_slots, context_lens, flags)
    write_at = jnp.where(sample_mask, context_lens, slots.tokens.shape[1])
    tokens = slots.tokens.at[row_slots, write_at].set(out.tokens, mode="drop")
    return dataclasses.replace(slots, tokens=tokens), out


def prompt_logprobs_step(graphdef, params, hidden: jax.Array, token_buffer: jax.Array, token_slots: jax.Array,
                         positions: jax.Array, matmul_impl: str = "xla") -> PromptLogprobs:
    """log p(token at position + 1 | prefix) for every token of a step, in chunks of rows (compiled per T)."""
    model: Llama = nnx.merge(graphdef, params)
    targets = token_buffer[token_slots, positions + 1]
    t = hidden.shape[0]
    chunk = min(PROMPT_LOGPROB_CHUNK, t)
    pad = -t % chunk

    def one_chunk(args):
        h, tgt = args
        lp = jax.nn.log_softmax(model.logits(h, matmul_impl), axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
        return jnp.take_along_axis(lp, tgt[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[1])
    tg = jnp.pad(targets, (0, pad)).reshape(-1, chunk)
    chosen, top_ids, top_lp = jax.lax.map(one_chunk, (h, tg))
    return PromptLogprobs(chosen.reshape(-1)[:t], top_ids.reshape(-1, MAX_TOP_LOGPROBS)[:t],
                          top_lp.reshape(-1, MAX_TOP_LOGPROBS)[:t])


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose outputs are still on the device."""

    plan: StepPlan
    shape: StepShape
    sampled: SampleOutput
    prompt_logprobs: PromptLogprobs | None
    flags: SamplingFlags
    dispatched_at: float


class ModelRunner:
    """Three executable families, all compiled at start-up:

        model[StepShape]   (params, kv, token buffer, inputs) -> (kv, logits, hidden...)
        sample[S]          (logits, slots, inputs) -> (slots, sampled tokens)
        prompt_lp[T]       (params, hidden, token buffer, ...) -> prompt logprobs   (prefill token counts only)
    """

    def __init__(self, model: Llama, kv: KVCache, slots: SlotState, buckets: BucketTable, attention_impl: str,
                 compiler_options: dict | None = None, matmul_impl: str = "xla", sharder: Sharder | None = None):
        self.sharder = sharder or Sharder(single_device_mesh(), RULES)
        self.replicated = self.sharder.replicated  # slots, step inputs and every output but the cache
        self.mirror = None  # multi-host leader: jaxserve.engine.multihost.StepMirror, told each device call first
        self.graphdef, self.params = nnx.split(model)
        self.compiler_options = compiler_options
        self.cfg = model.cfg
        self.kv, self.slots = kv, slots
        self.buckets = buckets
        self.page_size = kv.page_size
        self.attention_impl = attention_impl
        self.matmul_impl = matmul_impl  # quantized weights only: "pallas" or "xla"
        self.model_executables: dict[StepShape, Callable] = {}
        self.sample_executables: dict[int, Callable] = {}
        self.prompt_lp_executables: dict[int, Callable] = {}
        self._assign = jax.jit(assign_slot, donate_argnums=0, out_shardings=self.replicated)

    @property
    def num_executables(self) -> int:
        return len(self.executables)

    @property
    def executables(self) -> list[jax.stages.Compiled]:
        return [*self.model_executables.values(), *self.sample_executables.values(),
                *self.prompt_lp_executables.values()]

    def set_cache(self, kv: KVCache) -> None:
        """Replaces the cache (or the abstract stand-in it was compiled against); the step executables compiled
        for another page count are dropped."""
        if jax.tree.map(lambda x: x.shape, kv) != jax.tree.map(lambda x: x.shape, self.kv):
            self.model_executables.clear()
        self.kv = kv

    # ---- compilation ----------------------------------------------------------------------------------------
    def compile_all(self, progress: Callable | None = None, workers: int | None = None) -> float:
        """Compiles every bucket ahead of time (those not compiled yet), XLA compiles running in parallel threads
        (they release the GIL; tracing and lowering stay on this thread). Returns seconds spent."""
        start = time.perf_counter()
        self.compile_shapes(self.buckets.shapes(), progress, workers)
        return time.perf_counter() - start

    def measure_transients(self, shapes: list[StepShape]) -> int:
        """Compiles the executables of `shapes` (kept for compile_all) and returns the most transient bytes one
        of them needs (jaxserve.engine.memory.transient_bytes)."""
        self.compile_shapes(shapes)
        compiled = [self.model_executables[s] for s in shapes] + [self.sample_executables[s.seqs] for s in shapes]
        compiled += [self.prompt_lp_executables[s.tokens] for s in shapes if s.kind == "prefill"]
        return transient_bytes(compiled)

    def compile_shapes(self, shapes: list[StepShape], progress: Callable | None = None,
                       workers: int | None = None) -> None:
        with jax.set_mesh(self.sharder.mesh):  # shard_map inside the model finds its mesh here
            jobs = [(self.model_executables, shape, self._lower_model(shape)) for shape in shapes
                    if shape not in self.model_executables]
            jobs += [(self.sample_executables, s, self._lower_sample(s)) for s in sorted({x.seqs for x in shapes})
                     if s not in self.sample_executables]
            jobs += [(self.prompt_lp_executables, t, self._lower_prompt_lp(t))
                     for t in sorted({x.tokens for x in shapes if x.kind == "prefill"})
                     if t not in self.prompt_lp_executables]
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            futures = {pool.submit(lowered.compile, self.compiler_options): (table, key)
                       for table, key, lowered in jobs}
            done = concurrent.futures.as_completed(futures)
            for future in (progress(done, total=len(futures)) if progress else done):
                table, key = futures[future]
                table[key] = future.result()

    def _lower_model(self, shape: StepShape):
        fn = functools.partial(model_step, self.graphdef, shape=shape, page_size=self.page_size,
                               attention_impl=self.attention_impl, matmul_impl=self.matmul_impl)
        kv_shardings = jax.tree.map(lambda x: x.sharding, self.kv)
        return jax.jit(fn, donate_argnums=1, out_shardings=(kv_shardings, self.replicated)).lower(
            self.params, self.kv, self.slots.tokens, self.abstract_inputs(shape))

    def _lower_sample(self, num_seqs: int):
        logits = jax.ShapeDtypeStruct((num_seqs, self.cfg.vocab_size), jnp.float32, sharding=self.replicated)
        i = self.abstract_inputs(StepShape("decode", num_seqs, num_seqs, 1))
        return jax.jit(sample_step, donate_argnums=1, out_shardings=self.replicated).lower(
            logits, self.slots, i.row_slots, i.context_lens, i.sample_mask, i.flags)

    def _lower_prompt_lp(self, num_tokens: int):
        i32 = jax.ShapeDtypeStruct((num_tokens,), jnp.int32, sharding=self.replicated)
        hidden = jax.ShapeDtypeStruct((num_tokens, self.cfg.hidden_size), self.params["embed"][...].dtype,
                                      sharding=self.replicated)
        fn = functools.partial(prompt_logprobs_step, self.graphdef, matmul_impl=self.matmul_impl)
        return jax.jit(fn, out_shardings=self.replicated).lower(self.params, hidden, self.slots.tokens, i32, i32)

    def abstract_inputs(self, shape: StepShape) -> StepInputs:
        s, p = shape.seqs, shape.pages
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=self.replicated)
        bool_ = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bool_, sharding=self.replicated)
        return StepInputs(i32((s, p)), i32((s,)), i32((s + 1,)), i32((s,)), bool_((s,)), bool_((6,)))

    # ---- execution ------------------------------------------------------------------------------------------
    def assign_slot(self, slot: int, row: dict) -> None:
        if self.mirror is not None:
            self.mirror.assign(slot, row)
        self.slots = self._assign(self.slots, np.int32(slot), row)

    def shape_for(self, plan: StepPlan) -> StepShape:
        max_pages = max(len(row.pages) for row in plan.seqs)
        if plan.is_decode and not any(row.prompt_logprobs for row in plan.seqs):  # prompt scoring: prefill only
            return self.buckets.decode_shape(len(plan.seqs), max_pages)
        return self.buckets.prefill_shape(plan.num_tokens, len(plan.seqs), max_pages)

    def dispatch(self, plan: StepPlan, flags: SamplingFlags) -> PendingStep:
        """Starts the step on the device and returns at once (JAX dispatch is asynchronous)."""
        shape = self.shape_for(plan)
        sampled, prompt_lp = self.run(shape, build_inputs(plan, shape, flags), flags.prompt_logprobs)
        return PendingStep(plan, shape, sampled, prompt_lp, flags, time.perf_counter())

    def run(self, shape: StepShape, inputs: StepInputs, prompt_logprobs: bool
            ) -> tuple[SampleOutput, PromptLogprobs | None]:
        """The executables of one step, on padded inputs (a multi-host follower calls this with the leader's)."""
        executable = self.model_executables.get(shape)
        if executable is None:
            raise BucketError(f"{shape} is not in the compiled table")
        if self.mirror is not None:
            self.mirror.step(shape, inputs, prompt_logprobs)
        self.kv, model_out = executable(self.params, self.kv, self.slots.tokens, inputs)
        prompt_lp = None
        if prompt_logprobs:
            prompt_lp = self.prompt_lp_executables[shape.tokens](self.params, model_out.hidden, self.slots.tokens,
                                                                 model_out.token_slots, model_out.positions)
        self.slots, sampled = self.sample_executables[shape.seqs](model_out.logits, self.slots, inputs.row_slots,
                                                                  inputs.context_lens, inputs.sample_mask,
                                                                  inputs.flags)
        return sampled, prompt_lp


def build_inputs(plan: StepPlan, shape: StepShape, flags: SamplingFlags) -> StepInputs:
    """Pads a plan to its bucket (numpy, host side)."""
    s = shape.seqs
    block_tables = np.zeros((s, shape.pages), np.int32)
    context_lens = np.zeros(s, np.int32)
    query_start = np.zeros(s + 1, np.int32)
    row_slots = np.zeros(s, np.int32)
    sample_mask = np.zeros(s, bool)
    for i, row in enumerate(plan.seqs):
        block_tables[i, :len(row.pages)] = row.pages
        context_lens[i] = row.context_len
        query_start[i + 1] = row.num_new_tokens
        row_slots[i] = row.slot
        sample_mask[i] = row.sample
    np.cumsum(query_start, out=query_start)
    return StepInputs(block_tables, context_lens, query_start, row_slots, sample_mask, flags.as_array())
