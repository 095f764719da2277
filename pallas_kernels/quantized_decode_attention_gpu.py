"""The one GPU entry point for decode attention over a quantized (KIVI / GEAR) segment: picks the
Pallas lowering. "triton" (the default, measured on an H100; its variants and settings are
`quantized_decode_attention_triton`'s) or "mosaic_gpu" (TMA ring and warpgroup MMA; KIVI
segments only, not yet timed on a GPU).

A segment the Mosaic GPU kernel does not take (GEAR terms, head dims other than 64 / 128, fewer
than 8 code words per token, ...) runs on the Triton kernel with its default settings:
`mosaic_gpu_fallback_reason` says why, so the caller can warn.
"""

from pallas_kernels import quantized_decode_attention_mosaic_gpu, quantized_decode_attention_triton

LOWERINGS = ("triton", "mosaic_gpu")
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
  ),
  "mosaic_gpu": ("block_tokens", "num_splits", "num_stages"),
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
  if lowering == "mosaic_gpu":
    quantized_decode_attention_mosaic_gpu.check_settings(
      **{key: value for key, value in config.items() if key != "lowering"}
    )
  return lowering


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
  return quantized_decode_attention_mosaic_gpu.unsupported_reason(
    queries, k_codes, k_scale, v_scale, **segment
  )


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
  settings = {key: value for key, value in config.items() if key != "lowering"}
  if check_config(config) == "mosaic_gpu":
    mosaic_gpu = quantized_decode_attention_mosaic_gpu
    if mosaic_gpu.unsupported_reason(*arrays[:3], v_scale, **segment) is None:
      quantization = dict(bits=bits, group_size=group_size)
      return mosaic_gpu.quantized_decode_attention_mosaic_gpu(
        *arrays, **quantization, sm_scale=sm_scale, interpret=interpret, **settings
      )
    settings = {}  # the Triton kernel's defaults: the Mosaic GPU settings are not its own
  return quantized_decode_attention_triton.quantized_decode_attention_triton(
    *arrays, sm_scale=sm_scale, interpret=interpret, **segment, **settings
  )
