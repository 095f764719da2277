"""DecoderConfig: reading Hugging Face config dicts (with transformers' defaults) and refusing
values that would give NaN logits or fail deep inside tracing."""

import dataclasses

import jax.numpy as jnp
import pytest

from models.config import DecoderConfig, check_param_dtype, rope_scaling_from_hf
from models.loading import load_model

HF_LLAMA = {
  "model_type": "llama",
  "vocab_size": 32,
  "hidden_size": 16,
  "intermediate_size": 32,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
}
VALID = DecoderConfig.from_hf_dict(HF_LLAMA)


@pytest.mark.parametrize(
  ("model_type", "expected"),
  [
    (
      "llama",
      dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        num_kv_heads=16,
        bos_token_id=1,
        eos_token_ids=(2,),
      ),
    ),
    (
      "mistral",
      dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        num_kv_heads=8,
        sliding_window=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
      ),
    ),
  ],
)
def test_missing_keys_take_transformers_defaults(model_type, expected):
  config = DecoderConfig.from_hf_dict(
    {**HF_LLAMA, "model_type": model_type, "hidden_size": 32, "num_attention_heads": 16}
  )
  for name, value in expected.items():
    assert getattr(config, name) == value, name


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_explicit_nulls_are_read_as_the_config_classes_read_them(model_type):
  """Found by a review: a null num_key_value_heads took Mistral's default of 8, where
  MistralConfig gives every query head its own; absent token ids took none, where the config
  classes give 1 and 2 (a null still means none)."""
  nulls = {"num_key_value_heads": None, "bos_token_id": None, "eos_token_id": None}
  config = DecoderConfig.from_hf_dict({**HF_LLAMA, "model_type": model_type, **nulls})
  assert config.num_kv_heads == HF_LLAMA["num_attention_heads"]
  assert config.bos_token_id is None and config.eos_token_ids == ()


def test_explicit_null_window_means_full_attention():
  mistral = {**HF_LLAMA, "model_type": "mistral", "num_key_value_heads": 2}
  config = DecoderConfig.from_hf_dict({**mistral, "sliding_window": None})
  assert config.sliding_window is None
  llama = DecoderConfig.from_hf_dict({**HF_LLAMA, "sliding_window": 8})
  assert llama.sliding_window is None  # transformers' Llama has no window


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("sliding_window", 0, "sliding_window=0 must be None"),
    ("sliding_window", -3, "sliding_window=-3 must be None"),
    ("rope_theta", 0.0, "rope_theta=0.0 must be a finite number > 0"),
    ("rope_theta", -1e4, "rope_theta=-10000.0 must be a finite number > 0"),
    ("rms_norm_eps", -1.0, "rms_norm_eps=-1.0 must be a finite number >= 0"),
    # An infinite epsilon zeroes every normalised hidden state.
    ("rms_norm_eps", float("inf"), "rms_norm_eps=inf must be a finite number >= 0"),
    ("rms_norm_eps", None, "rms_norm_eps=None must be a finite number >= 0"),
    ("rope_theta", None, "rope_theta=None must be a finite number > 0"),
    ("rope_theta", float("nan"), "rope_theta=nan must be a finite number > 0"),
    ("num_kv_heads", 0, "num_kv_heads=0 must be a positive integer"),
    ("num_layers", 0, "num_layers=0 must be a positive integer"),
    ("head_dim", 2.5, "head_dim=2.5 must be a positive integer"),
  ],
)
def test_invalid_values_are_refused_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("+", r"\+")):
    dataclasses.replace(VALID, **{field: value})


def test_zero_kv_heads_in_config_json_is_refused_not_replaced():
  with pytest.raises(ValueError, match="num_kv_heads=0"):
    DecoderConfig.from_hf_dict({**HF_LLAMA, "num_key_value_heads": 0})


LLAMA3 = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
  ("change", "message"),
  [
    ({"factor": 0.0}, "factor=0.0 must be >= 1"),
    ({"low_freq_factor": 4.0}, "0 < low_freq_factor < high_freq_factor"),
    ({"original_max_position_embeddings": None}, "needs 'original_max_position_embeddings'"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings=0 must be >= 1"),
  ],
)
def test_invalid_llama3_scaling_is_refused(change, message):
  with pytest.raises(ValueError, match=message):
    rope_scaling_from_hf({**LLAMA3, **change})


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, "float32"])
def test_float_param_dtypes_are_accepted(dtype):
  check_param_dtype(dtype)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, "float64", "half-ish"])
def test_other_param_dtypes_are_refused_before_loading(dtype):
  with pytest.raises(ValueError, match="dtype=.* is not supported; allowed: bfloat16, float16"):
    load_model("no-such-model-is-read", dtype=dtype)


@pytest.mark.parametrize(
  ("change", "message"),
  [
    # A string "false" reads as true: a tied model would skip the stored lm_head.
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
    ({"mlp_bias": "false"}, "mlp_bias='false' must be true or false"),
    ({"eos_token_id": "2"}, r"eos_token_id='2' must be an int token id in \[0, vocab_size=32\)"),
    ({"eos_token_id": [1, 99]}, r"eos_token_id=99 must be an int token id"),
    ({"bos_token_id": -1}, r"bos_token_id=-1 must be an int token id"),
    # Divided by before any check once; transformers derives head_dim only when it is null.
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a finite number"),
  ],
)
def test_config_values_of_the_wrong_type_or_range_are_refused(change, message):
  with pytest.raises(ValueError, match=message):
    DecoderConfig.from_hf_dict({**HF_LLAMA, **change})
