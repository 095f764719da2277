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


def read_hf_checkpoint(directory: str | pathlib.Path) -> Checkpoint:
  """The Llama/Mistral checkpoint in a Hugging Face directory, as float32 tensors by HF name.

  Only the tensors the config calls for are read, so a stored copy of a tied `lm_head.weight` or
  a rotary `inv_freq` buffer is ignored rather than loaded.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise CheckpointError(f"{directory}: no such checkpoint directory")
  config = hf_config(read_json_file(directory / CONFIG_FILE))
  decoder = decoder_config(config, directory / CONFIG_FILE)

  stored = safetensors_files(directory)
  wanted_by_file: dict[pathlib.Path, list[str]] = {}
  for name in expected_tensor_shapes(decoder):
    if name in stored:
      wanted_by_file.setdefault(stored[name], []).append(name)
  tensors = {}
  for path, names in wanted_by_file.items():
    tensors |= read_safetensors(path, names)
  check_tensors(decoder, tensors, directory)
  return Checkpoint(config=config, tensors=tensors, source=directory)


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
  rope_parameters = config.pop("rope_parameters", None) or {}
  config.setdefault("rope_theta", rope_parameters.get("rope_theta", 10000.0))
  scaling = config.get("rope_scaling") or {
    key: value for key, value in rope_parameters.items() if key != "rope_theta"
  }
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  config["rope_scaling"] = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
  return config


def safetensors_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """The safetensors file holding each stored tensor, from the shard index or the single file."""
  index_path = directory / INDEX_FILE
  if index_path.is_file():
    weight_map = read_json_file(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_path}: has no 'weight_map' object naming each tensor's shard")
    files = {name: directory / shard for name, shard in weight_map.items()}
    absent = sorted({str(path) for path in files.values() if not path.is_file()})
    if absent:
      raise CheckpointError(f"{index_path}: lists shards that do not exist: {', '.join(absent)}")
    return files

  single_path = directory / SINGLE_FILE
  if single_path.is_file():
    try:
      with safe_open(single_path, framework="numpy") as file:
        return {name: single_path for name in file.keys()}
    except (SafetensorError, OSError) as error:
      raise CheckpointError(f"{single_path}: not a readable safetensors file: {error}") from error

  raise CheckpointError(
    f"{directory}: found neither {SINGLE_FILE} nor {INDEX_FILE}; kvjax reads weights only from "
    "safetensors (pytorch_model.bin is not supported)"
  )


def read_safetensors(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
  """Tensors `names` from safetensors file `path`, converted to float32."""
  try:
    with safe_open(path, framework="numpy") as file:
      stored = set(file.keys())
      absent = [name for name in names if name not in stored]
      if absent:
        raise CheckpointError(
          f"{path}: the shard index assigns {describe_names(absent)} here, but the file lacks them"
        )
      return {name: file.get_tensor(name).astype(np.float32) for name in names}
  except (SafetensorError, OSError, TypeError) as error:
    raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from error
