"""Decoder configuration for the Llama family and Mistral, from Hugging Face or GGUF metadata."""

import dataclasses
import json
import math
import numbers
import os

from kvjax.cache_protocol import check_float_dtype
from kvjax.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# What transformers assumes for keys a config.json leaves out (LlamaConfig, MistralConfig), so a
# sparse config describes the same model here as there. `sliding_window` is read only for
# Mistral: Llama's config class has no such field and transformers ignores one written there.
_HF_DEFAULTS = {
  "llama": {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
  },
  "mistral": {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
    "num_key_value_heads": 8,
    "bos_token_id": 1,
    "eos_token_id": 2,
  },
}

_POSITIVE_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "max_position_embeddings",
)


def _is_positive_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = False
  sliding_window: int | None = None
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  model_type: str = "llama"

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"model_type={self.model_type!r} is not supported; "
        f"allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
      )
    for name in _POSITIVE_FIELDS:
      value = getattr(self, name)
      if not _is_positive_int(value):
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if self.sliding_window is not None and not _is_positive_int(self.sliding_window):
      raise ValueError(
        f"sliding_window={self.sliding_window!r} must be None (full attention) or an integer >= 1"
      )
    finite = lambda value: (
      isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    )
    if not (finite(self.rope_theta) and self.rope_theta > 0):
      raise ValueError(f"rope_theta={self.rope_theta!r} must be a finite number > 0")
    # An infinite epsilon would zero every normalised hidden state.
    if not (finite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
      raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be a finite number >= 0")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  @property
  def query_group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @classmethod
  def from_hf_dict(cls, config: dict) -> "DecoderConfig":
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"model_type={model_type!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
      )
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
      # A string "false" would read as true (and a tied model would skip a stored lm_head).
      if config.get(flag) is not None and not isinstance(config[flag], bool):
        raise ValueError(f"{flag}={config[flag]!r} must be true or false (a JSON boolean)")
    for flag in ("attention_bias", "mlp_bias"):
      if config.get(flag):
        raise ValueError(f"{flag}=True is not supported (Llama/Mistral checkpoints have no biases)")
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
      raise ValueError(f"hidden_act={hidden_act!r} is not supported; allowed: silu")
    num_heads = config["num_attention_heads"]
    if not _is_positive_int(num_heads):
      raise ValueError(f"num_attention_heads={num_heads!r} must be a positive integer")
    # Only an absent (or null) head_dim is derived, as transformers does: 0 is refused below.
    head_dim = config.get("head_dim")
    if head_dim is None:
      head_dim = config["hidden_size"] // num_heads
    defaults = _HF_DEFAULTS[model_type]
    # An absent id takes the config class's default; an explicit null means none.
    eos = config.get("eos_token_id", defaults["eos_token_id"])
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    vocab_size = config.get("vocab_size")
    bos = config.get("bos_token_id", defaults["bos_token_id"])
    for key, ids in (("eos_token_id", eos_ids), ("bos_token_id", () if bos is None else (bos,))):
      for token in ids:
        integral = isinstance(token, numbers.Integral) and not isinstance(token, bool)
        known_vocabulary = isinstance(vocab_size, numbers.Integral)
        if not integral or not (known_vocabulary and 0 <= token < vocab_size):
          raise ValueError(
            f"{key}={token!r} must be an int token id in [0, vocab_size={vocab_size!r})"
          )
    sliding_window = None
    if model_type == "mistral":
      sliding_window = config.get("sliding_window", defaults["sliding_window"])
    # As the config classes read it: absent, Mistral's default of 8 (Llama's: every head);
    # null, one KV head per query head.
    num_kv_heads = config.get("num_key_value_heads", defaults.get("num_key_value_heads", num_heads))
    if num_kv_heads is None:
      num_kv_heads = num_heads
    # transformers >= 5 writes `rope_parameters` (theta and scaling together); 4.x wrote
    # `rope_theta` and `rope_scaling` separately.
    rope_parameters = config.get("rope_parameters") or {}
    rope_theta = rope_parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_scaling = config.get("rope_scaling") or (rope_parameters or None)
    return cls(
      vocab_size=config["vocab_size"],
      hidden_size=config["hidden_size"],
      intermediate_size=config["intermediate_size"],
      num_layers=config["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      rms_norm_eps=config.get("rms_norm_eps", defaults["rms_norm_eps"]),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling_from_hf(rope_scaling),
      tie_word_embeddings=config.get("tie_word_embeddings", False),
      sliding_window=sliding_window,
      max_position_embeddings=config.get(
        "max_position_embeddings", defaults["max_position_embeddings"]
      ),
      bos_token_id=bos,
      eos_token_ids=eos_ids,
      model_type=model_type,
    )

  @classmethod
  def from_hf_json(cls, path: str | os.PathLike) -> "DecoderConfig":
    with open(path) as f:
      return cls.from_hf_dict(json.load(f))


def rope_scaling_from_hf(rope_scaling: dict | None) -> RopeScaling | None:
  if not rope_scaling:
    return None
  rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"rope_scaling type {rope_type!r} is not supported; "
      f"allowed: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
  if rope_type == "default":
    return None
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  absent = [key for key in keys if rope_scaling.get(key) is None]
  if absent:
    raise ValueError(f"rope_scaling (llama3) needs {', '.join(map(repr, absent))}")
  scaling = RopeScaling(
    factor=float(rope_scaling["factor"]),
    low_freq_factor=float(rope_scaling["low_freq_factor"]),
    high_freq_factor=float(rope_scaling["high_freq_factor"]),
    original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
  )
  # The checks transformers makes for llama3 scaling; other values give infinite frequencies.
  if not scaling.factor >= 1:
    raise ValueError(f"rope_scaling (llama3) factor={scaling.factor} must be >= 1")
  if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
    raise ValueError(
      f"rope_scaling (llama3) needs 0 < low_freq_factor < high_freq_factor; got "
      f"low_freq_factor={scaling.low_freq_factor}, high_freq_factor={scaling.high_freq_factor}"
    )
  if scaling.original_max_position_embeddings < 1:
    raise ValueError(
      "rope_scaling (llama3) original_max_position_embeddings="
      f"{scaling.original_max_position_embeddings} must be >= 1"
    )
  return scaling


def check_param_dtype(dtype) -> None:
  """ValueError unless `dtype` is bfloat16, float16 or float32 (weights are floating point;
  float64 would be cut to float32 by JAX's default settings without saying so)."""
  check_float_dtype(dtype, name="dtype")
