"""Base of the layer "caches" that only observe a prompt's attention and store no K/V
(RazorAttention's head scoring, DuoAttention's gate training): they ride through a decoder's
prefill like a cache, and refuse to decode."""

from kvjax.cache_protocol import tree_nbytes


class PromptProbeLayerCache:
  """A subclass defines `ingest` (and, to change how the prompt attends, `prompt_attention`)."""

  def _refuse_decoding(self):
    raise ValueError(
      f"{type(self).__name__} only observes a prompt's attention and holds no K/V; it cannot "
      "decode (allocate a cache method's caches to generate)"
    )

  def append(self, keys, values):
    self._refuse_decoding()

  def attend(self, queries, *, sm_scale):
    self._refuse_decoding()

  @property
  def nbytes(self) -> int:
    return tree_nbytes(self)

  @property
  def stored_elements(self) -> int:
    return 0
