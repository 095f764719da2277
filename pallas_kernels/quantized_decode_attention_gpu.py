"""The one GPU entry point for decode attention over a quantized (KIVI / GEAR) segment: picks the
Pallas lowering. "triton" (its variants and settings are `quantized_decode_attention_triton`'s)
or "mosaic_gpu" (TMA ring; KIVI segments only), in one of three variants:
"dequantize" (the default: K and V dequantized element by element and staged in bf16, warpgroup
MMA; measured on an H100 and an H200, slower than either folded kernel), "folded" (scales folded
into stacked queries and probabilities, codes staged by masking alone as subnormal bf16
operands; `quantized_decode_attention_folded_mosaic_gpu`) or "warp" (the folded operands, both
products per warp by `mma.sync` with operands in registers, 2- and 4-bit codes at head_dim 64
and 128 and up to 8 query heads per KV head; `quantized_decode_attention_warp_mosaic_gpu`; the
fastest measured on an H200, KERNEL_NOTES v59).

An empty kernel_config runs what was measured fastest (`measured_default_config`): on a Hopper
GPU (and in interpret mode, which checks what such a GPU runs), for 1 to 8 query heads per KV
head, the warp variant with v59's settings (`WARP_MOSAIC_GPU_V59`) where it takes the segment,
else the folded Mosaic GPU kernel with v34's settings (`FOLDED_MOSAIC_GPU_V34`) where that does;
otherwise the folded Triton kernel, with stack copies for one head.

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
  quantized_decode_attention_warp_mosaic_gpu,
)
from pallas_kernels.launch_settings import check_launch_settings

LOWERINGS = ("triton", "mosaic_gpu")
# Mosaic GPU variant -> (its module, the name of its entry point there). The entry point is looked
# up when called, so that tests can wrap it.
MOSAIC_GPU_KERNELS = {
  "dequantize": (quantized_decode_attention_mosaic_gpu, "quantized_decode_attention_mosaic_gpu"),
  "folded": (quantized_decode_attention_folded_mosaic_gpu, "folded_decode_attention_mosaic_gpu"),
  "warp": (quantized_decode_attention_warp_mosaic_gpu, "warp_decode_attention_mosaic_gpu"),
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
  "mosaic_gpu": (
    "variant",
    "block_tokens",
    "num_splits",
    "num_stages",
    *quantized_decode_attention_folded_mosaic_gpu.FOLDED_SETTINGS,
    *quantized_decode_attention_warp_mosaic_gpu.WARP_ONLY_SETTINGS,
  ),
}
FOLDED_ONLY_KEYS = quantized_decode_attention_folded_mosaic_gpu.FOLDED_SETTINGS
WARP_ONLY_KEYS = quantized_decode_attention_warp_mosaic_gpu.WARP_ONLY_SETTINGS
# kernel_config keys the "warp" variant takes (besides "lowering" and "variant").
WARP_KEYS = (
  "block_tokens",
  "num_splits",
  "num_stages",
  "key_products",
  "key_bias_source",
  "split_merge",
  "copy_issuer",
  "ring_release",
  "query_loads",
  "value_ring_layout",
  "statistic_loads",
)


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
    settings = mosaic_gpu_settings(config)
    if config.get("variant") == "warp":
      _check_warp_settings(settings)
      return lowering
    warp_only = sorted(set(settings) & set(WARP_ONLY_KEYS))
    if warp_only:
      raise ValueError(
        f'kernel_config keys {warp_only} are taken by the "warp" Mosaic GPU kernel only; add '
        f'"variant": "warp" or remove them'
      )
    folded_only = {key: settings.pop(key) for key in FOLDED_ONLY_KEYS if key in settings}
    if folded_only and config.get("variant") != "folded":
      raise ValueError(
        f"kernel_config keys {sorted(folded_only)} are taken by the folded Mosaic GPU kernel "
        f'only; add "variant": "folded" or remove them'
      )
    quantized_decode_attention_folded_mosaic_gpu.check_folded_settings(**folded_only)
    quantized_decode_attention_mosaic_gpu.check_settings(**settings)
  return lowering


def _check_warp_settings(settings: dict) -> None:
  """ValueError naming a kernel_config key or value the "warp" variant does not take."""
  unknown = sorted(set(settings) - set(WARP_KEYS))
  if unknown:
    raise ValueError(
      f'kernel_config keys {unknown} are not taken by the "warp" Mosaic GPU kernel; allowed: '
      f"{', '.join(('lowering', 'variant', *WARP_KEYS))}"
    )
  quantized_decode_attention_warp_mosaic_gpu.check_settings(**settings)


def _mosaic_gpu_kernel(config: dict):
  """(module, entry point name) of the config's Mosaic GPU variant; ValueError naming a bad one."""
  variant = config.get("variant", "dequantize")
  if variant not in MOSAIC_GPU_VARIANTS:
    raise ValueError(
      f"variant={variant!r} is not a Mosaic GPU quantized kernel; allowed: "
      f"{', '.join(MOSAIC_GPU_VARIANTS)}"
    )
  return MOSAIC_GPU_KERNELS[variant]


def mosaic_gpu_settings(config: dict) -> dict:
  """A Mosaic GPU kernel_config's keyword arguments to the kernel: all but lowering and variant."""
  return {key: value for key, value in config.items() if key not in ("lowering", "variant")}


def unsupported_reason(queries, k_codes, k_scale, v_scale, **segment) -> str | None:
  """Why no GPU kernel can take this segment (None if one can): the Triton kernel, which every
  lowering falls back to, decides."""
  return quantized_decode_attention_triton.unsupported_reason(
    queries, k_codes, k_scale, v_scale, **segment
  )


def triton_variant_fallback(queries, *, config: dict, **segment) -> tuple[str, str, str] | None:
  """(the Triton variant a config asks for, the one that runs, why) where they differ; None where
  the config asks for none (no "variant" and no folded-only setting: the choice is the kernel's,
  as documented) or for the Mosaic GPU lowering."""
  triton = quantized_decode_attention_triton
  if check_config(config) != "triton":
    return None
  asked = config.get("variant")
  if asked is None:
    if not any(name in config for name in triton.FOLDED_SETTINGS):
      return None
    asked = "folded"
  gear = segment.get("lowrank") is not None or segment.get("outliers") is not None
  runs, reason = triton.variant_that_runs(
    asked,
    group=queries.shape[2],
    head_dim=queries.shape[3],
    bits=segment["bits"],
    group_size=segment["group_size"],
    gear_block=segment.get("block") if gear else None,
    config=config,
  )
  return None if reason is None else (asked, runs, reason)


def mosaic_gpu_fallback_reason(queries, k_codes, k_scale, v_scale, *, config: dict, **segment):
  """Why a config asking for the Mosaic GPU kernel runs the Triton kernel instead (None when it
  does not ask for it, or the Mosaic GPU kernel takes the segment)."""
  if check_config(config) != "mosaic_gpu":
    return None
  module, _ = _mosaic_gpu_kernel(config)
  return module.unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    block_tokens=config.get("block_tokens"),
    operand_order=config.get("operand_order"),
    value_operand=config.get("value_operand"),
    key_bias_source=config.get("key_bias_source"),
    num_splits=config.get("num_splits"),
    blocks_per_copy=config.get("blocks_per_copy"),
    value_stat_loads=config.get("value_stat_loads"),
    **segment,
  )


FOLDED_MOSAIC_GPU = {"lowering": "mosaic_gpu", "variant": "folded"}
# KERNEL_NOTES v30: 64-token blocks in 4 stages, the key codes handed to wgmma from registers,
# each masked code word one operand register.
FOLDED_MOSAIC_GPU_V30 = {
  **FOLDED_MOSAIC_GPU,
  "block_tokens": 64,
  "num_stages": 4,
  "key_operand": "registers",
  "operand_order": "word",
}
# KERNEL_NOTES v34 (H200): v30's settings with the first warp alone issuing the copies, the value
# product adding into the running accumulator and the value statistics as two arrays; the fastest
# of v31-v33's settings at every shape timed (v33's fixed softmax reference was slower).
FOLDED_MOSAIC_GPU_V34 = {
  **FOLDED_MOSAIC_GPU_V30,
  "copy_issuer": "first_warp",
  "value_accumulator": "carried",
  "value_stats": "separate",
}
# KERNEL_NOTES v59 (H200): the warp variant with the kernel's own q . k_min bias, two ring stages
# and the splits merged by one Triton kernel; the fastest at every shape timed.
WARP_MOSAIC_GPU_V59 = {
  "lowering": "mosaic_gpu",
  "variant": "warp",
  "key_bias_source": "kernel",
  "num_stages": 2,
  "split_merge": "triton",
}
MOSAIC_DEFAULT_MAX_GROUP = 8  # the largest query group timed (KERNEL_NOTES v29, v30, v34, v59)


def measured_default_config(
  queries, k_codes, k_scale, v_scale, *, interpret: bool, **segment
) -> dict:
  """The kernel_config an empty one stands for, by KERNEL_NOTES v30 and v34 (H200, jax 0.11.2,
  KIVI group size 32, head_dim 128, 8 rows x 8 KV heads; us per call in one run). v30: folded
  Mosaic GPU as v29 left it -> `FOLDED_MOSAIC_GPU_V30` (with approximate exp2, which timed the
  same or slower at 32k): KIVI-2 32k 232.8 -> 215.0 (218.8), 8k 93.5 -> (91.8), 128k 777.2 ->
  (729.3), 32k with 1 head per KV head 230.0 -> (197.6) against 222.0 for folded Triton with
  stack copies (v29's one-head default), 8 heads 273.6 -> (230.7); KIVI-4 at 32k 257.4 ->
  (231.1). v34: `FOLDED_MOSAIC_GPU_V30` -> `FOLDED_MOSAIC_GPU_V34`: KIVI-2 32k 222.8 -> 183.6
  (216.1 -> 180.9 in a later call), 8k 93.4 -> 78.8, 128k 731.5 -> 563.7, 1 head 208.4 -> 197.6
  (folded Triton with stack copies 223.9), 8 heads 239.1 -> 198.3; KIVI-4 218.0 -> 207.7.
  v59: `FOLDED_MOSAIC_GPU_V34` -> `WARP_MOSAIC_GPU_V59` (v39's fastest folded settings, "C +
  merge", in brackets): KIVI-2 32k 175.1 -> 110.6 (121.0; 106.1 in the issue's table: 49.7% of
  the copy rate, 2.95x XLA's bf16 attention), 1 head 107.0 (folded Triton with stack copies
  217.2; v34's untimed there), 8 heads 134.5 (148.5); KIVI-4 32k 188.4 -> 122.4; 2-bit codes at
  head_dim 64 (which no folded kernel takes) 76.2 against 184.2 for folded Triton, but not the
  default there (below). 8k and 128k were not timed with it.
  Two to eight heads were timed at 4 and 8, not 2; more than 8 (shared contexts fold rows into
  the query group) not at all, so those keep the Triton kernel's own choice (past
  `FOLDED_MAX_GROUP`, its joined variant).

  On Hopper (compute capability 9.x: the Mosaic kernels are built for it) and in interpret mode
  (which checks what such a GPU runs), for 1 to 8 query heads per KV head: `WARP_MOSAIC_GPU_V59`
  where the warp variant takes the segment (bf16 statistics, 2- or 4-bit codes, head_dim 64 or
  128, key groups of 32, a multiple of 8 cached tokens, splits of at most 256 key groups for the
  kernel's bias) and the segment is not 2-bit at head_dim 64 (an unresolved native divergence
  in v59's generate check; the warp variant runs there when asked for by name), else
  `FOLDED_MOSAIC_GPU_V34` where the folded kernel takes it at its 64-token blocks (whole key
  groups per block: group sizes up to 64), else v29's folded Mosaic GPU default where that takes
  it, else folded Triton (with stack copies for one head, v29's measurement). Segments no
  Mosaic kernel takes (GEAR terms, f32 / f16 statistics, 8-bit codes, 2-bit codes at head_dim 64
  by default, ...) and other GPUs run folded Triton as before these measurements."""
  capability = _compat.gpu_compute_capability()
  hopper = interpret or (capability is not None and capability.split(".")[0] == "9")
  if not hopper:
    return {}
  group = queries.shape[2]
  triton_default = {"stack_copies": True} if group == 1 else {}
  if group > MOSAIC_DEFAULT_MAX_GROUP:
    return triton_default
  # 2-bit codes at head_dim 64 keep folded Triton: there the warp variant's generate check on
  # the H200 left the reference's tokens at a step where the reference's top-two margin was wide
  # (KERNEL_NOTES v59), which interpret mode does not reproduce
  warp_checked = not (queries.shape[3] == 64 and segment.get("bits") == 2)
  candidates = (WARP_MOSAIC_GPU_V59,) if warp_checked else ()
  # v34's settings take the segments v30's take (they differ in none that a segment can refuse)
  for config in (*candidates, FOLDED_MOSAIC_GPU_V34, FOLDED_MOSAIC_GPU):
    if (
      mosaic_gpu_fallback_reason(queries, k_codes, k_scale, v_scale, config=config, **segment)
      is None
    ):
      return dict(config)
  return triton_default


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
        **mosaic_gpu_settings(config),
      )
    settings = {}  # the Triton kernel's defaults: the Mosaic GPU settings are not its own
  return quantized_decode_attention_triton.quantized_decode_attention_triton(
    *arrays, sm_scale=sm_scale, interpret=interpret, **segment, **settings
  )
