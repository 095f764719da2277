"""`token_halves_tpu`: the rows (f, h, w) of channel 4 f + w and token h * block / 2 + t', as
the kernel's products take them, run here as plain jnp against the [64, block] layout: the
halves, the scale-folded scores, the value update (bfloat16 operands: exact products, float32
sums), the value statistics' rows."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import token_halves_tpu
from pallas_kernels.bit_packing import pack_codes
from pallas_kernels.quantized_decode_attention_tpu import _stacked_fields

HEAD_DIM = 64
HIGHEST = jax.lax.Precision.HIGHEST


def rows_of(x: np.ndarray) -> np.ndarray:
  """[64, block] (channel, token) -> [128, block / 2]: row f * 8 + h * 4 + w, column t' holds
  channel 4 f + w of token h * block / 2 + t'."""
  channels, block = x.shape
  half = block // 2
  out = np.empty((2 * channels, half), x.dtype)
  for f in range(channels // 4):
    for h in range(2):
      for w in range(4):
        out[f * 8 + h * 4 + w] = x[4 * f + w, h * half : (h + 1) * half]
  return out


def test_the_fields_of_the_halves_are_the_rows_of_the_channels():
  """Unpacking the halves' words gives each channel of each token on its row."""
  rng = np.random.default_rng(0)
  block = 512
  codes = rng.integers(0, 4, (block, HEAD_DIM))  # [T, D] 2-bit codes
  words = pack_codes(jnp.asarray(codes, jnp.uint8), 2)  # [T, 4]
  fields = _stacked_fields(token_halves_tpu.halves_on_sublanes(jnp.asarray(words).T), 2)
  np.testing.assert_array_equal(np.asarray(fields), rows_of(codes.T.astype(np.float32)))


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**16),
  group_size=st.sampled_from([8, 32, 64]),
  tiles=st.integers(1, 4),
  rows=st.sampled_from([8, 16]),
  dtype=st.sampled_from([jnp.bfloat16, jnp.float32]),
)
def test_the_products_in_rows_are_those_of_the_channels(seed, group_size, tiles, rows, dtype):
  rng = np.random.default_rng(seed)
  block = 256 * tiles
  groups = block // group_size
  assert token_halves_tpu.applies(4, block, group_size)
  k_scale = jnp.asarray(rng.random((HEAD_DIM, groups)) + 0.5, dtype)
  codes = rng.integers(0, 4, (HEAD_DIM, block)).astype(np.float32) - 1.5
  queries = jnp.asarray(rng.normal(size=(rows, HEAD_DIM)), dtype)
  scores = token_halves_tpu.scale_folded_key_scores(
    queries, jnp.asarray(rows_of(codes)), k_scale, group_size
  )
  keys = np.repeat(np.asarray(k_scale, np.float32), group_size, axis=1) * codes  # [64, block]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  expected = jnp.einsum("rd,dt->rt", f32(queries), keys, precision=HIGHEST)
  # Each term q x scale rounded once in bfloat16 (2^-9 of it); float32 exact products
  magnitude = np.abs(np.asarray(queries, np.float32)) @ np.abs(keys)
  bound = (2.0**-8 if dtype == jnp.bfloat16 else 2.0**-20) * magnitude + 1e-6
  assert np.all(np.abs(np.asarray(scores) - np.asarray(expected)) <= bound)

  values = jnp.asarray(rng.normal(size=(HEAD_DIM, block)), dtype)
  probs = jnp.asarray(rng.random((rows, block)), dtype)
  update = token_halves_tpu.value_update(probs, jnp.asarray(rows_of(np.asarray(values)), dtype))
  expected = jnp.einsum("rt,dt->rd", f32(probs), f32(values), precision=HIGHEST)
  np.testing.assert_allclose(np.asarray(update), np.asarray(expected), rtol=1e-5, atol=1e-4)


def test_value_statistics_and_masks_reach_their_channels_rows():
  rng = np.random.default_rng(1)
  block, group_size = 512, 16
  stats = rng.normal(size=(HEAD_DIM // group_size, block)).astype(np.float32)
  in_rows = token_halves_tpu.value_statistics_in_rows(jnp.asarray(stats), group_size, fields=16)
  np.testing.assert_array_equal(np.asarray(in_rows), rows_of(np.repeat(stats, group_size, 0)))
  mask = (np.arange(block) < 300).astype(np.float32)[None, :]
  mask_rows = token_halves_tpu.value_statistics_in_rows(jnp.asarray(mask), 64, fields=16)
  np.testing.assert_array_equal(np.asarray(mask_rows), rows_of(np.repeat(mask, HEAD_DIM, 0)))
