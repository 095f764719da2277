"""GEAR's terms laid out for a TPU (`gear_terms_tpu`): equal to `gear_terms_xla`'s on the same
inputs (test_gear_terms_xla checks both against the dense cache), and an empty row's zero."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gear_terms_tpu, gear_terms_xla
from pallas_kernels.base_two_softmax import LOG2_E
from tests.pallas_kernels.test_gear_terms_xla import (
  _segment,
  assert_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean,
)


def test_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean():
  assert_value_terms_of_an_empty_row_are_zero_and_of_a_uniform_row_the_mean(gear_terms_tpu)


def test_the_terms_equal_the_gpu_layouts_terms():
  # Five GEAR blocks of 16 tokens, 12 outliers each, rank 2; one row ending mid-block.
  block, tokens, head_dim = 16, 80, 64
  rng, segment = _segment(5, 2, 12, tokens, head_dim, block)
  queries = jnp.asarray(rng.normal(size=(2, 3, 8, head_dim)), jnp.float32)
  biases = [
    module.gear_score_bias(segment.lowrank, segment.outliers, queries, tokens=tokens, block=block)
    for module in (gear_terms_xla, gear_terms_tpu)
  ]
  np.testing.assert_allclose(np.asarray(biases[1]), np.asarray(biases[0]), rtol=1e-6, atol=1e-6)
  lengths = jnp.asarray([tokens, 37], jnp.int32)
  scores = jnp.asarray(rng.normal(size=(2, 3, 8, tokens)), jnp.float32)
  inside = jnp.arange(tokens)[None, None, None, :] < lengths[:, None, None, None]
  lse = jax.nn.logsumexp(jnp.where(inside, scores, -jnp.inf)[:, :, :4], axis=-1)
  terms = [
    module.gear_value_terms_from_scores(
      segment.lowrank,
      segment.outliers,
      scores * LOG2_E,
      lse,
      lengths,
      block=block,
      head_dim=head_dim,
    )
    for module in (gear_terms_xla, gear_terms_tpu)
  ]
  assert terms[1].shape == (2, 3, 4, head_dim)
  np.testing.assert_allclose(np.asarray(terms[1]), np.asarray(terms[0]), rtol=1e-5, atol=1e-6)
