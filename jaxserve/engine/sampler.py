"""On-device sampling, inside the compiled step.

Per-sequence sampling state lives on the device in a `SlotState` (one row per slot; slot 0 is the null slot that
padding rows point at). The host writes a row once when a sequence enters a slot (`assign_slot`), so a step only
sends the slot of each row. The token history is there too: a decode step reads its input token from it, which is
what lets the host dispatch step N+1 before it has read step N's tokens.

Seeded sampling draws with key fold_in(PRNGKey(seed), position): the same seed gives the same tokens whatever else
is in the batch.

Structured output (jaxserve.structured): a step may carry a packed token bitmask, [S, ceil(vocab / 32)] int32 with
bit t of row r set when token t may not be sampled in row r. It is applied first, before bias, penalties,
temperature and top-k/p/min-p, behind the STRUCTURED flag: a step without constrained rows skips it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1
MAX_BANNED = 32  # EOS + stop token ids masked while fewer than min_tokens outputs exist


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    tokens: jax.Array  # [slots, max_model_len + 1] int32: prompt then outputs; the step writes sampled tokens
    prompt_len: jax.Array  # [slots] int32
    min_len: jax.Array  # [slots] int32: before this many tokens, banned ids cannot be sampled
    temperature: jax.Array  # [slots] float32; 0 = greedy
    top_k: jax.Array  # [slots] int32; <= 0 = off
    top_p: jax.Array  # [slots] float32
    min_p: jax.Array  # [slots] float32
    repetition_penalty: jax.Array  # [slots] float32
    presence_penalty: jax.Array  # [slots] float32
    frequency_penalty: jax.Array  # [slots] float32
    seed: jax.Array  # [slots] uint32
    banned: jax.Array  # [slots, MAX_BANNED] int32, -1 = unused
    bias_ids: jax.Array  # [slots, MAX_LOGIT_BIAS] int32, -1 = unused
    bias_values: jax.Array  # [slots, MAX_LOGIT_BIAS] float32

    @classmethod
    def zeros(cls, num_slots: int, max_len: int) -> "SlotState":
        f = lambda: jnp.zeros((num_slots,), jnp.float32)  # noqa: E731
        return cls(jnp.zeros((num_slots, max_len + 1), jnp.int32), jnp.zeros((num_slots,), jnp.int32),
                   jnp.zeros((num_slots,), jnp.int32), f(), jnp.zeros((num_slots,), jnp.int32), f() + 1, f(),
                   f() + 1, f(), f(), jnp.zeros((num_slots,), jnp.uint32),
                   jnp.full((num_slots, MAX_BANNED), -1, jnp.int32),
                   jnp.full((num_slots, MAX_LOGIT_BIAS), -1, jnp.int32),
                   jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.float32))


def slot_row(token_ids, num_prompt_tokens: int, params: SamplingParams, seed: int, eos_ids, max_len: int) -> dict:
    """The numpy values `assign_slot` writes for one sequence (built on the host, sent once)."""
    tokens = np.zeros(max_len + 1, np.int32)
    tokens[:len(token_ids)] = token_ids
    banned = np.full(MAX_BANNED, -1, np.int32)
    ban = ([] if params.ignore_eos else list(eos_ids)) + list(params.stop_token_ids)
    banned[:min(len(ban), MAX_BANNED)] = ban[:MAX_BANNED]
    bias_ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (tok, value) in enumerate(params.logit_bias):
        bias_ids[i], bias_values[i] = tok, value
    # Validation bounds both (jaxserve.validation); clamping keeps a value the device cannot hold from raising
    # here, on the engine thread: min_len past max_len and top_k past the vocabulary mean the same as any larger.
    return dict(tokens=tokens, prompt_len=np.int32(num_prompt_tokens),
                min_len=np.int32(min(num_prompt_tokens + params.min_tokens, max_len + 1)),
                temperature=np.float32(params.temperature), top_k=np.int32(min(params.top_k, INT32_MAX)),
                top_p=np.float32(params.top_p), min_p=np.float32(params.min_p),
                repetition_penalty=np.float32(params.repetition_penalty),
                presence_penalty=np.float32(params.presence_penalty),
                frequency_penalty=np.float32(params.frequency_penalty), seed=np.uint32(seed), banned=banned,
                bias_ids=bias_ids, bias_values=bias_values)


def assign_slot(state: SlotState, slot: jax.Array, row: dict) -> SlotState:
    """Writes one slot's row (jit with the state donated)."""
    return SlotState(**{name: getattr(state, name).at[slot].set(value) for name, value in row.items()})


class SamplingFlags(enum.IntFlag):
    """Which optional stages any row of a step needs; the others are skipped at run time (lax.cond).
    A bit set, so the host ORs a step's rows together with plain integer operations."""

    NONE = 0
    RANDOM = 1
    FILTERS = 2  # top-k / top-p / min-p
    PENALTIES = 4
    BIAS = 8  # logit_bias or min_tokens masking
    LOGPROBS = 16
    PROMPT_LOGPROBS = 32
    STRUCTURED = 64  # a row samples under a grammar's token bitmask
    DRAFT_PASS = 128  # not a sampling stage: the draft model's forward pass runs in this step (jaxserve.spec.draft)

    @property
    def logprobs(self) -> bool:
        return bool(self & SamplingFlags.LOGPROBS)

    @property
    def prompt_logprobs(self) -> bool:
        return bool(self & SamplingFlags.PROMPT_LOGPROBS)

    def as_array(self) -> np.ndarray:
        """[NUM_FLAGS] bool in bit order: the step function's `flags` input."""
        return np.array([bool(self & (1 << i)) for i in range(NUM_FLAGS)], dtype=bool)

    @classmethod
    @functools.lru_cache(maxsize=4096)
    def of(cls, params: SamplingParams) -> "SamplingFlags":
        random = params.temperature > 0
        flags = [(random, cls.RANDOM),
                 (random and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0), cls.FILTERS),
                 (params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0,
                  cls.PENALTIES),
                 (bool(params.logit_bias) or params.min_tokens > 0, cls.BIAS),
                 (params.logprobs is not None, cls.LOGPROBS),
                 (params.prompt_logprobs is not None, cls.PROMPT_LOGPROBS)]
        return functools.reduce(operator.or_, (bit for on, bit in flags if on), cls.NONE)


NUM_FLAGS = 8
(FLAG_RANDOM, FLAG_FILTERS, FLAG_PENALTIES, FLAG_BIAS, FLAG_LOGPROBS, FLAG_PROMPT_LOGPROBS, FLAG_STRUCTURED,
 FLAG_DRAFT_PASS) = range(8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32: log-probability of the sampled token under the model
    top_ids: jax.Array  # [S, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [S, MAX_TOP_LOGPROBS] float32


def sample(logits: jax.Array, state: SlotState, slots: jax.Array, positions: jax.Array,
           flags: jax.Array, disallowed: jax.Array | None = None) -> SampleOutput:
    """logits [S, V] float32 for the rows' slots [S]; positions [S] is where each sampled token will go;
    disallowed [S, ceil(V / 32)] int32: the structured-output bitmask (bit set = token not allowed), applied when
    flags[FLAG_STRUCTURED]."""
    raw = logits
    if disallowed is not None:
        logits = jax.lax.cond(flags[FLAG_STRUCTURED], apply_token_bitmask, lambda lg, _: lg, logits, disallowed)
    logits = jax.lax.cond(flags[FLAG_BIAS], _apply_bias, lambda lg, *_: lg, logits, state, slots, positions)
    logits = jax.lax.cond(flags[FLAG_PENALTIES], _apply_penalties, lambda lg, *_: lg, logits, state, slots,
                          positions)
    greedy = argmax(logits)
    tokens = jax.lax.cond(flags[FLAG_RANDOM], _sample_random, lambda lg, *_: greedy, logits, state, slots,
                          positions, flags[FLAG_FILTERS], greedy)
    s = logits.shape[0]
    empty = SampleOutput(tokens, jnp.zeros((s,), jnp.float32), jnp.zeros((s, MAX_TOP_LOGPROBS), jnp.int32),
                         jnp.zeros((s, MAX_TOP_LOGPROBS), jnp.float32))
    return jax.lax.cond(flags[FLAG_LOGPROBS], lambda: _with_logprobs(raw, tokens), lambda: empty)


def _with_logprobs(raw: jax.Array, tokens: jax.Array) -> SampleOutput:
    lp = jax.nn.log_softmax(raw, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def apply_token_bitmask(logits: jax.Array, disallowed: jax.Array) -> jax.Array:
    """-inf where the packed bitmask [S, ceil(V / 32)] int32 has the token's bit set (bit t % 32 of word t // 32)."""
    bits = (disallowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    banned = bits.reshape(disallowed.shape[0], -1)[:, :logits.shape[1]] != 0
    return jnp.where(banned, -jnp.inf, logits)


def _apply_bias(logits, state: SlotState, slots, positions):
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = state.bias_ids[slots]
    logits = logits.at[rows, jnp.where(ids >= 0, ids, logits.shape[1])].add(state.bias_values[slots], mode="drop")
    banned = state.banned[slots]
    too_early = (positions < state.min_len[slots])[:, None] & (banned >= 0)
    return logits.at[rows, jnp.where(too_early, banned, logits.shape[1])].set(-jnp.inf, mode="drop")


def _apply_penalties(logits, state: SlotState, slots, positions):
    """Repetition penalty over prompt + output; presence and frequency penalties over the output (vLLM's rules)."""
    history = state.tokens[slots]  # [S, L + 1]
    pos = jnp.arange(history.shape[1])[None, :]
    seen = pos < positions[:, None]
    is_output = seen & (pos >= state.prompt_len[slots][:, None])
    rows = jnp.arange(logits.shape[0])[:, None]
    out_counts = jnp.zeros(logits.shape, jnp.float32).at[rows, history].add(is_output.astype(jnp.float32))
    any_seen = jnp.zeros(logits.shape, jnp.float32).at[rows, history].add(seen.astype(jnp.float32)) > 0
    rep = state.repetition_penalty[slots][:, None]
    logits = jnp.where(any_seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - state.frequency_penalty[slots][:, None] * out_counts
    return logits - state.presence_penalty[slots][:, None] * (out_counts > 0)


def _sample_random(logits, state: SlotState, slots, positions, use_filters, greedy):
    temperature = state.temperature[slots]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = jax.lax.cond(use_filters, _filter, lambda lg, *_: lg, scaled, state, slots)
    gumbel = _gumbel(_position_keys(state, slots, positions), logits.shape[1])
    drawn = argmax(scaled + gumbel)
    return jnp.where(temperature > 0, drawn, greedy)


def _position_keys(state: SlotState, slots: jax.Array, positions: jax.Array) -> jax.Array:
    """Each row's key for the token at its position: fold_in(PRNGKey(seed), position)."""
    return jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(state.seed[slots], positions)


def _gumbel(keys: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise [rows, vocab], a function of each row's key: one 32-bit word drawn from the key
    (threefry), then a counter hash per token (the bijective lowbias32 mixer over a Weyl sequence, 23 bits of it
    as a uniform in (0, 1)). Threefry for every token cost 9.5 ms of a 16-row decode step on a 2-core CPU (32000
    tokens), this 1.8 ms, argmax included (bench/sampling.py)."""
    word = jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(keys)
    h = word[:, None] + jnp.arange(vocab, dtype=jnp.uint32)[None, :] * jnp.uint32(0x9E3779B9)
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    uniform = ((h >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-23)  # never 0 or 1
    return -jnp.log(-jnp.log(uniform))


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum), int32, as a max and a min: XLA:CPU's
    argmax (a reduce over value-index pairs) ran 10x slower than a max over [16, 32000] float32. A NaN row gives
    the last index."""
    top = jnp.max(x, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def _filter(scaled, state: SlotState, slots):
    """top-k, then top-p on what is left, then min-p; masked logits become -inf."""
    vocab = scaled.shape[1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = state.top_k[slots]
    k = jnp.where((k <= 0) | (k > vocab), vocab, k)
    rank = jnp.arange(vocab)[None, :]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < state.top_p[slots][:, None]) & (probs >= state.min_p[slots][:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    num_keep = jnp.sum(keep & (rank < k[:, None]), axis=-1)
    threshold = jnp.take_along_axis(desc, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


# ---- speculative decoding: verifying proposals --------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyOutput:
    """A verify step's rows: tokens[s, :num_accepted[s] + 1] are row s's new tokens (its accepted proposals, then
    the target's token at the first rejection, or the bonus token after the last proposal)."""

    tokens: jax.Array  # [S, K + 1] int32
    num_accepted: jax.Array  # [S] int32
    logprobs: jax.Array  # [S, K + 1] float32: of each token under the target model
    top_ids: jax.Array  # [S, K + 1, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [S, K + 1, MAX_TOP_LOGPROBS] float32


def verify(logits: jax.Array, state: SlotState, slots: jax.Array, positions: jax.Array, drafts: jax.Array,
           num_drafts: jax.Array, flags: jax.Array, draft_probs: jax.Array | None = None) -> VerifyOutput:
    """Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023) of each row's proposals.

    logits [S, K + 1, V]: the target's at a row's last K + 1 query tokens; positions [S, K + 1]: where the token
    drawn from each would go; drafts [S, K]: row s's proposals are the first num_drafts[s]; draft_probs
    [S, K, V]: the proposer's distributions q (None: point masses, as n-gram proposals are).

    Each position's logits are processed as plain sampling processes them (bias, min_tokens, penalties over a
    history holding the earlier proposals, temperature, top-k/p, min-p) into the target distribution p_i.
    Proposal d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
    drawn from the residual max(0, p_i - q_i), normalised; after the last proposal the bonus token is drawn
    from p. The tokens are then distributed exactly as the target's. Greedy rows accept while the proposal is
    the argmax. A row without proposals draws exactly as `sample` would (same key, fold_in(seed, position)).
    """
    s, k1, vocab = logits.shape
    row_slots, flat_positions = jnp.repeat(slots, k1), positions.reshape(-1)
    raw = logits.reshape(-1, vocab)
    processed = jax.lax.cond(flags[FLAG_BIAS], _apply_bias, lambda lg, *_: lg, raw, state, row_slots,
                             flat_positions)
    processed = jax.lax.cond(flags[FLAG_PENALTIES], _apply_penalties, lambda lg, *_: lg, processed, state,
                             row_slots, flat_positions)
    greedy = argmax(processed).reshape(s, k1)
    has_draft = jnp.arange(k1)[None, :] < num_drafts[:, None]  # [S, K + 1]: never at the bonus position
    proposals = jnp.pad(drafts, ((0, 0), (0, 1)))
    greedy_accept = proposals == greedy
    if draft_probs is not None:
        draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))) * has_draft[..., None]
    drawn, random_accept = jax.lax.cond(
        flags[FLAG_RANDOM], _verify_random, lambda *_: (greedy, greedy_accept), processed, state, row_slots,
        flat_positions, flags[FLAG_FILTERS], proposals, has_draft, draft_probs)
    is_random = (state.temperature[slots] > 0)[:, None]
    accept = jnp.where(is_random, random_accept, greedy_accept) & has_draft
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(k1)[None, :] < num_accepted[:, None], proposals, jnp.where(is_random, drawn, greedy))
    flat = tokens.reshape(-1)
    empty = SampleOutput(flat, jnp.zeros((s * k1,), jnp.float32), jnp.zeros((s * k1, MAX_TOP_LOGPROBS), jnp.int32),
                         jnp.zeros((s * k1, MAX_TOP_LOGPROBS), jnp.float32))
    lp = jax.lax.cond(flags[FLAG_LOGPROBS], lambda: _with_logprobs(raw, flat), lambda: empty)
    return VerifyOutput(tokens, num_accepted, lp.logprobs.reshape(s, k1),
                        lp.top_ids.reshape(s, k1, MAX_TOP_LOGPROBS), lp.top_logprobs.reshape(s, k1, MAX_TOP_LOGPROBS))


def _verify_random(processed, state: SlotState, row_slots, positions, use_filters, proposals, has_draft,
                   draft_probs):
    """(token drawn from the residual, proposal accepted) at each [S, K + 1] position, for rows with temperature."""
    shape, vocab = proposals.shape, processed.shape[1]
    temperature = state.temperature[row_slots]
    scaled = processed / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = jax.lax.cond(use_filters, _filter, lambda lg, *_: lg, scaled, state, row_slots)
    keys = _position_keys(state, row_slots, positions)
    gumbel = _gumbel(keys, vocab)
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    p = jax.nn.softmax(scaled, axis=-1)
    d, proposed = proposals.reshape(-1), has_draft.reshape(-1)
    p_d = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    if draft_probs is None:  # q is a point mass at d: accept with p(d); the residual is p without d
        q_d = jnp.ones_like(p_d)
        is_d = jnp.arange(vocab)[None, :] == d[:, None]
        residual = jnp.where(proposed[:, None] & is_d, -jnp.inf, scaled)
    else:
        q = draft_probs.reshape(-1, vocab)
        q_d = jnp.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        excess = jnp.maximum(p - q, 0.0)
        residual = jnp.where(excess > 0, jnp.log(jnp.where(excess > 0, excess, 1.0)), -jnp.inf)
    no_residual = ~jnp.any(residual > -jnp.inf, axis=-1)  # p <= q everywhere (up to rounding): always accept
    accept = (uniform * q_d < p_d) | no_residual
    drawn = argmax(residual + gumbel)
    return drawn.reshape(shape), accept.reshape(shape)


def sample_draft(logits: jax.Array, state: SlotState, slots: jax.Array, positions: jax.Array, flags: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """A draft model's proposal for each row (speculative decoding): (tokens [S], q [S, V]), q the distribution
    the token was drawn from, for `verify`'s acceptance test. Greedy rows propose the draft's argmax (q unused:
    greedy verification compares with the target's argmax); rows with temperature draw from softmax(logits / T)
    with key fold_in(fold_in(PRNGKey(seed), position), 2), a stream apart from the target's draws at the same
    position. The draft's q needs no top-k/p: any q works for exact sampling, as long as it is the one drawn from.
    """
    greedy = argmax(logits)

    def draw(logits):
        temperature = state.temperature[slots]
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(_position_keys(state, slots, positions))
        gumbel = _gumbel(keys, logits.shape[1])
        drawn = argmax(scaled + gumbel)
        return jnp.where(temperature > 0, drawn, greedy), jax.nn.softmax(scaled, axis=-1)

    return jax.lax.cond(flags[FLAG_RANDOM], draw, lambda lg: (greedy, jnp.zeros_like(lg)), logits)
