"""Where a GEAR-2 decode-attention call spends its time on a GPU: the kernel alone (the same codes
as a KIVI segment), the kernel with GEAR's terms fused, and each part of GEAR's terms as XLA
computes them around the kernel (`pallas_kernels.gear_terms_xla`, `gear_terms="xla"`), with
the earlier formulation of the value-outlier sum beside the current one.

    PYTHONPATH=. python benchmarks/gear_terms_parts.py [--contexts 8192 32768 131072] \
        [--parts-context 32768] [--out parts.json]

Shapes are decode_attention.py's GEAR-2 row: batch 8, 8 KV heads, 4 query heads per KV head,
head_dim 128, groups of 64, rank 4, 163 outliers (2%) per 64-token block for keys and values.
The whole attention calls are timed as decode_attention.py times its rows (a jitted loop of
`--iters` dependent calls, median of `--repeats`), at every context; each part is jitted alone
at `--parts-context` and timed as the median of `--repeats` loops of `--iters` calls
(dispatched back to back, blocked once per loop).
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
from jax.lax import Precision

from benchmarks.decode_attention import time_op
from kvjax import attention_dispatch
from pallas_kernels import gear_terms_xla
from pallas_kernels.base_two_softmax import LN_2
from pallas_kernels.random_inputs import random_quantized_segment


def time_call(fn, args, *, iters: int, repeats: int) -> float:
  """Median seconds per call of the jitted `fn(*args)`."""
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      result = jitted(*args)
    jax.block_until_ready(result)
    samples.append((time.perf_counter() - start) / iters)
  return statistics.median(samples)


def value_outliers_scalar_scatter(outliers, probs, *, block: int, head_dim: int, slots: int):
  """GEAR's value-outlier term by a scatter of one scalar per outlier and query row into `slots`
  partial accumulators (GEAR block j into j mod slots), summed afterwards: gear_terms_xla's
  formulation before v13 with slots=1."""
  batch, kv_heads, group, _ = probs.shape
  token, channel = gear_terms_xla._outlier_positions(outliers[2], block, head_dim)
  count = outliers[2].shape[-1]
  slot = (jnp.arange(token.shape[-1], dtype=jnp.int32) // count) % slots
  p_at_token = jnp.take_along_axis(probs, token[:, :, None, :], axis=-1)
  weighted = p_at_token * outliers[3].astype(jnp.float32).reshape(token.shape)[:, :, None, :]
  terms = jnp.zeros((batch, kv_heads, group, slots, head_dim), jnp.float32)
  b, h, g = jnp.ogrid[:batch, :kv_heads, :group]
  terms = terms.at[
    b[..., None], h[..., None], g[..., None], slot[None, None, None, :], channel[:, :, None, :]
  ].add(weighted)
  return terms.sum(axis=3)


def gear_segment(tokens: int):
  """Queries, the GEAR-2 segment and lengths of decode_attention.py's gear2 row."""
  keys = jax.random.split(jax.random.key(tokens), 2)
  queries = jax.random.normal(keys[0], (BATCH, KV_HEADS, GROUP, HEAD_DIM)).astype(jnp.bfloat16)
  segment = random_quantized_segment(
    keys[1],
    BATCH,
    KV_HEADS,
    tokens,
    HEAD_DIM,
    bits=2,
    group_size=BLOCK,
    dtype=jnp.bfloat16,
    rank=RANK,
    outliers_per_block=int(0.02 * BLOCK * HEAD_DIM),
  )
  return queries, segment, jnp.full((BATCH,), tokens, jnp.int32)


def attention(lowrank: bool, outliers: bool, config: dict):
  """op(queries, segment, lengths) -> (out, lse) through the dispatch's Pallas path."""

  def call(queries, segment, lengths):
    return attention_dispatch.quantized_decode_attention(
      queries,
      *segment[:6],
      lengths,
      bits=2,
      group_size=BLOCK,
      sm_scale=1.0 / math.sqrt(HEAD_DIM),
      lowrank=segment.lowrank if lowrank else None,
      outliers=segment.outliers if outliers else None,
      implementation="pallas",
      kernel_config=config,
    )

  return call


BATCH, KV_HEADS, GROUP, HEAD_DIM, BLOCK, RANK = 8, 8, 4, 128, 64, 4
HIGHEST = Precision.HIGHEST

# (low rank, outliers, kernel config) per row. gear_terms is named on every GEAR row: its
# default changed to "xla" (v21), and the fused row must keep timing the fused kernel.
CALL_SETTINGS = {
  "kernel, codes only (KIVI-2)": (False, False, {}),
  "kernel, GEAR terms fused": (True, True, {"gear_terms": "kernel"}),
  "kernel + XLA terms (gear_terms=xla)": (True, True, {"gear_terms": "xla"}),
  "kernel + XLA low rank only": (True, False, {"gear_terms": "xla"}),
  "kernel + XLA outliers only": (False, True, {"gear_terms": "xla"}),
}
CALLS = {label: attention(*settings) for label, settings in CALL_SETTINGS.items()}


def score_bias_lowrank_einsums(lowrank, scaled_queries, *, tokens: int, block: int):
  """GEAR's low-rank score bias as two einsums: gear_terms_xla's formulation before v21."""
  batch, kv_heads, rows, _ = scaled_queries.shape
  k_a, k_b = lowrank[0], lowrank[1]
  q_b = jnp.einsum("bhgd,bhjdr->bhgjr", scaled_queries, k_b.astype(jnp.float32), precision=HIGHEST)
  k_a = k_a.astype(jnp.float32).reshape(batch, kv_heads, tokens // block, block, -1)
  bias = jnp.einsum("bhgjr,bhjkr->bhgjk", q_b, k_a, precision=HIGHEST)
  return bias.reshape(batch, kv_heads, rows, tokens)


def value_terms_lowrank_einsums(lowrank, scores, lse, lengths, *, block: int):
  """GEAR's low-rank value terms as two einsums: gear_terms_xla's formulation before v21."""
  probs = gear_terms_xla.normalised_probabilities(scores, lse, lengths)
  batch, kv_heads, group, tokens = probs.shape
  v_a, v_b = lowrank[2], lowrank[3]
  v_a = v_a.astype(jnp.float32).reshape(batch, kv_heads, tokens // block, block, -1)
  probs_blocks = probs.reshape(batch, kv_heads, group, tokens // block, block)
  p_a = jnp.einsum("bhgjk,bhjkr->bhgjr", probs_blocks, v_a, precision=HIGHEST)
  return jnp.einsum("bhgjr,bhjdr->bhgd", p_a, v_b.astype(jnp.float32), precision=HIGHEST)


def score_bias_outliers_windows(outliers, scaled_queries, *, tokens: int, block: int):
  """GEAR's key-outlier score bias scattered as one window of R contiguous floats per outlier
  into a token-major [B, H, T, R] bias, then transposed to the kernel's [B, H, R, T]: one
  index per outlier instead of one per outlier and query row, as the value outliers do."""
  batch, kv_heads, rows, _ = scaled_queries.shape
  token, contribution = gear_terms_xla.key_outlier_contributions(
    outliers, scaled_queries, block=block
  )
  b = jnp.arange(batch)[:, None, None]
  h = jnp.arange(kv_heads)[None, :, None]
  bias = jnp.zeros((batch, kv_heads, tokens, rows), jnp.float32)
  bias = bias.at[b, h, token].add(jnp.swapaxes(contribution, 2, 3))
  return jnp.swapaxes(bias, 2, 3)


def part_inputs(queries, lengths, tokens: int) -> dict:
  """The arrays the parts take besides the segment: queries times sm_scale, scores (base-2
  logits, as the kernel writes them), their natural log-sum-exp and the normalised
  probabilities, at the row's length `lengths`."""
  scaled_queries = queries.astype(jnp.float32) / math.sqrt(HEAD_DIM)
  scores = jax.random.normal(jax.random.key(1), (BATCH, KV_HEADS, GROUP, tokens), jnp.float32)
  lse = jax.nn.logsumexp(scores * LN_2, axis=-1)
  return dict(
    scaled_queries=scaled_queries,
    scores=scores,
    lse=lse,
    probs=gear_terms_xla.normalised_probabilities(scores, lse, lengths),
    lengths=lengths,
  )


def parts(tokens: int) -> dict:
  """name -> fn(inputs, segment): GEAR's terms, each computed alone as gear_terms_xla does
  (with earlier formulations beside them); `inputs` as `part_inputs` makes them."""
  terms = dict(block=BLOCK, head_dim=HEAD_DIM)
  return {
    "score bias, low rank and outliers": lambda x, s: gear_terms_xla.gear_score_bias(
      s.lowrank, s.outliers, x["scaled_queries"], tokens=tokens, block=BLOCK
    ),
    "value terms, low rank and outliers": lambda x, s: gear_terms_xla.gear_value_terms_from_scores(
      s.lowrank, s.outliers, x["scores"], x["lse"], x["lengths"], **terms
    ),
    "score bias, low rank": lambda x, s: gear_terms_xla.gear_score_bias(
      s.lowrank, None, x["scaled_queries"], tokens=tokens, block=BLOCK
    ),
    "score bias, low rank, einsums (before v21)": lambda x, s: score_bias_lowrank_einsums(
      s.lowrank, x["scaled_queries"], tokens=tokens, block=BLOCK
    ),
    "score bias, outliers": lambda x, s: gear_terms_xla.gear_score_bias(
      None, s.outliers, x["scaled_queries"], tokens=tokens, block=BLOCK
    ),
    "score bias, outliers, windows of R (token-major, transposed)": lambda x, s: (
      score_bias_outliers_windows(s.outliers, x["scaled_queries"], tokens=tokens, block=BLOCK)
    ),
    "value terms, low rank": lambda x, s: gear_terms_xla.gear_value_terms_from_scores(
      s.lowrank, None, x["scores"], x["lse"], x["lengths"], **terms
    ),
    "value terms, low rank, einsums (before v21)": lambda x, s: value_terms_lowrank_einsums(
      s.lowrank, x["scores"], x["lse"], x["lengths"], block=BLOCK
    ),
    "value terms, outliers (as gear_terms_xla)": lambda x, s: (
      gear_terms_xla.gear_value_terms_from_scores(
        None, s.outliers, x["scores"], x["lse"], x["lengths"], **terms
      )
    ),
    "value outliers, windows, 8 slots": lambda x, s: gear_terms_xla.value_outlier_terms(
      s.outliers, x["probs"], x["lengths"], slots=8, **terms
    ),
    "value outliers, windows, 128 slots": lambda x, s: gear_terms_xla.value_outlier_terms(
      s.outliers, x["probs"], x["lengths"], slots=128, **terms
    ),
    "value outliers, scalar scatter, 1 slot": lambda x, s: value_outliers_scalar_scatter(
      s.outliers, x["probs"], slots=1, **terms
    ),
    "value outliers, scalar scatter, 32 slots": lambda x, s: value_outliers_scalar_scatter(
      s.outliers, x["probs"], slots=32, **terms
    ),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
  parser.add_argument("--parts-context", type=int, default=32768)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", help="write the times as JSON here")
  args = parser.parse_args()
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "us": {}}
  print(f"{results['device']}, jax {jax.__version__}", flush=True)
  for tokens in sorted(set(args.contexts) | {args.parts_context}):
    queries, segment, lengths = gear_segment(tokens)
    timed = {}
    if tokens in args.contexts:
      for name, op in CALLS.items():
        timed[name] = (time_op, op, (queries, segment, lengths))
    if tokens == args.parts_context:
      inputs = part_inputs(queries, lengths, tokens)
      for name, fn in parts(tokens).items():
        timed[name] = (time_call, fn, (inputs, segment))
    for name, (timer, fn, fn_args) in timed.items():
      try:
        seconds = timer(fn, fn_args, iters=args.iters, repeats=args.repeats)
      except Exception as e:  # one call failing to compile is reported, not fatal
        print(f"  {tokens:>7} {name:<50} {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      results["us"][f"{tokens} {name}"] = seconds * 1e6
      print(f"  {tokens:>7} {name:<50} {seconds * 1e6:9.1f} us", flush=True)
    del segment
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
