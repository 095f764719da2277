"""Builds a `Decoder` from Hugging Face-named weight tensors (what every checkpoint reader yields)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import DecoderConfig
from models.decoder import Decoder

# (Hugging Face suffix, NNX path suffix, transpose): torch Linear stores [out, in], NNX [in, out].
_LAYER_TENSORS = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), False),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), True),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), True),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), True),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), True),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), True),
)


def hf_tensor_paths(config: DecoderConfig) -> dict[tuple, tuple[str, bool]]:
  """NNX parameter path -> (Hugging Face tensor name, transpose?)."""
  paths = {
      ("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
      ("norm", "weight"): ("model.norm.weight", False),
  }
  if not config.tie_word_embeddings:
    paths[("lm_head", "kernel")] = ("lm_head.weight", True)
  for layer in range(config.num_layers):
    for hf_suffix, nnx_suffix, transpose in _LAYER_TENSORS:
      paths[("layers", layer, *nnx_suffix)] = (f"model.layers.{layer}.{hf_suffix}", transpose)
  return paths


def decoder_from_tensors(
    config: DecoderConfig,
    tensors: dict[str, np.ndarray],
    *,
    dtype=jnp.float32,
    source: str = "checkpoint",
) -> Decoder:
  """A Decoder holding `tensors` (names and layouts of Hugging Face Llama checkpoints)."""
  abstract = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  paths = hf_tensor_paths(config)
  flat = []
  for path, variable in nnx.to_flat_state(abstract_state):
    name, transpose = paths[path]
    if name not in tensors:
      raise ValueError(f"{source}: missing tensor {name!r}")
    array = np.asarray(tensors[name])
    array = array.T if transpose else array
    if array.shape != variable.shape:
      raise ValueError(
          f"{source}: tensor {name!r} has shape {array.shape[::-1] if transpose else array.shape}, "
          f"expected {variable.shape[::-1] if transpose else variable.shape} for this config"
      )
    flat.append((path, variable.replace(jnp.asarray(array, dtype=dtype))))
  state = nnx.from_flat_state(flat)
  return nnx.merge(graphdef, state)


def random_decoder(config: DecoderConfig, *, seed: int = 0, dtype=jnp.float32) -> Decoder:
  """A randomly initialised Decoder (tests, examples)."""
  return Decoder(config, dtype=dtype, rngs=nnx.Rngs(seed))
