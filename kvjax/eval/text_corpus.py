"""Real English text available offline: CPython's own documentation topics, or a user's file."""

import os


def pydoc_topics_text() -> str:
  """CPython's `pydoc_data/topics.py` prose (~465k characters), joined in a fixed order."""
  from pydoc_data.topics import topics

  return "\n\n".join(topics[name] for name in sorted(topics))


def load_text(path: str | os.PathLike | None, *, name: str = "--text") -> str:
  """`path` as UTF-8 text, or the pydoc topics when `path` is None; errors name the option
  `name` the path came from."""
  if path is None:
    return pydoc_topics_text()
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as error:
    raise ValueError(f"{name} {path}: cannot read as UTF-8 text ({error})") from error
  if not text.strip():
    raise ValueError(f"{name} {path}: the file is empty")
  return text
