"""End-to-end check on an accelerator: `generate` through the Pallas kernels gives the tokens of
the jnp reference path (tiny random Llama, full and quantized caches), and decode timings.

    python benchmarks/generate_kernels_check.py [--only bfloat16]
"""

import argparse

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


def prompts_of_record() -> list[list[int]]:
  """Two rows of random ids, 700 and 333 tokens: several quantized groups, different lengths."""
  rng = np.random.default_rng(0)
  return [rng.integers(1, 256, n).tolist() for n in (700, 333)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", help="run only the checks whose label contains this text")
  args = parser.parse_args()
  print(jax.__version__, jax.devices())
  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  prompts = prompts_of_record()
  runs_to_check = [
    # First: the measured default (KERNEL_NOTES v30: on Hopper the folded Mosaic GPU kernel
    # with 64-token blocks, register key codes and the word operand order) on a bf16 cache. In
    # v30's last call the step's time limit stopped the script before its bf16 runs.
    ("kivi:bits=4,residual=32", KernelSettings(), jnp.bfloat16),
    ("full", KernelSettings()),
    ("kivi:bits=4,residual=32", KernelSettings()),
    ("kivi:bits=2,residual=32", KernelSettings()),
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
  ]
  if args.only:
    runs_to_check = [run for run in runs_to_check if args.only in _label(*run)]
  for spec, settings, *cache_dtype in runs_to_check:
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
