"""Imports every cache method module so each registers its spec name."""

from kvjax import (  # noqa: F401
  dense_cache,  # noqa: F401
  duo_attention,  # noqa: F401
  gear_cache,
  h2o,  # noqa: F401
  h2o_decode,  # noqa: F401
  kivi_cache,
  pyramidkv,  # noqa: F401
  razor_attention,  # noqa: F401
  snapkv,  # noqa: F401
  streaming_llm,  # noqa: F401
)
