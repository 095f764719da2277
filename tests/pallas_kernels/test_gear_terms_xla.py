"""GEAR's terms computed by XLA around the kernel (`gear_terms_xla`) against the dense cache:
the score bias is q . (K_gear - K_kivi) and the value terms are sum_t p_t (V_gear - V_kivi)[t],
with K / V materialised by `dequantize_segment` with and without the GEAR parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gear_terms_xla import (
  check_gear_terms,
  gear_score_bias,
  gear_value_terms_from_scores,
)
from pallas_kernels.quantized_decode_attention_reference import dequantize_segment
from pallas_kernels.random_inputs import random_quantized_segment, random_queries

BATCH, KV_HEADS, GROUP, TOKENS, HEAD_DIM, BLOCK = 2, 3, 4, 192, 64, 64


def _segment(seed, rank, outliers_per_block):
  rng = np.random.default_rng(seed)
  segment = random_quantized_segment(
    rng,
    BATCH,
    KV_HEADS,
    TOKENS,
    HEAD_DIM,
    bits=2,
    group_size=32,
    dtype=jnp.bfloat16,
    rank=rank,
    outliers_per_block=outliers_per_block,
  )
  queries = random_queries(rng, BATCH, KV_HEADS, GROUP, HEAD_DIM)
  return rng, segment, queries


def _gear_parts(segment):
  """(K_gear - K_kivi, V_gear - V_kivi) float32 [B, H, T, D]."""
  kwargs = dict(bits=2, group_size=32, block=BLOCK)
  gear_k, gear_v = dequantize_segment(
    *segment[:6], lowrank=segment.lowrank, outliers=segment.outliers, **kwargs
  )
  kivi_k, kivi_v = dequantize_segment(*segment[:6], **kwargs)
  return gear_k - kivi_k, gear_v - kivi_v


@pytest.mark.parametrize("rank,outliers_per_block", [(3, 20), (2, 0), (0, 41)])
def test_score_bias_is_the_queries_times_the_gear_parts_of_the_keys(rank, outliers_per_block):
  _, segment, queries = _segment(rank + outliers_per_block, rank, outliers_per_block)
  key_part, _ = _gear_parts(segment)
  bias = gear_score_bias(
    segment.lowrank, segment.outliers, queries, tokens=TOKENS, block=BLOCK
  )  # [B, H, G, T]
  expected = jnp.einsum("bhgd,bhtd->bhgt", queries, key_part, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(bias), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank,outliers_per_block", [(3, 20), (2, 0), (0, 41)])
def test_value_terms_are_the_probabilities_times_the_gear_parts_of_the_values(
  rank, outliers_per_block
):
  rng, segment, _ = _segment(10 + rank + outliers_per_block, rank, outliers_per_block)
  _, value_part = _gear_parts(segment)
  lengths = jnp.asarray([TOKENS, 77], jnp.int32)
  scores = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, GROUP, TOKENS)), jnp.float32)
  inside = jnp.arange(TOKENS)[None, :] < lengths[:, None]
  masked = jnp.where(inside[:, None, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(masked, axis=-1)
  # Entries past a row's length are never written by the kernel: NaN must not reach the sum.
  scores = jnp.where(inside[:, None, None, :], scores, jnp.nan)
  terms = gear_value_terms_from_scores(
    segment.lowrank, segment.outliers, scores, lse, lengths, block=BLOCK, head_dim=HEAD_DIM
  )
  probs = jnp.exp(masked - lse[..., None])
  expected = jnp.einsum("bhgt,bhtd->bhgd", probs, value_part, precision=jax.lax.Precision.HIGHEST)
  assert np.all(np.isfinite(np.asarray(terms)))
  np.testing.assert_allclose(np.asarray(terms), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_value_terms_of_an_empty_row_are_zero():
  _, segment, _ = _segment(3, 2, 20)
  lengths = jnp.asarray([0, TOKENS], jnp.int32)
  scores = jnp.full((BATCH, KV_HEADS, GROUP, TOKENS), jnp.nan, jnp.float32)
  scores = scores.at[1].set(0.0)
  lse = jnp.stack(
    [jnp.full((KV_HEADS, GROUP), -jnp.inf), jnp.full((KV_HEADS, GROUP), np.log(TOKENS))]
  )
  terms = gear_value_terms_from_scores(
    segment.lowrank, segment.outliers, scores, lse, lengths, block=BLOCK, head_dim=HEAD_DIM
  )
  np.testing.assert_array_equal(np.asarray(terms[0]), 0.0)
  assert np.all(np.isfinite(np.asarray(terms[1])))


def test_gear_terms_names_its_allowed_values():
  check_gear_terms(None)
  for value in ("kernel", "xla"):
    check_gear_terms(value)
  for bad in ("XLA", "fused", 1, True):
    with pytest.raises(
      ValueError, match=f"gear_terms={bad!r} is not supported; allowed: kernel, xla"
    ):
      check_gear_terms(bad)
