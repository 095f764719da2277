"""GEAR's outlier terms laid out for a TPU (`gear_outlier_terms_tpu`): equal to the dense cache's
outlier parts (a segment of rank 0, so that GEAR's parts are its outliers alone), and to
`gear_terms_xla`'s on the same inputs; an empty row's terms are zero."""

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import Precision

from pallas_kernels import gear_outlier_terms_tpu, gear_terms_xla
from pallas_kernels.base_two_softmax import LOG2_E
from tests.pallas_kernels.test_gear_terms_xla import (
  BATCH,
  GEAR_SEGMENTS,
  KV_HEADS,
  _gear_parts,
  _segment,
  scores_of_random_rows,
)


@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(**GEAR_SEGMENTS)
def test_outlier_terms_are_the_outlier_parts_of_the_dense_cache(
  seed, rank, outliers_per_block, head_dim, block, blocks, group
):
  del rank  # the low-rank terms are the TPU kernel's own
  hypothesis.assume(outliers_per_block)
  tokens = blocks * block
  rng, segment = _segment(seed, 0, outliers_per_block, tokens, head_dim, block)
  key_part, value_part = _gear_parts(segment, block)
  queries = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, group, head_dim)), jnp.float32)
  bias = gear_outlier_terms_tpu.outlier_score_bias(
    segment.outliers, queries, tokens=tokens, block=block
  )
  expected_bias = jnp.einsum("bhgd,bhtd->bhgt", queries, key_part, precision=Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(bias), np.asarray(expected_bias), rtol=1e-5, atol=1e-5)

  lengths, scores, lse, probs = scores_of_random_rows(rng, tokens, group)
  terms = gear_outlier_terms_tpu.outlier_value_terms_from_scores(
    segment.outliers, scores, lse, lengths, block=block, head_dim=head_dim
  )
  expected = jnp.einsum("bhgt,bhtd->bhgd", probs, value_part, precision=Precision.HIGHEST)
  assert np.all(np.isfinite(np.asarray(terms)))
  np.testing.assert_allclose(np.asarray(terms), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_the_terms_equal_the_gpu_layouts_outlier_terms():
  # Five GEAR blocks of 16 tokens, 12 outliers each; one row ending mid-block.
  block, tokens, head_dim = 16, 80, 64
  rng, segment = _segment(5, 0, 12, tokens, head_dim, block)
  queries = jnp.asarray(rng.normal(size=(2, 3, 8, head_dim)), jnp.float32)
  bias = gear_outlier_terms_tpu.outlier_score_bias(
    segment.outliers, queries, tokens=tokens, block=block
  )
  expected_bias = gear_terms_xla.gear_score_bias(
    None, segment.outliers, queries, tokens=tokens, block=block
  )
  np.testing.assert_allclose(np.asarray(bias), np.asarray(expected_bias), rtol=1e-6, atol=1e-6)
  lengths = jnp.asarray([tokens, 37], jnp.int32)
  scores = jnp.asarray(rng.normal(size=(2, 3, 8, tokens)), jnp.float32)
  inside = jnp.arange(tokens)[None, None, None, :] < lengths[:, None, None, None]
  lse = jax.nn.logsumexp(jnp.where(inside, scores, -jnp.inf)[:, :, :4], axis=-1)
  common = dict(block=block, head_dim=head_dim)
  terms = gear_outlier_terms_tpu.outlier_value_terms_from_scores(
    segment.outliers, scores * LOG2_E, lse, lengths, **common
  )
  expected = gear_terms_xla.gear_value_terms_from_scores(
    None, segment.outliers, scores * LOG2_E, lse, lengths, **common
  )
  assert terms.shape == (2, 3, 4, head_dim)
  np.testing.assert_allclose(np.asarray(terms), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_value_terms_of_an_empty_row_are_zero():
  """Row 0 is empty: its scores NaN (never written) and its lse -inf."""
  block, tokens, head_dim = 16, 48, 64
  _, segment = _segment(3, 0, 20, tokens, head_dim, block)
  lengths = jnp.asarray([0, tokens], jnp.int32)
  scores = jnp.full((2, 3, 4, tokens), jnp.nan, jnp.float32).at[1].set(0.0)
  lse = jnp.stack([jnp.full((3, 4), -jnp.inf), jnp.full((3, 4), np.log(tokens))])
  terms = gear_outlier_terms_tpu.outlier_value_terms_from_scores(
    segment.outliers, scores, lse, lengths, block=block, head_dim=head_dim
  )
  np.testing.assert_array_equal(np.asarray(terms[0]), 0.0)
  assert np.all(np.isfinite(np.asarray(terms[1])))
