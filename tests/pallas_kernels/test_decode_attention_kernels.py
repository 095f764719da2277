"""Full-precision decode kernels (GPU/Triton and TPU/Mosaic) against the jnp reference.

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU/TPU machine); fresh random
inputs per case; partial outputs poisoned with NaN before the call.
"""

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_tpu, decode_attention_triton
from pallas_kernels.decode_attention_reference import decode_attention_reference
from pallas_kernels.random_inputs import random_full_segment, random_queries
from pallas_kernels.splits import merge_split_partials
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  assert_relative_error_below,
  exact_float32_products,
  relative_tolerance,
  tpu_interpret,
  triton_interpret,
)

TOKENS = 200  # capacity: not a multiple of any block size
# Below 128 channels the TPU kernel's token blocks are lane tiles (multiples of 128 tokens):
# 600 tokens make five, the last one partly past the capacity, so 2 and 3 splits exist.
TPU_LANE_TOKENS = 600


def _inputs(rng, head_dim, group, dtype, batch=3, tokens=TOKENS):
  queries = random_queries(rng, batch, 2, group, head_dim)
  keys, values = random_full_segment(rng, batch, 2, tokens, head_dim, dtype)
  # Full row, a row ending mid-block, an empty row, then any others at random.
  lengths = [tokens, int(rng.integers(1, tokens)), 0] + list(
    rng.integers(1, tokens + 1, size=batch - 3)
  )
  return queries, keys, values, jnp.asarray(lengths, jnp.int32)


def _check_kernel(kernel, head_dim, group, dtype, seed, num_splits=2, block_tokens=64):
  """`kernel`: the module (decode_attention_triton or decode_attention_tpu) under test."""
  rng = np.random.default_rng(seed)
  tokens = TOKENS
  if kernel is decode_attention_tpu and decode_attention_tpu.tokens_on_lanes(head_dim):
    tokens, block_tokens = TPU_LANE_TOKENS, max(block_tokens, decode_attention_tpu.LANES)
  queries, keys, values, lengths = _inputs(rng, head_dim, group, dtype, tokens=tokens)
  rows = kernel.tile_rows(group)
  poison = (
    jnp.full((3, 2, num_splits, rows, head_dim), jnp.nan, jnp.float32),
    jnp.full((3, 2, num_splits, rows), jnp.nan, jnp.float32),
  )
  if kernel is decode_attention_triton:
    interpret, partials = triton_interpret(), kernel.decode_attention_partials_triton
  else:
    interpret, partials = tpu_interpret(), kernel.decode_attention_partials_tpu
  out_p, lse_p = partials(
    queries,
    keys,
    values,
    lengths,
    poison,
    sm_scale=head_dim**-0.5,
    block_tokens=block_tokens,
    num_splits=num_splits,
    interpret=interpret,
  )
  assert_all_written(out_p, lse_p)
  out, lse = merge_split_partials(out_p, lse_p, group)
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=head_dim**-0.5)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(dtype, interpret))


@pytest.mark.parametrize(
  "head_dim,group,dtype",
  [
    (64, 1, jnp.float32),
    (128, 4, jnp.bfloat16),
    (64, 8, jnp.bfloat16),
    (128, 3, jnp.float32),
  ],
)
def test_triton_kernel_matches_reference(head_dim, group, dtype):
  _check_kernel(decode_attention_triton, head_dim, group, dtype, seed=head_dim * 10 + group)


@pytest.mark.parametrize("head_dim,group,dtype", [(128, 4, jnp.float32), (64, 8, jnp.bfloat16)])
def test_tpu_kernel_matches_reference(head_dim, group, dtype):
  _check_kernel(decode_attention_tpu, head_dim, group, dtype, seed=head_dim * 10 + group + 1)


def _both_kernels(queries, keys, values, lengths, *, triton_splits, tpu_splits):
  """(out, lse) of the Triton and the TPU kernel, sm_scale 0.125."""
  return (
    decode_attention_triton.decode_attention_triton(
      queries,
      keys,
      values,
      lengths,
      sm_scale=0.125,
      num_splits=triton_splits,
      interpret=triton_interpret(),
    ),
    decode_attention_tpu.decode_attention_tpu(
      queries,
      keys,
      values,
      lengths,
      sm_scale=0.125,
      block_tokens=64,
      num_splits=tpu_splits,
      interpret=tpu_interpret(),
    ),
  )


def test_kernels_ignore_nan_past_length():
  """Capacity past a row's length may hold anything (NaN here): none of it reaches the result.
  (That blocks past the length are not loaded, so cost no work, is the kernels' design; this
  test checks only the result.)"""
  rng = np.random.default_rng(5)
  queries, keys, values, lengths = _inputs(rng, 64, 4, jnp.float32)
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.125)
  past = jnp.arange(TOKENS)[None, None, :, None] >= lengths[:, None, None, None]
  keys, values = jnp.where(past, jnp.nan, keys), jnp.where(past, jnp.nan, values)
  for out, lse in _both_kernels(queries, keys, values, lengths, triton_splits=3, tpu_splits=1):
    assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.float32, False))


@pytest.mark.slow
@pytest.mark.parametrize(
  "head_dim,group,dtype",
  list(itertools.product((64, 128), (1, 2, 4, 8), (jnp.float32, jnp.bfloat16))),
)
def test_triton_kernel_grid(head_dim, group, dtype):
  _check_kernel(
    decode_attention_triton,
    head_dim,
    group,
    dtype,
    seed=head_dim + group,
    num_splits=3,
    block_tokens=32,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "head_dim,group,dtype",
  list(itertools.product((64, 128), (1, 2, 4, 8), (jnp.float32, jnp.bfloat16))),
)
def test_tpu_kernel_grid(head_dim, group, dtype):
  _check_kernel(
    decode_attention_tpu,
    head_dim,
    group,
    dtype,
    seed=head_dim + group + 7,
    num_splits=3,
    block_tokens=32,
  )


@pytest.mark.parametrize("where", ["key", "value"])
def test_a_nan_in_a_valid_slot_makes_its_row_nan_as_in_the_reference(where):
  """A NaN the model wrote into a held token reaches the output (as full attention hands it
  on), in every split layout; it does not make the row look empty (out 0, lse -inf)."""
  rng = np.random.default_rng(6)
  queries, keys, values, lengths = _inputs(rng, 64, 4, jnp.float32)
  slot = (1, 0, 5)  # row 1, KV head 0, a token inside its length
  if where == "key":
    keys = keys.at[slot].set(jnp.nan)
  else:
    values = values.at[slot].set(jnp.nan)
  ref_out, ref_lse = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.125)
  assert np.all(np.isnan(ref_out[1, 0])) and np.isnan(ref_lse[1, 0]).all() == (where == "key")
  for num_splits in (1, 3):
    for out, lse in _both_kernels(
      queries, keys, values, lengths, triton_splits=num_splits, tpu_splits=num_splits
    ):
      out, lse = np.asarray(out), np.asarray(lse)
      np.testing.assert_array_equal(np.isnan(out), np.isnan(np.asarray(ref_out)))
      np.testing.assert_array_equal(np.isnan(lse), np.isnan(np.asarray(ref_lse)))
      ok = ~np.isnan(np.asarray(ref_out))
      if exact_float32_products():
        np.testing.assert_allclose(out[ok], np.asarray(ref_out)[ok], rtol=1e-5, atol=1e-6)
      else:  # tf32 products on both sides: the float32 kernel tests' bound
        rtol = relative_tolerance(jnp.float32, interpret=False)
        assert_relative_error_below(out[ok], np.asarray(ref_out)[ok], rtol)


def test_the_triton_kernel_called_directly_refuses_what_it_does_not_take():
  """The dispatch sends these to the reference; the kernel's own entry point refuses them by
  name instead of computing on them (an int8 cache gave a 0.32 relative error before)."""
  rng = np.random.default_rng(9)
  queries, keys, values, lengths = _inputs(rng, 64, 4, jnp.float32)
  with pytest.raises(ValueError, match="does not take cache dtype int8"):
    decode_attention_triton.decode_attention_triton(
      queries, keys.astype(jnp.int8), values.astype(jnp.int8), lengths, sm_scale=0.1
    )
  queries, keys, values, lengths = _inputs(rng, 96, 4, jnp.float32)
  with pytest.raises(ValueError, match=r"does not take head_dim=96"):
    decode_attention_triton.decode_attention_triton(queries, keys, values, lengths, sm_scale=0.1)


def test_the_tpu_kernel_called_directly_refuses_what_it_does_not_take():
  """As the Triton kernel's entry point: by name, before tracing (an int8 cache gave a 0.99
  relative error, block_tokens=0 a ZeroDivisionError, a negative block was rounded up to a
  lane tile, mismatched lengths were accepted)."""
  rng = np.random.default_rng(10)
  queries, keys, values, lengths = _inputs(rng, 128, 4, jnp.float32)
  call = functools.partial(decode_attention_tpu.decode_attention_tpu, sm_scale=0.1)
  with pytest.raises(ValueError, match="does not take cache dtype int8"):
    call(queries, keys.astype(jnp.int8), values.astype(jnp.int8), lengths)
  with pytest.raises(ValueError, match="values dtype bfloat16 with keys dtype float32"):
    call(queries, keys, values.astype(jnp.bfloat16), lengths)
  for block_tokens in (0, -64, 3.5, 48):
    with pytest.raises(ValueError, match=rf"block_tokens={block_tokens!r} is not supported"):
      call(queries, keys, values, lengths, block_tokens=block_tokens)
  with pytest.raises(ValueError, match="num_splits=0 is not supported"):
    call(queries, keys, values, lengths, num_splits=0)
  with pytest.raises(ValueError, match=r"lengths must be \[3\]"):
    call(queries, keys, values, lengths[:2])
  queries, keys, values, lengths = _inputs(rng, 96, 4, jnp.float32)
  with pytest.raises(ValueError, match=r"does not take head_dim=96"):
    call(queries, keys, values, lengths)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_length_past_the_capacity_counts_as_the_capacity(head_dim):
  """As in the reference (every slot valid). The TPU kernel's index maps clamped to a block
  past the capacity before: NaN compiled, an out-of-bounds read interpreted."""
  rng = np.random.default_rng(11 + head_dim)
  tokens = TPU_LANE_TOKENS if decode_attention_tpu.tokens_on_lanes(head_dim) else TOKENS
  queries, keys, values, _ = _inputs(rng, head_dim, 4, jnp.float32, tokens=tokens)
  ref = decode_attention_reference(
    queries, keys, values, jnp.full((3,), tokens, jnp.int32), sm_scale=0.125
  )
  past = jnp.asarray([tokens + 1, tokens + 200, 2**30], jnp.int32)
  for out, lse in _both_kernels(queries, keys, values, past, triton_splits=3, tpu_splits=2):
    assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.float32, False))
