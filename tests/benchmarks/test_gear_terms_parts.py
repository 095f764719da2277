"""benchmarks/gear_terms_parts.py's other formulations of GEAR's terms (the einsums before v21,
the key outliers as windows) compute what gear_terms_xla computes, so the GPU A/B between them
times the same result."""

import jax.numpy as jnp
import numpy as np

from benchmarks import gear_terms_parts
from pallas_kernels import gear_terms_xla
from pallas_kernels.random_inputs import random_quantized_segment

BATCH, KV_HEADS, GROUP, TOKENS, HEAD_DIM, BLOCK, RANK = 2, 3, 4, 128, 32, 32, 3


def test_earlier_and_candidate_formulations_match_gear_terms_xla():
  rng = np.random.default_rng(0)
  segment = random_quantized_segment(
    rng,
    BATCH,
    KV_HEADS,
    TOKENS,
    HEAD_DIM,
    bits=2,
    group_size=16,
    rank=RANK,
    outliers_per_block=20,
    block=BLOCK,
  )
  queries = jnp.asarray(rng.standard_normal((BATCH, KV_HEADS, GROUP, HEAD_DIM)), jnp.float32)
  scores = jnp.asarray(rng.standard_normal((BATCH, KV_HEADS, GROUP, TOKENS)), jnp.float32)
  lse = jnp.log(jnp.sum(jnp.exp2(scores), axis=-1))  # base-2 scores, natural log-sum-exp
  lengths = jnp.asarray([TOKENS, 77], jnp.int32)

  bias = gear_terms_xla.gear_score_bias(segment.lowrank, None, queries, tokens=TOKENS, block=BLOCK)
  bias_before = gear_terms_parts.score_bias_lowrank_einsums(
    segment.lowrank, queries, tokens=TOKENS, block=BLOCK
  )
  np.testing.assert_allclose(bias, bias_before, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(bias))) > 0.1

  terms = gear_terms_xla.gear_value_terms_from_scores(
    segment.lowrank, None, scores, lse, lengths, block=BLOCK, head_dim=HEAD_DIM
  )
  terms_before = gear_terms_parts.value_terms_lowrank_einsums(
    segment.lowrank, scores, lse, lengths, block=BLOCK
  )
  np.testing.assert_allclose(terms, terms_before, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(terms))) > 1e-3

  bias = gear_terms_xla.gear_score_bias(None, segment.outliers, queries, tokens=TOKENS, block=BLOCK)
  bias_windows = gear_terms_parts.score_bias_outliers_windows(
    segment.outliers, queries, tokens=TOKENS, block=BLOCK
  )
  np.testing.assert_allclose(bias, bias_windows, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(bias))) > 0.1


def test_each_row_times_the_gear_terms_its_label_names():
  for label, (lowrank, outliers, config) in gear_terms_parts.CALL_SETTINGS.items():
    if not (lowrank or outliers):
      continue
    expected = "kernel" if "fused" in label else "xla"
    assert config.get("gear_terms") == expected, label
