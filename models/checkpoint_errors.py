"""The error every checkpoint, tokenizer and model-name reader raises for input it cannot use."""


class CheckpointError(ValueError):
  """A model file or directory is missing, unreadable, or describes a model kvjax cannot load.

  The message names the file and the problem and, where there is a choice, the allowed values.
  It subclasses ValueError so callers that only know "bad input" can still catch it.
  """
