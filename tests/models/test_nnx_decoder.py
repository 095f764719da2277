import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.generate import generate
from models.nnx_decoder import split_decoder
from models.weights import random_decoder
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder


def test_the_decoder_checks_params_by_their_shapes_before_anything_is_traced():
  """`split_decoder` records its parameters' shapes; `check_params` (which kvjax's entry points
  call) refuses params of another model or none, naming where they differ, and takes the same
  shapes in another float type."""
  decoder, params = tiny_decoder()
  assert len(decoder.param_shapes) == len(jax.tree.leaves(params))
  decoder.check_params(params)
  decoder.check_params(jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), params))
  with pytest.raises(ValueError, match=r"params holds 0 arrays \(NoneType\); this decoder's "):
    decoder.check_params(None)
  wider = dataclasses.replace(TINY_CONFIG, intermediate_size=96)
  _, other_params = split_decoder(random_decoder(wider, seed=0))
  down_projection = r"params\['layers'\]\[0\]\['mlp'\]\['down_proj'\]\['kernel'\]\.value"
  with pytest.raises(ValueError, match=down_projection + r" has shape \(96, 32\); .* \(64, 32\)"):
    decoder.check_params(other_params)
  with pytest.raises(
    ValueError, match=r"has shape .* \(params of another model or configuration\)"
  ):
    generate(decoder, other_params, [[1, 2, 3]], max_new_tokens=2)
  tokens = generate(decoder, params, [[1, 2, 3]], max_new_tokens=2).tokens
  assert np.asarray(tokens).shape == (1, 2)
