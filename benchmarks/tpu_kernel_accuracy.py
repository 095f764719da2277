"""Relative L2 error of the TPU quantized decode-attention kernel (Pallas interpret mode) against
the float32 jnp reference, on random bfloat16 KIVI / GEAR segments: the numbers KERNEL_NOTES
compares kernel versions by (v57: the codes as bfloat16 pairs against the unpacked codes).

  PYTHONPATH=. .venv/bin/python benchmarks/tpu_kernel_accuracy.py SPEC [SPEC ...]

with each SPEC KIND:BITS:HEAD_DIM:SEEDS:TOKENS:BLOCK, e.g. kivi:2:128:4:4096:2048.

KIND is kivi (group 32) or gear (group and block 64, rank 2, 2% outliers a block and side);
batch 3 (a full row, a row ending at a random odd length, one token), 2 KV heads x 4 query
heads. One line per spec: each seed's error and their mean.
"""

import argparse

import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantized_decode_attention_tpu
from pallas_kernels.quantized_decode_attention_reference import quantized_decode_attention_reference
from pallas_kernels.random_inputs import random_quantized_segment, random_queries, segment_kwargs

BATCH, KV_HEADS, QUERY_HEADS = 3, 2, 4


def relative_error(
  seed: int, *, kind: str, bits: int, head_dim: int, tokens: int, block_tokens: int
) -> float:
  """||kernel - reference|| / ||reference|| of the outputs, one random case."""
  if kind not in ("kivi", "gear"):
    raise ValueError(f"kind={kind!r}; allowed: kivi, gear")
  rng = np.random.default_rng(seed)
  gear = kind == "gear"
  group_size = 64 if gear else 32
  queries = random_queries(rng, BATCH, KV_HEADS, QUERY_HEADS, head_dim)
  segment = random_quantized_segment(
    rng,
    BATCH,
    KV_HEADS,
    tokens,
    head_dim,
    bits=bits,
    group_size=group_size,
    dtype=jnp.bfloat16,
    rank=2 if gear else 0,
    outliers_per_block=round(0.02 * 64 * head_dim) if gear else 0,
  )
  lengths = jnp.asarray([tokens, int(rng.integers(1, tokens)) | 1, 1], jnp.int32)
  kwargs = segment_kwargs(segment, bits=bits, group_size=group_size)
  reference, _ = quantized_decode_attention_reference(queries, *segment[:6], lengths, **kwargs)
  out, _ = quantized_decode_attention_tpu.quantized_decode_attention_tpu(
    queries, *segment[:6], lengths, interpret=True, block_tokens=block_tokens, **kwargs
  )
  return float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("specs", nargs="+", help="KIND:BITS:HEAD_DIM:SEEDS:TOKENS:BLOCK")
  args = parser.parse_args(argv)
  for spec in args.specs:
    parts = spec.split(":")
    if len(parts) != 6:
      parser.error(f"spec {spec!r}: expected KIND:BITS:HEAD_DIM:SEEDS:TOKENS:BLOCK")
    kind, bits, head_dim, seeds, tokens, block_tokens = parts[0], *map(int, parts[1:])
    errors = [
      relative_error(
        seed, kind=kind, bits=bits, head_dim=head_dim, tokens=tokens, block_tokens=block_tokens
      )
      for seed in range(seeds)
    ]
    print(spec, " ".join(f"{e:.3e}" for e in errors), f"mean {np.mean(errors):.3e}", flush=True)


if __name__ == "__main__":
  main()
