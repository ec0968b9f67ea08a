"""Speculative sampling keeps the target's distribution (jaxserve.engine.sampler.verify), tested statistically:
a tiny bigram model over a vocabulary of 32 is the target, deliberately bad proposals are verified, and the
empirical distributions of the first and second new tokens over 20,000 seeded rows must pass a chi-square test
against the exact target distributions (p > 0.01). Breaking the acceptance rule on purpose must fail it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.engine import sampler
from jaxserve.engine.sampler import SamplingFlags, SlotState, verify

VOCAB, ROWS, PROMPT_LEN = 32, 20_000, 3  # VOCAB >= MAX_TOP_LOGPROBS


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def bigram():
    """logits[previous token] of the next token: a tiny 'model' whose conditionals are known exactly."""
    return np.random.default_rng(0).normal(0, 1.0, (VOCAB, VOCAB)).astype(np.float32)


def slots(temperature=1.0, **fields):
    state = SlotState.zeros(ROWS + 1, PROMPT_LEN + 4)
    return dataclasses.replace(state, temperature=jnp.full((ROWS + 1,), temperature, jnp.float32),
                               seed=jnp.arange(ROWS + 1, dtype=jnp.uint32) * 7919, **fields)


def bad_draft(rng, previous):
    """q(. | previous): most mass on the target's least likely tokens (anti-correlated with the bigram)."""
    q = np.full((len(previous), VOCAB), 0.02)
    q[np.arange(len(previous)), (previous * 3 + 1) % VOCAB] += 0.84
    return q / q.sum(-1, keepdims=True)


def draw(rng, q):
    return (q.cumsum(-1) > rng.random((len(q), 1))).argmax(-1).astype(np.int32)


@jax.jit
def _verify(logits, state, positions, drafts, num_drafts, draft_probs):
    flags = jnp.asarray(SamplingFlags.RANDOM.as_array())
    return verify(logits, state, jnp.arange(1, ROWS + 1, dtype=jnp.int32), positions, drafts, num_drafts, flags,
                  draft_probs)


@jax.jit
def _verify_point_mass(logits, state, positions, drafts, num_drafts):
    flags = jnp.asarray(SamplingFlags.RANDOM.as_array())
    return verify(logits, state, jnp.arange(1, ROWS + 1, dtype=jnp.int32), positions, drafts, num_drafts, flags)


def verify_round(bigram, state, rng, previous, position, k, point_mass):
    """One verify step of every row: k proposals after `previous`; returns (tokens [ROWS, k + 1], accepted)."""
    drafts, probs, tokens = [], [], previous
    for _ in range(k):
        q = bad_draft(rng, tokens)
        tokens = np.full(ROWS, int(np.argmin(bigram[0])), np.int32) if point_mass else draw(rng, q)
        drafts.append(tokens)
        probs.append(q)
    drafts = np.stack(drafts, 1)
    inputs = np.concatenate([previous[:, None], drafts], 1)  # the token before each sampled position
    logits = bigram[inputs]  # [ROWS, k + 1, VOCAB]
    positions = position + np.arange(k + 1)[None, :].repeat(ROWS, 0)
    counts = np.full(ROWS, k, np.int32)
    if point_mass:
        out = _verify_point_mass(logits, state, positions, drafts, counts)
    else:
        out = _verify(logits, state, positions, drafts, counts, np.stack(probs, 1).astype(np.float32))
    return np.asarray(out.tokens), np.asarray(out.num_accepted)


def first_two_tokens(bigram, state, point_mass, k=2, seed=0):
    """The first and second new tokens of every row, by as many verify steps as it takes."""
    rng = np.random.default_rng(seed)
    start = np.zeros(ROWS, np.int32)
    tokens, accepted = verify_round(bigram, state, rng, start, PROMPT_LEN, k, point_mass)
    first = tokens[:, 0]
    again, _ = verify_round(bigram, state, rng, first, PROMPT_LEN + 1, k, point_mass)
    second = np.where(accepted >= 1, tokens[:, 1], again[:, 0])
    return first, second


def p_value(samples, probs):
    observed = np.bincount(samples, minlength=VOCAB)
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(observed, probs / probs.sum() * len(samples)).pvalue


def target(bigram):
    first = softmax(bigram[0])
    return first, first @ softmax(bigram)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass"])
def test_speculative_sampling_keeps_the_target_distribution(bigram, point_mass):
    first, second = first_two_tokens(bigram, slots(), point_mass)
    p_first, p_second = target(bigram)
    assert p_value(first, p_first) > 0.01
    assert p_value(second, p_second) > 0.01


def test_plain_sampling_reference_passes_the_same_test(bigram):
    """The test's own yardstick: rows with no proposals draw as plain sampling does, and pass."""
    state = slots()
    logits = bigram[np.zeros((ROWS, 1), np.int32)]
    out = _verify(logits, state, np.full((ROWS, 1), PROMPT_LEN), np.zeros((ROWS, 0), np.int32),
                  np.zeros(ROWS, np.int32), np.zeros((ROWS, 0, VOCAB), np.float32))
    assert p_value(np.asarray(out.tokens[:, 0]), target(bigram)[0]) > 0.01


def test_a_broken_acceptance_rule_fails_the_test(bigram, monkeypatch):
    """Accepting every proposal samples the bad draft instead: the test must notice."""
    rule = sampler._verify_random

    def accept_everything(*args):
        drawn, accept = rule(*args)
        return drawn, jnp.ones_like(accept)

    monkeypatch.setattr(sampler, "_verify_random", accept_everything)
    unjitted = _verify.__wrapped__
    monkeypatch.setitem(globals(), "_verify", jax.jit(lambda *args: unjitted(*args)))  # traced anew
    first, second = first_two_tokens(bigram, slots(), point_mass=False)
    p_first, p_second = target(bigram)
    assert p_value(first, p_first) < 1e-6 and p_value(second, p_second) < 1e-6


def test_greedy_accepts_the_argmax_prefix_and_adds_the_target_token(bigram):
    state = slots(temperature=0.0)
    argmax = bigram.argmax(-1)
    good = [argmax[0], argmax[argmax[0]]]
    drafts = np.array([good, [good[0], (good[1] + 1) % VOCAB], [(good[0] + 1) % VOCAB, 0]], np.int32)
    rows = np.zeros((ROWS, 2), np.int32)
    rows[:3] = drafts
    logits = bigram[np.concatenate([np.zeros((ROWS, 1), np.int32), rows], 1)]
    out = jax.jit(lambda *a: verify(*a, jnp.asarray(SamplingFlags.NONE.as_array())))(
        logits, state, jnp.arange(1, ROWS + 1, dtype=jnp.int32),
        np.full((ROWS, 3), PROMPT_LEN) + np.arange(3), rows, np.full(ROWS, 2, np.int32))
    assert np.asarray(out.num_accepted[:3]).tolist() == [2, 1, 0]
    assert np.asarray(out.tokens[0]).tolist() == [good[0], good[1], argmax[good[1]]]
    assert np.asarray(out.tokens[1, :2]).tolist() == good
    assert int(out.tokens[2, 0]) == good[0]
