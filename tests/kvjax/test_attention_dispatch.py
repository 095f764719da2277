"""Dispatch: which implementation runs, config errors before tracing, one-time fallback warning."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from pallas_kernels.decode_attention_reference import decode_attention_reference
from pallas_kernels.quantized_decode_attention_reference import quantized_decode_attention_reference
from pallas_kernels.random_inputs import (
  random_full_segment,
  random_quantized_segment,
  random_queries,
)


def _full_inputs(seed=0, head_dim=64, tokens=70):
  rng = np.random.default_rng(seed)
  queries = random_queries(rng, 2, 2, 4, head_dim)
  keys, values = random_full_segment(rng, 2, 2, tokens, head_dim)
  return queries, keys, values, jnp.asarray([tokens, 33], jnp.int32)


def _quantized_inputs(seed=0, bits=4):
  rng = np.random.default_rng(seed)
  queries = random_queries(rng, 2, 2, 4, 64)
  segment = random_quantized_segment(rng, 2, 2, 128, 64, bits=bits, group_size=32)
  return queries, segment, jnp.asarray([128, 45], jnp.int32)


def _close(a, b, rtol=None):
  # f32 dots are exact f32 on CPU; on GPU XLA and the kernels use tf32 tensor cores.
  rtol = rtol or (1e-5 if jax.default_backend() == "cpu" else 3e-3)
  a, b = np.asarray(a), np.asarray(b)
  assert np.all(np.isfinite(a))
  assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b)


@pytest.mark.parametrize("implementation", ["fast", "triton", "", None])
def test_unknown_implementation_raises_naming_allowed_values(implementation):
  queries, keys, values, lengths = _full_inputs()
  with pytest.raises(ValueError, match="implementation=.*allowed: auto, pallas, reference"):
    attention_dispatch.decode_attention(
      queries, keys, values, lengths, sm_scale=0.1, implementation=implementation
    )
  with pytest.raises(ValueError, match="implementation="):
    attention_dispatch.check_implementation(implementation)


def test_unknown_kernel_backend_raises():
  queries, keys, values, lengths = _full_inputs()
  with pytest.raises(ValueError, match="kernel_backend=.*allowed"):
    attention_dispatch.decode_attention(
      queries,
      keys,
      values,
      lengths,
      sm_scale=0.1,
      implementation="interpret",
      kernel_backend="cuda",
    )


@pytest.mark.parametrize(
  "platform, implementation, kernel_backend, chosen",
  [
    ("cpu", "auto", None, ("reference", False)),
    ("cpu", "auto", "tpu", ("reference", False)),
    ("cpu", "interpret", None, ("gpu", True)),
    ("cpu", "interpret", "tpu", ("tpu", True)),
    ("cuda", "auto", None, ("gpu", False)),
    ("cuda", "pallas", "gpu", ("gpu", False)),
    ("cuda", "interpret", "tpu", ("tpu", True)),
    ("tpu", "auto", None, ("tpu", False)),
    ("tpu", "reference", "gpu", ("reference", False)),
    ("cuda", "auto", "tpu", "kernel_backend='tpu' cannot run compiled on the 'cuda' backend"),
    ("tpu", "pallas", "gpu", "kernel_backend='gpu' cannot run compiled on the 'tpu' backend"),
    ("cpu", "pallas", "tpu", "implementation='pallas' needs a GPU or TPU backend"),
  ],
)
def test_the_kernel_family_chosen_on_each_platform(
  platform, implementation, kernel_backend, chosen, monkeypatch
):
  """The platform is patched where the choice reads it (no kernel runs): a compiled kernel of
  the other family is refused by name, interpret mode runs either family anywhere."""
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  if isinstance(chosen, str):
    with pytest.raises(ValueError, match=re.escape(chosen)):
      attention_dispatch.choose_kernel_family(implementation, kernel_backend)
  else:
    assert attention_dispatch.choose_kernel_family(implementation, kernel_backend) == chosen


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dispatch")
def test_auto_on_cpu_is_the_reference_and_pallas_is_refused():
  queries, keys, values, lengths = _full_inputs()
  out, lse = attention_dispatch.decode_attention(queries, keys, values, lengths, sm_scale=0.1)
  ref_out, ref_lse = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
  np.testing.assert_array_equal(out, ref_out)
  np.testing.assert_array_equal(lse, ref_lse)
  with pytest.raises(ValueError, match="implementation='pallas' needs a GPU or TPU"):
    attention_dispatch.decode_attention(
      queries, keys, values, lengths, sm_scale=0.1, implementation="pallas"
    )


@pytest.mark.parametrize("kernel_backend", [None, "tpu"])
def test_interpret_runs_a_kernel_under_jit(kernel_backend, kernel_calls):
  queries, keys, values, lengths = _full_inputs(seed=1)
  run = jax.jit(
    lambda q, k, v, lens: attention_dispatch.decode_attention(
      q,
      k,
      v,
      lens,
      sm_scale=0.1,
      implementation="interpret",
      kernel_backend=kernel_backend,
      kernel_config={"block_tokens": 32, "num_splits": 2},
    )
  )
  out, lse = run(queries, keys, values, lengths)
  assert kernel_calls.names == [f"decode_attention_{kernel_backend or 'gpu'}"]
  ref_out, ref_lse = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
  _close(out, ref_out)
  _close(lse, ref_lse)


def test_unsupported_shape_falls_back_to_reference_with_one_warning():
  queries, keys, values, lengths = _full_inputs(head_dim=48)  # no kernel takes head_dim 48
  attention_dispatch._warned.clear()
  with pytest.warns(RuntimeWarning, match="head_dim=48.*jnp reference"):
    out, _ = attention_dispatch.decode_attention(
      queries, keys, values, lengths, sm_scale=0.1, implementation="interpret"
    )
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a second call must not warn again
    attention_dispatch.decode_attention(
      queries, keys, values, lengths, sm_scale=0.1, implementation="interpret"
    )
  ref_out, _ = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
  np.testing.assert_array_equal(out, ref_out)


def test_fallback_warnings_are_kept_apart_by_lowering():
  inputs = _full_inputs(head_dim=48)
  attention_dispatch._warned.clear()
  for lowering in ("triton", "mosaic_gpu"):
    config = {"lowering": lowering}
    with pytest.warns(RuntimeWarning, match=rf"gpu \({lowering}\) .*head_dim=48"):
      attention_dispatch.decode_attention(
        *inputs, sm_scale=0.1, implementation="interpret", kernel_config=config
      )


@pytest.mark.parametrize("kernel_backend", ["gpu", "tpu"])
def test_a_segment_with_no_slots_gives_zero_and_minus_infinity(kernel_backend):
  """A 0-capacity segment (a shared context's own cache with room 0) has nothing to read."""
  queries, keys, values, _ = _full_inputs()
  no_slots = jnp.zeros((2,), jnp.int32)
  out, lse = attention_dispatch.decode_attention(
    queries,
    keys[:, :, :0],
    values[:, :, :0],
    no_slots,
    sm_scale=0.1,
    implementation="interpret",
    kernel_backend=kernel_backend,
  )
  np.testing.assert_array_equal(out, np.zeros(queries.shape, np.float32))
  np.testing.assert_array_equal(lse, np.full(queries.shape[:3], -np.inf, np.float32))
  queries, segment, _ = _quantized_inputs()
  empty = [part[:, :, :0] for part in segment[:6]]
  out, lse = attention_dispatch.quantized_decode_attention(
    queries,
    *empty,
    no_slots,
    bits=4,
    group_size=32,
    sm_scale=0.125,
    implementation="interpret",
    kernel_backend=kernel_backend,
  )
  np.testing.assert_array_equal(out, np.zeros(queries.shape, np.float32))
  np.testing.assert_array_equal(lse, np.full(queries.shape[:3], -np.inf, np.float32))


def test_quantized_interpret_matches_reference(kernel_calls):
  queries, segment, lengths = _quantized_inputs(seed=2)
  kwargs = dict(bits=4, group_size=32, sm_scale=0.125)
  out, lse = attention_dispatch.quantized_decode_attention(
    queries, *segment[:6], lengths, implementation="interpret", **kwargs
  )
  assert kernel_calls.names == ["quantized_decode_attention_gpu"]
  ref_out, ref_lse = quantized_decode_attention_reference(queries, *segment[:6], lengths, **kwargs)
  _close(out, ref_out)
  _close(lse, ref_lse)
  auto_out, _ = attention_dispatch.quantized_decode_attention(
    queries, *segment[:6], lengths, implementation="reference", **kwargs
  )
  np.testing.assert_array_equal(auto_out, ref_out)


@pytest.mark.parametrize("variant", ["joined", "folded"])
def test_quantized_interpret_takes_a_gpu_kernel_variant(variant, kernel_calls):
  queries, segment, lengths = _quantized_inputs(seed=3, bits=2)
  kwargs = dict(bits=2, group_size=32, sm_scale=0.125)
  out, lse = attention_dispatch.quantized_decode_attention(
    queries,
    *segment[:6],
    lengths,
    implementation="interpret",
    kernel_config={"variant": variant, "block_tokens": 64, "num_splits": 2},
    **kwargs,
  )
  assert kernel_calls.names == ["quantized_decode_attention_gpu"]
  ref_out, ref_lse = quantized_decode_attention_reference(queries, *segment[:6], lengths, **kwargs)
  _close(out, ref_out)
  _close(lse, ref_lse)


def test_a_triton_variant_asked_for_by_name_that_gives_way_is_warned_about(monkeypatch):
  """Found by a review: past 8 query heads per KV head (a shared context folds its rows into
  the query group) the folded variant ran the joined one, with an explicit "folded" too, and
  nothing said so. Asked for by name it now warns; left to the kernel, the choice is its own
  (README, "Attention kernels"), and no warning is given."""
  from pallas_kernels import quantized_decode_attention_triton as triton

  ran = []
  partials = triton.quantized_decode_attention_partials_triton

  def spy(*args, variant, **kwargs):
    ran.append(variant)
    return partials(*args, variant=variant, **kwargs)

  monkeypatch.setattr(triton, "quantized_decode_attention_partials_triton", spy)
  rng = np.random.default_rng(4)
  queries = random_queries(rng, 1, 1, 16, 64)
  segment = random_quantized_segment(rng, 1, 1, 128, 64, bits=4, group_size=32)
  lengths = jnp.asarray([100], jnp.int32)
  kwargs = dict(bits=4, group_size=32, sm_scale=0.125, implementation="interpret")
  attention_dispatch._warned.clear()
  with pytest.warns(
    RuntimeWarning,
    match=r"folded variant does not support 16 query heads per KV head \(at most 8\); using "
    r"its joined variant instead",
  ):
    out, lse = attention_dispatch.quantized_decode_attention(
      queries, *segment[:6], lengths, kernel_config={"variant": "folded"}, **kwargs
    )
  ref_out, ref_lse = quantized_decode_attention_reference(
    queries, *segment[:6], lengths, bits=4, group_size=32, sm_scale=0.125
  )
  _close(out, ref_out)
  _close(lse, ref_lse)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    attention_dispatch.quantized_decode_attention(queries, *segment[:6], lengths, **kwargs)
  assert ran == ["joined", "joined"]
  assert not [w for w in caught if "variant" in str(w.message)]


@pytest.mark.parametrize(
  "bad,match",
  [
    (dict(bits=3), "bits=3"),
    (dict(group_size=48), "group_size=48"),
    (dict(implementation="gpu"), "implementation='gpu'"),
    (dict(lowrank=(1, 2)), "lowrank"),
  ],
)
def test_quantized_config_errors_raise_before_tracing(bad, match):
  queries, segment, lengths = _quantized_inputs()
  kwargs = dict(bits=4, group_size=32, sm_scale=0.125) | bad

  def traced(q):
    return attention_dispatch.quantized_decode_attention(q, *segment[:6], lengths, **kwargs)

  with pytest.raises(ValueError, match=match):
    jax.eval_shape(traced, queries)  # raised while tracing starts: nothing compiled or run


@pytest.mark.parametrize(
  "implementation, kernel_backend", [("reference", None), ("interpret", "tpu")]
)
def test_outlier_slots_past_the_count_are_not_read(implementation, kernel_backend, kernel_calls):
  """GEAR's outliers stored in whole lane tiles, 82 a block in 128 slots (as a TPU cache stores
  head_dim 64's: `gear_outlier_slots`), the slots past them holding garbage (NaN values,
  indices anywhere): with `outlier_count`, the result of the 82 alone. The TPU kernel reads the
  whole tiles and masks the rest (`outlier_slots_read`); the other paths get them cut off."""
  rng = np.random.default_rng(5)
  queries = random_queries(rng, 2, 2, 4, 64)
  segment = random_quantized_segment(
    rng, 2, 2, 128, 64, bits=2, group_size=32, rank=2, outliers_per_block=82
  )
  lengths = jnp.asarray([128, 45], jnp.int32)
  garbage = lambda x, fill: jnp.concatenate([x, jnp.full((*x.shape[:-1], 46), fill, x.dtype)], -1)
  k_index, k_value, v_index, v_value = segment.outliers
  padded = (garbage(k_index, 4000), garbage(k_value, jnp.nan))
  padded += (garbage(v_index, 7), garbage(v_value, jnp.nan))
  common = dict(bits=2, group_size=32, sm_scale=0.125, lowrank=segment.lowrank)
  arrays = (queries, *segment[:6], lengths)
  ref_out, ref_lse = quantized_decode_attention_reference(
    *arrays, **common, outliers=segment.outliers
  )
  out, lse = attention_dispatch.quantized_decode_attention(
    *arrays,
    **common,
    outliers=padded,
    outlier_count=82,
    implementation=implementation,
    kernel_backend=kernel_backend,
  )
  _close(out, ref_out)
  _close(lse, ref_lse)
  if kernel_backend == "tpu":
    (call,) = kernel_calls
    assert call.name == "quantized_decode_attention_tpu" and call.kwargs["outlier_count"] == 82
  else:
    assert not kernel_calls


@pytest.mark.parametrize("count", [0, 129, 8.0, True])
def test_a_bad_outlier_count_is_named_before_tracing(count):
  queries, segment, lengths = _quantized_inputs()
  rng = np.random.default_rng(6)
  gear = random_quantized_segment(rng, 2, 2, 128, 64, bits=4, group_size=32, outliers_per_block=128)
  with pytest.raises(ValueError, match=re.escape(f"outlier_count={count!r} must be an int in")):
    attention_dispatch.quantized_decode_attention(
      queries,
      *gear[:6],
      lengths,
      bits=4,
      group_size=32,
      sm_scale=0.1,
      outliers=gear.outliers,
      outlier_count=count,
    )
  with pytest.raises(ValueError, match="outlier_count=3 is given without outliers"):
    attention_dispatch.quantized_decode_attention(
      queries, *segment[:6], lengths, bits=4, group_size=32, sm_scale=0.1, outlier_count=3
    )


@pytest.mark.parametrize("kernel_backend", ["gpu", "tpu"])
@pytest.mark.parametrize("gear", [False, True])
def test_a_nan_key_minimum_in_a_held_group_makes_its_rows_nan_everywhere(kernel_backend, gear):
  """A NaN statistic (a group quantized from a NaN key) reaches the output in the reference
  and the kernels alike, rather than making the row look empty (out 0, lse -inf)."""
  rng = np.random.default_rng(3)
  queries = random_queries(rng, 2, 2, 4, 64)
  segment = random_quantized_segment(
    rng,
    2,
    2,
    128,
    64,
    bits=2,
    group_size=32,
    rank=2 if gear else 0,
    outliers_per_block=4 if gear else 0,
  )
  lengths = jnp.asarray([128, 45], jnp.int32)
  k_min = segment.k_min.at[1, 0, 1].set(jnp.nan)  # row 1, KV head 0, its second key group
  arrays = (segment.k_codes, segment.k_scale, k_min, segment.v_codes, segment.v_scale)
  arrays += (segment.v_min, lengths)
  settings = dict(
    bits=2, group_size=32, sm_scale=0.125, lowrank=segment.lowrank, outliers=segment.outliers
  )
  ref_out, ref_lse = quantized_decode_attention_reference(queries, *arrays, **settings)
  nan_rows = np.zeros((2, 2), bool)
  nan_rows[1, 0] = True
  assert np.isnan(ref_lse).any(axis=-1).tolist() == nan_rows.tolist()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a kernel that falls back for this shape warns
    out, lse = attention_dispatch.quantized_decode_attention(
      queries,
      *arrays,
      **settings,
      implementation="interpret",
      kernel_backend=kernel_backend,
    )
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.isnan(lse).all(axis=-1).tolist() == nan_rows.tolist()
  assert np.isnan(out).all(axis=(-2, -1)).tolist() == nan_rows.tolist()
  _close(out[~nan_rows], np.asarray(ref_out)[~nan_rows], rtol=1e-4)


@pytest.mark.parametrize("kernel_backend", ["gpu", "tpu"])
def test_empty_batches_run_the_reference(kernel_backend):
  """No rows: the kernels have nothing to split (their planner refuses it by name); the
  dispatch hands the empty arrays to the reference, for both segment kinds."""
  rng = np.random.default_rng(0)
  queries = random_queries(rng, 0, 2, 4, 64)
  keys, values = random_full_segment(rng, 0, 2, 40, 64)
  lengths = jnp.zeros((0,), jnp.int32)
  out, lse = attention_dispatch.decode_attention(
    queries,
    keys,
    values,
    lengths,
    sm_scale=0.1,
    implementation="interpret",
    kernel_backend=kernel_backend,
  )
  assert out.shape == (0, 2, 4, 64) and lse.shape == (0, 2, 4)
  segment = random_quantized_segment(rng, 0, 2, 64, 64, bits=4, group_size=32)
  out, lse = attention_dispatch.quantized_decode_attention(
    queries,
    *segment[:6],
    lengths,
    bits=4,
    group_size=32,
    sm_scale=0.1,
    implementation="interpret",
    kernel_backend=kernel_backend,
  )
  assert out.shape == (0, 2, 4, 64) and lse.shape == (0, 2, 4)


def test_the_split_planner_refuses_an_empty_segment_by_name():
  from pallas_kernels.splits import plan_splits

  with pytest.raises(ValueError, match="got capacity 0 and batch x kv_heads = 4"):
    plan_splits(0, 64, 4, 2, 1)
  with pytest.raises(ValueError, match="got capacity 64 and batch x kv_heads = 0"):
    plan_splits(64, 64, 0, None, 132)
