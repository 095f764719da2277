"""End-to-end check on an accelerator: `generate` through the Pallas kernels gives the tokens of
the jnp reference path (tiny random Llama, full and quantized caches), and decode timings.

    python benchmarks/generate_kernels_check.py [--only bfloat16] [--kivi-settings '<JSON>']

--kivi-settings replaces the default quantized kernel setting of the KIVI runs (a candidate for
the default, checked through the decode loop before it becomes one).
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.generate import generate
from kvjax.kernel_settings import KernelSettings
from kvjax.method_spec import parse_method_spec
from models.config import DecoderConfig
from models.nnx_decoder import split_decoder
from models.weights import random_decoder

CONFIG = DecoderConfig(
  vocab_size=256,
  hidden_size=256,
  intermediate_size=512,
  num_layers=2,
  num_heads=8,
  num_kv_heads=2,
  head_dim=64,
  max_position_embeddings=4096,
)


WARP_MOSAIC_GPU = {"lowering": "mosaic_gpu", "variant": "warp"}


def prompts_of_record() -> list[list[int]]:
  """Two rows of random ids, 700 and 333 tokens: several quantized groups, different lengths."""
  rng = np.random.default_rng(0)
  return [rng.integers(1, 256, n).tolist() for n in (700, 333)]


def runs_to_check(kivi_settings: dict | None = None) -> list[tuple]:
  """(method spec, KernelSettings[, cache dtype]) per run; `kivi_settings` in place of the empty
  default setting of the KIVI runs."""
  default = KernelSettings(quantized=kivi_settings) if kivi_settings else KernelSettings()
  return [
    # First: the measured default (KERNEL_NOTES v34: on Hopper the folded Mosaic GPU kernel with
    # FOLDED_MOSAIC_GPU_V34's settings) on a bf16 cache. In v30's last call the step's time
    # limit stopped the script before its bf16 runs.
    ("kivi:bits=4,residual=32", default, jnp.bfloat16),
    # The same at 2 bits: the float32 KIVI runs below fall back to Triton in the Mosaic GPU
    # kernels, which take bf16 statistics only (KERNEL_NOTES v59)
    ("kivi:bits=2,residual=32", default, jnp.bfloat16),
    ("full", KernelSettings()),
    ("kivi:bits=4,residual=32", default),
    ("kivi:bits=2,residual=32", default),
    ("gear:bits=2", KernelSettings()),
    # GEAR's low-rank and outlier terms fused into the kernel (the default since KERNEL_NOTES
    # v13 has XLA compute them around it)
    ("gear:bits=2", KernelSettings(quantized={"gear_terms": "kernel"})),
    # The Mosaic GPU quantized kernel (KERNEL_NOTES v12); 2-bit codes at head_dim 64 are 4 words
    # per token, which it does not take, so 4-bit.
    ("kivi:bits=4,residual=32", KernelSettings(quantized={"lowering": "mosaic_gpu"})),
    # The folded Mosaic GPU kernel takes bf16 statistics only: a bf16 cache (KERNEL_NOTES v14).
    (
      "kivi:bits=4,residual=32",
      KernelSettings(quantized={"lowering": "mosaic_gpu", "variant": "folded"}),
      jnp.bfloat16,
    ),
    # Folded Triton on the same bf16 cache (named: on Hopper the empty setting is the Mosaic
    # kernel above, KERNEL_NOTES v29), to tell a difference in the row above that is the Mosaic
    # kernel's from one both kernels share.
    (
      "kivi:bits=4,residual=32",
      KernelSettings(quantized={"variant": "folded"}),
      jnp.bfloat16,
    ),
    # The "warp" Mosaic GPU variant (KERNEL_NOTES v45-v47; bf16 statistics, as the folded
    # kernel), the one Mosaic GPU kernel that takes 2-bit codes at this head_dim of 64.
    ("kivi:bits=2,residual=32", KernelSettings(quantized=WARP_MOSAIC_GPU), jnp.bfloat16),
    ("kivi:bits=4,residual=32", KernelSettings(quantized=WARP_MOSAIC_GPU), jnp.bfloat16),
  ]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", help="run only the checks whose label contains this text")
  parser.add_argument(
    "--kivi-settings",
    type=json.loads,
    help="quantized kernel setting (JSON) for the KIVI runs that use the default",
  )
  args = parser.parse_args()
  print(jax.__version__, jax.devices())
  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  prompts = prompts_of_record()
  checks = runs_to_check(args.kivi_settings)
  if args.only:
    checks = [check for check in checks if args.only in _label(*check)]
  for spec, settings, *cache_dtype in checks:
    cache_dtype = cache_dtype[0] if cache_dtype else jnp.float32
    runs = {
      impl: generate(
        decoder,
        params,
        prompts,
        max_new_tokens=16,
        cache_dtype=cache_dtype,
        cache_method=parse_method_spec(spec, implementation=impl, kernel_settings=settings),
      )
      for impl in ("reference", "pallas")
    }
    pallas_tokens, reference_tokens = (np.asarray(runs[i].tokens) for i in ("pallas", "reference"))
    same = np.array_equal(pallas_tokens, reference_tokens)
    agree = float(np.mean(pallas_tokens == reference_tokens))
    # per row, the first generated position where the tokens differ (-1: none)
    first_difference = [
      int(np.argmax(row_p != row_r)) if np.any(row_p != row_r) else -1
      for row_p, row_r in zip(pallas_tokens, reference_tokens)
    ]
    speeds = {impl: f"{run.decode_tokens_per_s:.0f}" for impl, run in runs.items()}
    print(
      f"{_label(spec, settings, cache_dtype):28s} same tokens: {same} (agreement {agree:.2f}, "
      f"first difference per row {first_difference}); decode tok/s "
      f"reference {speeds['reference']}, pallas {speeds['pallas']}"
    )


def _label(spec, settings, *cache_dtype) -> str:
  cache_dtype = cache_dtype[0] if cache_dtype else jnp.float32
  label = spec + (f" {dict(settings.quantized)}" if settings.quantized else "")
  return label + (f" {jnp.dtype(cache_dtype).name}" if cache_dtype != jnp.float32 else "")


if __name__ == "__main__":
  main()
