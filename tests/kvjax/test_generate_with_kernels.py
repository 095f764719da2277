"""End to end: the Pallas kernels (interpret mode on CPU) drive generation exactly like the
jnp reference path, for a full-precision and a quantized cache.

The tiny model's head_dim is 64 here (the kernels take 64/128/256), and a fallback to the
reference is an error, so the "interpret" run really goes through the kernels."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder

KERNEL_CONFIG = dataclasses.replace(TINY_CONFIG, head_dim=64)

PROMPTS = [
  list(np.random.default_rng(3).integers(1, 64, 37)),
  list(np.random.default_rng(4).integers(1, 64, 21)),
]


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
@pytest.mark.parametrize("spec", ["full", "kivi:bits=4,group_size=16,residual=16"])
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_interpret_kernels_generate_the_reference_tokens(spec, layer_loop):
  """Also with the kernels called inside the scan over layers (kvjax.layer_runs)."""
  decoder, params = tiny_decoder(config=KERNEL_CONFIG, layer_loop=layer_loop)
  tokens = {
    implementation: generate(
      decoder,
      params,
      PROMPTS,
      max_new_tokens=4,
      cache_dtype=jnp.float32,
      cache_method=parse_method_spec(spec, implementation=implementation),
    ).tokens
    for implementation in ("reference", "interpret")
  }
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
