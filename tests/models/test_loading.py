"""load_model: one call from a name or path to decoder, parameters and tokenizer."""

import pathlib

import pytest

import models.loading
from models.checkpoint_errors import CheckpointError
from models.loading import load_model
from tests.models.test_gguf_checkpoint import tiny_hf_tensors, write_tiny_gguf

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"


@pytest.mark.parametrize("source", ["hf_without_tokenizer_json", "gguf_sentencepiece"])
def test_an_unusable_tokenizer_is_refused_before_the_weights_are_read(
  source, tmp_path, monkeypatch
):
  """A tokenizer kvjax cannot build is refused before the checkpoint is read and dequantized to
  float32 (minutes and tens of GB for a 7B GGUF, whose SentencePiece vocabulary is then refused
  anyway)."""
  if source == "gguf_sentencepiece":
    path = write_tiny_gguf(
      tmp_path / "tiny.gguf", tiny_hf_tensors(), metadata={"tokenizer.ggml.model": "llama"}
    )
    message = "GGUF tokenizer model 'llama' is not supported"
  else:
    path, message = FIXTURES / "tiny_llama", "tokenizer.json: file not found"
  monkeypatch.setattr(
    models.loading, "read_checkpoint", lambda *a, **k: pytest.fail("checkpoint read first")
  )
  with pytest.raises(CheckpointError, match=message):
    load_model(str(path))
