"""Builds a `Decoder` from Hugging Face-named weight tensors (what every reader yields)."""

import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.checkpoint import check_tensors, expected_tensor_shapes
from models.config import DecoderConfig
from models.decoder import Decoder


def nnx_path(hf_name: str) -> tuple[tuple, bool]:
  """(NNX parameter path, transpose?) of a Hugging Face Llama tensor name.

  `model.layers.3.self_attn.q_proj.weight` -> `("layers", 3, "self_attn", "q_proj", "kernel")`;
  torch Linear weights are [out, in] and NNX kernels [in, out], hence the transpose.
  """
  parts = [int(p) if p.isdigit() else p for p in hf_name.removeprefix("model.").split(".")]
  module = parts[-2]
  if module == "embed_tokens":
    return (*parts[:-1], "embedding"), False
  if module.endswith("_proj") or module == "lm_head":
    return (*parts[:-1], "kernel"), True
  return tuple(parts), False


def decoder_from_tensors(
  config: DecoderConfig,
  tensors: dict[str, np.ndarray],
  *,
  dtype=jnp.float32,
  source: str = "checkpoint",
  layer_loop: str = "unroll",
) -> Decoder:
  """A Decoder holding `tensors` (names and layouts of Hugging Face Llama checkpoints).

  `layer_loop`: "scan" (one compiled body per run of look-alike layers) or "unroll"
  (see kvjax.layer_runs).
  """
  check_tensors(config, tensors, pathlib.Path(source))
  abstract = nnx.eval_shape(
    lambda: Decoder(config, dtype=dtype, layer_loop=layer_loop, rngs=nnx.Rngs(0))
  )
  graphdef, abstract_state = nnx.split(abstract)
  variables = dict(nnx.to_flat_state(abstract_state))
  flat = []
  for name in expected_tensor_shapes(config):
    path, transpose = nnx_path(name)
    array = np.asarray(tensors[name])
    flat.append(
      (path, variables[path].replace(jnp.asarray(array.T if transpose else array, dtype=dtype)))
    )
  if len(flat) != len(variables):
    missing = sorted(set(variables) - {path for path, _ in flat})
    raise ValueError(f"{source}: no checkpoint tensor maps to model parameters {missing}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def random_decoder(
  config: DecoderConfig, *, seed: int = 0, dtype=jnp.float32, layer_loop: str = "unroll"
) -> Decoder:
  """A randomly initialised Decoder (tests, examples)."""
  return Decoder(config, dtype=dtype, layer_loop=layer_loop, rngs=nnx.Rngs(seed))
