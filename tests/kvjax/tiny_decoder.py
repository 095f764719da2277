"""A tiny random Llama decoder for kvjax tests (tests may use `models`; kvjax itself may not)."""

import functools

from models.config import DecoderConfig
from models.nnx_decoder import split_decoder
from models.weights import random_decoder

TINY_CONFIG = DecoderConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  rope_theta=10000.0,
  max_position_embeddings=512,
)


@functools.cache
def tiny_decoder(seed: int = 0, config: DecoderConfig = TINY_CONFIG, layer_loop: str = "unroll"):
  """(decoder, params) of a random tiny model, built once per process."""
  return split_decoder(random_decoder(config, seed=seed, layer_loop=layer_loop))
