"""Reading a Hugging Face checkpoint directory (config.json + safetensors) as float32 tensors."""

import json
import pathlib

# Imported for its side effect: it registers bfloat16 (and the float8 types) with numpy, which
# safetensors' numpy API needs to return the bf16 tensors most Hugging Face checkpoints store.
import ml_dtypes  # noqa: F401
import numpy as np
from safetensors import SafetensorError, safe_open

from models.checkpoint import (
  Checkpoint,
  check_tensors,
  decoder_config,
  describe_names,
  expected_tensor_shapes,
)
from models.checkpoint_errors import CheckpointError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' names of the dtypes read (all converted to float32).
SAFETENSORS_DTYPES = ("F32", "F16", "BF16")


def read_hf_checkpoint(directory: str | pathlib.Path) -> Checkpoint:
  """The Llama/Mistral checkpoint in a Hugging Face directory, as float32 tensors by HF name.

  Only the tensors the config calls for are read. A stored copy of a tied `lm_head.weight` and
  rotary `inv_freq` buffers are skipped; any other stored tensor (a bias the config does not
  declare, an adapter) is refused, since the model would run without it.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise CheckpointError(f"{directory}: no such checkpoint directory")
  raw_config = read_json_file(directory / CONFIG_FILE)
  quantization = raw_config.get("quantization_config")
  if quantization:
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    raise CheckpointError(
      f"{directory / CONFIG_FILE}: declares quantization_config (quant_method={method!r}); kvjax "
      "reads only unquantized checkpoints (float32, float16 or bfloat16 safetensors)"
    )
  try:
    config = hf_config(raw_config)
  except ValueError as error:
    raise CheckpointError(f"{directory / CONFIG_FILE}: {error}") from None
  decoder = decoder_config(config, directory / CONFIG_FILE)

  stored = safetensors_files(directory)
  expected = expected_tensor_shapes(decoder)
  unused = [name for name in stored if name not in expected and not _is_redundant(name)]
  if unused:
    raise CheckpointError(
      f"{directory}: stored tensors {describe_names(sorted(unused))} have no place in a "
      f"{decoder.model_type} decoder with this config (biases, extra norms or adapters are not "
      "supported)"
    )
  wanted_by_file: dict[pathlib.Path, list[str]] = {}
  for name in expected:
    if name in stored:
      wanted_by_file.setdefault(stored[name], []).append(name)
  tensors = {}
  for path, names in wanted_by_file.items():
    tensors |= read_safetensors(path, names)
  check_tensors(decoder, tensors, directory)
  return Checkpoint(config=config, tensors=tensors, source=directory)


def _is_redundant(name: str) -> bool:
  """A stored tensor the model rebuilds or shares rather than reads: the tied LM head (the
  embedding matrix, used when tie_word_embeddings is set) and RoPE's inverse frequencies."""
  return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


def read_json_file(path: pathlib.Path) -> dict:
  """The JSON object in `path`, or a CheckpointError saying it is missing or malformed."""
  if not path.is_file():
    raise CheckpointError(f"{path}: file not found")
  try:
    with open(path, encoding="utf-8") as file:
      value = json.load(file)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise CheckpointError(f"{path}: not a readable JSON file: {error}") from error
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
  return value


def hf_config(raw: dict) -> dict:
  """config.json with RoPE settings in the legacy top-level keys `DecoderConfig` reads.

  transformers >= 5 writes `rope_parameters` (`rope_theta` plus the scaling keys in one dict)
  where older versions wrote `rope_theta` and `rope_scaling`; both spellings are accepted.
  """
  config = dict(raw)
  for key in ("rope_parameters", "rope_scaling"):
    if config.get(key) is not None and not isinstance(config[key], dict):
      raise ValueError(f"{key} must be an object (or null), got {config[key]!r}")
  rope_parameters = config.pop("rope_parameters", None) or {}
  # transformers 5 takes the theta inside rope_parameters over a top-level rope_theta.
  if "rope_theta" in rope_parameters:
    config["rope_theta"] = rope_parameters["rope_theta"]
  config.setdefault("rope_theta", 10000.0)
  scaling = config.get("rope_scaling") or {
    key: value for key, value in rope_parameters.items() if key != "rope_theta"
  }
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  config["rope_scaling"] = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
  return config


def safetensors_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """The safetensors file holding each stored tensor, from the single file or the shard index."""
  # The single file first, as transformers reads a directory holding both (a stale index beside
  # it would otherwise load other weights than transformers loads).
  single_path = directory / SINGLE_FILE
  if single_path.is_file():
    try:
      with safe_open(single_path, framework="numpy") as file:
        return {name: single_path for name in file.keys()}
    except (SafetensorError, OSError) as error:
      raise CheckpointError(f"{single_path}: not a readable safetensors file: {error}") from error

  index_path = directory / INDEX_FILE
  if index_path.is_file():
    weight_map = read_json_file(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_path}: has no 'weight_map' object naming each tensor's shard")
    bad = next(((n, s) for n, s in weight_map.items() if not isinstance(s, str) or not s), None)
    if bad is not None:
      raise CheckpointError(
        f"{index_path}: weight_map[{bad[0]!r}]={bad[1]!r} must be a shard's file name"
      )
    files = {name: directory / shard for name, shard in weight_map.items()}
    absent = sorted({str(path) for path in files.values() if not path.is_file()})
    if absent:
      raise CheckpointError(f"{index_path}: lists shards that do not exist: {', '.join(absent)}")
    return files

  raise CheckpointError(
    f"{directory}: found neither {SINGLE_FILE} nor {INDEX_FILE}; kvjax reads weights only from "
    "safetensors (pytorch_model.bin is not supported)"
  )


def read_safetensors(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """Tensors `names` from safetensors file `path`, converted to float32.

  Only floating-point tensors are read: integer or float8 ones are quantization codes whose
  scales live in other tensors, and casting them alone would load garbage weights.
  """
  try:
    with safe_open(path, framework="numpy") as file:
      stored = set(file.keys())
      absent = [name for name in names if name not in stored]
      if absent:
        raise CheckpointError(
          f"{path}: the shard index assigns {describe_names(absent)} here, but the file lacks them"
        )
      tensors = {}
      for name in names:
        stored_dtype = file.get_slice(name).get_dtype()
        if stored_dtype not in SAFETENSORS_DTYPES:
          raise CheckpointError(
            f"{path}: tensor {name!r} is stored as {stored_dtype}; kvjax reads only "
            f"{', '.join(SAFETENSORS_DTYPES)} weights (quantized checkpoints are not supported)"
          )
        tensors[name] = file.get_tensor(name).astype(np.float32)
      return tensors
  except (SafetensorError, OSError, TypeError, AttributeError, ValueError) as error:
    if isinstance(error, CheckpointError):
      raise
    raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from error
