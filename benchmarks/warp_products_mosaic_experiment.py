"""The per-warp products loop (KERNEL_NOTES v44) as a Pallas Mosaic GPU kernel: an experiment.

`warp_products_experiment.cu` says what the design costs written by hand; this says what it costs
in the library's own framework (built since, v45, as the "warp" variant,
`quantized_decode_attention_warp_mosaic_gpu`, from this experiment's inline pieces, which live in
`pallas_kernels.warp_key_product` and `pallas_kernels.warp_value_product` now). The same
computation and inputs as the CUDA experiment (`warp_products_experiment`'s arrays, model and
check), with Mosaic GPU's pieces:
- the ring: TMA copies of a 64-token block's key words, key scales, key bias (q . k_min, XLA's),
  value words and group-major value statistics, one barrier per slot;
- the key product: `plgpu.mma` (mma.sync per warp), A the key codes masked straight into the
  MMA_LHS layout (`stage_words_in_word_order(..., operand_layout="mma_lhs")`), B Q'^T of the
  block's two key groups [128, 16] staged in shared memory (a barrier) and loaded in MMA_RHS;
  each warp's 16 tokens take their own group's 8 columns;
- the softmax with the split's fixed reference, as array code on [64, 8];
- the value product per warp (`value_product_per_warp`, inline code): P' of the two slot pairings
  of value groups moved to B operands by `movmatrix`, the warp's own 16 tokens' value codes by
  one `ldmatrix.x4.trans`, 8 `mma.sync` into the warp's partial output, a [512, 8] f32 array in
  the wgmma layout (row 64 p + 16 w + r: warp w's m-tile p);
- a barrier per block before a slot is refilled (the folded kernel's ring protocol).
The kernel writes each warp's partial output and the per-lane sums as they are; `finish` adds
them up (numpy), so the outputs compare with `warp_products_experiment.model_outputs`.

Native only (inline PTX). Here it is lowered and counted for sm_90a without a GPU:

  MOSAIC_GPU_CUDA_ROOT=/usr/local/cuda-13.0 PYTHONPATH=. \\
    .venv-mosaic-analysis/bin/python benchmarks/warp_products_mosaic_experiment.py --count

and `--run` on the GPU machine checks it against the model and times it at the 32k shape.
"""

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warp_products_experiment as experiment  # noqa: E402

from pallas_kernels.warp_key_product import key_product_per_warp, own_token_words  # noqa: E402
from pallas_kernels.warp_value_product import (  # noqa: E402
  add_warp_partials,
  statistics_by_slot,
  value_product_per_warp,
)

BLOCK = 64
STAGES = 4
ROWS = 8  # the products' N: the 4 query rows, repeated
BITS = 2
QUERY_EXPONENT = 69  # `subnormal_codes`: queries times 2^(69 - bit), scores times 2^64
SCORE_SCALE = 2.0**64
PROBS_SCALE = 2.0**64


KEY_PRODUCTS = ("per_warp", "stacked")
STATISTICS = ("by_lane", "selects")


TILES = (1, 2)


def experiment_kernel(
  rows: int,
  tokens: int,
  splits: int,
  key_product: str = "per_warp",
  statistics: str = "by_lane",
  tiles: int = 1,
):
  """(kernel, its argument shapes) of the experiment for `rows` cache rows (batch x KV heads).
  key_product "per_warp": `key_product_per_warp` (each warp its own group's Q', built in
  registers: no staging, no barrier); "stacked": `plgpu.mma` against both groups' Q' staged in
  shared memory (a barrier), each token taking its group's columns. statistics "by_lane":
  `statistics_by_slot`; "selects": both groups' tiles broadcast and selected per column. tiles:
  16-token tiles a warp takes per block (blocks of 64 tiles tokens; 2: each warp one key group,
  its Q' built once for both; with "per_warp" and "by_lane" only)."""
  if tiles not in TILES:
    raise ValueError(f"tiles={tiles!r} is not supported; allowed: {TILES}")
  if tiles > 1 and (key_product, statistics) != ("per_warp", "by_lane"):
    raise ValueError(
      f"tiles={tiles} needs key_product='per_warp' and statistics='by_lane' (got "
      f"{key_product!r}, {statistics!r})"
    )
  if key_product not in KEY_PRODUCTS:
    raise ValueError(f"key_product={key_product!r} is not supported; allowed: {KEY_PRODUCTS}")
  if statistics not in STATISTICS:
    raise ValueError(f"statistics={statistics!r} is not supported; allowed: {STATISTICS}")
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels import _compat
  from pallas_kernels.word_operand_order import (
    load_channels_in_word_order,
    stage_words_in_word_order,
  )

  split_tokens = experiment.split_tokens(tokens, splits, tiles)
  groups = experiment.VALUE_GROUPS
  span = BLOCK * tiles  # tokens of a block
  wgmma = plgpu.Layout.WGMMA

  def body(
    lengths_gmem, queries_gmem, k_words_gmem, k_scale_gmem, key_bias_gmem, v_words_gmem,
    v_scale_gmem, v_min_gmem, reference_gmem, out_gmem, totals_gmem,
    lengths_smem, queries_smem, reference_smem, k_words_smem, k_scale_smem, key_bias_smem,
    v_words_smem, v_scale_smem, v_min_smem, stack_smem, partial_smem, out_smem, totals_smem,
    setup_barrier, ring_barriers,
  ):  # fmt: skip
    row, split = lax.axis_index("row"), lax.axis_index("split")
    plgpu.copy_gmem_to_smem(lengths_gmem, lengths_smem, setup_barrier)
    plgpu.copy_gmem_to_smem(queries_gmem.at[row], queries_smem, setup_barrier)
    plgpu.copy_gmem_to_smem(reference_gmem.at[row, split], reference_smem, setup_barrier)
    plgpu.barrier_wait(setup_barrier)
    start = split * split_tokens
    length = lengths_smem[row]
    blocks = (jnp.clip(length - start, 0, split_tokens) + span - 1) // span

    def fetch(i):
      slot, first = lax.rem(i, STAGES), start + i * span
      barrier = ring_barriers.at[slot]
      tokens_of = pl.ds(first, span)
      groups_of = pl.ds(first // experiment.GROUP, span // experiment.GROUP)
      plgpu.copy_gmem_to_smem(k_words_gmem.at[row, tokens_of], k_words_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(k_scale_gmem.at[row, groups_of], k_scale_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(key_bias_gmem.at[row, groups_of], key_bias_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(v_words_gmem.at[row, tokens_of], v_words_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(v_scale_gmem.at[row, :, tokens_of], v_scale_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(v_min_gmem.at[row, :, tokens_of], v_min_smem.at[slot], barrier)

    def fetch_by_first_warp(i):
      # the first warp alone issues the copies (the folded kernel's copy_issuer="first_warp")
      plgpu.warp_map(lambda warp: pl.when(warp == 0)(functools.partial(fetch, i)))

    for i in range(STAGES):
      pl.when(i < blocks)(functools.partial(fetch_by_first_warp, i))
    code_queries = plgpu.layout_cast(queries_smem[...], wgmma)  # bf16 [128, 8], word order
    # the same, as each lane's B-fragment pairs (loaded once: the per-warp key product's)
    lane_queries = plgpu.load(queries_smem, layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))
    reference = plgpu.layout_cast(reference_smem[...], wgmma.reduce(0))
    per_channel = functools.partial(
      lax.broadcast_in_dim, shape=(128, ROWS), broadcast_dimensions=[0]
    )
    per_token = functools.partial(
      lax.broadcast_in_dim, shape=(BLOCK, ROWS), broadcast_dimensions=[0]
    )
    per_column = functools.partial(
      lax.broadcast_in_dim, shape=(BLOCK, ROWS), broadcast_dimensions=[1]
    )
    token = plgpu.broadcasted_iota(jnp.int32, (BLOCK, ROWS), 0, layout=wgmma)
    if statistics == "selects":  # (made only where used: an unused value leaves layout
      # inference without a solution)
      token_of_vector = plgpu.broadcasted_iota(jnp.int32, (BLOCK,), 0, layout=wgmma.reduce(1))
      column_slot = plgpu.broadcasted_iota(jnp.int32, (BLOCK, ROWS), 1, layout=wgmma) // 4

    def step(i, state):
      acc, sums, min_low, min_high = state
      slot = lax.rem(i, STAGES)
      plgpu.barrier_wait(ring_barriers.at[slot])
      first_token = start + i * span
      if key_product == "per_warp":
        keys = [
          stage_words_in_word_order(
            own_token_words(k_words_smem.at[slot], t, tiles), BITS, operand_layout="mma_lhs"
          )
          for t in range(tiles)
        ]
        # the bias is in the scores (the accumulators start at it)
        tile_scores = key_product_per_warp(
          keys, lane_queries, k_scale_smem.at[slot], key_bias_smem.at[slot], tiles
        )
        tile_logits = [scores * SCORE_SCALE - per_column(reference) for scores in tile_scores]
      else:
        words = plgpu.layout_cast(k_words_smem[slot], wgmma)
        keys = stage_words_in_word_order(words, BITS, operand_layout="mma_lhs")
        second_group = token // experiment.GROUP == 1
        bias = [
          per_column(plgpu.layout_cast(key_bias_smem[slot, k, :], wgmma.reduce(0)))
          for k in range(2)
        ]
        for k in range(2):  # Q' of the block's two key groups, [k * 8 + j, position]
          k_scale = load_channels_in_word_order(k_scale_smem.at[slot, k], 128, BITS, False)
          stack_smem.at[pl.ds(ROWS * k, ROWS)].T[...] = code_queries * per_channel(k_scale)
        plgpu.commit_smem()  # Q' visible to every warp
        queries_stacked = plgpu.load(stack_smem.T, layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))
        zeros = plgpu.layout_cast(
          jnp.zeros((BLOCK, 2 * ROWS), jnp.float32), plgpu.Layout.MMA_ACC(jnp.bfloat16)
        )
        stacked = plgpu.mma(zeros, keys, queries_stacked)  # [64, 16]: both groups' scores
        scores = jnp.where(second_group, stacked[:, ROWS:], stacked[:, :ROWS])
        scores = scores * SCORE_SCALE + jnp.where(second_group, bias[1], bias[0])
        tile_logits = [scores - per_column(reference)]

      for t, logits in enumerate(tile_logits):
        # row 16 w + r of a tile is token 16 tiles w + 16 t + r of the block
        token_in_block = (token // 16) * (16 * tiles) + 16 * t + token % 16
        valid = token_in_block + first_token < length
        probs = jnp.where(valid, jnp.exp2(logits), 0.0)

        def statistic(ring, group):
          # zeroed past the length (p is 0 there, the statistics may be NaN), per token: 2
          # selects a thread, not 4 on the [64, 8] tile
          valid_token = token_of_vector + first_token < length
          vector = plgpu.layout_cast(ring[slot, group, :], wgmma.reduce(1)).astype(jnp.float32)
          return per_token(jnp.where(valid_token, vector, 0.0))

        def slot_tile(ring, b, t=t):
          if statistics == "by_lane":  # (past the length: see `statistics_by_slot`)
            return statistics_by_slot(ring.at[slot], b, t, tiles)
          return jnp.where(column_slot == 1, statistic(ring, 2 + b), statistic(ring, b))

        # slot s of the columns holds value group 2 s + b: b = 0 for m-tiles 0-3, 1 for 4-7
        pairs = []
        for b in range(2):
          scale, minimum = slot_tile(v_scale_smem, b), slot_tile(v_min_smem, b)
          pairs.append(((probs * scale * PROBS_SCALE).astype(jnp.bfloat16), probs * minimum))
        acc = value_product_per_warp(
          (pairs[0][0], pairs[1][0]), v_words_smem.at[slot], acc, t, tiles
        )
        sums, min_low, min_high = sums + probs, min_low + pairs[0][1], min_high + pairs[1][1]
      plgpu.commit_smem()  # every warp's reads of the slot done: it may be refilled
      pl.when(i + STAGES < blocks)(functools.partial(fetch_by_first_warp, i + STAGES))
      return acc, sums, min_low, min_high

    zero = plgpu.layout_cast(jnp.zeros((BLOCK, ROWS), jnp.float32), wgmma)
    init = (plgpu.layout_cast(jnp.zeros((512, ROWS), jnp.float32), wgmma), zero, zero, zero)
    acc, sums, min_low, min_high = lax.fori_loop(0, blocks, step, init)
    # Once per split: the sums over tokens, and the four warps' partial outputs added (through
    # shared memory), each channel from its slot's columns.
    for k, partial in enumerate((sums, min_low, min_high)):
      totals_smem[k, :] = partial.sum(axis=0)
    partial_smem[...] = acc
    plgpu.commit_smem()
    out_smem[...] = add_warp_partials(partial_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[row, split])
    plgpu.copy_smem_to_gmem(totals_smem, totals_gmem.at[row, split])
    plgpu.wait_smem_to_gmem(0)

  key_groups = tokens // experiment.GROUP
  kernel = plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct((rows, splits, 128, 4), jnp.float32),  # [channel, query row]
      # per column: the sum of p, of p v_min for pairing 0, for pairing 1
      jax.ShapeDtypeStruct((rows, splits, 3, ROWS), jnp.float32),
    ),
    grid=(rows, splits),
    grid_names=("row", "split"),
    scratch_types=[
      plgpu.SMEM((rows,), jnp.int32),
      plgpu.SMEM((128, ROWS), jnp.bfloat16),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((STAGES, span, 8), jnp.uint32),
      plgpu.SMEM((STAGES, span // experiment.GROUP, 128), jnp.bfloat16),
      plgpu.SMEM((STAGES, span // experiment.GROUP, ROWS), jnp.float32),
      plgpu.SMEM((STAGES, span, 8), jnp.uint32),
      plgpu.SMEM((STAGES, groups, span), jnp.bfloat16),
      plgpu.SMEM((STAGES, groups, span), jnp.bfloat16),
      plgpu.SMEM((2 * ROWS, 128), jnp.bfloat16),
      plgpu.SMEM((512, ROWS), jnp.float32),
      plgpu.SMEM((128, 4), jnp.float32),
      plgpu.SMEM((3, ROWS), jnp.float32),
      plgpu.Barrier(num_arrivals=3),
      plgpu.Barrier(num_arrivals=6, num_barriers=STAGES),
    ],
    compiler_params=_compat.mosaic_gpu_compiler_params(
      unsafe_no_auto_barriers=True, reduction_scratch_bytes=1024
    ),
  )
  shapes = (
    jax.ShapeDtypeStruct((rows,), jnp.int32),
    jax.ShapeDtypeStruct((rows, 128, ROWS), jnp.bfloat16),
    jax.ShapeDtypeStruct((rows, tokens, 8), jnp.uint32),
    jax.ShapeDtypeStruct((rows, key_groups, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((rows, key_groups, ROWS), jnp.float32),
    jax.ShapeDtypeStruct((rows, tokens, 8), jnp.uint32),
    jax.ShapeDtypeStruct((rows, groups, tokens), jnp.bfloat16),
    jax.ShapeDtypeStruct((rows, groups, tokens), jnp.bfloat16),
    jax.ShapeDtypeStruct((rows, splits, ROWS), jnp.float32),
  )
  return kernel, shapes


def prepare(arrays: dict, splits: int) -> tuple:
  """The kernel's inputs (numpy) from `warp_products_experiment`'s arrays: the queries in the
  key operand's word order, times 2^(69 - bit), rounded to bf16 and transposed to [128, 8] with
  the 4 rows repeated; the key bias and the references with their rows repeated."""
  from pallas_kernels.subnormal_codes import code_exponent
  from pallas_kernels.word_operand_order import word_order_channels

  channels = word_order_channels(128, BITS)  # the channel at each operand position
  scale = 2.0 ** (QUERY_EXPONENT - code_exponent(channels, 128, BITS))
  queries = arrays["queries"][:, :, channels] * scale  # [R, 4, 128] by position
  queries = experiment.bf16_bits(np.tile(queries, (1, 2, 1)).transpose(0, 2, 1).copy())
  repeat = lambda values: np.ascontiguousarray(np.tile(values, 2), np.float32)  # rows j % 4
  return (
    np.asarray(arrays["lengths"], np.int32),
    queries,  # bf16 bits [R, 128, 8]
    arrays["key_words"],
    arrays["k_scale"],
    repeat(arrays["key_bias"]),
    arrays["value_words"],
    arrays["v_scale"],
    arrays["v_min"],
    repeat(arrays["reference"]),
  )


def finish(out: np.ndarray, totals: np.ndarray):
  """The kernel's outputs (out [R, S, 128, 4] channel-major; totals [R, S, 3, 8]: per column the
  sum of p and of p v_min for each pairing of value groups) -> (out [R, S, 4, 128], sums
  [R, S, 4, 5]) as `warp_products_experiment.model_outputs` gives them: column 4 s + j is query
  row j in slot s, whose value group is 2 s + b for pairing b."""
  sums = np.zeros((*totals.shape[:2], 4, 1 + experiment.VALUE_GROUPS), np.float64)
  sums[..., 0] = totals[:, :, 0, :4]
  for b in range(2):
    for slot in range(2):
      sums[..., 1 + 2 * slot + b] = totals[:, :, 1 + b, 4 * slot : 4 * slot + 4]
  return np.swapaxes(out, 2, 3).astype(np.float64), sums


def run_on_gpu(iters: int = 100, repeats: int = 7) -> list:
  """On a GPU, for each key product at 16 tokens a warp and the per-warp one at 32 (with the
  statistics by lane): the kernel against the model
  (random inputs, a short row) and its time at the 32k shape (constant inputs, jitted calls back
  to back: the kernel alone), as `warp_products_experiment.run_on_gpu` does for the CUDA one."""
  import jax
  import jax.numpy as jnp
  from gear_terms_parts import time_call

  def device_inputs(prepared):
    # `prepare` gives the bf16 arrays as their uint16 bit patterns
    return [
      jax.device_put(jnp.asarray(a).view(jnp.bfloat16) if a.dtype == np.uint16 else jnp.asarray(a))
      for a in prepared
    ]

  results = []
  for key_product, tiles in (("per_warp", 1), ("stacked", 1), ("per_warp", 2)):
    rows, tokens, splits = 4, 2048, 2
    arrays = experiment.random_arrays(rows, tokens, splits)
    kernel, _ = experiment_kernel(rows, tokens, splits, key_product, tiles=tiles)
    raw = [np.asarray(x) for x in jax.jit(kernel)(*device_inputs(prepare(arrays, splits)))]
    out, sums = finish(*raw)
    model_out, model_sums = experiment.model_outputs(arrays, splits, tiles)
    result = {
      "key_product": key_product,
      "tiles": tiles,
      "device": jax.devices()[0].device_kind,
      "out_error": float(np.abs(out - model_out).max() / np.abs(model_out).max()),
      "sums_error": float(np.abs(sums - model_sums).max() / np.abs(model_sums).max()),
    }
    result["check_passed"] = bool(
      result["out_error"] <= experiment.CHECK_TOLERANCE["out"]
      and result["sums_error"] <= experiment.CHECK_TOLERANCE["sums"]
    )
    rows, tokens = experiment.BENCHMARK_ROWS, experiment.BENCHMARK_TOKENS
    splits = tokens // experiment.SPLIT_TOKENS
    shapes = experiment.array_shapes(rows, tokens, splits)
    constant = {
      name: np.full(shape, {"lengths": tokens}.get(name, 0), dtype)
      for name, (dtype, shape) in shapes.items()
    }
    kernel, _ = experiment_kernel(rows, tokens, splits, key_product, tiles=tiles)
    inputs = device_inputs(prepare(constant, splits))
    result["us"] = 1e6 * time_call(kernel, inputs, iters=iters, repeats=repeats)
    result["bytes"] = experiment.bytes_read(rows, tokens, splits)
    result["gbps"] = result["bytes"] / result["us"] / 1e3
    print(json.dumps(result), flush=True)
    results.append(result)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--count", action="store_true", help="lower and count for sm_90a (no GPU)")
  parser.add_argument("--run", action="store_true", help="check and time on a GPU")
  parser.add_argument("--out", help="write the result as JSON here")
  args = parser.parse_args()
  if args.count:  # every combination of the settings
    import tempfile

    import mosaic_static_cost
    import triton_static_cost

    device = mosaic_static_cost.compile_only_device()
    result = []
    settings = [(k, s, 1) for k in KEY_PRODUCTS for s in STATISTICS] + [("per_warp", "by_lane", 2)]
    for key_product, statistics, tiles in settings:
      kernel, shapes = experiment_kernel(64, 32768, 32, key_product, statistics, tiles)
      ptx, _ = mosaic_static_cost.ptx_of(kernel, shapes, device)
      with tempfile.TemporaryDirectory() as workdir:
        sass, usage, (live, _) = mosaic_static_cost.sass_of(ptx, workdir, "warp_products")
      cost = triton_static_cost.loop_cost(
        f"warp products (Mosaic GPU), key_product={key_product}, statistics={statistics}, "
        f"tiles={tiles}",
        sass,
        usage,
        "",
        tokens_per_iteration=BLOCK * tiles,
        warps=4,
      )
      result.append({**vars(cost), "live_registers": live})
  elif args.run:
    result = run_on_gpu()
  else:
    parser.error("give --count or --run")
  print(json.dumps(result, default=str, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, default=str, indent=1)


if __name__ == "__main__":
  main()
