"""One call from a model name or path to a ready decoder, its parameters and its tokenizer."""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from kvjax.layer_runs import check_layer_loop
from models.config import DecoderConfig, check_param_dtype
from models.nnx_decoder import NNXCachedDecoder, split_decoder
from models.registry import load_tokenizer, read_checkpoint, resolve_model_path
from models.tokenizer import Tokenizer
from models.weights import decoder_from_tensors

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  name: str
  config: DecoderConfig
  decoder: NNXCachedDecoder
  params: nnx.State
  tokenizer: Tokenizer

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    return tuple(sorted(set(self.tokenizer.stop_ids) | set(self.config.eos_token_ids)))


def load_model(
  name_or_path: str = DEFAULT_MODEL, *, dtype=jnp.float32, layer_loop: str = "unroll"
) -> LoadedModel:
  """Loads a GGUF file, a Hugging Face checkpoint directory, or a short name (`smollm2-135m`).

  `dtype`: the parameters' and activations' dtype, one of bfloat16, float16, float32.

  `layer_loop`: "unroll" (the default) compiles every layer apart; "scan" compiles the cache
  code once per run of look-alike layers, several times faster to compile for quantized
  caches, while each decode step reads and writes its layer's slice of the stacked caches
  (about 10% slower batch-1 decoding on a 2-core CPU; kvjax.layer_runs).
  """
  check_layer_loop(layer_loop)
  check_param_dtype(dtype)
  path = resolve_model_path(name_or_path)
  # The tokenizer first: it reads only metadata (the GGUF parse is shared with the checkpoint),
  # while the weights take minutes and float32 memory to read; a tokenizer kvjax cannot build
  # (a GGUF's SentencePiece vocabulary) is refused before that work, not after it.
  tokenizer = load_tokenizer(name_or_path)
  checkpoint = read_checkpoint(name_or_path)
  config = DecoderConfig.from_hf_dict(checkpoint.config)
  model = decoder_from_tensors(
    config, checkpoint.tensors, dtype=dtype, source=str(path), layer_loop=layer_loop
  )
  decoder, params = split_decoder(model)
  return LoadedModel(
    name=str(name_or_path),
    config=config,
    decoder=decoder,
    params=params,
    tokenizer=tokenizer,
  )
