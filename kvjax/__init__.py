"""kvjax: KV-cache compression for decoder LLMs in JAX, with Pallas decode kernels.

    import kvjax
    method = kvjax.parse_method_spec("pyramidkv:budget=256+kivi:bits=4")
    result = kvjax.generate(decoder, params, prompts, max_new_tokens=64, cache_method=method)

`decoder` is anything implementing `kvjax.CachedDecoder` (the bundled Flax models in `models`
do: `models.loading.load_model("smollm2-135m")`).
"""

from kvjax.cache_protocol import (
  CacheMethod,
  LayerCache,
  ModelCacheShape,
  allocate_model_cache,
  append_and_attend,
  model_cache_nbytes,
)
from kvjax.cache_room import check_room
from kvjax.chunked_prefill import CHUNKED_PREFILL_METHODS, prefill_in_chunks
from kvjax.compressed_context import (
  CompressedContext,
  compress_context,
  context_template,
  continue_context,
  repeat_context,
  share_context,
)
from kvjax.context_checkpoint import restore_context, save_context
from kvjax.decoder_protocol import CachedDecoder
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.generate import GenerateResult, decode, generate, prefill
from kvjax.kernel_settings import KernelSettings
from kvjax.layer_runs import StackedLayerCaches, flatten_layer_caches, run_layers
from kvjax.method_registry import METHODS
from kvjax.method_spec import describe_method, parse_method_spec
from kvjax.sampling import SamplingConfig
from kvjax.sliding_window_cache import SlidingWindowLayerCache
from kvjax.teacher_forcing import teacher_force

__all__ = [
  "CHUNKED_PREFILL_METHODS",
  "CacheMethod",
  "CachedDecoder",
  "CompressedContext",
  "DenseLayerCache",
  "FullCache",
  "GenerateResult",
  "KernelSettings",
  "LayerCache",
  "METHODS",
  "ModelCacheShape",
  "SamplingConfig",
  "SlidingWindowLayerCache",
  "StackedLayerCaches",
  "allocate_model_cache",
  "append_and_attend",
  "check_room",
  "compress_context",
  "context_template",
  "continue_context",
  "repeat_context",
  "decode",
  "describe_method",
  "flatten_layer_caches",
  "generate",
  "model_cache_nbytes",
  "parse_method_spec",
  "prefill",
  "prefill_in_chunks",
  "restore_context",
  "run_layers",
  "save_context",
  "share_context",
  "teacher_force",
]
