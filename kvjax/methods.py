"""Imports every cache method module so each registers its spec name."""

from kvjax import dense_cache  # noqa: F401
from kvjax import gear_cache, kivi_cache  # noqa: F401
from kvjax import h2o  # noqa: F401
from kvjax import pyramidkv  # noqa: F401
from kvjax import razor_attention  # noqa: F401
from kvjax import snapkv  # noqa: F401
from kvjax import streaming_llm  # noqa: F401
