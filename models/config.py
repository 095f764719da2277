"""Decoder configuration for the Llama family and Mistral, from Hugging Face or GGUF metadata."""

import dataclasses
import json
import os

from kvjax.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


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
    for flag in ("attention_bias", "mlp_bias"):
      if config.get(flag):
        raise ValueError(f"{flag}=True is not supported (Llama/Mistral checkpoints have no biases)")
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
      raise ValueError(f"hidden_act={hidden_act!r} is not supported; allowed: silu")
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    sliding_window = config.get("sliding_window") if model_type == "mistral" else None
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
      num_kv_heads=config.get("num_key_value_heads") or num_heads,
      head_dim=head_dim,
      rms_norm_eps=config.get("rms_norm_eps", 1e-5),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling_from_hf(rope_scaling),
      tie_word_embeddings=config.get("tie_word_embeddings", False),
      sliding_window=sliding_window,
      max_position_embeddings=config.get("max_position_embeddings", 4096),
      bos_token_id=config.get("bos_token_id"),
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
  return RopeScaling(
    factor=float(rope_scaling["factor"]),
    low_freq_factor=float(rope_scaling["low_freq_factor"]),
    high_freq_factor=float(rope_scaling["high_freq_factor"]),
    original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
  )
