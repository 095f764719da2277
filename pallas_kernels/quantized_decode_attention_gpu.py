"""The one GPU entry point for decode attention over a quantized (KIVI / GEAR) segment: picks the
Pallas lowering. "triton" (its variants and settings are `quantized_decode_attention_triton`'s)
or "mosaic_gpu" (TMA ring and warpgroup MMA; KIVI segments only), in one of two variants:
"dequantize" (the default: K and V dequantized element by element and staged in bf16; measured
on an H100 and an H200, slower than either folded kernel) or "folded" (scales folded into stacked
queries and probabilities, codes staged by masking alone as subnormal bf16 operands;
`quantized_decode_attention_folded_mosaic_gpu`).

An empty kernel_config runs what was measured fastest (`measured_default_config`): on a Hopper
GPU (and in interpret mode, which checks what such a GPU runs) the folded Mosaic GPU kernel where
it takes the segment, for 2 to 8 query heads per KV head; otherwise the folded Triton kernel, with
stack copies for one head.

A segment the chosen Mosaic GPU kernel does not take (GEAR terms, head dims other than 64 / 128,
fewer than 8 code words per token, for "folded" also 8-bit codes and non-bf16 statistics, ...)
runs on the Triton kernel with its default settings: `mosaic_gpu_fallback_reason` says why, so the
caller can warn.
"""

from pallas_kernels import (
  _compat,
  quantized_decode_attention_folded_mosaic_gpu,
  quantized_decode_attention_mosaic_gpu,
  quantized_decode_attention_triton,
)
from pallas_kernels.launch_settings import check_launch_settings

LOWERINGS = ("triton", "mosaic_gpu")
# Mosaic GPU variant -> (its module, the name of its entry point there). The entry point is looked
# up when called, so that tests can wrap it.
MOSAIC_GPU_KERNELS = {
  "dequantize": (quantized_decode_attention_mosaic_gpu, "quantized_decode_attention_mosaic_gpu"),
  "folded": (quantized_decode_attention_folded_mosaic_gpu, "folded_decode_attention_mosaic_gpu"),
}
MOSAIC_GPU_VARIANTS = tuple(MOSAIC_GPU_KERNELS)
# kernel_config keys each lowering takes (besides "lowering").
CONFIG_KEYS = {
  "triton": (
    "variant",
    "block_tokens",
    "num_splits",
    "num_warps",
    "num_stages",
    "unroll",
    "prefetch",
    "code_operand",
    "channel_parts",
    "gear_terms",
    "stack_copies",
  ),
  "mosaic_gpu": ("variant", "block_tokens", "num_splits", "num_stages"),
}


def check_config(config: dict) -> str:
  """The config's lowering; ValueError naming a bad lowering or a key it does not take."""
  lowering = config.get("lowering", "triton")
  if lowering not in LOWERINGS:
    raise ValueError(f"lowering={lowering!r} is not supported; allowed: {', '.join(LOWERINGS)}")
  unknown = sorted(set(config) - {"lowering", *CONFIG_KEYS[lowering]})
  if unknown:
    raise ValueError(
      f"kernel_config keys {unknown} are not taken by the quantized kernel of "
      f"lowering={lowering!r}; allowed: {', '.join(('lowering',) + CONFIG_KEYS[lowering])}"
    )
  check_launch_settings(config)
  if lowering == "mosaic_gpu":
    _mosaic_gpu_kernel(config)
    quantized_decode_attention_mosaic_gpu.check_settings(**_mosaic_gpu_settings(config))
  return lowering


def _mosaic_gpu_kernel(config: dict):
  """(module, entry point name) of the config's Mosaic GPU variant; ValueError naming a bad one."""
  variant = config.get("variant", "dequantize")
  if variant not in MOSAIC_GPU_VARIANTS:
    raise ValueError(
      f"variant={variant!r} is not a Mosaic GPU quantized kernel; allowed: "
      f"{', '.join(MOSAIC_GPU_VARIANTS)}"
    )
  return MOSAIC_GPU_KERNELS[variant]


def _mosaic_gpu_settings(config: dict) -> dict:
  return {key: value for key, value in config.items() if key not in ("lowering", "variant")}


def unsupported_reason(queries, k_codes, k_scale, v_scale, **segment) -> str | None:
  """Why no GPU kernel can take this segment (None if one can): the Triton kernel, which every
  lowering falls back to, decides."""
  return quantized_decode_attention_triton.unsupported_reason(
    queries, k_codes, k_scale, v_scale, **segment
  )


def mosaic_gpu_fallback_reason(queries, k_codes, k_scale, v_scale, *, config: dict, **segment):
  """Why a config asking for the Mosaic GPU kernel runs the Triton kernel instead (None when it
  does not ask for it, or the Mosaic GPU kernel takes the segment)."""
  if check_config(config) != "mosaic_gpu":
    return None
  module, _ = _mosaic_gpu_kernel(config)
  return module.unsupported_reason(
    queries, k_codes, k_scale, v_scale, block_tokens=config.get("block_tokens"), **segment
  )


FOLDED_MOSAIC_GPU = {"lowering": "mosaic_gpu", "variant": "folded"}
MOSAIC_DEFAULT_MAX_GROUP = 8  # the largest query group timed (KERNEL_NOTES v29)


def measured_default_config(
  queries, k_codes, k_scale, v_scale, *, interpret: bool, **segment
) -> dict:
  """The kernel_config an empty one stands for. By KERNEL_NOTES v29 (H200, jax 0.11.2, KIVI-2
  with 32-token groups, head_dim 128, 8 rows x 8 KV heads; us per call, folded Triton -> folded
  Mosaic GPU): 8k 98.0 -> 92.6, 32k 254.1 -> 233.7 (the table; sweeps 242.9 / 257.7 -> 232.0 /
  234.5), 128k 882.3 -> 783.4, 32k with 8 heads per KV head 294.9 -> 238.3; KIVI-4 at 32k level
  (266.8, 267.1). With one head per KV head folded Triton with stack copies was faster (216.3 /
  219.3 against 231.7 folded Mosaic and 253.7 / 259.8 padded); at 2 heads (group size 32) and at
  4 heads with group size 64 the copies gained nothing. Timed were 1, 4 and 8 heads per KV head;
  2 were not timed on the Mosaic kernel, more than 8 (shared contexts fold rows into the query
  group) not at all, so those keep folded Triton's path. KIVI-4 was timed once (level), head_dim
  64 and other group sizes not at all.

  Both choices were measured on Hopper (compute capability 9.x) only, and the folded Mosaic GPU
  kernel issues wgmma, which exists there alone; elsewhere, and for segments it does not take
  (GEAR terms, f32 / f16 statistics, 8-bit codes, ...), the folded Triton kernel runs as it did
  before these measurements."""
  capability = _compat.gpu_compute_capability()
  hopper = interpret or (capability is not None and capability.split(".")[0] == "9")
  if not hopper:
    return {}
  group = queries.shape[2]
  if group == 1:
    return {"stack_copies": True}
  mosaic_takes_it = (
    quantized_decode_attention_folded_mosaic_gpu.unsupported_reason(
      queries, k_codes, k_scale, v_scale, **segment
    )
    is None
  )
  if group <= MOSAIC_DEFAULT_MAX_GROUP and mosaic_takes_it:
    return dict(FOLDED_MOSAIC_GPU)
  return {}


def quantized_decode_attention_gpu(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  *,
  bits,
  group_size,
  sm_scale,
  lowrank=None,
  outliers=None,
  block=64,
  interpret=False,
  **config,
):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]) by the configured lowering's kernel."""
  arrays = (queries, k_codes, k_scale, k_min, v_codes, v_scale, v_min, lengths)
  segment = dict(bits=bits, group_size=group_size, lowrank=lowrank, outliers=outliers, block=block)
  if not config:
    config = measured_default_config(
      queries, k_codes, k_scale, v_scale, interpret=interpret, **segment
    )
  settings = {key: value for key, value in config.items() if key != "lowering"}
  if check_config(config) == "mosaic_gpu":
    if mosaic_gpu_fallback_reason(*arrays[:3], v_scale, config=config, **segment) is None:
      module, entry_point = _mosaic_gpu_kernel(config)
      return getattr(module, entry_point)(
        *arrays,
        bits=bits,
        group_size=group_size,
        sm_scale=sm_scale,
        interpret=interpret,
        **_mosaic_gpu_settings(config),
      )
    settings = {}  # the Triton kernel's defaults: the Mosaic GPU settings are not its own
  return quantized_decode_attention_triton.quantized_decode_attention_triton(
    *arrays, sm_scale=sm_scale, interpret=interpret, **segment, **settings
  )
