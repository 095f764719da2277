"""`code_pair_products_tpu`: the TPU kernel's key scores and value update with the codes as
bfloat16 pairs, against float64 references on the same rounded operands (exact but for float32
sums), with the query rows copied (several groups a register of rows) or zero-padded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bfloat16_code_pairs
from pallas_kernels import code_pair_products_tpu as products
from pallas_kernels.bit_packing import pack_codes

ROWS = 8


def _bf16(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _codes(rng, bits, head_dim, tokens):
  codes = rng.integers(0, 2**bits, (tokens, head_dim))
  words = pack_codes(jnp.asarray(codes), bits).T  # [W, T]
  return codes.T.astype(np.float64), jax.jit(bfloat16_code_pairs.code_pairs, static_argnums=1)(
    words, bits
  )


def test_rounded_to_bfloat16_rounds_to_the_nearest_and_halves_away_from_zero():
  x = np.float32([1.0 + 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 3 * 2.0**-9, 3.0e38, 1e-40, 0.0, -2.5])
  rounded = np.asarray(products.rounded_to_bfloat16(jnp.asarray(x)))
  np.testing.assert_array_equal(
    rounded,
    np.float32(
      [1.0 + 2.0**-7, -(1.0 + 2.0**-7), 1.0 + 2.0**-7, _bf16(3.0e38), _bf16(1e-40), 0, -2.5]
    ),
  )
  rng = np.random.default_rng(1)
  y = (rng.normal(size=4096) * 10.0 ** rng.integers(-5, 5, 4096)).astype(np.float32)
  rounded = np.asarray(products.rounded_to_bfloat16(jnp.asarray(y)), np.float64)
  assert np.array_equal(rounded, _bf16(rounded))  # bfloat16 numbers
  ties = (y.view(np.uint32) & 0xFFFF) == 0x8000
  np.testing.assert_array_equal(rounded[~ties], _bf16(y)[~ties])  # the nearest


@pytest.mark.parametrize(
  "query_rows,groups,expected", [(4, 4, 2), (2, 4, 4), (1, 4, 4), (1, 8, 8), (8, 4, 1), (3, 4, 1)]
)
def test_groups_per_block(query_rows, groups, expected):
  assert products.groups_per_block(ROWS, query_rows, groups) == expected
  assert products.groups_per_block(16, query_rows, groups) == 1


@pytest.mark.parametrize("query_rows", [1, 2, 4, 8, 3])
def test_query_rows_are_copied_where_they_divide_the_register(query_rows):
  queries = jnp.arange(query_rows * 5, dtype=jnp.float32).reshape(1, query_rows, 5) + 1
  filled = np.asarray(products.fill_query_rows(queries, ROWS))
  assert filled.shape == (1, ROWS, 5)
  copies = ROWS % query_rows == 0
  for row in range(ROWS):
    expected = queries[0, row % query_rows] if copies or row < query_rows else 0 * queries[0, 0]
    np.testing.assert_array_equal(filled[0, row], expected)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_each_token_own_block_of_rows_goes_everywhere(k):
  """Block own[t] of column t's rows, in every block of column t (sublane rotations)."""
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  own = jnp.arange(128)[None, :] // 3 % k
  moved = np.asarray(jax.jit(products._own_block_everywhere, static_argnums=2)(x, own, k))
  size = 8 // k
  for t in range(128):
    j = int(own[0, t])
    expected = np.tile(np.asarray(x)[j * size : (j + 1) * size, t], k)
    np.testing.assert_array_equal(moved[:, t], expected)


@pytest.mark.parametrize(
  "k,first,groups", [(1, 5, 6), (2, 2, 4), (2, 10, 12), (4, 4, 8), (8, 0, 8)]
)
@pytest.mark.parametrize("gathers", [True, False])
def test_sublane_rows_take_block_j_from_row_first_plus_j(k, first, groups, gathers):
  """By a sublane gather (a TPU v5e or newer) or by broadcasts; at 4 groups (fewer than a
  slab) the gather's slab is padded."""
  stats = jnp.arange(groups * 256, dtype=jnp.float32).reshape(groups, 256) + 1
  rows = np.asarray(
    jax.jit(products._sublane_rows, static_argnums=(1, 2, 3, 4))(stats, first, k, (8, 256), gathers)
  )
  for r in range(8):
    np.testing.assert_array_equal(rows[r], np.asarray(stats)[first + r // (8 // k)])


def _key_case(seed, bits, head_dim, query_rows, group_size=32, tokens=512):
  rng = np.random.default_rng(seed)
  codes, pairs = _codes(rng, bits, head_dim, tokens)
  groups = tokens // group_size
  queries = _bf16(rng.normal(size=(query_rows, head_dim)))
  k_scale = _bf16(rng.uniform(0.05, 2.0, (groups, head_dim)))
  k_min = _bf16(rng.normal(size=(groups, head_dim)) * 3.0)
  keys = codes * np.repeat(k_scale, group_size, axis=0).T + np.repeat(k_min, group_size, axis=0).T
  return queries, codes, pairs, k_scale, k_min, queries @ keys  # reference [q, T]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("query_rows", [4, 1, 2, 8, 3])
@pytest.mark.parametrize("sublane_gathers", [True, False], ids=["gathers", "broadcasts"])
def test_key_scores_are_exact_but_for_float32_sums(bits, query_rows, sublane_gathers):
  head_dim, group_size = 128, 32
  queries, codes, pairs, k_scale, k_min, reference = _key_case(
    bits + 10 * query_rows, bits, head_dim, query_rows, group_size
  )
  filled = products.fill_query_rows(jnp.asarray(queries, jnp.bfloat16), ROWS)
  matrix = jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16)
  scores = jax.jit(
    products.key_scores, static_argnames=("group_size", "query_rows", "sublane_gathers")
  )(
    filled,
    products.pair_query_rows(filled, bits),
    pairs,
    jnp.asarray(k_scale, jnp.bfloat16),
    jnp.asarray(k_min, jnp.bfloat16),
    matrix,
    group_size=group_size,
    query_rows=query_rows,
    sublane_gathers=sublane_gathers,
  )
  scores = np.asarray(scores, np.float64)
  assert scores.shape == (ROWS, codes.shape[1])
  # |terms| bounds the float32 sums' error (the 1s add 2^7 of a scale at most).
  terms = np.abs(queries) @ (
    (codes + 2.0**7) * np.repeat(k_scale, group_size, axis=0).T
    + np.abs(np.repeat(k_min, group_size, axis=0).T)
  )
  assert np.all(np.abs(scores[:query_rows] - reference) <= 2.0**-20 * terms)
  if ROWS % query_rows == 0:  # the copies' rows score as their originals
    for row in range(query_rows, ROWS):
      np.testing.assert_allclose(scores[row], reference[row % query_rows], rtol=0, atol=1e-3)


@pytest.mark.parametrize("groups_axis", [0, 1])
def test_key_scores_of_token_ranges_are_the_block_scores(groups_axis):
  """`pair_key_scores` of tokens [offset, offset + n) with the whole block's `key_score_terms`
  (the kernel's chunks) gives exactly those tokens' columns of the whole block's scores: each
  range takes its own groups' scales and constants, not the block's first groups'."""
  head_dim, bits, group_size, query_rows = 128, 2, 32, 4
  queries, _, pairs, k_scale, k_min, _ = _key_case(7, bits, head_dim, query_rows, group_size)
  filled = products.fill_query_rows(jnp.asarray(queries, jnp.bfloat16), ROWS)
  pair_queries = products.pair_query_rows(filled, bits)
  matrix = jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16)
  stats = [jnp.asarray(x, jnp.bfloat16) for x in (k_scale, k_min)]
  if groups_axis == 1:
    stats = [x.T for x in stats]
  scales, per_group = products.key_score_terms(filled, pair_queries, *stats, matrix, groups_axis)
  tokens = pairs.shape[1]
  assert tokens >= 512 and per_group.shape[1] == tokens // group_size
  # jitted: `pltpu.roll` has no eager rule
  whole = jax.jit(products.key_scores, static_argnames=("group_size", "query_rows", "groups_axis"))(
    filled,
    pair_queries,
    pairs,
    *stats,
    matrix,
    group_size=group_size,
    query_rows=query_rows,
    groups_axis=groups_axis,
  )
  for offset, width in [(0, 128), (256, 256), (tokens - 128, 128)]:
    part = jax.jit(products.pair_key_scores, static_argnums=(4, 5), static_argnames="token_offset")(
      pair_queries[:ROWS],
      pairs[:, offset : offset + width],
      scales,
      per_group,
      group_size,
      query_rows,
      token_offset=offset,
    )
    np.testing.assert_array_equal(np.asarray(part), np.asarray(whole[:, offset : offset + width]))


def test_zero_codes_and_minimums_make_zero_scores():
  """The 1s cancel: with every code 0 and every minimum 0, any scales give scores of 0 (to the
  float32 sums), not sum(q x scale x 2^7)."""
  head_dim, bits, group_size = 128, 2, 32
  rng = np.random.default_rng(3)
  pairs = jnp.ones((head_dim, 256), jnp.bfloat16)  # the pairs of all-zero codes
  queries = products.fill_query_rows(jnp.asarray(rng.normal(size=(4, head_dim)), jnp.bfloat16), 8)
  k_scale = jnp.asarray(rng.uniform(1.0, 100.0, (8, head_dim)), jnp.bfloat16)
  scores = jax.jit(products.key_scores, static_argnames=("group_size", "query_rows"))(
    queries,
    products.pair_query_rows(queries, bits),
    pairs,
    k_scale,
    jnp.zeros_like(k_scale),
    jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16),
    group_size=group_size,
    query_rows=4,
  )
  scale = jnp.abs(queries.astype(jnp.float32)) @ jnp.abs(k_scale.astype(jnp.float32)).T
  assert float(jnp.abs(scores).max()) <= 2.0**-16 * 2.0**7 * float(scale.max())
  assert float(scale.max()) * 2.0**7 > 1e5  # what the 1s would leave


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("query_rows,group_size", [(4, 32), (1, 32), (8, 32), (2, 64), (3, 128)])
@pytest.mark.parametrize("sublane_gathers", [True, False], ids=["gathers", "broadcasts"])
def test_the_value_update_is_exact_but_for_the_weights_rounding(
  bits, query_rows, group_size, sublane_gathers
):
  head_dim, tokens = 128, 384
  rng = np.random.default_rng(bits * 100 + query_rows)
  codes, pairs = _codes(rng, bits, head_dim, tokens)
  groups = head_dim // group_size
  probs = rng.uniform(0.0, 1.0, (query_rows, tokens)).astype(np.float32)
  probs[:, -5:] = 0.0  # past a length: the statistics there are zero (the kernel zeroes them)
  v_scale = _bf16(rng.uniform(0.05, 2.0, (groups, tokens)))
  v_min = _bf16(rng.normal(size=(groups, tokens)))
  filled = np.asarray(products.fill_query_rows(jnp.asarray(probs), ROWS))

  @jax.jit
  def update(probs, pairs, v_scale, v_min):
    v_stats = jnp.concatenate([v_scale, v_min])
    codes_part, minimums = products.pair_value_partials(
      probs, pairs, v_stats, query_rows, sublane_gathers
    )
    matrix = jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16)
    return products.pair_value_update(codes_part, minimums, matrix, group_size, query_rows, ROWS)

  out = np.asarray(update(jnp.asarray(filled), pairs, *map(jnp.asarray, (v_scale, v_min))))
  assert out.shape == (ROWS, head_dim)
  scale_of = np.repeat(v_scale, group_size, axis=0)  # [D, T]
  min_of = np.repeat(v_min, group_size, axis=0)
  p = probs.astype(np.float64)
  # The kernel rounds p x scale to bfloat16 (the MXU operand), p x minimum it keeps float32.
  weighted = _bf16(
    np.asarray(products.rounded_to_bfloat16(jnp.asarray((p[:, None] * v_scale).astype(np.float32))))
  )
  rounded = (
    np.einsum("rdt,dt->rd", weighted[:, np.arange(head_dim) // group_size], codes) + p @ min_of.T
  )
  terms = (
    np.einsum("rdt,dt->rd", np.abs(weighted[:, np.arange(head_dim) // group_size]), codes + 2.0**7)
    + p @ np.abs(min_of).T
  )
  assert np.all(np.abs(out[:query_rows] - rounded) <= 2.0**-18 * terms)
  exact = p @ (codes * scale_of + min_of).T
  assert np.linalg.norm(out[:query_rows] - exact) <= 2.0**-8 * np.linalg.norm(exact)
  if ROWS % query_rows == 0:
    for row in range(query_rows, ROWS):
      np.testing.assert_allclose(out[row], out[row % query_rows], rtol=1e-6, atol=1e-6)


def test_sets_sharing_pairs_get_each_their_own_products():
  """`key_scores_sharing_pairs` and `value_partials_sharing_pairs` (one product for several
  sets' rows against the same pairs: the token halves') give each set what it would get alone;
  sets swapped, their results swap."""
  head_dim, bits, group_size, query_rows, tokens = 128, 2, 32, 4, 384
  rng = np.random.default_rng(11)
  _, pairs = _codes(rng, bits, head_dim, tokens)
  matrix = jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16)
  key_sets, prob_sets = [], []
  for _ in range(2):
    queries = products.fill_query_rows(
      jnp.asarray(rng.normal(size=(query_rows, head_dim)), jnp.bfloat16), ROWS
    )
    k_scale, k_min = (
      jnp.asarray(x, jnp.bfloat16)
      for x in (
        rng.uniform(0.05, 2.0, (tokens // group_size, head_dim)),
        rng.normal(size=(tokens // group_size, head_dim)),
      )
    )
    scales, per_group = products.key_score_terms(
      queries, products.pair_query_rows(queries, bits), k_scale, k_min, matrix
    )
    key_sets.append((products.pair_query_rows(queries, bits)[:ROWS], scales, per_group))
    probs = jnp.asarray(rng.uniform(0.0, 1.0, (ROWS, tokens)), jnp.float32)
    v_stats = jnp.asarray(rng.uniform(0.05, 2.0, (2 * head_dim // group_size, tokens)), jnp.float32)
    prob_sets.append((probs, v_stats))
  shared_keys = jax.jit(
    lambda sets, pairs: products.key_scores_sharing_pairs(sets, pairs, group_size, query_rows)
  )
  shared_values = jax.jit(
    lambda sets, pairs: products.value_partials_sharing_pairs(sets, pairs, query_rows)
  )
  both_scores, swapped_scores = shared_keys(key_sets, pairs), shared_keys(key_sets[::-1], pairs)
  both_parts, swapped_parts = (
    shared_values(prob_sets, pairs),
    shared_values(prob_sets[::-1], pairs),
  )
  for index in range(2):
    alone = shared_keys(key_sets[index : index + 1], pairs)[0]
    np.testing.assert_allclose(both_scores[index], alone, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(swapped_scores[1 - index], alone, rtol=1e-6, atol=1e-4)
    for part in range(2):
      alone = shared_values(prob_sets[index : index + 1], pairs)[0][part]
      np.testing.assert_allclose(both_parts[index][part], alone, rtol=1e-6, atol=1e-4)
      np.testing.assert_allclose(swapped_parts[1 - index][part], alone, rtol=1e-6, atol=1e-4)
  assert not np.allclose(both_scores[0], both_scores[1], rtol=1e-2)
  assert not np.allclose(both_parts[0][0], both_parts[1][0], rtol=1e-2)
