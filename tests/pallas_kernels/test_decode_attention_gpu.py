"""The GPU entry point picks the lowering from kernel_config and refuses settings it does not
take; through kvjax's dispatch, the Mosaic GPU kernel gives the reference's result."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from pallas_kernels import decode_attention_gpu
from pallas_kernels.decode_attention_reference import decode_attention_reference
from pallas_kernels.random_inputs import random_full_segment, random_queries
from tests.pallas_kernels.kernel_checks import assert_matches_reference, relative_tolerance

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


@pytest.mark.parametrize(
  "config,match",
  [
    ({"lowering": "mosaic"}, "lowering='mosaic' is not supported; allowed: triton, mosaic_gpu"),
    ({"lowering": "mosaic_gpu", "num_warps": 4}, r"\['num_warps'\] are not taken"),
    ({"block_size": 64}, r"\['block_size'\] are not taken by lowering='triton'"),
  ],
)
def test_bad_kernel_config_is_named(config, match):
  with pytest.raises(ValueError, match=match):
    decode_attention_gpu.check_config(config)
  queries = jnp.zeros((1, 1, 4, 64), jnp.float32)
  cache = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    attention_dispatch.decode_attention(
      queries,
      cache,
      cache,
      jnp.ones((1,), jnp.int32),
      sm_scale=1.0,
      implementation="interpret",
      kernel_config=config,
    )


@pytest.mark.parametrize("lowering", ["triton", "mosaic_gpu"])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to the reference fails
def test_dispatch_runs_either_lowering(lowering):
  rng = np.random.default_rng(4)
  queries = random_queries(rng, 2, 2, 4, 128)
  keys, values = random_full_segment(rng, 2, 2, 152, 128, jnp.bfloat16)
  lengths = jnp.asarray([152, 70], jnp.int32)
  out, lse = attention_dispatch.decode_attention(
    queries,
    keys,
    values,
    lengths,
    sm_scale=0.1,
    implementation="interpret",
    kernel_config={"lowering": lowering, "num_splits": 2},
  )
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))


def test_shape_the_mosaic_kernel_refuses_falls_back_to_the_reference():
  """A float32 cache (wgmma takes 16-bit operands): the reference runs, with a warning."""
  rng = np.random.default_rng(6)
  queries = random_queries(rng, 1, 2, 4, 64)
  keys, values = random_full_segment(rng, 1, 2, 100, 64, jnp.float32)
  lengths = jnp.asarray([90], jnp.int32)
  with pytest.warns(RuntimeWarning, match="cache dtype float32"):
    out, lse = attention_dispatch.decode_attention(
      queries,
      keys,
      values,
      lengths,
      sm_scale=0.1,
      implementation="interpret",
      kernel_config={"lowering": "mosaic_gpu"},
    )
  ref = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref[0]))
