"""Static experiment: where Triton stages 2-bit key codes on their way into the score dot.

Two single-purpose kernels compute exp(q . k) summed over tokens for a [16, 128] bf16 query tile
and 2-bit key codes, nothing else (no scales, no values), so the codes' path into the tensor
core is all that differs:

  channel_packed  the cache's layout (a word = 16 channels of one token); unpacked to a bf16
                  [tokens, D] tile by the "folded" kernel's own `unpack_codes_for_dot` (bf16
                  pairs); the join of the bit fields is not elementwise, so Triton converts the
                  bf16 tile to the dot-operand layout through shared memory;
  token_packed    a word = 16 tokens of one channel (a different cache layout); bit field k is
                  one [tokens/16, D] operand, reached from the words by elementwise ops only, so
                  Triton moves the dot-operand conversion onto the packed words (cp.async into
                  shared memory, ldmatrix straight into operand registers) and unpacks there.

It prints `triton_static_cost.LoopCost` for each (compiled for sm_90 by triton 3.9.0; counts of
the compiled main loop, not timings). Needs `pip install -e ".[kernel-analysis]"`:

  PYTHONPATH=. python benchmarks/operand_layout_experiment.py
"""

import argparse
import json
import tempfile
from dataclasses import asdict

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.triton_static_cost import capture_triton_ir, compile_sm90, loop_cost
from pallas_kernels.folded_scales_kernel_triton import BF16_128, unpack_codes_for_dot

ROWS = 16  # the smallest tensor-core tile, as in the real kernels
HEAD_DIM = 128
TOKENS = 8192
FIELDS = 16  # 2-bit codes per uint32 word


def _exp_score_sum(queries, keys):
  scores = jax.lax.dot_general(
    queries, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )
  return jnp.exp(scores).sum(axis=1)


def channel_packed_kernel(block_tokens: int):
  def kernel(queries_ref, words_ref, out_ref):
    queries = queries_ref[...]

    def body(i, total):
      words = words_ref[pl.ds(i * block_tokens, block_tokens), :]  # [block, D / 16]
      return total + _exp_score_sum(queries, unpack_codes_for_dot(words, 2, jnp.bfloat16))

    out_ref[...] = jax.lax.fori_loop(
      0, TOKENS // block_tokens, body, jnp.zeros((ROWS,), jnp.float32)
    )

  return kernel, (TOKENS, HEAD_DIM // FIELDS)


def token_packed_kernel(block_tokens: int):
  word_rows = block_tokens // FIELDS

  def kernel(queries_ref, words_ref, out_ref):
    queries = queries_ref[...]

    def body(i, total):
      words = words_ref[pl.ds(i * word_rows, word_rows), :]  # [block / 16, D]
      for k in range(FIELDS):
        field = jnp.right_shift(words, jnp.uint32(2 * k)) if k else words
        biased = (field & jnp.uint32(3)) | jnp.uint32(BF16_128)  # bf16 bits of 128 + code
        # The code itself, as folded's unpack gives it (both cases feed the dot the same numbers).
        keys = jax.lax.bitcast_convert_type(biased.astype(jnp.uint16), jnp.bfloat16)
        keys = keys - jnp.bfloat16(128.0)
        total = total + _exp_score_sum(queries, keys)
      return total

    out_ref[...] = jax.lax.fori_loop(
      0, TOKENS // block_tokens, body, jnp.zeros((ROWS,), jnp.float32)
    )

  return kernel, (TOKENS // FIELDS, HEAD_DIM)


def static_cost(name: str, make_kernel, block_tokens: int, workdir: str) -> dict:
  kernel, words_shape = make_kernel(block_tokens)

  def call(queries, words):
    return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((ROWS,), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
    )(queries, words)

  (ttir,) = capture_triton_ir(
    call,
    jax.ShapeDtypeStruct((ROWS, HEAD_DIM), jnp.bfloat16),
    jax.ShapeDtypeStruct(words_shape, jnp.uint32),
  )
  sass, resources, ttgir = compile_sm90(ttir, num_warps=4, num_stages=3, workdir=workdir, name=name)
  cost = loop_cost(name, sass, resources, ttgir, tokens_per_iteration=block_tokens, warps=4)
  per_key_element = 2 * cost.per_element(HEAD_DIM)  # per_element counts K and V; keys only here
  wavefronts_per_128_tokens = cost.wavefronts * 128 / block_tokens
  return {
    **asdict(cost),
    "thread_instructions_per_key_element": round(per_key_element, 2),
    "wavefronts_per_128_tokens_per_warp": round(wavefronts_per_128_tokens, 1),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args()
  cases = [
    ("channel_packed_block128", channel_packed_kernel, 128),
    ("token_packed_block256", token_packed_kernel, 256),
    ("token_packed_block1024", token_packed_kernel, 1024),
  ]
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for name, make_kernel, block_tokens in cases:
      results.append(static_cost(name, make_kernel, block_tokens, workdir))
  print("| case | regs | thread instr / key element | smem wavefronts / 128 tokens / warp |")
  print("|---|---:|---:|---:|")
  for r in results:
    print(
      f"| {r['name']} | {r['registers']} | {r['thread_instructions_per_key_element']} "
      f"| {r['wavefronts_per_128_tokens_per_warp']} |"
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
