"""The one GPU entry point for decode attention over a full-precision segment: picks the Pallas
lowering. "triton" (the default) or "mosaic_gpu" (TMA and warpgroup MMA; jax's successor to the
deprecated Triton lowering). On an H200 at 32k both read a bf16 cache at about the copy rate:
287.3 and 281.8 us, one timing each (KERNEL_NOTES v29). 2% apart in one run is not enough to
change the default."""

from pallas_kernels import decode_attention_mosaic_gpu, decode_attention_triton
from pallas_kernels.launch_settings import check_launch_settings

LOWERINGS = ("triton", "mosaic_gpu")
# kernel_config keys each lowering takes (besides "lowering").
CONFIG_KEYS = {
  "triton": ("block_tokens", "num_splits", "num_warps", "num_stages"),
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
      f"kernel_config keys {unknown} are not taken by lowering={lowering!r}; allowed: "
      f"{', '.join(('lowering',) + CONFIG_KEYS[lowering])}"
    )
  check_launch_settings(config)
  if lowering == "mosaic_gpu":
    decode_attention_mosaic_gpu.check_settings(
      block_tokens=config.get("block_tokens"),
      num_stages=config.get("num_stages"),
      num_splits=config.get("num_splits"),
    )
  return lowering


def unsupported_reason(queries, keys, config: dict) -> str | None:
  """Why the configured GPU kernel cannot take these shapes (None if it can)."""
  if check_config(config) == "mosaic_gpu":
    return decode_attention_mosaic_gpu.unsupported_reason(queries, keys)
  return decode_attention_triton.unsupported_reason(queries, keys)


def decode_attention_gpu(
  queries, keys, values, lengths, *, sm_scale: float, interpret=False, **config
):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]) by the configured lowering's kernel."""
  settings = {key: value for key, value in config.items() if key != "lowering"}
  kernel = (
    decode_attention_mosaic_gpu.decode_attention_mosaic_gpu
    if check_config(config) == "mosaic_gpu"
    else decode_attention_triton.decode_attention_triton
  )
  return kernel(queries, keys, values, lengths, sm_scale=sm_scale, interpret=interpret, **settings)
