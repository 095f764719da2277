"""GEAR's terms computed by XLA around the GPU kernels (`gear_terms_xla`) against the dense
cache: the score bias is q . (K_gear - K_kivi) and the value terms are
sum_t p_t (V_gear - V_kivi)[t], with K / V materialised by `dequantize_segment` with and
without the GEAR parts."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gear_terms_xla
from pallas_kernels.base_two_softmax import LOG2_E
from pallas_kernels.gear_terms_xla import (
  check_gear_terms,
  gear_value_terms_from_scores,
)
from pallas_kernels.quantized_decode_attention_reference import dequantize_segment
from pallas_kernels.random_inputs import random_quantized_segment

BATCH, KV_HEADS, GROUP, TOKENS, HEAD_DIM, BLOCK = 2, 3, 4, 192, 64, 64
HIGHEST = jax.lax.Precision.HIGHEST


def _segment(seed, rank, outliers_per_block, tokens=TOKENS, head_dim=HEAD_DIM, block=BLOCK):
  rng = np.random.default_rng(seed)
  segment = random_quantized_segment(
    rng,
    BATCH,
    KV_HEADS,
    tokens,
    head_dim,
    bits=2,
    group_size=16,
    dtype=jnp.bfloat16,
    rank=rank,
    outliers_per_block=outliers_per_block,
    block=block,
  )
  return rng, segment


@functools.partial(jax.jit, static_argnames="block")
def _gear_parts(segment, block):
  """(K_gear - K_kivi, V_gear - V_kivi) float32 [B, H, T, D]. Jitted, as are the terms below:
  each example's shapes then compile a few programs instead of every op apart."""
  kwargs = dict(bits=2, group_size=16, block=block)
  gear_k, gear_v = dequantize_segment(
    *segment[:6], lowrank=segment.lowrank, outliers=segment.outliers, **kwargs
  )
  kivi_k, kivi_v = dequantize_segment(*segment[:6], **kwargs)
  return gear_k - kivi_k, gear_v - kivi_v


GEAR_SEGMENTS = dict(
  seed=st.integers(0, 2**16),
  rank=st.integers(0, 3),
  outliers_per_block=st.integers(0, 24),
  head_dim=st.sampled_from([32, 64]),
  block=st.sampled_from([16, 32]),
  blocks=st.integers(1, 3),
  group=st.integers(1, 4),
)


def scores_of_random_rows(rng, tokens: int, group: int):
  """(lengths int32 [2]: a full row and one of random length; random scores as the kernels write
  them, base-2 and NaN at and past a row's length, [2, KV_HEADS, group, tokens]; their lse and
  the probabilities they give, 0 past the length)."""
  lengths = jnp.asarray([tokens, int(rng.integers(1, tokens + 1))], jnp.int32)
  inside = (jnp.arange(tokens)[None, :] < lengths[:, None])[:, None, None, :]
  scores = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, group, tokens)), jnp.float32)
  masked = jnp.where(inside, scores, -jnp.inf)
  lse = jax.nn.logsumexp(masked, axis=-1)
  base_two = jnp.where(inside, scores * LOG2_E, jnp.nan)
  return lengths, base_two, lse, jnp.exp(masked - lse[..., None])


@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(**GEAR_SEGMENTS)
def test_gear_terms_are_the_gear_parts_of_the_dense_cache(
  seed, rank, outliers_per_block, head_dim, block, blocks, group
):
  """bias = q . (K_gear - K_kivi); value terms = sum_t p_t (V_gear - V_kivi)[t], p normalised
  over each row's length; the scores past a row's length are NaN (never written by the kernel)
  and must not reach the terms."""
  hypothesis.assume(rank or outliers_per_block)
  tokens = blocks * block
  rng, segment = _segment(seed, rank, outliers_per_block, tokens, head_dim, block)
  key_part, value_part = _gear_parts(segment, block)
  queries = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, group, head_dim)), jnp.float32)
  bias = jax.jit(gear_terms_xla.gear_score_bias, static_argnames=("tokens", "block"))(
    segment.lowrank, segment.outliers, queries, tokens=tokens, block=block
  )
  expected_bias = jnp.einsum("bhgd,bhtd->bhgt", queries, key_part, precision=HIGHEST)
  np.testing.assert_allclose(np.asarray(bias), np.asarray(expected_bias), rtol=1e-5, atol=1e-5)

  lengths, scores, lse, probs = scores_of_random_rows(rng, tokens, group)
  terms = jax.jit(
    gear_terms_xla.gear_value_terms_from_scores, static_argnames=("block", "head_dim")
  )(segment.lowrank, segment.outliers, scores, lse, lengths, block=block, head_dim=head_dim)
  expected = jnp.einsum("bhgt,bhtd->bhgd", probs, value_part, precision=HIGHEST)
  assert np.all(np.isfinite(np.asarray(terms)))
  np.testing.assert_allclose(np.asarray(terms), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean():
  assert_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean(gear_terms_xla)


def assert_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean(terms_module):
  """Row 0 is empty (its scores NaN, its lse -inf): zero terms. Row 1's scores are all 0, so its
  probabilities are uniform and its terms are the mean of GEAR's value parts over the tokens."""
  _, segment = _segment(3, 2, 20)
  lengths = jnp.asarray([0, TOKENS], jnp.int32)
  scores = jnp.full((BATCH, KV_HEADS, GROUP, TOKENS), jnp.nan, jnp.float32)
  scores = scores.at[1].set(0.0)
  lse = jnp.stack(
    [jnp.full((KV_HEADS, GROUP), -jnp.inf), jnp.full((KV_HEADS, GROUP), np.log(TOKENS))]
  )
  terms = terms_module.gear_value_terms_from_scores(
    segment.lowrank, segment.outliers, scores, lse, lengths, block=BLOCK, head_dim=HEAD_DIM
  )
  np.testing.assert_array_equal(np.asarray(terms[0]), 0.0)
  uniform = np.asarray(_gear_parts(segment, BLOCK)[1][1]).mean(axis=1)  # [KV_HEADS, D]
  expected = np.broadcast_to(uniform[:, None, :], (KV_HEADS, GROUP, HEAD_DIM))
  np.testing.assert_allclose(np.asarray(terms[1]), expected, rtol=1e-5, atol=1e-6)


def test_gear_terms_names_its_allowed_values():
  check_gear_terms(None)
  for value in ("kernel", "xla"):
    check_gear_terms(value)
  for bad in ("XLA", "fused", 1, True):
    with pytest.raises(
      ValueError, match=f"gear_terms={bad!r} is not supported; allowed: kernel, xla"
    ):
      check_gear_terms(bad)


def test_value_outliers_wrap_around_the_partial_accumulators(monkeypatch):
  """Five GEAR blocks into two partial accumulators (blocks 0, 2, 4 share one): the sum is the
  dense cache's, whatever the number of accumulators."""
  block, blocks = 16, 5
  tokens = block * blocks
  rng, segment = _segment(11, 0, 12, tokens, HEAD_DIM, block)
  _, value_part = _gear_parts(segment, block)
  scores = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, GROUP, tokens)), jnp.float32)
  lengths = jnp.asarray([tokens, tokens - 7], jnp.int32)
  inside = (jnp.arange(tokens)[None, :] < lengths[:, None])[:, None, None, :]
  masked = jnp.where(inside, scores, -jnp.inf)
  lse = jax.nn.logsumexp(masked, axis=-1)
  expected = jnp.einsum(
    "bhgt,bhtd->bhgd", jnp.exp(masked - lse[..., None]), value_part, precision=HIGHEST
  )
  for slots in (2, 1, 32):
    monkeypatch.setattr(gear_terms_xla, "OUTLIER_SLOTS", slots)
    terms = gear_value_terms_from_scores(
      None, segment.outliers, scores * LOG2_E, lse, lengths, block=block, head_dim=HEAD_DIM
    )
    np.testing.assert_allclose(np.asarray(terms), np.asarray(expected), rtol=1e-5, atol=1e-6)
