"""Reading a llama.cpp GGUF file as a Hugging Face-style checkpoint (config dict + float32 tensors).

Three things differ between a GGUF file and the Hugging Face checkpoint it was converted from, and
each is undone here: the config lives in `{arch}.*` metadata keys, tensors have llama.cpp names
(`blk.0.attn_q.weight`) and may be block-quantized, and the rows of every Q and K projection were
permuted by llama.cpp's converter to suit its RoPE kernel.
"""

import dataclasses
import functools
import numbers
import pathlib
import re

import gguf
import numpy as np

from models.checkpoint import Checkpoint, check_tensors, decoder_config, describe_names
from models.checkpoint_errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("llama", "mistral")

# The types gguf.quants can dequantize that this reader promises to handle (and tests).
SUPPORTED_TENSOR_TYPES = (
  gguf.GGMLQuantizationType.F32,
  gguf.GGMLQuantizationType.F16,
  gguf.GGMLQuantizationType.BF16,
  gguf.GGMLQuantizationType.Q8_0,
  gguf.GGMLQuantizationType.Q4_0,
  gguf.GGMLQuantizationType.Q4_1,
)

_GLOBAL_TENSOR_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}

_LAYER_TENSOR_NAMES = {
  "attn_norm": "input_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_norm": "post_attention_layernorm",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# What gguf.GGUFReader raises on truncated or corrupt input: it slices a memory map and reshapes
# the slices, so short or garbled data surfaces as numpy shape/index errors rather than one type.
_READER_ERRORS = (OSError, ValueError, IndexError, KeyError, OverflowError)

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class GGUFFile:
  """An open GGUF file, with metadata access that reports problems against its path."""

  path: pathlib.Path
  reader: gguf.GGUFReader

  def value(self, key: str, default=_REQUIRED):
    """Metadata `key` (str, number, bool or list); `default` when absent, if one is given."""
    field = self.reader.fields.get(key)
    if field is None:
      if default is _REQUIRED:
        raise CheckpointError(f"{self.path}: GGUF metadata has no {key!r} entry")
      return default
    try:
      return field.contents()
    except (ValueError, IndexError) as error:
      raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is unreadable: {error}") from error


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
  """Parsing the metadata takes seconds: the checkpoint and the tokenizer share one parse.
  `mtime_ns` and `size` are in the key so a rewritten file is parsed again."""
  del mtime_ns, size
  return gguf.GGUFReader(path)


def open_gguf(path: str | pathlib.Path) -> GGUFFile:
  """The GGUF file at `path`, or a CheckpointError when it is missing or not readable as GGUF."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise CheckpointError(f"{path}: no such GGUF file")
  try:
    stat = path.stat()
    return GGUFFile(path, _read_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size))
  except _READER_ERRORS as error:
    raise CheckpointError(
      f"{path}: not a readable GGUF file (truncated, corrupt, or another format): {error}"
    ) from error


def read_gguf_checkpoint(path: str | pathlib.Path) -> Checkpoint:
  """The Llama/Mistral checkpoint in GGUF file `path`, in Hugging Face names/layouts, float32."""
  gguf_file = open_gguf(path)
  path = gguf_file.path
  gguf_tensors = {tensor.name: tensor for tensor in gguf_file.reader.tensors}
  config = gguf_config(gguf_file, tuple(gguf_tensors))
  decoder = decoder_config(config, path)

  hf_names = hf_tensor_names(tuple(gguf_tensors), path)
  for tensor in gguf_tensors.values():
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
      supported = ", ".join(kind.name for kind in SUPPORTED_TENSOR_TYPES)
      raise CheckpointError(
        f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which kvjax cannot "
        f"dequantize; supported types: {supported}"
      )
  tensors = {hf_names[name]: dequantize(tensor) for name, tensor in gguf_tensors.items()}
  check_tensors(decoder, tensors, path)

  for layer in range(decoder.num_layers):
    for projection, num_heads in (("q_proj", decoder.num_heads), ("k_proj", decoder.num_kv_heads)):
      name = f"model.layers.{layer}.self_attn.{projection}.weight"
      tensors[name] = unpermute_rope_rows(tensors[name], num_heads)
  return Checkpoint(config=config, tensors=tensors, source=path)


def gguf_config(gguf_file: GGUFFile, tensor_names: tuple[str, ...]) -> dict:
  """A Hugging Face config.json-style dict from the GGUF metadata (`DecoderConfig.from_hf_dict`)."""
  path = gguf_file.path
  architecture = gguf_file.value("general.architecture")
  if architecture not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
      f"{path}: GGUF architecture {architecture!r} is not supported; "
      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
  value = lambda key, default=_REQUIRED: gguf_file.value(f"{architecture}.{key}", default)

  hidden_size = value("embedding_length")
  num_heads = value("attention.head_count")
  num_kv_heads = value("attention.head_count_kv", num_heads)
  if isinstance(num_kv_heads, list):
    raise CheckpointError(
      f"{path}: per-layer KV head counts ({architecture}.attention.head_count_kv is a list) "
      "are not supported; kvjax needs one KV head count for all layers"
    )
  for key, count in (("embedding_length", hidden_size), ("attention.head_count", num_heads)):
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
      raise CheckpointError(f"{path}: {architecture}.{key} = {count!r} must be an integer >= 1")
  head_dim = value("attention.key_length", None)
  if head_dim is None:
    head_dim = hidden_size // num_heads
  for key in ("attention.value_length", "rope.dimension_count"):
    if value(key, head_dim) != head_dim:
      raise CheckpointError(
        f"{path}: {architecture}.{key} = {value(key)} differs from the head size {head_dim}; "
        "kvjax supports only values and RoPE spanning the whole head"
      )
  # llama.cpp stores Llama-3 RoPE scaling as a `rope_freqs` factor tensor whose parameters
  # cannot be recovered exactly, and marks other scalings in metadata; running such a model with
  # plain RoPE would silently give wrong logits, so both are refused. llama.cpp reads a factor
  # from `rope.scaling.factor` or the older `rope.scale_linear` and, with no type written, takes
  # it as linear scaling: a factor other than 1 is refused whatever the type says.
  scaling = value("rope.scaling.type", None)
  factor = value("rope.scaling.factor", None)
  if factor is None:
    factor = value("rope.scale_linear", None)
  if factor not in (None, 0.0, 1.0) and scaling in (None, "none"):
    scaling = f"linear, factor {factor}"
  if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
    raise CheckpointError(
      f"{path}: RoPE scaling ({scaling if scaling not in (None, 'none') else 'rope_freqs factors'})"
      " is not supported in GGUF files; supported: none (load the Hugging Face directory for "
      "llama3 scaling)"
    )

  vocab_size = value("vocab_size", None)
  if vocab_size is None:
    tokens = gguf_file.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise CheckpointError(
        f"{path}: GGUF metadata has neither {architecture}.vocab_size nor tokenizer.ggml.tokens, "
        "so the vocabulary size is unknown"
      )
    vocab_size = len(tokens.data)

  # llama.cpp's converter writes Mistral checkpoints under the "llama" architecture; a window in
  # the metadata is the model's, so it is kept (as a Mistral config) rather than dropped.
  sliding_window = value("attention.sliding_window", None)
  return {
    "model_type": "mistral" if architecture == "mistral" or sliding_window else "llama",
    "hidden_size": hidden_size,
    "intermediate_size": value("feed_forward_length"),
    "num_hidden_layers": value("block_count"),
    "num_attention_heads": num_heads,
    "num_key_value_heads": num_kv_heads,
    "head_dim": head_dim,
    "rms_norm_eps": value("attention.layer_norm_rms_epsilon"),
    "rope_theta": value("rope.freq_base", 10000.0),
    "rope_scaling": None,
    "vocab_size": vocab_size,
    "max_position_embeddings": value("context_length"),
    # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
    "tie_word_embeddings": "output.weight" not in tensor_names,
    "bos_token_id": gguf_file.value("tokenizer.ggml.bos_token_id", None),
    "eos_token_id": gguf_file.value("tokenizer.ggml.eos_token_id", None),
    "sliding_window": sliding_window,
  }


def hf_tensor_names(gguf_names: tuple[str, ...], path: pathlib.Path) -> dict[str, str]:
  """Hugging Face name for each llama.cpp tensor name; a CheckpointError lists any it cannot map."""
  mapped, unknown = {}, []
  for name in gguf_names:
    layer_match = _LAYER_TENSOR.fullmatch(name)
    if name in _GLOBAL_TENSOR_NAMES:
      mapped[name] = _GLOBAL_TENSOR_NAMES[name]
    elif layer_match and layer_match.group(2) in _LAYER_TENSOR_NAMES:
      layer, part = layer_match.groups()
      mapped[name] = f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.weight"
    else:
      unknown.append(name)
  if unknown:
    raise CheckpointError(
      f"{path}: tensors {describe_names(unknown)} have no counterpart in a Llama/Mistral decoder "
      "(biases, extra norms or adapters are not supported)"
    )
  return mapped


def dequantize(tensor) -> np.ndarray:
  """A `gguf.ReaderTensor` as a float32 array in [rows, columns] (torch Linear) layout."""
  values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
  # F32 tensors come back as views of the read-only file mapping; copy those so the checkpoint
  # owns its arrays and the file can be closed or replaced.
  return values if values.flags.writeable else values.copy()


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's convert_hf_to_gguf `permute` of a Q or K projection's rows.

  Hugging Face RoPE rotates dimension i of a head together with dimension i + head_dim/2; the
  llama.cpp kernel rotates adjacent dimensions (2i, 2i+1). The converter therefore viewed each
  head's rows as (2, head_dim/2) and transposed them to (head_dim/2, 2), interleaving the halves.
  Viewing them as (head_dim/2, 2) and transposing back restores the Hugging Face order.
  `num_heads` is the number of query heads for Q and of KV heads for K.
  """
  rows, columns = weight.shape
  half_head = rows // num_heads // 2
  return np.ascontiguousarray(
    weight.reshape(num_heads, half_head, 2, columns).swapaxes(1, 2).reshape(rows, columns)
  )
