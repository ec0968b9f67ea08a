"""The sampler's own pieces (jaxserve.engine.sampler): the argmax it uses over the vocabulary and the Gumbel noise
behind every random draw. The end-to-end distribution tests are in test_spec_sampling.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxserve.engine import sampler
from jaxserve.engine.sampler import SamplingFlags, SlotState


def test_argmax_is_the_first_index_of_the_maximum():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 1000)).astype(np.float32)  # many ties
    x[5] = -np.inf  # a fully masked row
    x[6, 10:] = -np.inf
    out = np.asarray(sampler.argmax(jnp.asarray(x)))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.argmax(x, axis=-1))
    y = rng.standard_normal((3, 7, 50)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(sampler.argmax(jnp.asarray(y))), np.argmax(y, axis=-1))


def test_argmax_of_a_nan_row_stays_in_the_vocabulary():
    x = np.zeros((2, 40), np.float32)
    x[0, 3] = np.nan
    out = np.asarray(sampler.argmax(jnp.asarray(x)))
    assert 0 <= out[0] < 40 and out[1] == 0


def _keys(seeds, positions):
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(jnp.asarray(seeds, jnp.uint32),
                                                                          jnp.asarray(positions, jnp.int32))


def test_gumbel_noise_is_standard_gumbel_and_a_function_of_the_key():
    vocab = 32000
    noise = np.asarray(sampler._gumbel(_keys(np.arange(16), np.full(16, 5)), vocab), np.float64)
    assert noise.shape == (16, vocab) and np.isfinite(noise).all()
    assert stats.kstest(noise.ravel(), stats.gumbel_r.cdf).pvalue > 0.01
    for row in (noise[0], noise[15]):  # each row alone too (the counter runs along the vocabulary)
        assert stats.kstest(row, stats.gumbel_r.cdf).pvalue > 0.01
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.03
    again = np.asarray(sampler._gumbel(_keys([0, 1], [5, 5]), vocab))
    np.testing.assert_array_equal(again, noise[:2])
    other = np.asarray(sampler._gumbel(_keys([0], [6]), vocab))
    assert abs(np.corrcoef(noise[0], other[0])[0, 1]) < 0.03


def test_sample_draws_the_softmax_of_the_scaled_logits():
    rows, vocab = 20_000, 48
    logits = np.random.default_rng(1).normal(0, 1.5, vocab).astype(np.float32)
    state = SlotState.zeros(rows + 1, 8)
    for temperature in (1.0, 0.6):
        state = dataclasses.replace(state, temperature=jnp.full((rows + 1,), temperature, jnp.float32),
                                    seed=jnp.arange(rows + 1, dtype=jnp.uint32) * 7919)
        flags = jnp.asarray(SamplingFlags.RANDOM.as_array())
        out = jax.jit(sampler.sample)(jnp.tile(logits, (rows, 1)), state, jnp.arange(1, rows + 1, dtype=jnp.int32),
                                      jnp.full((rows,), 3, jnp.int32), flags)
        scaled = logits.astype(np.float64) / temperature
        p = np.exp(scaled - scaled.max())
        observed = np.bincount(np.asarray(out.tokens), minlength=vocab)
        assert stats.chisquare(observed, p / p.sum() * rows).pvalue > 0.01
