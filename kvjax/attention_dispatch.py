"""Chooses how decode attention over a cache segment is computed: Pallas kernel or jnp reference.

implementation:
  "auto"       the Pallas kernel of the current backend (on GPU what an empty kernel_config
               stands for, `quantized_decode_attention_gpu.measured_default_config` for
               quantized segments: on Hopper mostly Mosaic GPU kernels, else Triton; or what
               kernel_config names; Mosaic on TPU), the jnp reference on CPU;
  "pallas"     the current backend's kernel (ValueError on CPU: use "interpret");
  "reference"  the jnp reference;
  "interpret"  a kernel in Pallas interpret mode (runs on CPU; tests): the GPU kernel, or the
               TPU kernel with kernel_backend="tpu" (caches: `KernelSettings.kernel_backend`).
Where a kernel does not support a shape, the reference runs instead, with a one-time warning
(a Mosaic GPU kernel gives way to the Triton one, a Triton variant asked for by name to the one
that takes the shape, with such a warning too).
Every result is (out f32 [B, H, G, D], lse f32 [B, H, G]); a row with length 0 gives out 0 and
lse -inf, so segments merge with `merge_attention_partials`.
"""

import warnings
from typing import Any, Literal

import jax

from pallas_kernels import (
  decode_attention_gpu,
  decode_attention_tpu,
  gear_outlier_terms_tpu,
  quantized_decode_attention_gpu,
  quantized_decode_attention_tpu,
)
from pallas_kernels.decode_attention_reference import (
  check_decode_inputs,
  decode_attention_reference,
)
from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.quantized_decode_attention_reference import (
  check_quantized_inputs,
  quantized_decode_attention_reference,
)

Implementation = Literal["auto", "pallas", "reference", "interpret"]
IMPLEMENTATIONS = ("auto", "pallas", "reference", "interpret")
KERNEL_BACKENDS = ("gpu", "tpu")

# kernel_config keys the TPU kernels take (the GPU kernels' keys depend on their lowering:
# `decode_attention_gpu.CONFIG_KEYS`, `quantized_decode_attention_gpu.CONFIG_KEYS`).
TPU_CONFIG_KEYS = ("block_tokens", "num_splits")

_warned: set[str] = set()


def check_kernel_config(kernel_config: dict | None, *, quantized: bool, family: str) -> None:
  """ValueError naming kernel_config keys the chosen kernel does not take (family "gpu" or
  "tpu"; the reference takes any, since it ignores them)."""
  config = kernel_config or {}
  if family == "gpu":
    (quantized_decode_attention_gpu if quantized else decode_attention_gpu).check_config(config)
    return
  if family != "tpu":
    return
  unknown = sorted(set(config) - set(TPU_CONFIG_KEYS))
  if unknown:
    kind = "quantized" if quantized else "full-precision"
    raise ValueError(
      f"kernel_config keys {unknown} are not taken by the tpu {kind} kernel; allowed: "
      f"{', '.join(TPU_CONFIG_KEYS)}"
    )
  check_launch_settings(config)


def check_implementation(implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation={implementation!r} is not supported; allowed: {', '.join(IMPLEMENTATIONS)}"
    )


def _check_kernel_backend(kernel_backend: str | None) -> None:
  if kernel_backend is not None and kernel_backend not in KERNEL_BACKENDS:
    raise ValueError(
      f"kernel_backend={kernel_backend!r} is not supported; allowed: None, "
      f"{', '.join(KERNEL_BACKENDS)}"
    )


def choose_kernel_family(implementation: str, kernel_backend: str | None) -> tuple[str, bool]:
  """(kernel family "gpu" | "tpu" | "reference", interpret?) for this call; ValueError for an
  implementation this backend cannot run ("pallas" on CPU)."""
  check_implementation(implementation)
  _check_kernel_backend(kernel_backend)
  if implementation == "reference":
    return "reference", False
  if implementation == "interpret":
    return kernel_backend or "gpu", True
  platform = jax.default_backend()
  family = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform)
  if kernel_backend is not None and family is not None and kernel_backend != family:
    raise ValueError(
      f"kernel_backend={kernel_backend!r} cannot run compiled on the {platform!r} backend; "
      "use implementation='interpret' to run it on another backend"
    )
  if family is None:
    if implementation == "pallas":
      raise ValueError(
        f"implementation='pallas' needs a GPU or TPU backend, this is {platform!r}; allowed "
        "here: 'auto', 'reference', 'interpret'"
      )
    return "reference", False
  return family, False


def _warn_fallback_once(kernel: str, reason: str, instead: str = "the jnp reference") -> None:
  key = f"{kernel}: {reason}"
  if key not in _warned:
    _warned.add(key)
    warnings.warn(
      f"{kernel} does not support {reason}; using {instead} instead",
      RuntimeWarning,
      stacklevel=3,
    )


def _kernel_name(family: str, kernel_config: dict | None) -> str:
  """The kernel named in fallback warnings ("gpu (triton)", "gpu (mosaic_gpu)", "tpu"), so a
  warning given for one lowering does not silence the same reason for the other."""
  if family != "gpu":
    return family
  return f"gpu ({(kernel_config or {}).get('lowering', 'triton')})"


def decode_attention(
  queries: jax.Array,  # [batch, kv_heads, group, head_dim]
  keys: jax.Array,  # [batch, kv_heads, tokens, head_dim]
  values: jax.Array,
  lengths: jax.Array,  # int32 [batch]
  *,
  sm_scale: float,
  implementation: Implementation = "auto",
  kernel_backend: str | None = None,
  kernel_config: dict[str, Any] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of one query position over the valid slots of a full-precision segment.

  kernel_config: optional kernel settings (block_tokens, num_splits; on GPU num_stages, and
  "lowering": "triton" (default; also num_warps) or "mosaic_gpu", see
  `pallas_kernels.decode_attention_gpu`).
  """
  family, interpret = choose_kernel_family(implementation, kernel_backend)
  check_kernel_config(kernel_config, quantized=False, family=family)
  check_decode_inputs(queries, keys, values, lengths)
  if 0 in keys.shape[:3]:
    # No rows, heads or slots: nothing to read (out 0 and lse -inf where there are rows).
    family = "reference"
  if family != "reference":
    reason = (
      decode_attention_gpu.unsupported_reason(queries, keys, kernel_config or {})
      if family == "gpu"
      else decode_attention_tpu.unsupported_reason(queries, keys, values)
    )
    if reason is None:
      kernel = (
        decode_attention_gpu.decode_attention_gpu
        if family == "gpu"
        else decode_attention_tpu.decode_attention_tpu
      )
      return kernel(
        queries,
        keys,
        values,
        lengths,
        sm_scale=sm_scale,
        interpret=interpret,
        **(kernel_config or {}),
      )
    _warn_fallback_once(
      f"the {_kernel_name(family, kernel_config)} decode-attention kernel", reason
    )
  return decode_attention_reference(queries, keys, values, lengths, sm_scale=sm_scale)


def quantized_decode_attention(
  queries: jax.Array,  # [B, H, G, D]
  k_codes: jax.Array,  # uint32 [B, H, T, D*bits/32]
  k_scale: jax.Array,  # [B, H, T/group_size, D]
  k_min: jax.Array,
  v_codes: jax.Array,  # uint32 [B, H, T, D*bits/32]
  v_scale: jax.Array,  # [B, H, T, D/group_size]
  v_min: jax.Array,
  lengths: jax.Array,  # int32 [B]
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  lowrank=None,
  outliers=None,
  block: int = 64,
  implementation: Implementation = "auto",
  kernel_backend: str | None = None,
  kernel_config: dict[str, Any] | None = None,
  outlier_count: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of one query position over a KIVI/GEAR quantized segment (fused dequantize).

  `outlier_count`: the outliers a GEAR block holds in the first slots of its [s] rows, the rest
  padding (zeros: `GearCodec.outlier_slots`, `gear_outlier_slots`); the TPU kernel does not read
  the padding, the other paths are given the outliers without it. None: every slot.

  Storage layout: see `pallas_kernels.quantized_decode_attention_reference`. Configuration
  errors raise ValueError before anything is traced. On GPU (and in interpret mode) an empty
  `kernel_config` runs the measured default, `quantized_decode_attention_gpu.
  measured_default_config`: on Hopper, for 1 to 8 query heads per KV head, the "warp" Mosaic
  GPU variant with its v59 settings where it takes the segment, else the folded Mosaic GPU
  kernel with its v34 settings where that does; folded Triton otherwise (with stack copies for
  one head). A non-empty one is taken as given. It may pick the Triton
  kernel's variant: {"variant": "folded" (default) | "joined" | "reshape" | "planar"} and, for
  "folded", {"prefetch": True (default) | False, "code_operand": "subnormal" (default for bf16
  2- and 4-bit codes) | "offset", "channel_parts": 1 (default) | 2 | 4, "gear_terms": "xla"
  (default) | "kernel", "stack_copies": False (default) | True} (see
  `pallas_kernels.quantized_decode_attention_triton`); or
  {"lowering": "mosaic_gpu"} (also "variant": "dequantize" (default) | "folded" | "warp" (both
  products per warp by mma.sync: KIVI 2/4-bit, head_dim 64 / 128, group size 32, up to 8 query heads
  per KV head; block_tokens 128, num_splits, num_stages, key_products, key_bias_source,
  split_merge, "copy_issuer": "first_warp" (default) | "slot_owner", "ring_release": "barrier"
  (default) | "per_warp", "query_loads": "per_block" (default) | "once", "value_ring_layout":
  "rows" (default) | "swizzled", "statistic_loads": "per_token" (default) | "matrix_loads"),
  block_tokens,
  num_splits, num_stages, and for "folded" "key_operand": "shared_memory" (default) |
  "registers", "operand_order": "channel" (default) | "word", "approx_math": False (default) |
  True, "copy_issuer": "warpgroup" (default) | "first_warp" | "spread", "value_accumulator":
  "fresh" (default) | "carried", "value_stats": "pairs" (default) | "separate", "row_max":
  "exchange" (default) | "bound", "key_products": "einsum" (default) | "reduction",
  "value_operand": "shared_memory" (default) | "registers" | "matrix_loads" (register codes by
  transposing matrix loads, head_dim 64 or 128), "key_bias_source": "xla" (default) |
  "kernel", "value_stat_loads": "all_groups" (default) | "own_slot", "blocks_per_copy": 1
  (default) | 2 | 4, "token_order": "natural" (default) | "spread" (with "value_operand":
  "registers"), "partial_slots": "every" (default) | "own", "key_stack_timing": "own_block"
  (default) | "block_ahead" (with "row_max": "bound" and both code operands from registers),
  "copy_issue_point": "slot_start" (default) | "value_product", "value_product_columns":
  "all_tiles" (default) | "own_tiles" (with the value product's rows in channel order),
  "warpgroups_per_program": 1 (default) to 8 (each warpgroup its own split; launched that wide,
  ptxas fits 65536 / (128 x it) registers per thread), "split_merge": "xla" (default) |
  "triton"; KIVI segments, others run the Triton kernel with a
  warning; see `pallas_kernels.quantized_decode_attention_gpu`).
  """
  family, interpret = choose_kernel_family(implementation, kernel_backend)
  check_kernel_config(kernel_config, quantized=True, family=family)
  check_quantized_inputs(
    queries,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    lengths,
    bits=bits,
    group_size=group_size,
    lowrank=lowrank,
    outliers=outliers,
    block=block,
  )
  outlier_count = quantized_decode_attention_tpu.check_outlier_count(outlier_count, outliers)
  padded = outliers is not None and outlier_count < outliers[0].shape[-1]
  # Only the TPU kernel takes the padded slots (and skips them); the others get them cut off.
  common = dict(
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    lowrank=lowrank,
    outliers=tuple(array[..., :outlier_count] for array in outliers) if padded else outliers,
    block=block,
  )
  arrays = (queries, k_codes, k_scale, k_min, v_codes, v_scale, v_min, lengths)
  if 0 in k_codes.shape[:3]:
    # No rows, heads or slots: nothing to read (out 0 and lse -inf where there are rows).
    family = "reference"
  if family != "reference":
    module = quantized_decode_attention_gpu if family == "gpu" else quantized_decode_attention_tpu
    segment = dict(
      bits=bits, group_size=group_size, lowrank=lowrank, outliers=common["outliers"], block=block
    )
    reason = module.unsupported_reason(queries, k_codes, k_scale, v_scale, **segment)
    if reason is None:
      if family == "gpu":
        fallback = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
          queries, k_codes, k_scale, v_scale, config=kernel_config or {}, **segment
        )
        if fallback is not None:
          _warn_fallback_once(
            "the Mosaic GPU quantized decode-attention kernel",
            fallback,
            instead="the Triton kernel with its default settings",
          )
        variant = quantized_decode_attention_gpu.triton_variant_fallback(
          queries, config=kernel_config or {}, **segment
        )
        if variant is not None:
          asked, runs, why = variant
          _warn_fallback_once(
            f"the Triton quantized decode-attention kernel's {asked} variant",
            why,
            instead=f"its {runs} variant",
          )
      if family == "gpu":
        kernel, taken = quantized_decode_attention_gpu.quantized_decode_attention_gpu, common
      else:  # the padded slots, which it skips
        kernel = quantized_decode_attention_tpu.quantized_decode_attention_tpu
        taken = dict(common, outliers=outliers, outlier_count=outlier_count if padded else None)
      return kernel(*arrays, interpret=interpret, **taken, **(kernel_config or {}))
    _warn_fallback_once(
      f"the {_kernel_name(family, kernel_config)} quantized decode-attention kernel", reason
    )
  return quantized_decode_attention_reference(*arrays, **common)


def full_precision_cache_granule(
  implementation: Implementation, head_dim: int, kernel_backend: str | None = None
) -> int:
  """Tokens a full-precision cache's capacity is rounded up to a multiple of, so that this
  call's kernel reads it in a TPU's default layout (`decode_attention_tpu.cache_token_granule`:
  the compiled TPU kernel), or 1 (the GPU kernels, the reference, interpret mode)."""
  family, interpret = choose_kernel_family(implementation, kernel_backend)
  if family != "tpu" or interpret:
    return 1
  return decode_attention_tpu.cache_token_granule(head_dim)


def quantized_segment_granule(
  implementation: Implementation,
  head_dim: int,
  group_size: int,
  stats_dtype,
  kernel_backend: str | None = None,
  outlier_block: int | None = None,
) -> int:
  """Tokens a quantized segment's capacity is rounded up to a multiple of, so that this call's
  kernel reads it in place and copies its last block itself
  (`quantized_decode_attention_tpu.segment_token_granule`: the compiled TPU kernel), or 1 (the
  GPU kernels, the reference, interpret mode). `outlier_block`: tokens a GEAR block, where the
  segment holds GEAR's outliers."""
  if quantized_segment_layouts(implementation, head_dim, kernel_backend) is None:
    return 1
  return quantized_decode_attention_tpu.segment_token_granule(
    head_dim, group_size, stats_dtype, outlier_block
  )


def gear_outlier_slots(
  implementation: Implementation,
  head_dim: int,
  count: int,
  kernel_backend: str | None = None,
) -> int:
  """Entries a GEAR block stores for its `count` outliers (of K, and of V), so that this call's
  kernel reads them in place: whole lane tiles where the compiled TPU kernel reads them
  (`gear_outlier_terms_tpu.stored_outlier_slots`: the rest zeros), else `count`."""
  if not count or quantized_segment_layouts(implementation, head_dim, kernel_backend) is None:
    return count
  return gear_outlier_terms_tpu.stored_outlier_slots(count)


def quantized_segment_layouts(
  implementation: Implementation, head_dim: int, kernel_backend: str | None = None
) -> dict[str, tuple[int, ...]] | None:
  """The layouts a quantized segment's arrays should keep so that this call's kernel and GEAR's
  terms read them in place (`quantized_decode_attention_tpu.segment_layouts`,
  `gear_outlier_terms_tpu.OUTLIER_LAYOUT`: the compiled TPU kernel), or None where any layout
  XLA picks is read in place (the GPU kernels and the reference take the default row-major
  layout; interpret mode runs on the CPU)."""
  family, interpret = choose_kernel_family(implementation, kernel_backend)
  if family != "tpu" or interpret:
    return None
  return dict(
    quantized_decode_attention_tpu.segment_layouts(head_dim),
    outliers=gear_outlier_terms_tpu.OUTLIER_LAYOUT,
  )
