import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.dense_cache import FullCache
from kvjax.gear_cache import Gear, GearCodec, GearLayerCache
from kvjax.kivi_cache import KiviCodec
from kvjax.method_spec import describe_method, parse_method_spec
from tests.kvjax.test_kivi_cache import (
  CAPACITY,
  PROMPT,
  B,
  D,
  G,
  H,
  _attend,
  _forced_logprobs,
  _ingest,
  _random,
  assert_streaming_equals_ingesting,
  explicit_attention,
)


def test_spec_strings_parse_to_gear_with_the_authors_defaults():
  method = parse_method_spec("gear:bits=2,rank=2,outliers=0.02")
  assert method == Gear() == Gear(bits=2, group_size=64, rank=2, outliers=0.02, block=64)
  assert parse_method_spec("gear:outliers=0") == Gear(outliers=0.0)  # GEAR-L
  assert describe_method(Gear(bits=4, rank=4)) == "gear:bits=4,rank=4"
  # 2% of a 64 x 64 block: round(0.01 * 4096) = 41 largest + 41 smallest per block and head.
  cache = method.allocate_storage(
    batch=1, kv_heads=3, capacity=200, head_dim=64, dtype=jnp.bfloat16
  )
  assert isinstance(cache, GearLayerCache) and cache.quantized_capacity == 192
  k_index, k_value, v_index, v_value = cache.segment.outliers
  assert k_index.shape == v_value.shape == (1, 3, 3, 82) and k_index.dtype == jnp.uint16
  k_a, k_b, _, _ = cache.segment.lowrank
  assert k_a.shape == (1, 3, 192, 2) and k_b.shape == (1, 3, 3, 64, 2)
  gear_l = Gear(outliers=0).allocate_storage(
    batch=1, kv_heads=1, capacity=64, head_dim=64, dtype=jnp.bfloat16
  )
  assert gear_l.segment.outliers is None and gear_l.segment.lowrank is not None


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(bits=3), "bits=3 is not supported"),
    (dict(group_size=48), "block=64 must be a multiple of group_size=48"),
    (dict(block=0), "block=0 must be a positive int"),
    (dict(outliers=0.5), r"outliers=0.5 must be a fraction in \[0, 0.5\)"),
    (dict(outliers=-0.01), r"outliers=-0.01 must be a fraction in \[0, 0.5\)"),
    (dict(rank=-1), "rank=-1 must be a non-negative int"),
    (dict(iterations=0), "iterations=0 must be a positive int"),
    (dict(rank=True), "rank=True must be a non-negative int"),
    (dict(iterations=True), "iterations=True must be a positive int"),
    (dict(bits=4.0), "bits=4.0 is not supported"),
  ],
)
def test_bad_configurations_raise_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Gear(**kwargs)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(rank=32, group_size=16, block=32), "gear: rank=32 must be < head_dim=32"),
    (dict(group_size=64), "gear: group_size=64 must divide head_dim=32"),
  ],
)
def test_head_dim_dependent_checks_raise_at_allocation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Gear(**kwargs).allocate_storage(
      batch=1, kv_heads=1, capacity=128, head_dim=32, dtype=jnp.float32
    )


def _heavy_tailed(seed, shape):
  """Keys/values-like blocks: t-distributed entries, a few large channels, a shared direction."""
  rng = np.random.default_rng(seed)
  x = rng.standard_t(df=3, size=shape)
  x += 4.0 * rng.normal(size=shape[-1:]) * (rng.random(shape[-1:]) < 0.1)
  x += np.einsum("...t,d->...td", rng.normal(size=shape[:-1]), rng.normal(size=shape[-1:]))
  return jnp.asarray(x, jnp.float32)


def test_each_gear_term_reduces_the_reconstruction_error_and_outliers_are_exact():
  keys, values = _heavy_tailed(0, (1, 2, 64, D)), _heavy_tailed(1, (1, 2, 64, D))
  common = dict(bits=2, group_size=16, window=32)
  errors = {}
  for name, codec in {
    "kivi": KiviCodec(**common),
    "outliers": GearCodec(**common, rank=0, outliers_per_side=10),
    "lowrank": GearCodec(**common, rank=2, outliers_per_side=0),
    "gear": GearCodec(**common, rank=2, outliers_per_side=10),
  }.items():
    segment = codec.encode(keys, values, jnp.float32)
    k_hat, v_hat = codec.decode(segment)
    errors[name] = float(jnp.linalg.norm(k_hat - keys) + jnp.linalg.norm(v_hat - values))
    if name in ("outliers", "gear"):
      # At an outlier the stored correction makes the quantized part exact, so what is left
      # there is the low-rank term alone (none for the outliers-only codec), to float32 rounding.
      k_a, k_b = (
        (np.asarray(segment.lowrank[0]), np.asarray(segment.lowrank[1]))
        if segment.lowrank
        else (np.zeros((1, 2, 64, 1)), np.zeros((1, 2, 2, D, 1)))
      )
      low_rank = np.einsum("bhjtr,bhjdr->bhjtd", k_a.reshape(1, 2, 2, 32, -1), k_b)
      k_index = np.asarray(segment.outliers[0])
      assert np.all(np.diff(np.sort(k_index, axis=-1), axis=-1) > 0)  # distinct per block

      def at_outliers(x, k_index=k_index):
        return np.take_along_axis(np.asarray(x).reshape(1, 2, 2, 32 * D), k_index, axis=-1)

      np.testing.assert_allclose(
        at_outliers(k_hat - keys), at_outliers(low_rank), atol=1e-5 * np.abs(keys).max()
      )
  assert errors["outliers"] < errors["kivi"] and errors["lowrank"] < errors["kivi"]
  assert errors["gear"] < min(errors["outliers"], errors["lowrank"])


def test_a_nan_taken_as_an_outlier_stays_one_nan():
  """The outlier correction carries it; its quantization group keeps finite stats."""
  keys = np.random.default_rng(0).normal(size=(1, 1, 8, 32)).astype(np.float32)
  keys[0, 0, 3, 5] = np.nan
  codec = GearCodec(bits=2, group_size=8, window=8, rank=0, outliers_per_side=1)
  k_hat, v_hat = codec.decode(codec.encode(jnp.asarray(keys), jnp.asarray(keys), jnp.float32))
  for restored in (k_hat, v_hat):
    nan = np.isnan(np.asarray(restored))
    assert nan.sum() == 1 and nan[0, 0, 3, 5]


def test_an_outlier_correction_past_float16s_range_is_held_finite():
  # Every input fits float16, but the outlier's distance from its key group (80000) does not.
  keys = np.zeros((1, 1, 8, 16), np.float32)
  keys[0, 0, :, 0] = -40000.0
  keys[0, 0, 3, 0] = 40000.0
  storage = Gear(bits=2, group_size=4, block=8, rank=0, outliers=0.02).allocate_storage(
    batch=1, kv_heads=1, capacity=9, head_dim=16, dtype=jnp.float16
  )
  keys = jnp.asarray(keys, jnp.float16)
  cache = storage.ingest(keys, keys, None, jnp.array([8]))
  dequantized_keys = np.asarray(cache.dequantized()[0], np.float32)
  assert np.isfinite(dequantized_keys).all()
  # The group's minimum plus float16's largest correction: as near 40000 as float16 reaches.
  assert dequantized_keys[0, 0, 3, 0] == -40000.0 + 65504.0
  out = cache.attend(jnp.full((1, 1, 1, 16), 1e-4, jnp.float16), sm_scale=1.0)
  assert np.isfinite(np.asarray(out, np.float32)).all()


def test_a_cache_smaller_than_one_block_attends_and_dequantizes_its_window():
  method = Gear(bits=2, group_size=8, rank=2, outliers=0.05, block=64)
  cache = method.allocate_storage(batch=B, kv_heads=H, capacity=20, head_dim=D, dtype=jnp.float32)
  assert cache.quantized_capacity == 0 and cache.window_slots == 20
  keys, values = _random(0, B, H, 20, D), _random(1, B, H, 20, D)
  cache = _ingest(cache, keys, values, jnp.asarray([20, 7], jnp.int32))
  dequantized_keys, _, lengths = cache.dequantized()
  # Nothing is quantized: each row's tokens exactly, zeros past them.
  np.testing.assert_array_equal(dequantized_keys[0], keys[0])
  np.testing.assert_array_equal(dequantized_keys[1, :, :7], keys[1, :, :7])
  np.testing.assert_array_equal(dequantized_keys[1, :, 7:], 0)
  np.testing.assert_array_equal(lengths, [20, 7])
  queries = _random(5, B, H, G, D)
  np.testing.assert_allclose(
    _attend(cache, queries, 0.3), explicit_attention(cache, queries, 0.3), atol=1e-5
  )


def test_storage_and_nbytes_count_codes_stats_factors_outliers_and_window():
  method = Gear(bits=4, group_size=16, rank=2, outliers=0.05, block=32)
  cache = method.allocate_storage(batch=B, kv_heads=H, capacity=70, head_dim=D, dtype=jnp.bfloat16)
  assert cache.quantized_capacity == 64
  per_side = 26  # round(0.025 * 32 * 32) = round(25.6)
  segment = cache.segment
  assert segment.outliers[0].shape == (B, H, 2, 2 * per_side)
  codes = 2 * B * H * 64 * (D // 8) * 4
  stats = 2 * B * H * (64 // 16) * D * 2 + 2 * B * H * 64 * (D // 16) * 2
  factors = 2 * (B * H * 64 * 2 * 2 + B * H * 2 * D * 2 * 2)
  outliers = 2 * B * H * 2 * 2 * per_side * (2 + 2)  # uint16 index, bfloat16 value
  window = 2 * B * H * 32 * D * 2
  assert cache.nbytes == codes + stats + factors + outliers + window + 2 * B * 4
  assert cache.stored_elements == 2 * B * H * (64 + 32) * D


def test_outlier_slots_past_the_outliers_are_zeros_that_change_nothing():
  """Outliers stored in more slots than there are (`outlier_slots`, as on a TPU): the first
  2 s entries of each block are the unpadded codec's, the rest index 0 and value 0; the same
  dequantized K and V, to the last bit (the TPU kernel's tokens through `generate` on padded
  outliers: `test_the_tpu_kernels_generate_the_reference_tokens`)."""
  keys, values = _heavy_tailed(2, (1, 2, 64, D)), _heavy_tailed(3, (1, 2, 64, D))
  common = dict(bits=2, group_size=16, window=32, rank=2, outliers_per_side=10)
  exact, padded = GearCodec(**common), GearCodec(**common, outlier_slots=128)
  assert exact.stored_outliers == 20 and padded.stored_outliers == 128
  segments = [codec.encode(keys, values, jnp.bfloat16) for codec in (exact, padded)]
  for few, many in zip(segments[0].outliers, segments[1].outliers, strict=True):
    assert many.shape == (*few.shape[:-1], 128) and many.dtype == few.dtype
    np.testing.assert_array_equal(np.asarray(many[..., :20]), np.asarray(few))
    assert not np.asarray(many[..., 20:]).any()
  for a, b in zip(exact.decode(segments[0]), padded.decode(segments[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("slots", [19, -1, 20.0, True])
def test_too_few_outlier_slots_are_refused(slots):
  with pytest.raises(ValueError, match=f"outlier_slots={slots!r} must be 0 or an int >= 2 \\* "):
    GearCodec(bits=2, group_size=16, window=32, outliers_per_side=10, outlier_slots=slots)


def test_on_a_tpu_the_outliers_are_stored_in_whole_lane_tiles(monkeypatch):
  """Where the compiled TPU kernel reads them (`attention_dispatch.gear_outlier_slots`), each
  block's 164 outliers (2% of 64 x 128) are stored in 256 slots, 82 (at head_dim 64) in 128;
  on a CPU, a GPU and in interpret mode as many as there are; GEAR-L stores none."""
  import jax

  def stored(method, head_dim):
    cache = jax.eval_shape(
      lambda: method.allocate_storage(
        batch=1, kv_heads=1, capacity=200, head_dim=head_dim, dtype=jnp.bfloat16
      )
    )
    return cache.segment.outliers and cache.segment.outliers[0].shape[-1]

  gear = Gear()
  assert (stored(gear, 128), stored(gear, 64)) == (164, 82)  # the CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert stored(gear, 128) == 164
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert (stored(gear, 128), stored(gear, 64)) == (256, 128)
  assert stored(Gear(implementation="interpret"), 128) == 164
  assert stored(Gear(outliers=0), 128) is None


def test_streaming_tokens_one_by_one_equals_ingesting_them_at_once_across_blocks():
  # Codes and outlier indices are identical; the factors agree to float rounding (batched and
  # single-block QR/SVD may round differently).
  assert_streaming_equals_ingesting(
    Gear(bits=2, group_size=8, rank=2, outliers=0.05, block=16),
    dtype=jnp.float32,
    start_lengths=[5, 14],
    steps=20,
    exact=False,
  )


@settings(max_examples=10, deadline=None)
@given(
  lengths=st.tuples(st.integers(0, PROMPT), st.integers(1, PROMPT)),
  seed=st.integers(0, 2**31 - 1),
)
def test_attention_through_the_decomposition_equals_attention_over_dequantized_kv(lengths, seed):
  # One configuration (one compilation); the bit widths are covered by KIVI's property test
  # and appending by the streaming test.
  method = Gear(bits=2, group_size=8, rank=2, outliers=0.05, block=16)
  cache = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.float32
  )
  keys = _heavy_tailed(seed, (B, H, PROMPT, D))
  values = _heavy_tailed(seed + 1, (B, H, PROMPT, D))
  cache = _ingest(cache, keys, values, jnp.asarray(lengths, jnp.int32))
  queries = _random(seed + 20, B, H, G, D)
  np.testing.assert_allclose(
    _attend(cache, queries, 0.3), explicit_attention(cache, queries, 0.3), atol=3e-5, rtol=1e-5
  )


def test_gear_in_the_model_is_close_to_the_full_cache():
  rng = np.random.default_rng(0)
  lengths = np.array([37, 22], np.int32)
  tokens = rng.integers(1, 64, size=(B, 37)).astype(np.int32)
  forced = rng.integers(1, 64, size=(B, 20)).astype(np.int32)
  full, _ = _forced_logprobs(FullCache(), tokens, lengths, forced)
  spec = "gear:bits=4,group_size=16,block=16,rank=2,outliers=0.02"
  gear, caches = _forced_logprobs(parse_method_spec(spec), tokens, lengths, forced)
  assert isinstance(caches[0], GearLayerCache)
  np.testing.assert_array_equal(caches[0].quantized_lengths, [48, 32])
  # 4-bit KIVI on this model and input moves log-probs by 0.046 (median); GEAR's outliers and
  # low-rank factors bring 4-bit storage closer (measured 0.028; at most 0.26 here).
  assert np.median(np.abs(gear - full)) < 0.035
  np.testing.assert_allclose(gear, full, atol=0.5)
