"""Hugging Face directory reading: config normalisation, single/sharded safetensors, errors."""

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.checkpoint import expected_tensor_shapes
from models.checkpoint_errors import CheckpointError
from models.config import DecoderConfig, RopeScaling
from models.hf_checkpoint import hf_config, read_hf_checkpoint

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"

TINY_CONFIG = {
  "model_type": "llama",
  "hidden_size": 16,
  "intermediate_size": 32,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 4,
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "vocab_size": 24,
  "max_position_embeddings": 64,
  "tie_word_embeddings": True,
  "bos_token_id": 1,
  "eos_token_id": 2,
}


def tiny_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  shapes = expected_tensor_shapes(DecoderConfig.from_hf_dict(config))
  return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_hf_dir(
  directory: pathlib.Path, config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1
) -> pathlib.Path:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(config))
  if shards == 1:
    save_file(tensors, directory / "model.safetensors")
    return directory
  names = sorted(tensors)
  weight_map = {}
  for shard in range(shards):
    filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
    part = {name: tensors[name] for name in names[shard::shards]}
    save_file(part, directory / filename)
    weight_map |= dict.fromkeys(part, filename)
  index = {"metadata": {}, "weight_map": weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))
  return directory


def assert_error_names(error: pytest.ExceptionInfo, path: pathlib.Path, *fragments: str) -> None:
  message = str(error.value)
  assert str(path) in message, message
  for fragment in fragments:
    assert fragment in message, message


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mistral"])
def test_reads_repository_fixtures(name):
  directory = FIXTURES / name
  checkpoint = read_hf_checkpoint(directory)
  stored = load_file(directory / "model.safetensors")
  config = DecoderConfig.from_hf_dict(checkpoint.config)
  assert checkpoint.source == directory
  assert set(checkpoint.tensors) == set(expected_tensor_shapes(config))
  for tensor_name, array in checkpoint.tensors.items():
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, stored[tensor_name].astype(np.float32))


def test_rope_parameters_become_legacy_keys():
  """transformers 5 writes `rope_parameters`; DecoderConfig reads rope_theta / rope_scaling."""
  config = DecoderConfig.from_hf_dict(read_hf_checkpoint(FIXTURES / "tiny_llama").config)
  assert config.rope_theta == 10000.0
  assert config.rope_scaling == RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
  )
  assert not config.tie_word_embeddings


def test_legacy_and_new_rope_spellings_agree(tmp_path):
  scaling = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
  }
  legacy = {**TINY_CONFIG, "rope_theta": 500000.0}
  legacy["rope_scaling"] = {"rope_type": "llama3", **scaling}
  new = {key: value for key, value in TINY_CONFIG.items() if key != "rope_theta"}
  new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
  tensors = tiny_tensors(TINY_CONFIG)
  read = lambda config, name: read_hf_checkpoint(write_hf_dir(tmp_path / name, config, tensors))
  legacy_config = read(legacy, "legacy").config
  new_config = read(new, "new").config
  assert legacy_config["rope_theta"] == new_config["rope_theta"] == 500000.0
  assert legacy_config["rope_scaling"] == new_config["rope_scaling"]
  assert "rope_parameters" not in new_config


def test_sharded_equals_single_file(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  single = read_hf_checkpoint(write_hf_dir(tmp_path / "single", TINY_CONFIG, tensors))
  sharded = read_hf_checkpoint(write_hf_dir(tmp_path / "sharded", TINY_CONFIG, tensors, shards=3))
  assert set(sharded.tensors) == set(single.tensors)
  for name, array in single.tensors.items():
    np.testing.assert_array_equal(sharded.tensors[name], array)


def test_a_single_file_beside_a_shard_index_is_read_as_transformers_reads_it(tmp_path):
  """Found by a review: the index came first, so a stale one loaded other weights."""
  import shutil

  tensors = tiny_tensors(TINY_CONFIG)
  directory = write_hf_dir(tmp_path / "both", TINY_CONFIG, tensors)
  stale = {name: array + 1.0 for name, array in tensors.items()}
  sharded = write_hf_dir(tmp_path / "stale", TINY_CONFIG, stale, shards=2)
  for path in sharded.glob("model*"):  # the stale shards and their index beside the file
    shutil.copy(path, directory / path.name)
  checkpoint = read_hf_checkpoint(directory)
  read = [name for name in tensors if name in checkpoint.tensors]
  assert len(read) > 5
  for name in read:
    np.testing.assert_array_equal(checkpoint.tensors[name], tensors[name])


def test_bf16_and_f16_become_float32(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  stored = {
    name: array.astype(ml_dtypes.bfloat16 if index % 2 else np.float16)
    for index, (name, array) in enumerate(sorted(tensors.items()))
  }
  checkpoint = read_hf_checkpoint(write_hf_dir(tmp_path / "half", TINY_CONFIG, stored))
  for name, array in stored.items():
    assert checkpoint.tensors[name].dtype == np.float32
    np.testing.assert_array_equal(checkpoint.tensors[name], array.astype(np.float32))


def test_tied_checkpoint_ignores_stored_lm_head(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  tensors["model.rotary_emb.inv_freq"] = np.ones(2, np.float32)
  checkpoint = read_hf_checkpoint(write_hf_dir(tmp_path / "tied", TINY_CONFIG, tensors))
  assert "lm_head.weight" not in checkpoint.tensors
  assert "model.rotary_emb.inv_freq" not in checkpoint.tensors


def test_missing_config(tmp_path):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG))
  (directory / "config.json").unlink()
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", "not found")


def test_malformed_config(tmp_path):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG))
  (directory / "config.json").write_text("{ not json")
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", "not a readable JSON file")


def test_missing_safetensors(tmp_path):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG))
  (directory / "model.safetensors").unlink()
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory, "model.safetensors", "model.safetensors.index.json")


def test_missing_shard(tmp_path):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG), shards=2)
  (directory / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "model.safetensors.index.json", "model-00002-of-00002")


@pytest.mark.parametrize("shard", [None, 1, ""])
def test_a_shard_index_naming_no_file_is_refused(tmp_path, shard):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG), shards=2)
  index_path = directory / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  name = sorted(index["weight_map"])[0]
  index["weight_map"][name] = shard  # a raw TypeError from the path join, before
  index_path.write_text(json.dumps(index))
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, index_path, f"weight_map[{name!r}]={shard!r} must be a shard's file")


def test_corrupt_safetensors(tmp_path):
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tiny_tensors(TINY_CONFIG))
  (directory / "model.safetensors").write_bytes(b"\x00" * 64)
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "model.safetensors", "not a readable safetensors file")


def test_missing_tensor(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  del tensors["model.layers.1.self_attn.v_proj.weight"]
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tensors)
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory, "missing", "model.layers.1.self_attn.v_proj.weight")


def test_shape_mismatch(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((4, 16), np.float32)
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tensors)
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(
    error, directory, "model.layers.0.self_attn.k_proj.weight", "(4, 16)", "(8, 16)"
  )


def test_unknown_model_type(tmp_path):
  config = {**TINY_CONFIG, "model_type": "gpt2"}
  directory = write_hf_dir(tmp_path / "model", config, tiny_tensors(TINY_CONFIG))
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", "'gpt2'", "llama, mistral")


def test_config_missing_a_dimension(tmp_path):
  config = {key: value for key, value in TINY_CONFIG.items() if key != "hidden_size"}
  directory = write_hf_dir(tmp_path / "model", config, tiny_tensors(TINY_CONFIG))
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", "'hidden_size'")


def test_not_a_directory(tmp_path):
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(tmp_path / "absent")
  assert_error_names(error, tmp_path / "absent", "no such checkpoint directory")


@pytest.mark.parametrize("method", ["bitsandbytes", "fp8"])
def test_quantized_checkpoint_is_refused(tmp_path, method):
  config = {**TINY_CONFIG, "quantization_config": {"quant_method": method}}
  directory = write_hf_dir(tmp_path / "model", config, tiny_tensors(TINY_CONFIG))
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", f"quant_method={method!r}", "unquantized")


@pytest.mark.parametrize("stored_dtype", [np.int8, ml_dtypes.float8_e4m3fn], ids=["I8", "F8_E4M3"])
def test_non_float_tensors_are_refused(tmp_path, stored_dtype):
  """Integer or float8 tensors are quantization codes: casting them alone gives garbage."""
  tensors = tiny_tensors(TINY_CONFIG)
  name = "model.layers.0.self_attn.q_proj.weight"
  tensors[name] = np.clip(tensors[name] * 20, -100, 100).astype(stored_dtype)
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tensors)
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "model.safetensors", repr(name), "F32, F16, BF16")


def test_stored_tensors_without_a_place_are_refused(tmp_path):
  tensors = tiny_tensors(TINY_CONFIG)
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(16, np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
  directory = write_hf_dir(tmp_path / "model", TINY_CONFIG, tensors)
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory, "'model.layers.0.self_attn.q_proj.bias'", "no place")
  assert "inv_freq" not in str(error.value)


def test_rope_theta_inside_rope_parameters_wins_as_in_transformers_5(tmp_path):
  """transformers 5 reads the theta in rope_parameters over a top-level rope_theta."""
  config = {**TINY_CONFIG, "rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0}}
  assert hf_config(config)["rope_theta"] == 10000.0


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_settings_that_are_not_objects_are_refused(tmp_path, key):
  config = {**TINY_CONFIG, key: "linear"}
  directory = write_hf_dir(tmp_path / "model", config, tiny_tensors(TINY_CONFIG))
  with pytest.raises(CheckpointError) as error:
    read_hf_checkpoint(directory)
  assert_error_names(error, directory / "config.json", f"{key} must be an object")
