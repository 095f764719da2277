"""A checkpoint in Hugging Face terms: a config.json-style dict and float32 tensors by HF name.

Every reader (GGUF file, Hugging Face directory) produces this one shape, checked against its
config the same way, so the model code never needs to know where the weights came from.
"""

import dataclasses
import pathlib

import numpy as np

from models.checkpoint_errors import CheckpointError
from models.config import DecoderConfig

# How many offending tensor names an error message lists before it only counts the rest.
_NAMES_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """`config` uses Hugging Face config.json keys (`DecoderConfig.from_hf_dict` reads it);
  `tensors` maps Hugging Face names to float32 arrays in torch layouts (Linear is [out, in])."""

  config: dict
  tensors: dict[str, np.ndarray]
  source: pathlib.Path


def decoder_config(config: dict, source: pathlib.Path) -> DecoderConfig:
  """The parsed config, or a CheckpointError naming `source` if the dict cannot describe a model."""
  try:
    return DecoderConfig.from_hf_dict(config)
  except KeyError as error:
    raise CheckpointError(f"{source}: the model config has no {error.args[0]!r} entry") from error
  except (TypeError, ValueError) as error:
    raise CheckpointError(f"{source}: unsupported model config: {error}") from error


def expected_tensor_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a Llama/Mistral decoder with `config` needs, by Hugging Face name."""
  hidden = config.hidden_size
  q_rows = config.num_heads * config.head_dim
  kv_rows = config.num_kv_heads * config.head_dim
  shapes = {
    "model.embed_tokens.weight": (config.vocab_size, hidden),
    "model.norm.weight": (hidden,),
  }
  if not config.tie_word_embeddings:
    shapes["lm_head.weight"] = (config.vocab_size, hidden)
  for layer in range(config.num_layers):
    prefix = f"model.layers.{layer}"
    shapes |= {
      f"{prefix}.input_layernorm.weight": (hidden,),
      f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
      f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
      f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
      f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
      f"{prefix}.post_attention_layernorm.weight": (hidden,),
      f"{prefix}.mlp.gate_proj.weight": (config.intermediate_size, hidden),
      f"{prefix}.mlp.up_proj.weight": (config.intermediate_size, hidden),
      f"{prefix}.mlp.down_proj.weight": (hidden, config.intermediate_size),
    }
  return shapes


def describe_names(names: list[str]) -> str:
  """A short, readable list of tensor names for an error message."""
  shown = ", ".join(repr(name) for name in names[:_NAMES_SHOWN])
  hidden = len(names) - _NAMES_SHOWN
  return f"{shown} and {hidden} more" if hidden > 0 else shown


def check_tensors(
  config: DecoderConfig, tensors: dict[str, np.ndarray], source: pathlib.Path
) -> None:
  """Raises a CheckpointError naming `source` unless `tensors` are exactly what `config` needs."""
  expected = expected_tensor_shapes(config)
  missing = [name for name in expected if name not in tensors]
  if missing:
    raise CheckpointError(f"{source}: missing tensors {describe_names(missing)}")
  unexpected = [name for name in tensors if name not in expected]
  if unexpected:
    raise CheckpointError(
      f"{source}: tensors {describe_names(unexpected)} have no place in a "
      f"{config.model_type} decoder with {config.num_layers} layers"
    )
  for name, shape in expected.items():
    actual = tuple(tensors[name].shape)
    if actual != shape:
      raise CheckpointError(
        f"{source}: tensor {name!r} has shape {actual}, but the config implies {shape}"
      )
