"""The token halves' code pairs as a virtual head of twice the channels
(`code_pair_halves_tpu`), against the codes and float64 products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bfloat16_code_pairs, code_pair_halves_tpu, token_halves_tpu
from pallas_kernels import code_pair_products_tpu as products
from pallas_kernels.bit_packing import pack_codes

HEAD_DIM, BITS, GROUP, ROWS = 64, 2, 32, 8


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _stacked_pairs(rng, tokens):
  """(codes float64 [D, T], the pairs of the stacked halves bfloat16 [2 D, T / 2])."""
  codes = rng.integers(0, 2**BITS, (tokens, HEAD_DIM))
  words = pack_codes(jnp.asarray(codes), BITS).T  # [W, T]
  stacked = token_halves_tpu.halves_on_sublanes(words)
  pairs = jax.jit(bfloat16_code_pairs.code_pairs, static_argnums=1)(stacked, BITS)
  return codes.T.astype(np.float64), pairs


def test_each_virtual_channel_holds_its_real_channel_of_its_half():
  rng = np.random.default_rng(0)
  codes, pairs = _stacked_pairs(rng, 512)
  virtual = np.asarray(bfloat16_code_pairs.decoded_pairs(pairs, 2 * HEAD_DIM, BITS))
  half, channel = code_pair_halves_tpu.virtual_channels(HEAD_DIM, BITS)
  for c in range(2 * HEAD_DIM):
    np.testing.assert_array_equal(
      virtual[c], codes[channel[c], half[c] * 256 : half[c] * 256 + 256]
    )
  # Each half holds every real channel once.
  for h in range(2):
    assert sorted(channel[half == h]) == list(range(HEAD_DIM))


@pytest.mark.parametrize("query_rows", [4, 1, 3])
def test_each_half_scores_its_own_tokens(query_rows):
  """Key scores through the virtual head, as the kernel takes them: each half's pair queries,
  its key scales put into its virtual pair rows by its rows of `half_value_matrix`, the groups'
  constants from the real queries, both halves in one product with the pairs. The two halves'
  [rows, T / 2] side by side are q . k of every token (float32 sums aside)."""
  rng = np.random.default_rng(query_rows)
  tokens = 512
  codes, pairs = _stacked_pairs(rng, tokens)
  groups = tokens // GROUP
  queries = _bf16(rng.normal(size=(query_rows, HEAD_DIM)))
  k_scale = _bf16(rng.uniform(0.05, 2.0, (HEAD_DIM, groups)))  # [D, G]: groups on lanes
  k_min = _bf16(rng.normal(size=(HEAD_DIM, groups)))
  keys = codes * np.repeat(k_scale, GROUP, axis=1) + np.repeat(k_min, GROUP, axis=1)
  reference = queries @ keys  # [q, T]
  filled = products.fill_query_rows(jnp.asarray(queries, jnp.bfloat16), ROWS)
  half_pair_queries = code_pair_halves_tpu.half_pair_queries(filled, BITS)  # [2, rows, 2 D]
  assert half_pair_queries.shape == (2, ROWS, 2 * HEAD_DIM)
  matrix = jnp.asarray(code_pair_halves_tpu.half_value_matrix(HEAD_DIM, BITS), jnp.bfloat16)

  @jax.jit
  def scores(filled, half_pair_queries, pairs, k_scale, k_min):
    per_group = products.group_constants(
      filled, products.pair_query_rows(filled, BITS), k_scale, k_min, groups_axis=1
    )
    half = groups // 2
    sets = [
      (
        half_pair_queries[h],
        products.pair_ordered_scales(
          k_scale[:, h * half : (h + 1) * half],
          matrix[h * 2 * HEAD_DIM : (h + 1) * 2 * HEAD_DIM],
          groups_axis=1,
        ),
        per_group[:, h * half : (h + 1) * half],
      )
      for h in range(2)
    ]
    return jnp.concatenate(products.key_scores_sharing_pairs(sets, pairs, GROUP, query_rows), 1)

  stats = (jnp.asarray(x, jnp.bfloat16) for x in (k_scale, k_min))
  out = np.asarray(scores(filled, half_pair_queries, pairs, *stats), np.float64)
  terms = np.abs(queries) @ (
    (codes + 2.0**7) * np.repeat(k_scale, GROUP, axis=1) + np.abs(np.repeat(k_min, GROUP, axis=1))
  )
  assert np.all(np.abs(out[:query_rows] - reference) <= 2.0**-20 * terms)


@pytest.mark.parametrize("query_rows", [4, 2])
def test_both_halves_values_sum_into_real_channels(query_rows):
  """P' of each half times the pairs, side by side, times `half_value_matrix`: p . V of every
  token, with p x scale rounded to bfloat16 as the kernel's operand is."""
  rng = np.random.default_rng(10 + query_rows)
  tokens = 512
  codes, pairs = _stacked_pairs(rng, tokens)
  groups = HEAD_DIM // GROUP
  probs = rng.uniform(0.0, 1.0, (query_rows, tokens)).astype(np.float32)
  v_scale = _bf16(rng.uniform(0.05, 2.0, (groups, tokens)))
  v_min = _bf16(rng.normal(size=(groups, tokens)))
  filled = products.fill_query_rows(jnp.asarray(probs), ROWS)
  v_stats = jnp.concatenate([jnp.asarray(v_scale, jnp.float32), jnp.asarray(v_min, jnp.float32)])
  matrix = jnp.asarray(code_pair_halves_tpu.half_value_matrix(HEAD_DIM, BITS), jnp.bfloat16)
  assert matrix.shape == (4 * HEAD_DIM, HEAD_DIM)

  @jax.jit
  def update(filled, pairs, v_stats):
    half = tokens // 2
    parts, minimums = [], 0
    for h in range(2):
      piece = slice(h * half, (h + 1) * half)
      codes_part, mins = products.pair_value_partials(
        filled[:, piece], pairs, v_stats[:, piece], query_rows
      )
      parts.append(codes_part)
      minimums = minimums + mins
    both = jnp.concatenate(parts, axis=1)  # [arrays x rows, 4 D]
    return products.pair_value_update(both, minimums, matrix, GROUP, query_rows, ROWS)

  out = np.asarray(update(filled, pairs, v_stats), np.float64)
  p = probs.astype(np.float64)
  weighted = _bf16(
    np.asarray(products.rounded_to_bfloat16(jnp.asarray((p[:, None] * v_scale).astype(np.float32))))
  )  # [q, groups, T]
  expected = (
    np.einsum("rdt,dt->rd", weighted[:, np.arange(HEAD_DIM) // GROUP], codes)
    + p @ np.repeat(v_min, GROUP, axis=0).T
  )
  bound = p @ (np.repeat(v_scale, GROUP, axis=0).T * (2.0**7 + 3) + np.abs(v_min).max())
  assert np.all(np.abs(out[:query_rows] - expected) <= 2.0**-16 * bound + 1e-6)
