"""The jnp references against plain dense attention on materialised K/V (float64 numpy)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention_reference import (
  decode_attention_reference,
  merge_attention_partials,
)
from pallas_kernels.quantized_decode_attention_reference import (
  dequantize_segment,
  quantized_decode_attention_reference,
)
from pallas_kernels.random_inputs import (
  random_full_segment,
  random_quantized_segment,
  random_queries,
)
from tests.pallas_kernels.kernel_checks import assert_matches_reference, poison_past_lengths


def dense_attention_float64(queries, keys, values, lengths, sm_scale):
  q, k, v = (np.asarray(x, np.float64) for x in (queries, keys, values))
  scores = np.einsum("bhgd,bhtd->bhgt", q, k) * sm_scale
  valid = np.arange(k.shape[2])[None, :] < np.asarray(lengths)[:, None]
  scores = np.where(valid[:, None, None, :], scores, -np.inf)
  peak = np.max(scores, axis=-1, keepdims=True)
  peak = np.where(np.isfinite(peak), peak, 0.0)
  weights = np.where(valid[:, None, None, :], np.exp(scores - peak), 0.0)
  total = weights.sum(-1)
  v = np.where(valid[:, None, :, None], v, 0.0)
  out = np.einsum("bhgt,bhtd->bhgd", weights, v) / np.where(total > 0, total, 1)[..., None]
  lse = np.where(total > 0, np.log(np.where(total > 0, total, 1)) + peak[..., 0], -np.inf)
  return out, lse


def test_full_reference_ignores_nan_past_length():
  queries = random_queries(np.random.default_rng(0), 3, 2, 4, 64)
  keys, values = random_full_segment(np.random.default_rng(1), 3, 2, 50, 64)
  lengths = jnp.array([50, 17, 0], jnp.int32)
  past = jnp.arange(50)[None, None, :, None] >= lengths[:, None, None, None]
  ref = dense_attention_float64(queries, keys, values, lengths, 0.125)
  keys, values = jnp.where(past, jnp.nan, keys), jnp.where(past, jnp.nan, values)
  out, lse = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.125)
  assert_matches_reference(out, lse, *ref, rtol=1e-5)


def test_merge_of_two_segments_equals_whole():
  queries = random_queries(np.random.default_rng(2), 2, 2, 3, 64)
  keys, values = random_full_segment(np.random.default_rng(3), 2, 2, 40, 64)
  first = decode_attention_reference(
    queries, keys[:, :, :25], values[:, :, :25], jnp.array([25, 0], jnp.int32), sm_scale=0.1
  )
  second = decode_attention_reference(
    queries, keys[:, :, 25:], values[:, :, 25:], jnp.array([15, 15], jnp.int32), sm_scale=0.1
  )
  out, lse = merge_attention_partials([first, second])
  # Row 0 sees all 40 slots; row 1 (empty first segment) only the second segment's 15.
  whole = dense_attention_float64(queries[:1], keys[:1], values[:1], jnp.array([40]), 0.1)
  tail = dense_attention_float64(
    queries[1:], keys[1:, :, 25:], values[1:, :, 25:], jnp.array([15]), 0.1
  )
  assert_matches_reference(out[:1], lse[:1], *whole, rtol=1e-5)
  assert_matches_reference(out[1:], lse[1:], *tail, rtol=1e-5)


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,chunk",
  [
    (2, 64, 4, False, 64),
    (4, 128, 1, True, 128),
    (8, 64, 8, True, 512),
  ],
)
def test_quantized_reference_equals_dense_on_dequantized(bits, head_dim, group, gear, chunk):
  tokens, group_size = 256, 32
  segment = random_quantized_segment(
    np.random.default_rng(bits + head_dim),
    3,
    2,
    tokens,
    head_dim,
    bits=bits,
    group_size=group_size,
    rank=3 if gear else 0,
    outliers_per_block=7 if gear else 0,
  )
  queries = random_queries(np.random.default_rng(9), 3, 2, group, head_dim)
  lengths = jnp.array([tokens, 97, 0], jnp.int32)
  sm_scale = head_dim**-0.5
  out, lse = quantized_decode_attention_reference(
    queries,
    *segment[:6],
    lengths,
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    lowrank=segment.lowrank,
    outliers=segment.outliers,
    chunk_tokens=chunk,
  )
  keys, values = dequantize_segment(
    *segment[:6],
    bits=bits,
    group_size=group_size,
    lowrank=segment.lowrank,
    outliers=segment.outliers,
  )
  expected = dense_attention_float64(queries, keys, values, lengths, sm_scale)
  assert_matches_reference(out, lse, *expected, rtol=1e-5)


def test_quantized_reference_config_errors_name_the_parameter():
  segment = random_quantized_segment(np.random.default_rng(0), 1, 1, 64, 64, bits=2, group_size=32)
  queries = random_queries(np.random.default_rng(1), 1, 1, 2, 64)
  lengths = jnp.array([64], jnp.int32)
  with pytest.raises(ValueError, match="bits"):
    quantized_decode_attention_reference(
      queries, *segment[:6], lengths, bits=3, group_size=32, sm_scale=1.0
    )
  with pytest.raises(ValueError, match="k_scale"):
    quantized_decode_attention_reference(
      queries, *segment[:6], lengths, bits=2, group_size=16, sm_scale=1.0
    )
  with pytest.raises(ValueError, match="lowrank"):
    quantized_decode_attention_reference(
      queries,
      *segment[:6],
      lengths,
      bits=2,
      group_size=32,
      sm_scale=1.0,
      lowrank=(segment.k_codes,),
    )


@pytest.mark.parametrize("gear", [False, True])
def test_quantized_reference_ignores_garbage_past_length(gear):
  """Storage past a row's length may hold anything: NaN statistics and factors, all-ones codes,
  outlier indices past their block (`poison_past_lengths`). The result is the clean segment's,
  bit for bit: a probability of 0 times NaN would otherwise reach the output."""
  tokens, group_size = 256, 32
  segment = random_quantized_segment(
    np.random.default_rng(21),
    3,
    2,
    tokens,
    64,
    bits=4,
    group_size=group_size,
    rank=2 if gear else 0,
    outliers_per_block=5 if gear else 0,
  )
  queries = random_queries(np.random.default_rng(22), 3, 2, 4, 64)
  # Ending mid key group and mid GEAR block; one row empty.
  lengths = jnp.array([tokens, 97, 0], jnp.int32)
  kwargs = dict(bits=4, group_size=group_size, sm_scale=0.125, chunk_tokens=128)
  clean = quantized_decode_attention_reference(
    queries, *segment[:6], lengths, lowrank=segment.lowrank, outliers=segment.outliers, **kwargs
  )
  poisoned = poison_past_lengths(segment, lengths, group_size=group_size)
  assert np.isnan(np.asarray(poisoned.v_scale)).any()
  out, lse = quantized_decode_attention_reference(
    queries, *poisoned[:6], lengths, lowrank=poisoned.lowrank, outliers=poisoned.outliers, **kwargs
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(clean[0]))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean[1]))
