"""The Mosaic GPU full-precision decode kernel against the jnp reference.

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU machine). The interpreter
starts every buffer the kernel allocates, its outputs included, as NaN, so an element the kernel
never writes fails `assert_all_written`. Inputs are fresh random per case, with NaN in every
slot past a row's length.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention_mosaic_gpu
from pallas_kernels.decode_attention_mosaic_gpu import (
  decode_attention_mosaic_gpu as mosaic_kernel,
)
from pallas_kernels.decode_attention_mosaic_gpu import decode_attention_partials_mosaic_gpu
from pallas_kernels.decode_attention_reference import decode_attention_reference
from pallas_kernels.random_inputs import random_full_segment, random_queries
from pallas_kernels.splits import merge_split_partials
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  detect_mosaic_gpu_races,
  relative_tolerance,
  triton_interpret,
)

TOKENS = 200  # capacity: not a multiple of any block size (a multiple of 8, as the kernel needs)


def _inputs(rng, head_dim, group, dtype, batch=3, tokens=TOKENS):
  queries = random_queries(rng, batch, 2, group, head_dim)
  keys, values = random_full_segment(rng, batch, 2, tokens, head_dim, dtype)
  # Full row, a row ending mid-block, an empty row, then any others at random.
  lengths = [tokens, int(rng.integers(1, tokens)), 0] + list(
    rng.integers(1, tokens + 1, size=batch - 3)
  )
  lengths = jnp.asarray(lengths, jnp.int32)
  past = jnp.arange(tokens)[None, None, :, None] >= lengths[:, None, None, None]
  keys, values = jnp.where(past, jnp.nan, keys), jnp.where(past, jnp.nan, values)
  return queries, keys, values, lengths


def _check(head_dim, group, dtype, seed, *, batch=3, tokens=TOKENS, **config):
  rng = np.random.default_rng(seed)
  queries, keys, values, lengths = _inputs(rng, head_dim, group, dtype, batch, tokens)
  sm_scale = head_dim**-0.5
  interpret = triton_interpret()
  out_t, lse_p = decode_attention_partials_mosaic_gpu(
    queries, keys, values, lengths, sm_scale=sm_scale, interpret=interpret, **config
  )
  rows = decode_attention_mosaic_gpu.tile_rows(group)
  assert out_t.shape[-2:] == (head_dim, rows) and lse_p.shape[-1] == rows
  assert_all_written(out_t, lse_p)
  out, lse = merge_split_partials(out_t, lse_p, group, head_dim_last=False)
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=sm_scale)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(dtype, interpret))


@pytest.mark.parametrize(
  "head_dim,group,dtype,config",
  [
    (128, 4, jnp.bfloat16, dict(block_tokens=64, num_stages=2, num_splits=2)),
    (64, 8, jnp.float16, dict(block_tokens=64, num_stages=3, num_splits=3)),
    (128, 1, jnp.bfloat16, dict(block_tokens=128, num_stages=2, num_splits=1)),
    (64, 3, jnp.bfloat16, dict(block_tokens=64, num_stages=4)),
  ],
)
def test_mosaic_gpu_kernel_matches_reference(head_dim, group, dtype, config):
  _check(head_dim, group, dtype, seed=head_dim + group, **config)


def test_mosaic_gpu_kernel_batch_of_unequal_rows_and_wide_group():
  """Five rows of different lengths (one empty), a group of 16 (N = 16), head_dim 256."""
  _check(256, 16, jnp.bfloat16, seed=3, batch=5, tokens=328, num_splits=4)


def test_mosaic_gpu_kernel_capacity_below_one_block():
  """A 40-slot cache read by 64-token boxes: the rows past the capacity arrive as 0."""
  _check(64, 4, jnp.bfloat16, seed=8, tokens=40, block_tokens=64)


def test_mosaic_gpu_kernel_runs_without_races(monkeypatch):
  """Under the interpreter's race detector: 10 blocks through 2 ring stages, so every slot is
  refilled after the block's plain accesses (the values zeroed past a row's length, P staged).
  Without the `commit_smem` before the partials' copies (`send_partials`, which the quantized
  Mosaic kernels share) it reports a race, which the other tests here do not catch."""
  detect_mosaic_gpu_races(monkeypatch)
  _check(128, 4, jnp.bfloat16, seed=61, tokens=640, block_tokens=64, num_stages=2, num_splits=1)


def test_mosaic_gpu_entry_merges_like_the_partials():
  rng = np.random.default_rng(11)
  queries, keys, values, lengths = _inputs(rng, 64, 2, jnp.bfloat16)
  out, lse = mosaic_kernel(
    queries, keys, values, lengths, sm_scale=0.125, num_splits=2, interpret=triton_interpret()
  )
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.125)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))


@pytest.mark.slow
@pytest.mark.parametrize(
  "head_dim,group,dtype",
  list(itertools.product((64, 128), (1, 2, 4, 8), (jnp.bfloat16, jnp.float16))),
)
def test_mosaic_gpu_kernel_grid(head_dim, group, dtype):
  _check(head_dim, group, dtype, seed=head_dim * 3 + group, num_splits=3)


@pytest.mark.parametrize(
  "config,match",
  [
    (dict(block_tokens=32), "block_tokens=32"),
    (dict(num_stages=1), "num_stages=1"),
    (dict(num_splits=0), "num_splits=0"),
    (dict(block_tokens=256, num_stages=4), "shared memory"),
  ],
)
def test_mosaic_gpu_bad_settings_name_the_setting(config, match):
  queries = jnp.zeros((1, 1, 4, 128), jnp.float32)
  cache = jnp.zeros((1, 1, 512, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    decode_attention_partials_mosaic_gpu(
      queries, cache, cache, jnp.ones((1,), jnp.int32), sm_scale=1.0, **config
    )


@pytest.mark.parametrize(
  "dtype,tokens,head_dim,match",
  [
    (jnp.float32, 128, 128, "cache dtype"),
    (jnp.bfloat16, 333, 128, "capacity 333"),
    (jnp.bfloat16, 128, 96, "head_dim=96"),
  ],
)
def test_mosaic_gpu_unsupported_shapes_are_refused(dtype, tokens, head_dim, match):
  queries = jnp.zeros((1, 1, 4, head_dim), jnp.float32)
  cache = jnp.zeros((1, 1, tokens, head_dim), dtype)
  assert match in decode_attention_mosaic_gpu.unsupported_reason(queries, cache)
  with pytest.raises(ValueError, match=match):
    decode_attention_partials_mosaic_gpu(
      queries, cache, cache, jnp.ones((1,), jnp.int32), sm_scale=1.0
    )
