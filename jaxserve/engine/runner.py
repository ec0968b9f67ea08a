"""The model runner: the only owner of device state and the one place that compiles.

    device state   params (read-only), KVCache (donated), SlotState (donated)
    executables    one per StepShape in the BucketTable, compiled ahead of time; plus assign_slot

A step is `(params, kv, slots, inputs) -> (kv, slots, outputs)`: the forward pass, sampling and the sampled
tokens' logprobs (and, in prefill shapes, prompt logprobs) in one executable, so the logits never leave it. Inputs
are a handful of small int32 arrays per step (block tables, context lengths, query starts, row slots, sample
mask, flags); tokens are read on device from the slot token buffer, and only the sampled ids (and, when asked,
logprobs) come back.

With decode bursts (BucketTable.burst_tokens D > 1) the small decode shapes run `burst_step` instead: up to D
decode steps in a loop on device, each step's input the token the one before sampled, as many as each row's count
says (a plain decode step: one each); they return the tokens as a verify step does.

With a draft model (speculative decoding, jaxserve.spec.draft), every executable also runs the draft's forward pass
over the step's tokens into the draft's own cache (donated too), and verify shapes make the draft's proposals first,
in a loop on device.

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
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.buckets import BucketError, BucketTable, StepShape
from jaxserve.engine.memory import transient_bytes
from jaxserve.engine.sampler import (FLAG_DRAFT_PASS, FLAG_PROMPT_LOGPROBS, NUM_FLAGS, SampleOutput, SamplingFlags,
                                     SlotState, VerifyOutput, assign_slot, sample, sample_draft, verify)
from jaxserve.kv.cache import AttentionMetadata, KVCache
from jaxserve.lora.weights import write_slot
from jaxserve.models.kernels import Kernels
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
    flags: jax.Array  # [NUM_FLAGS] bool, see SamplingFlags
    lora_slots: jax.Array  # [S] int32: each row's adapter slot (0 = none; read only with adapter slots attached)
    # [S, ceil(vocab / 32)] int32 structured-output bitmask, bit set = token not allowed (jaxserve.structured);
    # None until ModelRunner.run puts its resident all-zero one there (nothing to send for unconstrained steps)
    disallowed: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftInputs:
    """A verify step's proposals (speculative decoding): row s's last counts[s] query tokens are tokens[s, :counts[s]],
    written into the slot's token buffer before the forward pass reads its input tokens there."""

    tokens: jax.Array  # [S, K] int32
    counts: jax.Array  # [S] int32, 0..K


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutputs:
    logits: jax.Array  # [S, vocab] float32 at each sequence's last new token (or at `logit_rows`)
    hidden: jax.Array  # [T, hidden] final hidden states (read only when prompt logprobs are wanted: every row
    # is computed, in place, only then; see model_step)
    token_slots: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    chosen: jax.Array  # [T] float32: log p(prompt token at position + 1 | prefix)
    top_ids: jax.Array  # [T, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_TOP_LOGPROBS] float32

    @classmethod
    def zeros(cls, num_tokens: int) -> "PromptLogprobs":
        return cls(jnp.zeros((num_tokens,), jnp.float32), jnp.zeros((num_tokens, MAX_TOP_LOGPROBS), jnp.int32),
                   jnp.zeros((num_tokens, MAX_TOP_LOGPROBS), jnp.float32))


def model_step(graphdef, params, kv: KVCache, token_buffer: jax.Array, inputs: StepInputs, *, shape: StepShape,
               page_size: int, kernels: Kernels, logit_rows: jax.Array | None = None) -> tuple[KVCache, ModelOutputs]:
    """The forward pass of one step. Input tokens come from the slots' token buffer on device. Logits are computed
    at each sequence's last new token, or at the step's tokens `logit_rows` [R] when given."""
    model: Llama = nnx.merge(graphdef, params)
    num_seqs, num_tokens = shape.seqs, shape.tokens
    is_decode = shape.kind == "decode"
    query_start = jnp.arange(num_seqs + 1, dtype=jnp.int32) if is_decode else inputs.query_start
    meta = AttentionMetadata.build(inputs.block_tables, inputs.context_lens, query_start, num_tokens, page_size,
                                   is_decode=is_decode)
    valid = meta.seq_ids < num_seqs
    row = jnp.minimum(meta.seq_ids, num_seqs - 1)
    token_slots = jnp.where(valid, inputs.row_slots[row], 0)
    token_adapters = jnp.where(valid, inputs.lora_slots[row], 0)
    if logit_rows is None:  # each sequence's last token; the padding rows (empty, at the end) need no logits
        rows, real_rows = jnp.clip(query_start[1:] - 1, 0, num_tokens - 1), meta.real_seqs()
    else:
        rows, real_rows = logit_rows, None
    wanted = None
    if not is_decode and rows.shape[0] < num_tokens and model.prunes_rows(kernels):
        # Only the rows logits are taken at need the last layer's output projection and MLP, unless prompt
        # logprobs (read at every row) are asked for: then every row, in place.
        every = inputs.flags[FLAG_PROMPT_LOGPROBS]
        tokens = jnp.arange(num_tokens, dtype=jnp.int32)
        wanted = (jnp.where(every, tokens, jnp.pad(rows, (0, num_tokens - rows.shape[0]))),
                  jnp.where(every, meta.real_tokens(), rows.shape[0] if real_rows is None else real_rows))
        rows = jnp.where(every, rows, jnp.arange(rows.shape[0], dtype=jnp.int32))
    hidden, kv = model(token_buffer[token_slots, meta.positions], kv, meta, kernels, token_adapters, wanted)
    logits = model.logits(hidden[rows], kernels, rows=real_rows)
    return kv, ModelOutputs(logits, hidden, token_slots, meta.positions)


def sample_step(logits: jax.Array, slots: SlotState, row_slots: jax.Array, context_lens: jax.Array,
                sample_mask: jax.Array, flags: jax.Array, disallowed: jax.Array | None = None
                ) -> tuple[SlotState, SampleOutput]:
    """Sampling: draws each row's token and appends it to the row's token history when the row samples."""
    out = sample(logits, slots, row_slots, context_lens, flags, disallowed)
    write_at = jnp.where(sample_mask, context_lens, slots.tokens.shape[1])
    tokens = slots.tokens.at[row_slots, write_at].set(out.tokens, mode="drop")
    return dataclasses.replace(slots, tokens=tokens), out


def forward_step(graphdef, params, kv: KVCache, token_buffer: jax.Array, inputs: StepInputs, *, shape: StepShape,
                 page_size: int, kernels: Kernels, sharder: Sharder | None = None) -> tuple[KVCache, jax.Array]:
    """The first half of a decode step split for masks that come late (ModelRunner.dispatch_forward): the forward
    pass alone, returning the [S, vocab] logits (gathered whole) for `sampling_step`."""
    kv, out = model_step(graphdef, params, kv, token_buffer, inputs, shape=shape, page_size=page_size,
                         kernels=kernels)
    return kv, gather_logits(out.logits, sharder)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleInputs:
    """What the second half of a split decode step reads: StepInputs' per-row sampling fields and the mask."""

    row_slots: jax.Array  # [S] int32
    context_lens: jax.Array  # [S] int32
    sample_mask: jax.Array  # [S] bool
    flags: jax.Array  # [NUM_FLAGS] bool
    disallowed: jax.Array  # [S, ceil(vocab / 32)] int32

    @classmethod
    def of(cls, inputs: StepInputs) -> "SampleInputs":
        return cls(inputs.row_slots, inputs.context_lens, inputs.sample_mask, inputs.flags, inputs.disallowed)


def sampling_step(slots: SlotState, logits: jax.Array, inputs: SampleInputs) -> tuple[SlotState, SampleOutput]:
    """The second half of a split decode step: sample_step on the forward half's logits (slots donated)."""
    return sample_step(logits, slots, inputs.row_slots, inputs.context_lens, inputs.sample_mask, inputs.flags,
                       inputs.disallowed)


def gather_logits(logits: jax.Array, sharder: Sharder | None) -> jax.Array:
    """[rows, vocab] logits whole on every device for the sampler: computed vocab-parallel as the LM head's
    weight lies, then gathered (one all-gather of the logits under tensor parallelism). Pinning only the
    replicated result lets GSPMD gather the LM head's weight instead; pinning nothing splits every reduction of
    the sampler (argmax, softmax, top-k, sorts) over the vocab shards."""
    if sharder is None:
        return logits
    logits = jax.lax.with_sharding_constraint(logits, sharder.sharding((None, "vocab")))
    return jax.lax.with_sharding_constraint(logits, sharder.replicated)


def prompt_logprobs_step(model: Llama, hidden: jax.Array, targets: jax.Array, kernels: Kernels,
                         sharder: Sharder | None = None) -> PromptLogprobs:
    """log p(targets | prefix) for every token of a step (hidden [T, hidden], targets [T]), in chunks of rows so
    that only [chunk, vocab] logits exist at a time (gathered whole, like the sampler's)."""
    t = hidden.shape[0]
    chunk = min(PROMPT_LOGPROB_CHUNK, t)
    pad = -t % chunk

    def one_chunk(args):
        h, tgt = args
        lp = jax.nn.log_softmax(gather_logits(model.logits(h, kernels), sharder), axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
        return jnp.take_along_axis(lp, tgt[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[1])
    tg = jnp.pad(targets, (0, pad)).reshape(-1, chunk)
    chosen, top_ids, top_lp = jax.lax.map(one_chunk, (h, tg))
    return PromptLogprobs(chosen.reshape(-1)[:t], top_ids.reshape(-1, MAX_TOP_LOGPROBS)[:t],
                          top_lp.reshape(-1, MAX_TOP_LOGPROBS)[:t])


def step(graphdef, params, kv: KVCache, slots: SlotState, inputs: StepInputs, draft_params=None,
         draft_kv: KVCache | None = None, *, shape: StepShape, page_size: int, kernels: Kernels,
         sharder: Sharder | None = None, draft_graphdef=None) -> tuple:
    """One whole step (compiled per StepShape, kv and slots donated): forward, prompt logprobs (prefill shapes,
    behind lax.cond on the flag), sampling. Prompt logprobs read their targets from the token buffer before
    sampling writes into it, as the forward pass reads its input tokens. With a draft model (speculative
    decoding), its forward pass over the same tokens too, when the step's DRAFT_PASS flag says so (its cache
    donated and returned last; the scheduler knows which pages a step without it leaves behind)."""
    kv, out = model_step(graphdef, params, kv, slots.tokens, inputs, shape=shape, page_size=page_size,
                         kernels=kernels)
    if draft_graphdef is not None:
        draft_kv = jax.lax.cond(
            inputs.flags[FLAG_DRAFT_PASS],
            lambda cache: model_step(draft_graphdef, draft_params, cache, slots.tokens, inputs, shape=shape,
                                     page_size=page_size, kernels=kernels)[0],
            lambda cache: cache, draft_kv)
    logits = gather_logits(out.logits, sharder)
    prompt_lp = None
    if shape.kind == "prefill":
        prompt_lp = maybe_prompt_logprobs(graphdef, params, out, slots, inputs.flags, kernels, sharder)
    slots, sampled = sample_step(logits, slots, inputs.row_slots, inputs.context_lens, inputs.sample_mask,
                                 inputs.flags, inputs.disallowed)
    return (kv, slots, sampled, prompt_lp) + ((draft_kv,) if draft_graphdef is not None else ())


def maybe_prompt_logprobs(graphdef, params, out: ModelOutputs, slots: SlotState, flags: jax.Array, kernels: Kernels,
                          sharder: Sharder | None) -> PromptLogprobs:
    targets = slots.tokens[out.token_slots, out.positions + 1]
    return jax.lax.cond(
        flags[FLAG_PROMPT_LOGPROBS],
        lambda: prompt_logprobs_step(nnx.merge(graphdef, params), out.hidden, targets, kernels, sharder),
        lambda: PromptLogprobs.zeros(out.hidden.shape[0]))


def verify_step(graphdef, params, kv: KVCache, slots: SlotState, inputs: StepInputs, drafts: DraftInputs,
                draft_params=None, draft_kv: KVCache | None = None, *, shape: StepShape, page_size: int,
                kernels: Kernels, sharder: Sharder | None = None, draft_graphdef=None) -> tuple:
    """A step whose rows may carry proposals (speculative decoding; the ragged prefill family with logits at K + 1
    tokens per row): the proposals go into the token buffer, the forward pass runs, and the sampler accepts or
    rejects them on device (jaxserve.engine.sampler.verify). Row s's sampled tokens go at positions
    context_lens[s] - counts[s] + j, j = 0..K; only the accepted ones and the next are written to its history.

    With a draft model, the proposals are made here first (`draft_proposals`, drafts.tokens are placeholders)
    and verified against the draft's distributions; then the draft's forward pass runs over the step's query
    tokens, as in `step`, and its cache is returned last."""
    num_seqs, k = drafts.tokens.shape
    draft_probs = None
    if draft_graphdef is not None:
        draft_kv, proposed, draft_probs = draft_proposals(
            draft_graphdef, draft_params, draft_kv, slots, inputs, drafts.counts, k, pages=shape.pages,
            page_size=page_size, kernels=kernels, sharder=sharder)
        drafts = DraftInputs(proposed, drafts.counts)
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    positions = inputs.context_lens[:, None] - drafts.counts[:, None] + j  # [S, K + 1]
    history = slots.tokens.shape[1]
    proposal_at = jnp.where(j[:, :k] < drafts.counts[:, None], positions[:, :k], history)
    tokens = slots.tokens.at[inputs.row_slots[:, None], proposal_at].set(drafts.tokens, mode="drop")
    rows = jnp.clip(inputs.query_start[1:, None] - 1 - drafts.counts[:, None] + j, 0, shape.tokens - 1)
    kv, out = model_step(graphdef, params, kv, tokens, inputs, shape=shape, page_size=page_size, kernels=kernels,
                         logit_rows=rows.reshape(-1))
    if draft_graphdef is not None:
        draft_kv, _ = model_step(draft_graphdef, draft_params, draft_kv, tokens, inputs, shape=shape,
                                 page_size=page_size, kernels=kernels)
    slots = dataclasses.replace(slots, tokens=tokens)
    logits = gather_logits(out.logits, sharder).reshape(num_seqs, k + 1, -1)
    prompt_lp = maybe_prompt_logprobs(graphdef, params, out, slots, inputs.flags, kernels, sharder)
    sampled = verify(logits, slots, inputs.row_slots, positions, drafts.tokens, drafts.counts, inputs.flags,
                     draft_probs)
    keep = inputs.sample_mask[:, None] & (j <= sampled.num_accepted[:, None])
    tokens = slots.tokens.at[inputs.row_slots[:, None], jnp.where(keep, positions, history)].set(
        sampled.tokens, mode="drop")
    out = (kv, dataclasses.replace(slots, tokens=tokens), sampled, prompt_lp)
    return out + ((draft_kv,) if draft_graphdef is not None else ())


def draft_proposals(graphdef, params, kv: KVCache, slots: SlotState, inputs: StepInputs, counts: jax.Array, k: int,
                    *, pages: int, page_size: int, kernels: Kernels, sharder: Sharder | None = None
                    ) -> tuple[KVCache, jax.Array, jax.Array]:
    """A draft model's proposals for a verify step, in one loop inside the executable (lax.fori_loop, K
    iterations): row s proposes counts[s] tokens, starting from its last known token (the first of its query
    tokens, at context_lens[s] - counts[s] - 1). Iteration j runs every proposing row's token at position
    start + j through the draft (a decode step: one token per row, its K/V written to the draft's cache, whose
    earlier positions the draft's forward pass over every past step filled) and draws proposal j + 1 from the
    draft's distribution (jaxserve.engine.sampler.sample_draft). Rows with fewer proposals, or none, are padding
    rows for the iterations past their count (they write only the null page).

    Returns (the draft's cache, proposals [S, K] int32, their distributions q [S, K, vocab] float32)."""
    num_seqs = counts.shape[0]
    decode = StepShape("decode", num_seqs, num_seqs, pages)
    start = inputs.context_lens - counts - 1
    history = slots.tokens.shape[1]
    vocab = params["embed"][...].shape[0]

    def one(j, carry):
        kv, tokens, proposed, probs = carry
        active = j < counts
        position = start + j + 1  # where the proposal drawn in this iteration goes
        step_inputs = dataclasses.replace(inputs, context_lens=jnp.where(active, position, 0))
        kv, out = model_step(graphdef, params, kv, tokens, step_inputs, shape=decode, page_size=page_size,
                             kernels=kernels)
        token, q = sample_draft(gather_logits(out.logits, sharder), slots, inputs.row_slots, position,
                                inputs.flags)
        tokens = tokens.at[inputs.row_slots, jnp.where(active, position, history)].set(token, mode="drop")
        return kv, tokens, proposed.at[:, j].set(token), probs.at[:, j].set(q)

    init = (kv, slots.tokens, jnp.zeros((num_seqs, k), jnp.int32), jnp.zeros((num_seqs, k, vocab), jnp.float32))
    kv, _, proposed, probs = jax.lax.fori_loop(0, k, one, init)
    return kv, proposed, probs


def burst_step(graphdef, params, kv: KVCache, slots: SlotState, inputs: StepInputs, counts: jax.Array, *,
               shape: StepShape, steps: int, page_size: int, kernels: Kernels, sharder: Sharder | None = None
               ) -> tuple:
    """A decode shape's step with decode bursts (kv and slots donated): row s runs counts[s] (0..D = `steps`)
    decode steps one after another, in a loop on device of max(counts) iterations (a while loop: its body
    compiles once, whatever D). inputs.context_lens is each row's context in its first step; step j runs the
    token at context_lens + j - 1 (sampled by step j - 1, read from the token buffer as a decode step reads its
    input) and samples the one at context_lens + j, exactly as j separate decode steps would, sampling keys and
    penalties included. A row past its count is a padding row (context 0: it writes only the null page, its
    token goes nowhere).

    Returns (kv, slots, VerifyOutput [S, D] with num_accepted = counts - 1, None): the engine reads a burst's
    tokens as a verify step's."""
    num_seqs = shape.seqs
    chosen = jnp.zeros((num_seqs, steps), jnp.float32)
    top = jnp.zeros((num_seqs, steps, MAX_TOP_LOGPROBS), jnp.int32)
    init = (kv, slots, jnp.zeros((num_seqs, steps), jnp.int32), chosen, top, top.astype(jnp.float32))

    def one(j, carry):
        kv, slots, tokens, chosen, top_ids, top_lp = carry
        active = j < counts
        step_inputs = dataclasses.replace(inputs, context_lens=jnp.where(active, inputs.context_lens + j, 0),
                                          sample_mask=inputs.sample_mask & active)
        kv, out = model_step(graphdef, params, kv, slots.tokens, step_inputs, shape=shape, page_size=page_size,
                             kernels=kernels)
        slots, sampled = sample_step(gather_logits(out.logits, sharder), slots, step_inputs.row_slots,
                                     step_inputs.context_lens, step_inputs.sample_mask, step_inputs.flags,
                                     step_inputs.disallowed)
        return (kv, slots, tokens.at[:, j].set(sampled.tokens), chosen.at[:, j].set(sampled.logprobs),
                top_ids.at[:, j].set(sampled.top_ids), top_lp.at[:, j].set(sampled.top_logprobs))

    kv, slots, tokens, chosen, top_ids, top_lp = jax.lax.fori_loop(0, jnp.max(counts), one, init)
    return kv, slots, VerifyOutput(tokens, counts - 1, chosen, top_ids, top_lp), None


@dataclasses.dataclass
class PendingForward:
    """The forward half of a split decode step, dispatched; its sampling half waits for the step's bitmask."""

    plan: StepPlan
    shape: StepShape
    logits: jax.Array  # [S, vocab] on the device
    inputs: StepInputs  # host arrays, the bitmask not filled in yet
    flags: SamplingFlags
    dispatched_at: float


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose outputs are still on the device."""

    plan: StepPlan
    shape: StepShape
    sampled: SampleOutput | VerifyOutput  # VerifyOutput for verify shapes
    prompt_logprobs: PromptLogprobs | None
    flags: SamplingFlags
    dispatched_at: float


class ModelRunner:
    """One executable per step shape, all compiled at start-up:

        step[StepShape]   (params, kv, slots, inputs) -> (kv, slots, sampled, prompt logprobs | None)

    Forward pass, sampling and sampled-token logprobs are fused, so the [S, vocab] logits stay inside the
    executable. Prompt logprobs (prefill shapes only) sit behind `lax.cond` on the step's PROMPT_LOGPROBS flag
    rather than in a second variant per shape: the table keeps one executable per shape (half the compile time of
    two variants), and a step without prompt logprobs skips their [T, vocab] LM-head pass at run time, paying only
    the zero-filled [T, 1 + 2 * MAX_TOP_LOGPROBS] outputs the untaken branch returns. Their scratch (one
    [chunk, vocab] block) counts in every prefill executable's temporary memory either way. A decode-only plan
    that asks for prompt logprobs (one-token prompts) runs in a prefill shape; decode shapes have no such branch.

    Each decode shape can also have its two halves, for steps whose structured-output bitmask is known only
    after they are dispatched (one step ahead, the mask of a constrained row needs the token still in flight):

        forward[decode shape]   (params, kv, token buffer, inputs) -> (kv, logits [S, vocab])
        sampling[S]             (slots, logits, sample inputs + bitmask) -> (slots, sampled)

    The forward half goes out first; the sampling half once the engine has read the previous step's tokens and
    advanced the grammars. Steps without a late mask keep the fused executable. The halves are compiled in the
    background when the first constrained request arrives (start_split_decode): they would almost double the
    start-up compile of every deployment (the demo model on a 2-core CPU: 32 -> 59 s) for a feature many never
    use, and until they are ready constrained rows simply wait for their token.
    """

    def __init__(self, model: Llama, kv: KVCache, slots: SlotState, buckets: BucketTable, kernels: Kernels,
                 compiler_options: dict | None = None, sharder: Sharder | None = None, draft: Llama | None = None,
                 draft_kv: KVCache | None = None):
        """`buckets.num_speculative_tokens` > 0 adds the verify family (speculative decoding): the prefill
        shapes again, each with K proposals per row, logits at K + 1 tokens per row and acceptance on device.
        `draft` (with its cache `draft_kv`, page for page beside `kv`): a draft model whose forward pass runs in
        every step executable and whose proposals the verify shapes make on device (`draft_proposals`)."""
        self.sharder = sharder or Sharder(single_device_mesh(), RULES)
        self.replicated = self.sharder.replicated  # slots, step inputs and every output but the cache
        self.mirror = None  # multi-host leader: jaxserve.engine.multihost.StepMirror, told each device call first
        self.graphdef, self.params = nnx.split(model)
        self.compiler_options = compiler_options
        self.cfg = model.cfg
        self.kv, self.slots = kv, slots
        self.draft_graphdef, self.draft_params = nnx.split(draft) if draft is not None else (None, None)
        self.draft_kv = draft_kv
        self.buckets = buckets
        self.page_size = kv.page_size
        self.kernels = kernels
        self.executables: dict[StepShape, Callable] = {}
        self.forwards: dict[StepShape, Callable] = {}  # decode shape -> its forward half (split_decode)
        self.samplers: dict[int, Callable] = {}  # S -> the sampling half of the decode shapes with S rows
        self._assign = jax.jit(assign_slot, donate_argnums=0, out_shardings=self.replicated)
        self._no_constraints: dict[int, jax.Array] = {}  # seqs -> resident all-zero token bitmask
        self._write_adapter = None  # compiled on the first adapter load

    @property
    def num_executables(self) -> int:
        return len(self.executables) + len(self.forwards) + len(self.samplers)

    def all_executables(self) -> list[Callable]:
        return [*self.executables.values(), *self.forwards.values(), *self.samplers.values()]

    def resident_arrays(self) -> list[jax.Array]:
        """The arrays every step reads and that stay put: the weights and the KV caches (donated, updated in place)."""
        return jax.tree.leaves((self.params, self.kv, self.draft_params, self.draft_kv))

    def set_cache(self, kv: KVCache, draft_kv: KVCache | None = None) -> None:
        """Replaces the cache (or the abstract stand-in it was compiled against), and the draft model's; the step
        executables compiled for another page count are dropped."""
        if jax.tree.map(lambda x: x.shape, kv) != jax.tree.map(lambda x: x.shape, self.kv):
            self.executables.clear()
            self.forwards.clear()
        self.kv, self.draft_kv = kv, draft_kv

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
        return transient_bytes([self.executables[s] for s in shapes])

    def compile_shapes(self, shapes: list[StepShape], progress: Callable | None = None,
                       workers: int | None = None) -> None:
        with jax.set_mesh(self.sharder.mesh):  # shard_map inside the model finds its mesh here
            jobs = [(self.executables, shape, self._lower_step(shape)) for shape in shapes
                    if shape not in self.executables]
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            futures = {pool.submit(lowered.compile, self.compiler_options): (table, key)
                       for table, key, lowered in jobs}
            done = concurrent.futures.as_completed(futures)
            for future in (progress(done, total=len(futures)) if progress else done):
                table, key = futures[future]
                table[key] = future.result()

    def _lower_step(self, shape: StepShape):
        verifying = shape.kind == "verify"
        kv_shardings = jax.tree.map(lambda x: x.sharding, self.kv)
        r = self.replicated
        args = (self.params, self.kv, self.slots, self.abstract_inputs(shape))
        if self.buckets.bursts(shape):  # no draft model: bursts are off with speculative decoding
            fn = functools.partial(burst_step, self.graphdef, shape=shape, steps=self.buckets.burst_tokens,
                                   page_size=self.page_size, kernels=self.kernels, sharder=self.sharder)
            counts = jax.ShapeDtypeStruct((shape.seqs,), jnp.int32, sharding=r)
            return jax.jit(fn, donate_argnums=(1, 2), out_shardings=(kv_shardings, r, r, r)).lower(*args, counts)
        fn = functools.partial(verify_step if verifying else step, self.graphdef, shape=shape,
                               page_size=self.page_size, kernels=self.kernels, sharder=self.sharder,
                               draft_graphdef=self.draft_graphdef)
        if verifying:
            args += (self.abstract_drafts(shape),)
        donate, out_shardings = (1, 2), (kv_shardings, r, r, r)
        if self.draft_graphdef is not None:
            donate += (len(args) + 1,)  # the draft's cache, after its params
            args += (self.draft_params, self.draft_kv)
            out_shardings += (jax.tree.map(lambda x: x.sharding, self.draft_kv),)
        return jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings).lower(*args)

    def start_split_decode(self) -> concurrent.futures.Future:
        """Compiles the decode shapes' halves (see the class docstring) in a background thread, so that neither
        start-up nor the engine thread waits for them; the future's result: (seconds, the most memory one pair
        needs beyond its persistent arguments). They take effect once the engine sees the future done
        (`use_split_decode`). Called on the engine thread, which owns the cache and slots: their shapes and
        shardings are captured here, since the arrays themselves are donated to every step."""
        kv, slots = _abstract(self.kv), _abstract(self.slots)
        shapes = [shape for shape in self.buckets.shapes() if shape.kind == "decode"]
        future: concurrent.futures.Future = concurrent.futures.Future()

        def compile_in_background():  # a daemon thread: a process that ends does not wait for it
            try:
                future.set_result(self._compile_split_decode(shapes, kv, slots))
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
                future.set_exception(exc)

        threading.Thread(target=compile_in_background, name="jaxserve-split-decode", daemon=True).start()
        return future

    def _compile_split_decode(self, shapes: list[StepShape], kv: KVCache, slots: SlotState):
        started = time.perf_counter()
        forwards, samplers = {}, {}
        with jax.set_mesh(self.sharder.mesh):
            for shape in shapes:
                forwards[shape] = self._lower_forward(shape, kv, slots.tokens).compile(self.compiler_options)
            for seqs in sorted({shape.seqs for shape in shapes}):
                samplers[seqs] = self._lower_sampling(seqs, slots).compile(self.compiler_options)
        most = max([transient_bytes([f]) for f in forwards.values()]
                   + [transient_bytes([f]) + seqs * self.cfg.vocab_size * 4 for seqs, f in samplers.items()])
        return time.perf_counter() - started, (forwards, samplers), most

    def use_split_decode(self, executables) -> None:
        """Engine thread: installs what start_split_decode compiled."""
        self.forwards, self.samplers = executables

    def _lower_forward(self, shape: StepShape, kv: KVCache, tokens: jax.ShapeDtypeStruct):
        fn = functools.partial(forward_step, self.graphdef, shape=shape, page_size=self.page_size,
                               kernels=self.kernels, sharder=self.sharder)
        kv_shardings = jax.tree.map(lambda x: x.sharding, kv)
        inputs = dataclasses.replace(self.abstract_inputs(shape), disallowed=None)  # the sampling half's
        return jax.jit(fn, donate_argnums=1, out_shardings=(kv_shardings, self.replicated)).lower(
            self.params, kv, tokens, inputs)

    def _lower_sampling(self, seqs: int, slots: SlotState):
        shape = StepShape("decode", seqs, seqs, 1)
        inputs = SampleInputs.of(self.abstract_inputs(shape))
        logits = jax.ShapeDtypeStruct((seqs, self.cfg.vocab_size), jnp.float32, sharding=self.replicated)
        return jax.jit(sampling_step, donate_argnums=0, out_shardings=(self.replicated, self.replicated)).lower(
            slots, logits, inputs)

    def abstract_drafts(self, shape: StepShape) -> DraftInputs:
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=self.replicated)
        return DraftInputs(i32((shape.seqs, self.buckets.num_speculative_tokens)), i32((shape.seqs,)))

    def abstract_inputs(self, shape: StepShape) -> StepInputs:
        s, p = shape.seqs, shape.pages
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=self.replicated)
        bool_ = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bool_, sharding=self.replicated)
        return StepInputs(i32((s, p)), i32((s,)), i32((s + 1,)), i32((s,)), bool_((s,)), bool_((NUM_FLAGS,)),
                          i32((s,)), i32((s, self.mask_words)))

    @property
    def mask_words(self) -> int:
        """int32 words of one row of the structured-output bitmask."""
        return (self.cfg.vocab_size + 31) // 32

    # ---- execution ------------------------------------------------------------------------------------------
    def assign_slot(self, slot: int, row: dict) -> None:
        if self.mirror is not None:
            self.mirror.assign(slot, row)
        self.slots = self._assign(self.slots, np.int32(slot), row)

    def load_adapter(self, slot: int, values: dict[str, np.ndarray]) -> None:
        """Writes one adapter slot of the stacked LoRA factors in place (jaxserve.lora.weights.slot_values)."""
        if self.mirror is not None:
            raise RuntimeError("LoRA adapters are not supported in multi-host runs")
        lora = self.params["layers"]["lora"]
        factors = nnx.to_pure_dict(lora)
        if self._write_adapter is None:
            shardings = jax.tree.map(lambda x: x.sharding, factors)
            self._write_adapter = jax.jit(write_slot, donate_argnums=0, out_shardings=shardings)
        nnx.replace_by_pure_dict(lora, self._write_adapter(factors, np.int32(slot), values))

    def shape_for(self, plan: StepPlan, prompt_logprobs: bool = False) -> StepShape:
        max_pages = max(len(row.pages) for row in plan.seqs)
        if plan.is_verify:
            return self.buckets.verify_shape(plan.num_tokens, len(plan.seqs), max_pages)
        if plan.is_decode and not prompt_logprobs:
            return self.buckets.decode_shape(len(plan.seqs), max_pages)
        return self.buckets.prefill_shape(plan.num_tokens, len(plan.seqs), max_pages)

    def dispatch(self, plan: StepPlan, flags: SamplingFlags, disallowed: np.ndarray | None = None) -> PendingStep:
        """Starts the step on the device and returns at once (JAX dispatch is asynchronous). `disallowed`: the
        structured-output bitmask of the plan's rows ([rows, mask_words] int32), or None."""
        shape = self.shape_for(plan, flags.prompt_logprobs)
        extra = None
        if shape.kind == "verify":
            extra = build_drafts(plan, shape, self.buckets.num_speculative_tokens)
        elif self.buckets.bursts(shape):
            extra = build_counts(plan, shape)
        elif plan.is_burst:
            raise BucketError(f"a decode burst of {len(plan.seqs)} sequences, but {shape} runs no bursts")
        sampled, prompt_lp = self.run(shape, build_inputs(plan, shape, flags, disallowed), flags.prompt_logprobs,
                                      extra)
        return PendingStep(plan, shape, sampled, prompt_lp, flags, time.perf_counter())

    def dispatch_forward(self, plan: StepPlan, flags: SamplingFlags) -> PendingForward:
        """The forward half of a decode plan's split step (see the class docstring); `dispatch_sampling` sends the
        rest once the bitmask is known."""
        shape = self.shape_for(plan, flags.prompt_logprobs)
        forward = self.forwards.get(shape)
        if forward is None:
            raise BucketError(f"{shape} has no split executables (a late mask needs a decode shape and "
                              f"split_decode)")
        inputs = build_inputs(plan, shape, flags)
        self.kv, logits = forward(self.params, self.kv, self.slots.tokens, inputs)
        return PendingForward(plan, shape, logits, inputs, flags, time.perf_counter())

    def dispatch_sampling(self, forward: PendingForward, disallowed: np.ndarray | None) -> PendingStep:
        """The sampling half of a split step, with the plan's rows' bitmask (None: no row is constrained now)."""
        inputs = SampleInputs.of(forward.inputs)
        if disallowed is None:
            inputs.disallowed = self._no_constraint_mask(forward.shape.seqs)
        else:
            inputs.disallowed = np.pad(disallowed, ((0, forward.shape.seqs - disallowed.shape[0]), (0, 0)))
            inputs.flags = (forward.flags | SamplingFlags.STRUCTURED).as_array()
        self.slots, sampled = self.samplers[forward.shape.seqs](self.slots, forward.logits, inputs)
        return PendingStep(forward.plan, forward.shape, sampled, None, forward.flags, forward.dispatched_at)

    def run(self, shape: StepShape, inputs: StepInputs, prompt_logprobs: bool,
            extra: DraftInputs | np.ndarray | None = None) -> tuple[SampleOutput | VerifyOutput, PromptLogprobs | None]:
        """The step's executable on padded inputs (a multi-host follower calls this with the leader's). Prompt
        logprobs are computed when inputs.flags asks for them; `prompt_logprobs` says whether to hand them back.
        Verify shapes take the step's proposals too, burst shapes each row's step count ([S] int32)."""
        executable = self.executables.get(shape)
        if executable is None:
            raise BucketError(f"{shape} is not in the compiled table")
        if self.mirror is not None:
            self.mirror.step(shape, inputs, prompt_logprobs)
        if inputs.disallowed is None:
            inputs = dataclasses.replace(inputs, disallowed=self._no_constraint_mask(shape.seqs))
        extra = () if extra is None else (extra,)
        if self.draft_graphdef is not None:
            extra += (self.draft_params, self.draft_kv)
        self.kv, self.slots, sampled, prompt_lp, *draft_kv = executable(self.params, self.kv, self.slots, inputs,
                                                                         *extra)
        if draft_kv:
            self.draft_kv, = draft_kv
        return sampled, prompt_lp if prompt_logprobs else None

    def _no_constraint_mask(self, seqs: int) -> jax.Array:
        """An all-zero bitmask kept on the device, so steps without constrained rows transfer none."""
        mask = self._no_constraints.get(seqs)
        if mask is None:
            mask = self._no_constraints[seqs] = jax.device_put(np.zeros((seqs, self.mask_words), np.int32),
                                                               self.replicated)
        return mask


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def build_inputs(plan: StepPlan, shape: StepShape, flags: SamplingFlags,
                 disallowed: np.ndarray | None = None) -> StepInputs:
    """Pads a plan to its bucket (numpy, host side); the bitmask too, when the step has one."""
    s = shape.seqs
    block_tables = np.zeros((s, shape.pages), np.int32)
    context_lens = np.zeros(s, np.int32)
    query_start = np.zeros(s + 1, np.int32)
    row_slots = np.zeros(s, np.int32)
    sample_mask = np.zeros(s, bool)
    lora_slots = np.zeros(s, np.int32)
    for i, row in enumerate(plan.seqs):  # a burst row: its first step's (one token, context_len - burst + 1)
        block_tables[i, :len(row.pages)] = row.pages
        context_lens[i] = row.context_len - row.burst + 1
        query_start[i + 1] = row.num_new_tokens - row.burst + 1
        row_slots[i] = row.slot
        sample_mask[i] = row.sample
        lora_slots[i] = row.lora_slot
    np.cumsum(query_start, out=query_start)
    if disallowed is not None:
        disallowed = np.pad(disallowed, ((0, s - disallowed.shape[0]), (0, 0)))
        flags |= SamplingFlags.STRUCTURED
    return StepInputs(block_tables, context_lens, query_start, row_slots, sample_mask, flags.as_array(), lora_slots,
                      disallowed)


def build_counts(plan: StepPlan, shape: StepShape) -> np.ndarray:
    """The steps per row of a plan in a shape that bursts, padded to [S] (padding rows: 0 steps)."""
    counts = np.zeros(shape.seqs, np.int32)
    counts[:len(plan.seqs)] = [row.burst for row in plan.seqs]
    return counts


def build_drafts(plan: StepPlan, shape: StepShape, k: int) -> DraftInputs:
    """The plan's proposals, padded to [S, K] (numpy, host side)."""
    tokens = np.zeros((shape.seqs, k), np.int32)
    counts = np.zeros(shape.seqs, np.int32)
    for i, row in enumerate(plan.seqs):
        counts[i] = row.num_draft_tokens
        tokens[i, :counts[i]] = row.draft_token_ids
    return DraftInputs(tokens, counts)
