"""End-to-end check on an accelerator: `generate` through the Pallas kernels gives the tokens of
the jnp reference path (tiny random Llama, full and quantized caches), and decode timings.

    python benchmarks/generate_kernels_check.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.generate import generate
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


def main():
  print(jax.__version__, jax.devices())
  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 256, n).tolist() for n in (700, 333)]
  for spec in ("full", "kivi:bits=4,residual=32", "kivi:bits=2,residual=32", "gear:bits=2"):
    runs = {
      impl: generate(
        decoder,
        params,
        prompts,
        max_new_tokens=16,
        cache_dtype=jnp.float32,
        cache_method=parse_method_spec(spec, implementation=impl),
      )
      for impl in ("reference", "pallas")
    }
    same = np.array_equal(runs["pallas"].tokens, runs["reference"].tokens)
    agree = float(np.mean(runs["pallas"].tokens == runs["reference"].tokens))
    print(
      f"{spec:28s} same tokens: {same} (agreement {agree:.2f}); decode tok/s "
      f"reference {runs['reference'].decode_tokens_per_s:.0f}, pallas {runs['pallas'].decode_tokens_per_s:.0f}"
    )


if __name__ == "__main__":
  main()
