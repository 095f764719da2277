"""How far the folded Mosaic GPU kernel's row_max="bound" references sit from the true max, and
how many splits fall back to the exact softmax, on a real model's own keys and queries.

`pallas_kernels.softmax_reference_bounds` gives each split the reference U - HEADROOM (U: the
largest upper bound on its scores from the key statistics) and sends a split to the exact online
softmax when U less the largest lower bound exceeds HEADROOM + UNDERFLOW_MARGIN. Whether that
serves real attention is a property of real keys and queries, so this runs the embedded
SmolLM2-135M over a prompt of CPython's documentation (its own forward pass, full causal
attention, no cache), KIVI-quantizes each layer's keys as the cache would (all but the last
`--window` tokens, in groups of `--group-size`), and for queries at a few positions reports per
split size (in key groups): the share of splits sent to the exact path, and over the others the
distance U - M from the bound to the split's true max M (the reference sits HEADROOM below U)
and m - M (must stay <= UNDERFLOW_MARGIN; above 0 the largest p is below 1).

  python benchmarks/softmax_reference_spread.py [--tokens 2100] [--out results/....json]

CPU is enough (a forward pass of a 135M model and small einsums).
"""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.eval.text_corpus import pydoc_topics_text
from kvjax.quantization.group_quantization import dequantize_keys, quantize_keys_per_channel
from models.loading import load_model
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.key_bias import key_bias
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  HEADROOM,
  UNDERFLOW_MARGIN,
  key_score_bounds,
  split_softmax_references,
)


def layer_queries_and_keys(model, token_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
  """Each layer's rotated (q [H, G, T, D], k [H, T, D]) over the prompt, from the model's own
  layers with exact causal attention between them."""
  decoder = nnx.merge(model.decoder.graphdef, model.params)
  tokens = jnp.asarray([token_ids], jnp.int32)
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  sm_scale = model.config.head_dim**-0.5

  @jax.jit
  def run(tokens):
    x = decoder.embed_tokens(tokens)
    captured = []
    for layer in decoder.layers:
      q, k, v = layer.before_cache(x, positions)  # [b,h,g,t,d], [b,h,t,d]
      scores = jnp.einsum("bhgtd,bhsd->bhgts", q, k).astype(jnp.float32) * sm_scale
      causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
      probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
      attended = jnp.einsum("bhgts,bhsd->bhgtd", probs, v.astype(jnp.float32))
      x = layer.after_cache(x, attended)
      captured.append((q[0], k[0]))
    return captured

  return [(np.asarray(q, np.float32), np.asarray(k, np.float32)) for q, k in run(tokens)]


def split_statistics(queries, keys, *, bits, group_size, split_groups, sm_scale):
  """For one query position: per split (served or not) and, for served ones, U - M and m - M."""
  quantized = quantize_keys_per_channel(
    jnp.asarray(keys), bits=bits, group_size=group_size, dtype=jnp.bfloat16
  )
  scaled = base_two_queries(jnp.asarray(queries)[None], sm_scale)  # [1, H, G, D]
  bias = key_bias(scaled, quantized.minimum[None])
  lower, upper = key_score_bounds(scaled, quantized.scale[None], bias, bits=bits)
  tokens = keys.shape[1]
  groups = tokens // group_size
  num_splits = math.ceil(groups / split_groups)
  references = np.asarray(
    split_softmax_references(
      lower,
      upper,
      jnp.asarray([tokens]),
      group_size=group_size,
      split_tokens=split_groups * group_size,
      num_splits=num_splits,
    )
  )[0]  # [H, S, G]
  dequantized = dequantize_keys(
    quantized.codes, quantized.scale, quantized.minimum, bits=bits, group_size=group_size
  )
  scores = np.einsum("hgd,htd->hgt", np.asarray(scaled[0]), np.asarray(dequantized))
  padded = np.full((*scores.shape[:2], num_splits * split_groups * group_size), -np.inf)
  padded[..., :tokens] = scores
  split_max = padded.reshape(*scores.shape[:2], num_splits, -1).max(axis=-1)  # [H, G, S]
  split_max = np.swapaxes(split_max, 1, 2)  # [H, S, G]
  upper_split = (
    np.pad(
      np.asarray(upper)[0],
      ((0, 0), (0, num_splits * split_groups - groups), (0, 0)),
      constant_values=-np.inf,
    )
    .reshape(scores.shape[0], num_splits, split_groups, -1)
    .max(axis=2)
  )  # [H, S, G]
  exchange = (references == EXCHANGE).all(axis=-1)  # [H, S]
  served = ~exchange
  return (
    exchange.ravel(),
    (upper_split - split_max)[served].ravel(),
    (references - split_max)[served].ravel(),
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--tokens", type=int, default=2100)
  parser.add_argument("--window", type=int, default=128, help="KIVI's full-precision window")
  parser.add_argument("--group-size", type=int, default=32)
  parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--split-groups", type=int, nargs="+", default=[2, 8, 32, 0])
  parser.add_argument("--out")
  args = parser.parse_args()

  model = load_model(args.model)
  token_ids = model.tokenizer.encode(pydoc_topics_text())[: args.tokens]
  layers = layer_queries_and_keys(model, token_ids)
  sm_scale = model.config.head_dim**-0.5
  positions = (len(token_ids) - 1, len(token_ids) // 2)
  print(
    f"{args.model}: {len(layers)} layers, {len(token_ids)} tokens, query positions {positions}; "
    f"HEADROOM {HEADROOM:g}, UNDERFLOW_MARGIN {UNDERFLOW_MARGIN:g} (base 2)"
  )
  print(
    "| bits | split (key groups) | splits | exact path | U - M p50 / p99 / max "
    "| m - M p50 / p99 / max |"
  )
  print("|---:|---:|---:|---:|---|---|")
  rows = []
  for bits in args.bits:
    for split_groups in args.split_groups:
      exchange, gaps, offsets = [], [], []
      for queries, keys in layers:
        for position in positions:
          quantized_tokens = (position + 1 - args.window) // args.group_size * args.group_size
          groups = quantized_tokens // args.group_size
          statistics = split_statistics(
            queries[:, :, position],
            keys[:, :quantized_tokens],
            bits=bits,
            group_size=args.group_size,
            split_groups=split_groups or groups,
            sm_scale=sm_scale,
          )
          for collected, values in zip((exchange, gaps, offsets), statistics):
            collected.append(values)
      exchange, gaps, offsets = (np.concatenate(values) for values in (exchange, gaps, offsets))
      percentiles = lambda x: [
        float(np.percentile(x, 50)),
        float(np.percentile(x, 99)),
        float(x.max()),
      ]
      row = dict(
        bits=bits,
        split_groups=split_groups or "all",
        splits=int(exchange.size),
        exact_share=float(exchange.mean()),
        gap=percentiles(gaps),
        offset=percentiles(offsets),
      )
      rows.append(row)
      print(
        f"| {bits} | {row['split_groups']} | {row['splits']} | {100 * row['exact_share']:.2f}% "
        f"| {' / '.join(f'{v:.1f}' for v in row['gap'])} "
        f"| {' / '.join(f'{v:.1f}' for v in row['offset'])} |"
      )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        dict(model=args.model, tokens=len(token_ids), positions=positions, rows=rows), f, indent=1
      )


if __name__ == "__main__":
  main()
