"""Decode-attention kernels vs XLA: time per call, bytes read, achieved bandwidth.

Default sizes (the issue's): batch 8, 8 KV heads, 4 query heads per KV head, head_dim 128,
bf16 cache, contexts 8k / 32k / 128k, every row full. Measured in one run:

  copy       device-to-device elementwise copy (x + 1 over 1 GiB), bytes = read + written:
             the reference rate "% copy" divides by (a read-only kernel can pass 100%);
  xla_bf16   bf16 full-cache decode attention by XLA (einsum, f32 accumulation) - the baseline;
  xla_dpa    jax.nn.dot_product_attention (XLA) on a [B, T, H, D] bf16 cache;
  pallas_bf16  the full-precision Pallas kernel (Triton lowering) on the bf16 cache;
  mosaic_bf16  the full-precision Mosaic GPU kernel (TMA, wgmma) on the bf16 cache (GPU only;
             interpret mode in --small);
  kivi2 / kivi4  the fused dequantize-attention kernel on 2/4-bit codes (group 32, bf16 stats)
             with --kernel-config, by default the measured default (KERNEL_NOTES v29: folded
             Mosaic GPU on Hopper for 2 to 8 heads per KV head where it takes the segment,
             else folded Triton; `{"variant": "folded"}` names folded Triton);
  kivi2_mosaic / kivi4_mosaic  the same caches through the Mosaic GPU quantized kernel
             (`pallas_kernels/quantized_decode_attention_mosaic_gpu.py`: TMA ring, K and V
             dequantized into swizzled bf16 tiles, wgmma; --quantized-mosaic-kernel-config adds
             settings; GPU only, interpret mode in --small; left out where it does not take the
             segment, e.g. 2-bit codes at head_dim 64);
  kivi2_mosaic_folded / kivi4_mosaic_folded  the same caches through the folded Mosaic GPU
             kernel (`pallas_kernels/quantized_decode_attention_folded_mosaic_gpu.py`: the same
             ring, scales folded into stacked queries / probabilities, codes staged by masking
             as subnormal bf16 operands; --folded-mosaic-kernel-config adds settings);
  gear2      the same with GEAR terms (rank 4, 2% outliers, block 64), by default
             (gear_terms="xla") computed by XLA around the kernel, which reads the codes as
             for KIVI (`pallas_kernels/gear_terms_xla.py`);
  gear2_kernel_terms  the same GEAR cache with kernel setting gear_terms="kernel": the terms
             fused into the kernel, one GEAR block per step (--gear-kernel-terms-config adds
             settings);
  kivi2_xla / kivi4_xla / gear2_xla  the same compressed caches through the jnp reference path
             (dequantize, then attention) compiled by XLA, i.e. `implementation="reference"`;
             its bytes column is the compressed cache's too (it reads those, and writes and
             reads back its dequantized copy on top).

Time per call: a jitted lax.fori_loop runs the op `--iters` times back to back (each call's
query depends on the previous output, and the cache passes an optimisation barrier with the
query, so no computation is hoisted; see time_op for layouts), the wall time of the whole loop
after block_until_ready is divided by the count; the median of `--repeats` such loops is
reported, after a warm-up. Bytes: what the op must read (codes, scales, minimums, factors,
outliers of the valid tokens; K and V for bf16); bandwidth = bytes / time. Each kernel's output
is also checked against the jnp reference (relative L2 error) on the same inputs, and so is each
--sweep config's (one past SWEEP_ERROR_LIMIT is marked "wrong" and never picked).

  python benchmarks/decode_attention.py --out bench.json          # GPU (or TPU)
  python benchmarks/decode_attention.py --small --out small.json  # CPU, interpret mode, tiny
"""

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from kvjax import attention_dispatch
from pallas_kernels import quantized_decode_attention_gpu
from pallas_kernels.decode_attention_reference import decode_attention_reference
from pallas_kernels.quantized_decode_attention_reference import quantized_decode_attention_reference
from pallas_kernels.random_inputs import random_quantized_segment
from pallas_kernels.subnormal_codes import CODE_OPERANDS


def time_op(op, args, *, iters: int, repeats: int) -> float:
  """Median seconds per call of op(queries, *rest) -> (out, lse), run `iters` times in a loop."""
  loop = timed_loop(op, iters)
  jax.block_until_ready(loop(*args))  # compile + warm-up
  jax.block_until_ready(loop(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(loop(*args))
    samples.append((time.perf_counter() - start) / iters)
  return statistics.median(samples)


def timed_loop(op, iters: int):
  """The jitted loop `time_op` times: op(queries, *rest) called `iters` times back to back."""

  @jax.jit
  def loop(queries, *rest):
    def body(_, q):
      # The cache passes a barrier together with the loop-carried query, so no computation on
      # it is hoisted out of the loop (in decoding the cache changes every step). XLA may still
      # carry it in the layout a kernel reads: the folded Mosaic wrapper's transpose of the
      # value statistics then runs once, before the loop, as it does in kvjax's decode loop
      # (benchmarks/value_stats_layout.py; a standalone jitted call pays it every time).
      q, cache = jax.lax.optimization_barrier((q, rest))
      out, _ = op(q, *cache)
      # A tiny data dependency on the previous output: calls run in order, none is hoisted.
      return (q.astype(jnp.float32) + 1e-6 * out).astype(q.dtype)

    return jax.lax.fori_loop(0, iters, body, queries)

  return loop


def copy_bandwidth(*, nbytes: int, iters: int, repeats: int) -> dict:
  words = jax.random.bits(jax.random.key(7), (nbytes // 4,), jnp.uint32)

  @jax.jit
  def loop(x):
    return jax.lax.fori_loop(0, iters, lambda _, y: y + jnp.uint32(1), x)

  jax.block_until_ready(loop(words))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(loop(words))
    samples.append((time.perf_counter() - start) / iters)
  seconds = statistics.median(samples)
  moved = 2 * nbytes
  return {"name": "copy", "seconds": seconds, "bytes": moved, "gbps": moved / seconds / 1e9}


def xla_bf16_attention(queries, keys, values, lengths, *, sm_scale):
  """The baseline: full-cache decode attention as XLA does it (bf16 operands, f32 accumulate)."""
  scores = (
    jnp.einsum(
      "bhgd,bhtd->bhgt", queries.astype(keys.dtype), keys, preferred_element_type=jnp.float32
    )
    * sm_scale
  )
  valid = jnp.arange(keys.shape[2])[None, :] < lengths[:, None]
  scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.exp(scores - lse[..., None]).astype(values.dtype)
  out = jnp.einsum("bhgt,bhtd->bhgd", probs, values, preferred_element_type=jnp.float32)
  return out, lse


def xla_dpa_attention(queries, keys_bthd, values_bthd, lengths, *, sm_scale):
  """jax.nn.dot_product_attention (XLA implementation) on a [B, T, H, D] cache."""
  batch, kv_heads, group, head_dim = queries.shape
  q = queries.reshape(batch, 1, kv_heads * group, head_dim).astype(keys_bthd.dtype)
  out = jax.nn.dot_product_attention(
    q, keys_bthd, values_bthd, scale=sm_scale, key_value_seq_lengths=lengths, implementation="xla"
  )
  out = out.reshape(batch, kv_heads, group, head_dim).astype(jnp.float32)
  return out, jnp.zeros((batch, kv_heads, group), jnp.float32)


def _quantized_reference(queries, segment, lengths, **kwargs):
  # GEAR arrays come in as arguments (a closure would make them compile-time constants).
  return quantized_decode_attention_reference(
    queries, *segment[:6], lengths, lowrank=segment.lowrank, outliers=segment.outliers, **kwargs
  )


# A swept config whose output is further than this from the jnp reference on the same codes
# (relative L2) is wrong: the kernels' bf16 operands leave ~5e-3 (folded Triton 4.45e-3 at 256
# tokens, interpret mode), a misplaced operand or statistic O(0.1) to O(1).
SWEEP_ERROR_LIMIT = 5e-2


def relative_error(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(out)):
    return float("nan")
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def quantized_bytes(segment, lengths, tokens) -> int:
  """Bytes of every stored array the kernel reads for the valid tokens (rows may differ)."""
  fraction = float(np.sum(np.asarray(lengths))) / (len(lengths) * tokens)
  arrays = [x for x in segment[:6]]
  if segment.lowrank is not None:
    arrays += list(segment.lowrank)
  if segment.outliers is not None:
    arrays += list(segment.outliers)
  return int(sum(x.size * x.dtype.itemsize for x in arrays) * fraction)


def check_grid(args) -> list[dict]:
  """Kernel vs reference on fresh random inputs over the shape grid, with poisoned outputs."""
  from pallas_kernels import (
    gear_terms_xla,
    quantized_decode_attention_tpu,
    quantized_decode_attention_triton,
  )
  from pallas_kernels.splits import merge_split_partials

  # The kernels of --check-family, or of this backend's (the GPU kernels on CPU); interpreted
  # in the CPU smoke run (--small) and wherever they are not this backend's.
  backend_family, _ = attention_dispatch.choose_kernel_family("auto", None)  # or "reference"
  family = args.check_family or ("gpu" if backend_family == "reference" else backend_family)
  on_tpu = family == "tpu"
  interpret = args.small or family != backend_family
  results = []
  batch, tokens = 3, 960  # capacity: a multiple of group 32 and GEAR block 64, not of 256
  rng = np.random.default_rng(0)
  cases = []
  for head_dim in (64, 128):
    for group in (1, 4, 8):
      for bits in (2, 4, 8):
        for gear in (False, True):
          dtype = jnp.bfloat16 if (bits + group + gear) % 2 == 0 else jnp.float32
          cases.append((head_dim, group, bits, gear, dtype))
  if args.small:
    cases = cases[::9]
  for head_dim, group, bits, gear, dtype in cases:
    key = jax.random.key(int(rng.integers(1 << 30)))
    keys_split = jax.random.split(key, 4)
    lengths = jnp.asarray([tokens, int(rng.integers(1, tokens)), 0], jnp.int32)
    queries = jax.random.normal(keys_split[0], (batch, 2, group, head_dim), jnp.float32)
    sm_scale = 1.0 / math.sqrt(head_dim)
    segment = random_quantized_segment(
      keys_split[1],
      batch,
      2,
      tokens,
      head_dim,
      bits=bits,
      group_size=32,
      dtype=dtype,
      rank=3 if gear else 0,
      outliers_per_block=40 if gear else 0,
    )
    kwargs = dict(
      bits=bits,
      group_size=32,
      sm_scale=sm_scale,
      lowrank=segment.lowrank,
      outliers=segment.outliers,
    )
    name = f"quantized D={head_dim} G={group} bits={bits} gear={gear} {jnp.dtype(dtype).name}"
    row = {"name": name}
    try:
      ref_out, ref_lse = quantized_decode_attention_reference(
        queries, *segment[:6], lengths, **kwargs
      )
      if on_tpu:
        partials_fn = functools.partial(
          quantized_decode_attention_tpu.quantized_decode_attention_partials_tpu,
          num_splits=3,
        )
      else:
        # GEAR's terms as the dispatch computes them by default for the folded kernel: by XLA
        # around it, from the scores it writes.
        xla_terms = {"gear_terms": "xla"} if gear and args.check_variant == "folded" else {}
        partials_fn = functools.partial(
          quantized_decode_attention_triton.quantized_decode_attention_partials_triton,
          num_splits=3,
          variant=args.check_variant,
          **xla_terms,
        )
      partials_fn = functools.partial(partials_fn, interpret=interpret, **kwargs)
      # Every output buffer poisoned, in the shapes the kernel plans (its split count may be
      # below the 3 asked for; a GEAR call may also write its scores).
      shapes = jax.eval_shape(partials_fn, queries, *segment[:6], lengths)
      poison = [jnp.full(x.shape, jnp.nan, x.dtype) for x in shapes]
      partials = partials_fn(queries, *segment[:6], lengths, tuple(poison))
      out_p, lse_p = partials[:2]
      out, lse = merge_split_partials(out_p, lse_p, group)
      if not on_tpu:  # the planar/joined/folded GPU kernels' outputs come in their own order
        order = quantized_decode_attention_triton.output_channel_order(
          head_dim,
          bits,
          32,
          args.check_variant,
          quantized_decode_attention_triton.compute_dtype_for(jnp.dtype(dtype)),
        )
        out = out[..., np.argsort(order)]
      if len(partials) == 3:  # GEAR terms by XLA from the scores the GPU kernel wrote
        scores = partials[2]
        written = np.arange(scores.shape[-1])[None, :] < np.asarray(lengths)[:, None]
        written = np.broadcast_to(written[:, None, None], scores.shape)
        row["unwritten_scores"] = int(
          np.isnan(np.asarray(scores)[:, :, :group][written[:, :, :group]]).sum()
        )
        out = out + gear_terms_xla.gear_value_terms_from_scores(
          segment.lowrank, segment.outliers, scores, lse, lengths, block=64, head_dim=head_dim
        )
      row["unwritten"] = int(np.isnan(np.asarray(out_p)).sum() + np.isnan(np.asarray(lse_p)).sum())
      row["relative_error"] = relative_error(out, ref_out)
      finite = np.isfinite(np.asarray(ref_lse))
      lse_error = np.abs(np.asarray(lse)[finite] - np.asarray(ref_lse)[finite])
      row["lse_max_abs_error"] = float(np.max(lse_error))
      row["empty_row_ok"] = bool(
        np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))
      )
    except Exception as e:  # keep going: report every case
      row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    results.append(row)
    print("  check", row, flush=True)
  for head_dim in (64, 128):
    for group in (1, 4, 8):
      dtype = jnp.bfloat16 if group != 4 else jnp.float32
      key = jax.random.key(int(rng.integers(1 << 30)))
      keys_split = jax.random.split(key, 3)
      lengths = jnp.asarray([1000, int(rng.integers(1, 1000)), 0], jnp.int32)
      queries = jax.random.normal(keys_split[0], (batch, 2, group, head_dim), jnp.float32)
      shape = (batch, 2, 1000, head_dim)
      keys = jax.random.normal(keys_split[1], shape, jnp.float32).astype(dtype)
      values = jax.random.normal(keys_split[2], shape, jnp.float32).astype(dtype)
      # The Mosaic GPU kernel takes 16-bit caches only (wgmma operands).
      lowerings = ["triton", "mosaic_gpu"] if not on_tpu and dtype != jnp.float32 else [None]
      for lowering in lowerings:
        name = f"full D={head_dim} G={group} {jnp.dtype(dtype).name}" + (
          f" {lowering}" if lowering else ""
        )
        row = {"name": name}
        try:
          ref_out, _ = decode_attention_reference(queries, keys, values, lengths, sm_scale=0.1)
          out, lse = attention_dispatch.decode_attention(
            queries,
            keys,
            values,
            lengths,
            sm_scale=0.1,
            implementation="interpret" if interpret else "pallas",
            kernel_backend="tpu" if on_tpu else "gpu",
            kernel_config={"lowering": lowering} if lowering else None,
          )
          row["relative_error"] = relative_error(out, ref_out)
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        results.append(row)
        print("  check", row, flush=True)
  return results


def sweep(args) -> tuple[dict, dict, dict, dict | None, list[dict]]:
  """Times kernel settings at 32k; returns the best kivi2 config (Triton), the best bf16 Triton
  config, the best bf16 Mosaic GPU config, the best kivi2 Mosaic GPU config per variant
  ({variant: config}, "dequantize" and / or "folded": those swept) and every kivi2 setting's
  time ([{"config", "seconds"}])."""
  batch, kv_heads, group, head_dim = args.batch, args.kv_heads, args.group, args.head_dim
  tokens = args.sweep_context
  sm_scale = 1.0 / math.sqrt(head_dim)
  keys_split = jax.random.split(jax.random.key(11), 4)
  queries = jax.random.normal(keys_split[0], (batch, kv_heads, group, head_dim))
  queries = queries.astype(jnp.bfloat16)
  lengths = jnp.full((batch,), tokens, jnp.int32)
  segment = random_quantized_segment(
    keys_split[1],
    batch,
    kv_heads,
    tokens,
    head_dim,
    bits=args.sweep_bits,
    group_size=args.group_size,
    dtype=jnp.bfloat16,
  )
  best_quantized, best_full, best_mosaic = (
    ({}, float("inf")),
    ({}, float("inf")),
    ({}, float("inf")),
  )
  best_quantized_mosaic = {}  # variant -> (config, seconds)
  quantized_timings = []
  quantized_configs = [
    dict(variant="reshape", block_tokens=128, num_warps=4, num_stages=3, num_splits=32),
    dict(variant="planar", unroll=2, num_warps=4, num_stages=2, num_splits=8),
  ]
  # The static analysis's candidates (benchmarks/triton_static_cost.py): "joined", and
  # "folded" (scales folded into stacked q / p, ~5 instructions per cached element).
  # (block_tokens, num_warps, num_stages, num_splits or None for the planner's choice)
  candidate_settings = {
    "joined": [
      (64, 4, 3, None),
      (64, 4, 3, 32),
      (64, 4, 2, None),
      (128, 4, 3, None),
      (128, 4, 3, 32),
      (64, 8, 3, None),
      (128, 8, 3, None),
      (32, 4, 3, None),
    ],
    "folded": [
      (128, 4, 3, None),
      (128, 4, 3, 32),
      (128, 4, 2, None),
      (128, 4, 4, None),
      (64, 4, 3, None),
      (256, 4, 3, None),
      (128, 8, 3, None),
      (128, 2, 3, None),
    ],
  }
  for variant, settings in candidate_settings.items():
    for block_tokens, num_warps, num_stages, num_splits in settings:
      config = dict(
        variant=variant, block_tokens=block_tokens, num_warps=num_warps, num_stages=num_stages
      )
      if num_splits is not None:
        config["num_splits"] = num_splits
      quantized_configs.append(config)
  # The ncu profile of folded (KERNEL_NOTES v8) showed 17% of warp stalls waiting on global
  # loads: the same settings with the next block's loads issued one step ahead, with both code
  # encodings (v9: "subnormal" unpacks a pair in one AND, "offset" in a shift, an AND-OR and a
  # subtraction).
  for code_operand in CODE_OPERANDS:
    for block_tokens, num_warps, num_stages in ((128, 4, 3), (128, 4, 2), (64, 4, 3), (128, 2, 3)):
      quantized_configs.append(
        dict(
          variant="folded",
          block_tokens=block_tokens,
          num_warps=num_warps,
          num_stages=num_stages,
          prefetch=True,
          code_operand=code_operand,
        )
      )
  if args.sweep_configs:
    quantized_configs = json.loads(args.sweep_configs)
  # Each config's output against the jnp reference on the same codes, so that a setting whose
  # kernel is wrong on this GPU (new inline code runs natively for the first time in a sweep) is
  # named and never picked, whatever its time.
  reference, _ = jax.jit(
    functools.partial(
      _quantized_reference,
      bits=args.sweep_bits,
      group_size=args.group_size,
      sm_scale=sm_scale,
    )
  )(queries, segment, lengths)
  for config in quantized_configs:
    op = lambda q, s, lens, config=config: attention_dispatch.quantized_decode_attention(
      q,
      *s[:6],
      lens,
      bits=args.sweep_bits,
      group_size=args.group_size,
      sm_scale=sm_scale,
      implementation="pallas",
      kernel_config=config,
    )
    try:
      seconds = time_op(op, (queries, segment, lengths), iters=args.iters, repeats=3)
    except Exception as e:  # a setting that fails to compile is reported, not fatal
      print(
        f"  sweep kivi{args.sweep_bits} {config}: {type(e).__name__}: {str(e)[:300]}", flush=True
      )
      continue
    out, _ = jax.jit(op)(queries, segment, lengths)
    error = relative_error(out, reference)
    wrong = not error <= SWEEP_ERROR_LIMIT  # NaN too
    print(
      f"  sweep kivi{args.sweep_bits} {config}: {seconds * 1e6:.1f} us, rel.err {error:.2e}"
      + (f" (WRONG: over {SWEEP_ERROR_LIMIT}, not picked)" if wrong else ""),
      flush=True,
    )
    quantized_timings.append(
      {"config": config, "seconds": seconds, "relative_error": error, "wrong": wrong}
    )
    if wrong:
      continue
    # The Mosaic GPU configs compete among themselves, per variant: the table times each in
    # its own row, beside the Triton kernel's.
    if config.get("lowering") == "mosaic_gpu":
      variant = config.get("variant", "dequantize")
      if seconds < best_quantized_mosaic.get(variant, (None, float("inf")))[1]:
        best_quantized_mosaic[variant] = (config, seconds)
    elif seconds < best_quantized[1]:
      best_quantized = (config, seconds)
  del segment
  if args.sweep_configs:  # a focused sweep of quantized settings only
    print(
      f"best kivi2 config {best_quantized}, best kivi2 Mosaic GPU config {best_quantized_mosaic}",
      flush=True,
    )
    mosaic_configs = {k: v[0] for k, v in best_quantized_mosaic.items()}
    return best_quantized[0], {}, {}, mosaic_configs, quantized_timings
  shape = (batch, kv_heads, tokens, head_dim)
  keys = jax.random.normal(keys_split[2], shape).astype(jnp.bfloat16)
  values = jax.random.normal(keys_split[3], shape).astype(jnp.bfloat16)
  full_configs = [dict(block_tokens=b, num_warps=4, num_stages=2) for b in (32, 64)]
  # Mosaic GPU (TMA ring of num_stages slots, wgmma): (block_tokens, num_stages, num_splits)
  for block_tokens, num_stages, num_splits in (
    (64, 2, None),
    (64, 3, None),
    (64, 4, None),
    (128, 2, None),
    (128, 3, None),
    (64, 3, 32),
  ):
    config = dict(lowering="mosaic_gpu", block_tokens=block_tokens, num_stages=num_stages)
    if num_splits is not None:
      config["num_splits"] = num_splits
    full_configs.append(config)
  for config in full_configs:
    op = lambda q, k, v, lens, config=config: attention_dispatch.decode_attention(
      q, k, v, lens, sm_scale=sm_scale, implementation="pallas", kernel_config=config
    )
    try:
      seconds = time_op(op, (queries, keys, values, lengths), iters=args.iters, repeats=3)
    except Exception as e:  # a setting that fails to compile is reported, not fatal
      print(f"  sweep bf16 {config}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    print(f"  sweep bf16 {config}: {seconds * 1e6:.1f} us", flush=True)
    if config.get("lowering") == "mosaic_gpu":
      if seconds < best_mosaic[1]:
        best_mosaic = ({k: v for k, v in config.items() if k != "lowering"}, seconds)
    elif seconds < best_full[1]:
      best_full = (config, seconds)
  print(
    f"best kivi2 config {best_quantized}, best bf16 config {best_full}, best Mosaic GPU bf16 "
    f"config {best_mosaic}",
    flush=True,
  )
  best_mosaic_configs = {k: v[0] for k, v in best_quantized_mosaic.items()}
  return best_quantized[0], best_full[0], best_mosaic[0], best_mosaic_configs, quantized_timings


def run(args) -> dict:
  backend = jax.default_backend()
  implementation = "interpret" if args.small else "pallas"
  batch, kv_heads, group, head_dim = args.batch, args.kv_heads, args.group, args.head_dim
  sm_scale = 1.0 / math.sqrt(head_dim)
  dtype = jnp.bfloat16
  results = {
    "device": str(jax.devices()[0].device_kind),
    "backend": backend,
    "jax_version": jax.__version__,
    "implementation": implementation,
    "sizes": {
      "batch": batch,
      "kv_heads": kv_heads,
      "group": group,
      "head_dim": head_dim,
      "cache_dtype": "bfloat16",
      "group_size": args.group_size,
    },
    "iters": args.iters,
    "repeats": args.repeats,
    "rows": [],
  }
  copy = copy_bandwidth(nbytes=args.copy_bytes, iters=args.iters, repeats=args.repeats)
  results["copy"] = copy
  print(f"device {results['device']} ({backend}), jax {jax.__version__}")
  print(
    f"copy: {copy['gbps']:.0f} GB/s (read + write of {args.copy_bytes / 2**30:.2f} GiB)", flush=True
  )
  kernel_config = json.loads(args.kernel_config) if args.kernel_config else {}
  full_kernel_config = json.loads(args.full_kernel_config) if args.full_kernel_config else {}
  mosaic_kernel_config = json.loads(args.mosaic_kernel_config) if args.mosaic_kernel_config else {}
  gear_kernel_terms_config = (
    json.loads(args.gear_kernel_terms_config) if args.gear_kernel_terms_config else {}
  )
  results["gear_kernel_terms_config"] = gear_kernel_terms_config
  mosaic_settings = args.quantized_mosaic_kernel_config
  quantized_mosaic_config = {
    "lowering": "mosaic_gpu",
    **(json.loads(mosaic_settings) if mosaic_settings else {}),
  }
  if args.check:
    results["check"] = check_grid(args)
  folded_settings = args.folded_mosaic_kernel_config
  folded_mosaic_config = {
    "lowering": "mosaic_gpu",
    "variant": "folded",
    **(json.loads(folded_settings) if folded_settings else {}),
  }
  if args.sweep and not args.small:
    kernel_config, full_kernel_config, mosaic_kernel_config, swept_mosaic, timings = sweep(args)
    results["sweep_kivi2"] = timings
    if args.sweep_only:
      return results
    quantized_mosaic_config = swept_mosaic.get("dequantize", quantized_mosaic_config)
    folded_mosaic_config = swept_mosaic.get("folded", folded_mosaic_config)
  results["quantized_mosaic_kernel_config"] = quantized_mosaic_config
  results["folded_mosaic_kernel_config"] = folded_mosaic_config
  results["kernel_config"], results["full_kernel_config"] = kernel_config, full_kernel_config
  results["mosaic_kernel_config"] = mosaic_kernel_config
  on_gpu = backend in ("gpu", "cuda")

  for tokens in args.contexts:
    key = jax.random.key(tokens)
    keys_split = jax.random.split(key, 8)
    queries = jax.random.normal(
      keys_split[0], (batch, kv_heads, group, head_dim), jnp.float32
    ).astype(dtype)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    shape = (batch, kv_heads, tokens, head_dim)
    keys = jax.random.normal(keys_split[1], shape, jnp.float32).astype(dtype)
    values = jax.random.normal(keys_split[2], shape, jnp.float32).astype(dtype)
    bf16_bytes = 2 * keys.size * keys.dtype.itemsize
    rows = []

    def record(name, op, op_args, nbytes, reference=None, tokens=tokens, rows=rows):
      seconds = time_op(op, op_args, iters=args.iters, repeats=args.repeats)
      row = {
        "context": tokens,
        "name": name,
        "seconds": seconds,
        "bytes": nbytes,
        "gbps": nbytes / seconds / 1e9,
        "fraction_of_copy": nbytes / seconds / 1e9 / copy["gbps"],
      }
      if reference is not None:
        out, _ = jax.jit(op)(*op_args)
        row["relative_error"] = relative_error(out, reference)
      rows.append(row)
      print(
        f"  {tokens:>7} {name:<20} {seconds * 1e6:9.1f} us  {nbytes / 1e6:9.1f} MB  "
        f"{row['gbps']:7.0f} GB/s  {100 * row['fraction_of_copy']:5.1f}% of copy"
        + (f"  rel.err {row['relative_error']:.2e}" if "relative_error" in row else ""),
        flush=True,
      )
      return row

    reference_full, _ = jax.jit(functools.partial(decode_attention_reference, sm_scale=sm_scale))(
      queries, keys, values, lengths
    )
    record(
      "xla_bf16",
      functools.partial(xla_bf16_attention, sm_scale=sm_scale),
      (queries, keys, values, lengths),
      bf16_bytes,
      reference_full,
    )
    if not args.small:
      keys_bthd, values_bthd = (jnp.swapaxes(x, 1, 2) for x in (keys, values))
      record(
        "xla_dpa",
        functools.partial(xla_dpa_attention, sm_scale=sm_scale),
        (queries, keys_bthd, values_bthd, lengths),
        bf16_bytes,
      )
      del keys_bthd, values_bthd
    record(
      "pallas_bf16",
      functools.partial(
        attention_dispatch.decode_attention,
        sm_scale=sm_scale,
        implementation=implementation,
        kernel_config=full_kernel_config,
      ),
      (queries, keys, values, lengths),
      bf16_bytes,
      reference_full,
    )
    if on_gpu or args.small:  # the Mosaic GPU kernel (interpret mode in the CPU smoke run)
      record(
        "mosaic_bf16",
        functools.partial(
          attention_dispatch.decode_attention,
          sm_scale=sm_scale,
          implementation=implementation,
          kernel_config={"lowering": "mosaic_gpu", **mosaic_kernel_config},
        ),
        (queries, keys, values, lengths),
        bf16_bytes,
        reference_full,
      )
    del keys, values, reference_full

    variants = [("kivi2", 2, 0, 0), ("kivi4", 4, 0, 0)]
    if args.gear:
      variants.append(("gear2", 2, 4, max(1, int(0.02 * 64 * head_dim))))
    for name, bits, rank, outliers in variants:
      segment = random_quantized_segment(
        keys_split[3 + bits],
        batch,
        kv_heads,
        tokens,
        head_dim,
        bits=bits,
        group_size=args.group_size if not rank else 64,
        dtype=dtype,
        rank=rank,
        outliers_per_block=outliers,
      )
      group_size = args.group_size if not rank else 64
      quant_kwargs = dict(bits=bits, group_size=group_size, sm_scale=sm_scale)
      reference, _ = jax.jit(functools.partial(_quantized_reference, **quant_kwargs))(
        queries, segment, lengths
      )

      def op(
        q,
        segment,
        lengths,
        bits=bits,
        group_size=group_size,
        path=implementation,
        config=kernel_config,
      ):
        # GEAR arrays come in as arguments (a closure would make them compile-time constants).
        return attention_dispatch.quantized_decode_attention(
          q,
          *segment[:6],
          lengths,
          bits=bits,
          group_size=group_size,
          sm_scale=sm_scale,
          lowrank=segment.lowrank,
          outliers=segment.outliers,
          implementation=path,
          kernel_config=config,  # unused on the reference path
        )

      nbytes = quantized_bytes(segment, lengths, tokens)
      record(name, op, (queries, segment, lengths), nbytes, reference)

      configured_rows = []  # (row name, kernel_config) timed on the same segment
      # Each Mosaic GPU variant in its own row, where it takes the segment (where it does not,
      # the entry point would run the Triton kernel: the same row again).
      for suffix, mosaic_config in (
        ("_mosaic", quantized_mosaic_config),
        ("_mosaic_folded", folded_mosaic_config),
      ):
        refusal = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
          queries,
          segment.k_codes,
          segment.k_scale,
          segment.v_scale,
          config=mosaic_config,
          bits=bits,
          group_size=group_size,
          lowrank=segment.lowrank,
          outliers=segment.outliers,
        )
        if (on_gpu or args.small) and refusal is None:
          configured_rows.append((f"{name}{suffix}", mosaic_config))
      if (rank or outliers) and backend != "tpu":  # a GPU (Triton folded) setting
        kernel_terms_config = {
          **kernel_config,
          "gear_terms": "kernel",
          **gear_kernel_terms_config,
        }
        configured_rows.append((f"{name}_kernel_terms", kernel_terms_config))
      for row_name, config in configured_rows:
        record(
          row_name,
          functools.partial(op, config=config),
          (queries, segment, lengths),
          nbytes,
          reference,
        )
      # The same compressed cache through the jnp path (dequantize, then attention) compiled by
      # XLA: what `implementation="reference"` costs a user on this device. (It is the function
      # the errors are measured against, so it has no error column.)
      record(
        f"{name}_xla", functools.partial(op, path="reference"), (queries, segment, lengths), nbytes
      )
      del segment, reference

    baseline = next(r for r in rows if r["name"] == "xla_bf16")["seconds"]
    for row in rows:
      row["speedup_vs_xla_bf16"] = baseline / row["seconds"]
    results["rows"] += rows

  print()
  print(
    f"device {results['device']}, jax {jax.__version__}, copy ceiling "
    f"{copy['gbps']:.0f} GB/s; time = median per call"
  )
  print(
    f"{'context':>8} {'op':<20} {'us/call':>9} {'MB read':>9} {'GB/s':>7} "
    f"{'%copy':>6} {'x XLA bf16':>10} {'rel.err':>9}"
  )
  for row in results["rows"]:
    err = row.get("relative_error")
    print(
      f"{row['context']:>8} {row['name']:<20} {row['seconds'] * 1e6:9.1f} "
      f"{row['bytes'] / 1e6:9.1f} {row['gbps']:7.0f} {100 * row['fraction_of_copy']:6.1f} "
      f"{row['speedup_vs_xla_bf16']:10.2f} " + (f"{err:9.2e}" if err is not None else "")
    )
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--small", action="store_true", help="tiny sizes, kernels in interpret mode (CPU smoke run)"
  )
  parser.add_argument("--out", help="write the results as JSON here")
  parser.add_argument("--contexts", type=int, nargs="+")
  parser.add_argument("--iters", type=int)
  parser.add_argument("--repeats", type=int)
  parser.add_argument("--no-gear", dest="gear", action="store_false")
  parser.add_argument("--group-size", type=int, default=32)
  parser.add_argument(
    "--kernel-config",
    help="JSON dict of quantized-kernel settings (block_tokens, num_warps, num_stages, num_splits)",
  )
  parser.add_argument(
    "--full-kernel-config", help="JSON dict of full-precision (Triton) kernel settings"
  )
  parser.add_argument(
    "--mosaic-kernel-config",
    help="JSON dict of the Mosaic GPU full-precision kernel's settings (block_tokens, "
    "num_stages, num_splits) for the mosaic_bf16 row",
  )
  parser.add_argument(
    "--quantized-mosaic-kernel-config",
    help="JSON dict of the Mosaic GPU quantized kernel's settings (block_tokens, num_stages, "
    "num_splits) for the kivi2_mosaic / kivi4_mosaic rows",
  )
  parser.add_argument(
    "--folded-mosaic-kernel-config",
    help="JSON dict of the folded Mosaic GPU quantized kernel's settings (block_tokens, "
    "num_stages, num_splits) for the kivi2_mosaic_folded / kivi4_mosaic_folded rows",
  )
  parser.add_argument(
    "--gear-kernel-terms-config",
    help='JSON dict of settings added for the gear2_kernel_terms row (e.g. {"prefetch": false})',
  )
  parser.add_argument(
    "--check",
    action="store_true",
    help="first check kernels against the references over a shape grid",
  )
  parser.add_argument(
    "--check-family",
    default=None,
    choices=["gpu", "tpu"],
    help="which kernels --check runs (default: this backend's; on CPU the GPU kernels)",
  )
  parser.add_argument(
    "--check-variant",
    default="folded",
    choices=["reshape", "planar", "joined", "folded"],
    help="which GPU quantized-kernel variant --check runs",
  )
  parser.add_argument(
    "--sweep", action="store_true", help="time kernel settings at --sweep-context and use the best"
  )
  parser.add_argument("--sweep-context", type=int, default=32768)
  parser.add_argument(
    "--sweep-bits",
    type=int,
    default=2,
    choices=(2, 4),
    help="code width of the swept segment (with --sweep-configs and --sweep-only: the timings "
    "stay under sweep_kivi2 in --out, labelled kivi<bits> in the log)",
  )
  parser.add_argument(
    "--sweep-configs",
    help="JSON list of quantized kernel_config dicts: --sweep times only these (no bf16 sweep)",
  )
  parser.add_argument(
    "--sweep-only",
    action="store_true",
    help="with --sweep: stop after the sweep (its timings go to --out as sweep_kivi2)",
  )
  parser.add_argument(
    "--query-group",
    type=int,
    help="query heads per KV head (default 4); the sweep's and the tables' queries",
  )
  parser.add_argument(
    "--head-dim",
    dest="head_dim_choice",
    type=int,
    choices=(64, 128),
    help="channels per head (default 128, --small 64); the sweep's and the tables' segments",
  )
  args = parser.parse_args()
  if args.sweep_only and not args.sweep:
    parser.error("--sweep-only needs --sweep")
  if args.sweep_bits != 2 and not (args.sweep_only and args.sweep_configs):
    parser.error("--sweep-bits 4 needs --sweep-only and --sweep-configs (the tables pick kivi2's)")
  if args.query_group is not None and args.query_group < 1:
    parser.error(f"--query-group must be >= 1, got {args.query_group}")
  if args.small:
    args.batch, args.kv_heads, args.group, args.head_dim = 2, 2, 4, 64
    args.contexts = args.contexts or [256, 512]
    args.iters, args.repeats = args.iters or 2, args.repeats or 3
    args.copy_bytes = 1 << 22
  else:
    args.batch, args.kv_heads, args.group, args.head_dim = 8, 8, 4, 128
    args.contexts = args.contexts or [8192, 32768, 131072]
    args.iters, args.repeats = args.iters or 20, args.repeats or 7
    args.copy_bytes = 1 << 30
  if args.query_group is not None:
    args.group = args.query_group
  if args.head_dim_choice is not None:
    args.head_dim = args.head_dim_choice
  results = run(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
